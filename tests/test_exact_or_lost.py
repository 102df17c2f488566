"""A block comes back with the bytes it was written with, or is reported lost
(docs/protocol.md §6.2, §6.3, §8.2): walked as an operator walks it, with the
``zkv`` commands against a real ``zkv up`` bus, reading what each prints, its
exit code and the digests of the bytes.

What each test holds: a CPU row (or disk row) not written in the current CPU
generation ends ``failed`` naming the blocks, never ``ok`` with zeros; a
resume after ``clear --keep-cpu`` says whether the CPU blocks survived, and a
swap-in of dropped ones fails ``lost_block``.
"""

from __future__ import annotations

import json

from test_operator_paths import LAYOUT, Up, cli

from zkv.harness.bus.attached_cluster import AttachedCluster
from zkv.wire.layout import CacheLayout

ATTACHED = CacheLayout(layers=2, gpu_blocks=16, cpu_blocks=8, block_size=4, kv_heads=2, head_dim=8)


def digests(broker: str, ids: str, tier: str) -> dict[str, list[str]]:
    res = cli("submit", "checksum", "--src", ids, "--tier", tier, "--json", "--broker", broker)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout)
    return {r: v["digests"] for r, v in out["ranks"].items()}


def failed(res, code: str, blocks: str) -> None:
    """The task ended ``failed``, its reason starts with ``code`` and names ``blocks``."""
    assert res.returncode == 1, res.stdout + res.stderr
    assert ": failed (" in res.stdout and code + ":" in res.stdout and blocks in res.stdout, res.stdout
    assert "the task did not succeed" in res.stderr


def test_rows_never_written_or_dropped_fail_naming_the_blocks_and_kept_ones_come_back_exact(tmp_path):
    disk = tmp_path / "disk"
    bus = Up(
        tmp_path, "--ranks", "2", "--fresh", "--gpu-blocks", "32", *LAYOUT, "--disk-dir", str(disk),
        "--disk-blocks", "16",
    )  # fmt: skip
    try:
        bus.wait_for("Ctrl-C to stop.")
        b = ["--broker", bus.broker]
        assert cli("submit", "fill", "--dst", "0-1", "--seed", "3", *b).returncode == 0
        written = digests(bus.broker, "0-1", "gpu")
        assert cli("submit", "swap-out", "--src", "0-1", "--dst", "20-21", *b).returncode == 0
        assert digests(bus.broker, "20-21", "cpu") == written

        # never written: a CPU row, a swap-in of it, a disk row
        failed(cli("submit", "checksum", "--src", "30", "--tier", "cpu", *b), "lost_block", "[30]")
        failed(cli("submit", "swap-in", "--src", "20,30", "--dst", "7-8", *b), "lost_block", "[30]")
        failed(cli("submit", "load", "--src", "5", "--dst", "40", *b), "disk_lost", "5")
        failed(cli("submit", "swap-in", "--src", "40", "--dst", "9", *b), "lost_block", "[40]")  # the failed load's row

        # the disk tier from the CLI: spill, checksum, load back exact
        assert cli("submit", "spill", "--src", "20-21", "--dst", "0-1", *b).returncode == 0
        assert digests(bus.broker, "0-1", "disk") == written
        assert cli("submit", "load", "--src", "0-1", "--dst", "50-51", *b).returncode == 0
        assert digests(bus.broker, "50-51", "cpu") == written

        # a keep_cpu clear and a resume to the same layout: kept, and said so
        assert cli("pause", *b).returncode == 0
        assert cli("clear", "--keep-cpu", *b).returncode == 0
        res = cli("resume", *b)
        assert res.returncode == 0 and "CPU blocks kept" in res.stdout, res.stdout
        assert cli("submit", "swap-in", "--src", "20-21", "--dst", "5-6", *b).returncode == 0
        assert digests(bus.broker, "5-6", "gpu") == written

        # the walk: a keep_cpu clear, then a resume to another CPU tier size drops the blocks
        assert cli("pause", *b).returncode == 0
        assert cli("clear", "--keep-cpu", *b).returncode == 0
        res = cli("resume", "--cpu-blocks", "128", *b)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "CPU blocks NOT kept" in res.stdout and "ranks [0, 1]" in res.stdout, res.stdout
        assert "swap-in of them fails lost_block" in res.stderr
        failed(cli("submit", "swap-in", "--src", "20-21", "--dst", "5-6", *b), "lost_block", "[20, 21]")
        failed(cli("submit", "checksum", "--src", "50", "--tier", "cpu", *b), "lost_block", "[50]")
        failed(cli("submit", "load", "--src", "0-1", "--dst", "20-21", *b), "disk_lost", "0")  # dropped with them
        as_json = json.loads(cli("resume", "--json", *b).stdout)
        assert as_json.get("noop") is True

        # and a clear without keep_cpu drops every CPU row
        assert cli("submit", "fill", "--dst", "3", "--tier", "cpu", "--seed", "1", *b).returncode == 0
        assert cli("pause", *b).returncode == 0
        assert cli("clear", *b).returncode == 0
        res = cli("resume", *b)
        assert res.returncode == 0 and "CPU blocks" not in res.stdout, res.stdout
        failed(cli("submit", "checksum", "--src", "3", "--tier", "cpu", *b), "lost_block", "[3]")
    finally:
        bus.stop()


