"""The tiers under chaos (tests/tier_chaos.py): real rank processes with a
CPU tier file and a disk tier, kill -9 among spills and loads, restarts on the
same directories, and every row the model knows read back (docs/protocol.md
§6.3: an acked spill is never lost, a block is served exact or reported lost;
docs/architecture.md: a restart keeps the CPU blocks).

The default run is two kills; ``ZKV_DISK_LONG=1`` adds a run of many rounds."""

import os

import pytest
from tier_chaos import DISK_BLOCKS, LAYOUT, Figures, TierChaos, TierModel

from zkv.wire.outcome import TaskOutcome

LONG = os.environ.get("ZKV_DISK_LONG") == "1"


def checksum(task: int, digests: dict[int, list[bytes]]) -> TaskOutcome:
    return TaskOutcome(task, "ok", per_rank={r: {"outcome": "ok", "digests": d} for r, d in digests.items()})


def test_the_model_carries_digests_along_ok_copies_and_forgets_what_any_other_outcome_wrote():
    model = TierModel()
    model.learn("gpu", [3, 4], checksum(1, {0: [b"a", b"b"], 1: [b"A", b"B"]}))
    model.copied("swap_out", [3, 4], [10, 11], ok=True)
    assert model.rows["cpu"] == {10: (b"a", b"A"), 11: (b"b", b"B")}, "each rank's own digest"
    model.copied("spill", [10, 11], [500, 501], ok=True)
    model.copied("spill", [11, 10], [500, 7], ok=False)  # a spill cut by a kill: what it wrote is unknown
    assert model.rows["disk"] == {501: (b"b", b"B")}
    model.copied("load", [501, 9], [10, 12], ok=True)  # disk row 9 is unknown: so is CPU row 12
    assert model.rows["cpu"] == {10: (b"b", b"B"), 11: (b"b", b"B")}
    assert model.known("cpu") == [10, 11]


def assert_clean(fig: Figures, kills: int) -> None:
    report = "\n".join(fig.lines())
    print("\n" + report)
    assert fig.wrong_bytes == 0, report
    assert fig.lost_acked_spills == 0, report
    assert fig.cpu_rows_lost == 0, report
    assert fig.kills == fig.restarts == kills and len(fig.restart_to_serving_s) == kills, report
    assert fig.kills_mid_task >= 1 and fig.interrupted_tasks >= 1, "a kill landed with tasks in flight on its rank"
    assert fig.unfinished["new"] + fig.unfinished["old"] > 0, "rows of unfinished tasks were read and judged"
    assert fig.rows_checked["cpu"] > LAYOUT.cpu_blocks * 2 and fig.rows_checked["disk"] > 0, report
    assert fig.outcomes.get("spill ok", 0) and fig.outcomes.get("load ok", 0), report


def test_kill_9_among_spills_and_loads_serves_no_wrong_byte_loses_no_acked_spill_and_keeps_the_cpu_rows(tmp_path):
    with TierChaos(seed=7, steps=4, directory=str(tmp_path)) as chaos:
        for _ in range(2):
            chaos.round()
        chaos.verify()
        assert_clean(chaos.fig, kills=2)

        # The counts count: a disk row torn behind the rank's back, a CPU row the model remembers otherwise.
        disk_row, cpu_row = chaos.model.known("disk")[0], chaos.model.known("cpu")[0]
        data_off = 4096 + DISK_BLOCKS * 32  # superblock page, 32-byte records, page-sized slots (disk_tier.py)
        with open(os.path.join(chaos.disk_dir, "zkv-rank0.disk"), "r+b") as f:
            f.seek(data_off + disk_row * LAYOUT.block_bytes + 100)
            f.write(b"\xa5" * 64)
        digests = chaos.model.rows["cpu"][cpu_row]
        chaos.model.rows["cpu"][cpu_row] = (digests[0], bytes(16))
        chaos.verify(("cpu", "disk"))
        assert (chaos.fig.lost_acked_spills, chaos.fig.wrong_bytes, chaos.fig.cpu_rows_lost) == (1, 1, 0)
        assert disk_row not in chaos.model.rows["disk"], "a row read back lost is forgotten"


@pytest.mark.skipif(not LONG, reason="set ZKV_DISK_LONG=1 for the longer disk tier tests")
@pytest.mark.parametrize("seed", [1, 2])
def test_many_rounds_of_kills_among_spills_and_loads(tmp_path, seed):
    fig = TierChaos(seed=seed, directory=str(tmp_path)).run(12)
    assert_clean(fig, kills=12)
    assert fig.kills_at["mid_spill"] and fig.kills_at["mid_load"], fig.lines()
