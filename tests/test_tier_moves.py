"""The tier moves (zkv/wire/moves.py): one table keyed by op, read by the rank's
store and the prefix cache manager alike, and one set of rules for every move."""

import pytest

from zkv.prefix.bus import SWAP_OPS
from zkv.rank.errors import CacheError
from zkv.rank.store import BlockStore
from zkv.rank.tiers.cpu_tier import CpuTier
from zkv.rank.tiers.disk_tier import DiskSpec
from zkv.rank.tiers.tier_file import TierPlace
from zkv.wire.layout import CacheLayout
from zkv.wire.moves import MOVES, ROW_MOVES
from zkv.wire.protocol import TaskBody
from zkv.wire.vocab import Op, Tier

SMALL = CacheLayout(layers=2, gpu_blocks=8, cpu_blocks=8, block_size=4, kv_heads=2, head_dim=8)


def test_the_table_holds_each_moving_op_once_with_its_two_tiers():
    assert {op: (m.source, m.dest) for op, m in MOVES.items()} == {
        Op.SWAP_OUT: (Tier.GPU, Tier.CPU),
        Op.SWAP_IN: (Tier.CPU, Tier.GPU),
        Op.SPILL: (Tier.CPU, Tier.DISK),
        Op.LOAD: (Tier.DISK, Tier.CPU),
        Op.PUT: (Tier.CPU, Tier.STORE),
        Op.GET: (Tier.STORE, Tier.CPU),
    }
    assert [op for op, m in MOVES.items() if m.down] == [Op.SWAP_OUT, Op.SPILL, Op.PUT]
    assert all(m.op is op for op, m in MOVES.items())
    assert MOVES["spill"] is MOVES[Op.SPILL]  # a decoded op, a plain str, finds its move
    assert SWAP_OPS == ROW_MOVES == (Op.SWAP_OUT, Op.SWAP_IN, Op.SPILL, Op.LOAD)  # the moves of rows on both sides
    assert [op for op, m in MOVES.items() if m.keyed] == [Op.PUT, Op.GET]
    assert (MOVES[Op.PUT].rows, MOVES[Op.GET].rows) == ("src", "dst")


@pytest.fixture
def store(tmp_path):
    s = BlockStore.owned(SMALL, disk=DiskSpec(str(tmp_path / "disk"), 8, direct=False))
    yield s
    s.close()


@pytest.mark.parametrize("op", ROW_MOVES)
def test_the_store_checks_ids_against_each_moves_tiers(store, op):
    move = MOVES[op]
    body = TaskBody(op=op, src=[0, 0], dst=[1, 1])
    with pytest.raises(CacheError, match="dst has duplicate block ids"):
        store.validate(body)  # a destination id twice, whatever the tiers
    with pytest.raises(CacheError, match=f"src block id 99 is out of range for the {move.source} tier"):
        store.validate(TaskBody(op=op, src=[99], dst=[1]))
    with pytest.raises(CacheError, match=f"dst block id 99 is out of range for the {move.dest} tier"):
        store.validate(TaskBody(op=op, src=[0], dst=[99]))


def test_every_move_carries_the_block_down_and_back_with_one_digest(store):
    store.fill(Tier.GPU, [2], seed=5)
    want = store.checksum(Tier.GPU, [2])
    store.move(Op.SWAP_OUT, [2], [3])
    store.move(Op.SPILL, [3], [4])
    store.move(Op.LOAD, [4], [6])
    store.move(Op.SWAP_IN, [6], [7])
    assert [store.checksum(t, [b])[0] for t, b in ((Tier.CPU, 3), (Tier.DISK, 4), (Tier.CPU, 6), (Tier.GPU, 7))] == [
        want[0]
    ] * 4


def test_a_move_reading_a_cpu_row_never_written_fails_whatever_the_destination(store):
    for op in (Op.SWAP_IN, Op.SPILL):
        with pytest.raises(CacheError, match="lost_block"):
            store.move(op, [5], [0])


@pytest.mark.parametrize("in_file", [False, True])
def test_the_cpu_tier_keeps_one_rule_whichever_keeps_its_seals(tmp_path, in_file):
    place = TierPlace("bus", 0, str(tmp_path)) if in_file else None
    tier = CpuTier([("k", 64)], 4, pin=False, place=place)
    tier.writing([1, 2])
    tier.written([1, 2])
    tier.check_rows([1, 2])
    with pytest.raises(CacheError, match=r"lost_block.*\[0\]"):
        tier.check_rows([0, 1])
    tier.writing([2])  # a write that never finished: the row is lost
    with pytest.raises(CacheError, match="lost_block"):
        tier.check_rows([2])
    tier.writing([3])
    tier.set_cpu_gen(1)  # the generation moved during the write: the row holds nothing of the new one
    tier.written([3])
    with pytest.raises(CacheError, match="CPU generation 1"):
        tier.check_rows([1])
    with pytest.raises(CacheError, match="lost_block"):
        tier.check_rows([3])
    assert tier.gen == 1 and tier.valid_rows() == 0 and tier.kept is False
    tier.close(unlink=True)