def test_a_fresh_engine_serves_on_a_broker_that_remembers_a_later_generation_and_the_way_out_works(tmp_path):
    """A broker with saved state (generation 2, an engine cache of 24 blocks)
    meets a freshly started engine (manifest generation 1, 16 blocks) and its
    ``zkv worker --attach``: the new instance's manifest is taken at its own
    generation (docs/engines.md, "Generations and restarts").  Its layout
    differs, so the worker is refused (it cannot adopt the bus's: its engine's
    memory fixes it), and names the way out: pause, clear, resume with the
    engine's layout; then the worker started again serves."""
    first = AttachedCluster(1, ATTACHED, directory=tmp_path, quiet=True).start(timeout=120)
    first._own_dir = False  # keep the broker's state file for the next broker
    b = ["--broker", first.endpoints.frontend]
    try:
        assert cli("submit", "fill", "--dst", "0-1", "--seed", "1", *b).returncode == 0
        assert cli("pause", *b).returncode == 0 and cli("clear", *b).returncode == 0
        first.reallocate(blocks=24)
        assert cli("resume", "--gpu-blocks", "24", *b).returncode == 0
        assert cli("submit", "fill", "--dst", "20", "--seed", "1", *b).returncode == 0
        remembered = cli("status", "--json", *b)
    finally:
        first.stop()
    remembered_gen = json.loads(remembered.stdout)["gen"]
    assert remembered_gen >= 1

    again = AttachedCluster(1, ATTACHED, directory=tmp_path, quiet=True)  # a fresh engine: generation 1, 16 blocks
    again._own_dir = False
    try:
        again.start_engines()
        again.start_broker()
        adopting = again.start_worker(0, ["--adopt-layout"])
        assert adopting.wait(timeout=60) == 2, "an attached worker cannot take the bus's layout"
        refused = again.start_worker(0)
        assert refused.wait(timeout=60) == 1, "another layout than the bus's"
        b = ["--broker", again.endpoints.frontend]
        assert cli("pause", "--allow-partial", *b).returncode == 0  # the rank is not registered
        assert cli("clear", *b).returncode == 0
        res = cli("resume", "--gpu-blocks", "16", *b)  # the engine's layout, as the refused worker named it
        assert res.returncode == 0 and "running" in res.stdout, res.stdout + res.stderr
        again.start_worker(0)  # its export of generation 1 is taken
        again.wait_ready(timeout=60)
        assert cli("submit", "fill", "--dst", "15", "--seed", "2", *b).returncode == 0
        assert json.loads(cli("status", "--json", *b).stdout)["gen"] > remembered_gen
    finally:
        again.stop()


def test_a_fresh_engine_resumes_a_bus_restored_cleared(tmp_path):
    first = AttachedCluster(1, ATTACHED, directory=tmp_path, quiet=True).start(timeout=120)
    first._own_dir = False
    b = ["--broker", first.endpoints.frontend]
    try:
        assert cli("submit", "fill", "--dst", "0-1", "--seed", "1", *b).returncode == 0
        assert cli("pause", *b).returncode == 0 and cli("clear", *b).returncode == 0
    finally:
        first.stop()
    again = AttachedCluster(1, ATTACHED, directory=tmp_path, quiet=True)
    again._own_dir = False
    try:
        again.start_engines()
        again.start_broker()
        again.start_worker(0)
        again.wait_ready(timeout=60)
        res = cli("resume", *b)  # cleared stays cleared; the fresh engine's first export is taken
        assert res.returncode == 0 and "running" in res.stdout, res.stdout + res.stderr
        assert cli("submit", "fill", "--dst", "3", "--seed", "2", *b).returncode == 0
        assert cli("pause", *b).returncode == 0 and cli("clear", *b).returncode == 0
        res = cli("resume", *b)  # now the bus used that export: the engine must hand over its next one
        assert res.returncode == 1 and "stale_manifest" in res.stderr and "export generation 2" in res.stderr, res
        again.reallocate()
        assert cli("resume", *b).returncode == 0
        assert cli("submit", "fill", "--dst", "3", "--seed", "2", *b).returncode == 0
    finally:
        again.stop()
