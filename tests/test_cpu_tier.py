"""The CPU tier that outlives a rank process (docs/protocol.md §8.2, §10.1):
the tier file on real files, and the broker's per-tier generations on the
sans-IO cores.  test_cpu_tier_restart_e2e.py kills real workers."""

import os

import pytest

from zkv.rank.errors import CacheError
from zkv.rank.store import BlockStore
from zkv.rank.tiers.tier_file import ROW_HEAD_BYTES, TierPlace, clean_tiers, list_tiers
from zkv.testing.sim import LAYOUT, Sim
from zkv.wire.layout import CacheLayout

SMALL = CacheLayout(layers=2, gpu_blocks=16, cpu_blocks=32, block_size=4, kv_heads=2, head_dim=8)


def store(tmp_path, layout=SMALL, rank=0, digests=False):
    return BlockStore.owned(layout, place=TierPlace("bus", rank, str(tmp_path), digests))


def test_a_second_process_of_the_rank_maps_the_tier_again_with_every_sealed_block(tmp_path):
    s = store(tmp_path)
    assert not s.restored and s.tier is not None and not s.tier.kept
    s.fill("gpu", [0, 1, 2], seed=7)
    s.move("swap_out", [0, 1, 2], [5, 6, 7])
    digests = s.checksum("cpu", [5, 6, 7])
    assert digests == s.checksum("gpu", [0, 1, 2])
    s.close()  # the rank stops: the file stays
    again = store(tmp_path)
    assert again.restored and again.tier.valid_rows() == 3
    assert again.kept_tiers(fresh=True) == {"kept_tiers": ["cpu"], "cpu_gen": 0}
    again.move("swap_in", [5, 6, 7], [8, 9, 10])
    assert again.checksum("gpu", [8, 9, 10]) == digests
    again.free()  # a clear without keep_cpu: the file goes
    assert list(list_tiers(str(tmp_path))) == []


@pytest.mark.parametrize("digests", [False, True])
def test_a_torn_header_loses_that_block_only_and_a_swap_in_naming_it_fails(tmp_path, digests):
    s = store(tmp_path, digests=digests)
    s.fill("cpu", [3, 4, 5], seed=1)
    good = s.checksum("cpu", [3, 5])
    # with digests: the digest no longer matches the bytes; without: the header's mark is gone
    s.tier.file.heads[4, 40 if digests else 0] ^= 0xFF
    with pytest.raises(CacheError, match=r"lost_block.*\[4\]"):
        s.move("swap_in", [3, 4, 5], [0, 1, 2])
    with pytest.raises(CacheError, match="lost_block"):
        s.checksum("cpu", [4])
    assert s.tier.digest_failures == 2
    s.move("swap_in", [3, 5], [0, 1])
    assert s.checksum("gpu", [0, 1]) == good
    s.close()


def test_with_digests_a_block_whose_bytes_changed_behind_zkv_is_lost_and_without_them_is_served(tmp_path):
    for digests in (True, False):
        s = store(tmp_path, digests=digests)
        s.fill("cpu", [6], seed=2)
        s.tier.file.data[6][0] ^= 0xFF  # a stray writer, not a torn write: the header still checks
        if digests:
            with pytest.raises(CacheError, match=r"lost_block.*\[6\]"):
                s.checksum("cpu", [6])
        else:
            assert len(s.checksum("cpu", [6])) == 1
        s.free()


def test_a_write_cut_short_leaves_a_block_that_does_not_check(tmp_path):
    s = store(tmp_path)
    s.fill("cpu", [2], seed=3)
    s.tier.writing([2])  # a kill after this and before written(): the mark is gone
    s.close()
    again = store(tmp_path)
    assert again.restored and again.tier.valid_rows() == 0
    with pytest.raises(CacheError, match="lost_block"):
        again.checksum("cpu", [2])
    again.close()


