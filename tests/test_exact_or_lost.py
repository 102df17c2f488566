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