def test_blocks_of_an_older_cpu_generation_stop_checking(tmp_path):
    s = store(tmp_path)
    s.fill("cpu", [1], seed=3)
    s.set_cpu_gen(4)
    with pytest.raises(CacheError, match="lost_block"):
        s.checksum("cpu", [1])
    s.fill("cpu", [1], seed=3)
    s.close()
    again = store(tmp_path)
    assert again.cpu_gen == 4 and again.tier.valid_rows() == 1
    again.close()


def test_a_tier_of_another_layout_is_never_mapped_and_a_live_one_is_never_shared(tmp_path):
    s = store(tmp_path)
    s.fill("cpu", [0], seed=1)
    with pytest.raises(CacheError, match="tier_in_use"):
        store(tmp_path)
    other = store(tmp_path, CacheLayout(**{**SMALL.to_wire(), "head_dim": 16}))
    assert not other.restored and other.tier.file.path != s.tier.file.path
    other.close()
    s.close()
    tiers = list(list_tiers(str(tmp_path)))
    assert len(tiers) == 2 and not any(t.owned for t in tiers)
    assert all(t.nbytes >= t.rows * (t.row_bytes + ROW_HEAD_BYTES) for t in tiers)


def test_clean_removes_only_tiers_no_live_process_holds(tmp_path):
    live = store(tmp_path, rank=0)
    dead = store(tmp_path, rank=1)
    dead.close()
    removed = clean_tiers(str(tmp_path))
    assert removed == [dead_path for dead_path in removed if "-r1-" in dead_path.name] and len(removed) == 1
    assert os.path.exists(live.tier.file.path)
    live.close()


def test_process_memory_tier_reports_kept_only_while_its_process_was_in_the_bus():
    s = BlockStore.owned(SMALL)
    assert s.tier is not None and s.tier.file is None
    assert s.kept_tiers(fresh=True) == {} and s.kept_tiers(fresh=False)["kept_tiers"] == ["cpu"]


# --- the broker: one generation per tier -------------------------------------------------


def restart_rank_1(sim: Sim, kept: dict) -> None:
    core = type(sim.ranks[1].core)(1, 2, LAYOUT, sessions=sim.sessions.__next__)  # a new process
    core.tiers = lambda: kept
    sim.ranks[1].core = core
    sim.start_rank(1)
    sim.settle()


def test_a_rank_restart_that_kept_its_cpu_tier_moves_only_the_gpu_generation():
    sim = Sim().up()
    first = sim.submit()
    sim.settle()
    assert sim.outcomes[first] == "ok"
    gens = sim.broker.gens
    restart_rank_1(sim, {"kept_tiers": ["cpu"], "cpu_gen": gens.cpu_gen})
    assert sim.broker.gen == 1 and gens.cpu_gen == 0
    assert "GPU blocks of generation 0 are gone; CPU blocks kept" in gens.reason


def test_a_rank_restart_that_lost_its_cpu_tier_moves_both_generations():
    sim = Sim().up()
    sim.submit()
    sim.settle()
    restart_rank_1(sim, {})
    gens = sim.broker.gens
    assert sim.broker.gen == 1 and gens.cpu_gen == 1 and "CPU blocks are gone too" in gens.reason


def test_a_kept_tier_of_another_cpu_generation_is_lost():
    sim = Sim().up()
    sim.submit()
    sim.settle()
    restart_rank_1(sim, {"kept_tiers": ["cpu"], "cpu_gen": 7})
    assert sim.broker.gens.cpu_gen == 8, "above the rank's: no client may take its blocks for the bus's"


def test_a_clear_moves_the_cpu_generation_unless_it_keeps_the_cpu_tier():
    sim = Sim().up()
    gens = sim.broker.gens
    for keep, cpu_gen in ((True, 0), (False, 1)):
        sim.request("pause")
        sim.settle()
        sim.request("clear", keep_cpu=keep)
        sim.settle()
        assert gens.cpu_gen == cpu_gen
        sim.request("resume")
        sim.settle()
