"""``zkv bench restart``: how long a rank worker killed with kill -9 takes to
serve again, phase by phase, beside same-run baselines.

Three starts of the same ``zkv worker`` (the same layout, one rank), in
alternating rounds of one run:

- **restart with its tiers**: a CPU tier file (``--tier-dir``) and a disk
  tier (``--disk-dir``), both full, left by the worker killed; the new
  process maps them again (headers checked, never the blocks' bytes: a
  block's digest is checked when it is read);
- **fresh start, no tiers** (``--tier-dir none``, no disk tier), on a bus of
  its own: the same process start with nothing to map;
- **standby takeover** (``--standby``): a worker started beside the serving
  one, blocked on the rank's lock with everything imported; the kill hands
  it the lock.

And ``python -c "import torch"`` and ``python -c pass``, timed the same way.

A start is timed from the ``exec`` (a takeover: from the kill) to the first
task ``ok``: a ``swap_in`` of a block the killed worker swapped out (checked
exact against its digest afterwards, with a block of the disk tier).  Its
phases are the worker's ``--startup-times`` marks, read from a pipe as it
writes them (so the client submits the first task the moment the worker is
welcomed, with no polling): python (exec to the first zkv code), the CLI's
imports, the rank's imports (torch), the rank's lock, the tiers mapped (and
the device tier allocated), the sockets, the broker's welcome, and the
resume and first task.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from ...rank.tiers.rank_lock import clean_locks
from ...rank.tiers.tier_file import DEFAULT_DIR, bus_name, clean_tiers
from ...wire.layout import CacheLayout
from .cluster import LocalCluster, layout_args

ROOT = str(Path(__file__).resolve().parents[2])  # the tree this zkv was imported from
WAIT_S = 180.0  # one phase of one start, on a loaded machine
GPU_BLOCKS = 256
PHASES = ("interpreter", "cli", "imports", "lock", "tiers", "ready", "welcome")
NAMES = {  # the phase that ends at each mark, as the report names it
    "interpreter": "python",
    "cli": "cli_imports",
    "imports": "rank_imports",
    "lock": "rank_lock",
    "tiers": "tiers",
    "ready": "sockets",
    "welcome": "register",
}


def layout_for(tier_bytes: int) -> CacheLayout:
    """64 KiB blocks (zkv's default shape); as many CPU rows as ``tier_bytes`` holds."""
    shape = CacheLayout(gpu_blocks=GPU_BLOCKS)
    return CacheLayout(gpu_blocks=GPU_BLOCKS, cpu_blocks=max(GPU_BLOCKS, tier_bytes // shape.block_bytes))


class Marks:
    """One worker's startup marks, read from the pipe its ``--startup-times`` names."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()
        self.marks: dict[str, float] = {}
        self._buf = b""

    @property
    def arg(self) -> str:
        return f"/dev/fd/{self.write_fd}"

    def wait_for(self, phase: str, proc: subprocess.Popen, timeout: float = WAIT_S) -> float:
        deadline = time.monotonic() + timeout
        while phase not in self.marks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the worker (pid {proc.pid}) did not reach {phase!r} within {timeout:.0f} s")
            if select.select([self.read_fd], [], [], left)[0]:
                chunk = os.read(self.read_fd, 65536)
                if not chunk:
                    raise RuntimeError(f"the worker (pid {proc.pid}) exited before {phase!r}: {proc.wait(10)}")
                self._buf += chunk
                *lines, self._buf = self._buf.split(b"\n")
                for line in lines:
                    rec = json.loads(line)
                    self.marks.setdefault(rec["phase"], rec["t"])
        return self.marks[phase]

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            if fd >= 0:
                os.close(fd)
        self.read_fd = self.write_fd = -1


class Bus:
    """A broker (a ``LocalCluster`` with no ranks of its own) and one rank worker we start and kill."""

    def __init__(self, layout: CacheLayout, tier_args: list[str], log: Path):
        self.cluster = LocalCluster(1, layout, quiet=True)
        self.layout, self.tier_args, self.log = layout, tier_args, log
        self.worker: tuple[subprocess.Popen, Marks] | None = None
        self.cluster.start_broker()
        self.client = self.cluster.client(request_timeout=60)

    def spawn(self, *extra: str) -> tuple[subprocess.Popen, Marks, float]:
        ep, marks = self.cluster.endpoints, Marks()
        args = ["worker", "--rank", "0", "--world-size", "1", "--backend", ep.backend, "--control", ep.control]
        args += [*layout_args(self.layout), *self.tier_args, "--startup-times", marks.arg, *extra]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
        with open(self.log, "ab") as log:
            t_exec = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-m", "zkv", *args], pass_fds=(marks.write_fd,), stdout=log, stderr=log, env=env
            )
        os.close(marks.write_fd)
        marks.write_fd = -1
        return proc, marks, t_exec

    def start(self) -> None:
        proc, marks, _ = self.spawn()
        marks.wait_for("welcome", proc)
        self.worker = (proc, marks)

    def kill(self) -> float:
        assert self.worker is not None
        proc, marks = self.worker
        t_kill = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        marks.close()
        self.worker = None
        return t_kill

    def first_task(self, proc: subprocess.Popen, marks: Marks, task: Callable[[], Any]) -> float:
        """Once the worker is welcomed, the first task; the time it came back ``ok``."""
        marks.wait_for("welcome", proc)
        _ok(task(), "the first task after the start")
        self.worker = (proc, marks)
        return time.monotonic()

    def close(self) -> None:
        if self.worker is not None:
            self.kill()
        self.client.close()
        self.cluster.stop()


def _ok(out: Any, what: str) -> Any:
    if not out.ok:
        raise RuntimeError(f"{what} failed: {out.outcome} {out.reason}")
    return out


def _phases(marks: dict[str, float], start: float, ok: float) -> dict[str, float]:
    """Milliseconds each phase took, in the order they ended after ``start`` (the exec,
    or the kill), to the first task ``ok``: a plain worker takes the rank's lock
    before its imports, a standby waits for it after them."""
    out, last = {}, start
    for phase in sorted((p for p in PHASES if p in marks and marks[p] >= start), key=marks.__getitem__):
        out[NAMES[phase]] = (marks[phase] - last) * 1000
        last = marks[phase]
    out["resume_and_first_task"] = (ok - last) * 1000
    return out


def _timed(code: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.monotonic() - t0


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    phases = {name: statistics.median(r["phases_ms"].get(name, 0.0) for r in runs) for name in runs[0]["phases_ms"]}
    return {
        "total_s": statistics.median(r["total_s"] for r in runs),
        "total_s_rounds": [round(r["total_s"], 3) for r in runs],
        "phases_ms": phases,
    }


def _populate(c: Any, layout: CacheLayout, disk_blocks: int) -> list[bytes]:
    """Every CPU row written (row r holds GPU block r % 256), the first ``disk_blocks``
    spilled to disk; the GPU blocks' digests."""
    gpu = list(range(GPU_BLOCKS))
    _ok(c.run("fill", None, gpu, tier="gpu", seed=7), "fill")
    digests = c.run("checksum", gpu, tier="gpu").per_rank[0]["digests"]
    for row in range(0, layout.cpu_blocks, GPU_BLOCKS):
        n = min(GPU_BLOCKS, layout.cpu_blocks - row)
        _ok(c.run("swap_out", gpu[:n], list(range(row, row + n)), timeout=120), "swap_out")
    for d in range(0, disk_blocks, 1024):
        n = min(1024, disk_blocks - d)
        _ok(c.run("spill", list(range(d, d + n)), list(range(d, d + n)), timeout=300), "spill")
    return digests


def _fresh_start(fresh: Bus) -> dict[str, Any]:
    fresh.kill()
    proc, marks, t0 = fresh.spawn()
    ok = fresh.first_task(proc, marks, lambda: fresh.client.run("swap_out", [0], [0], timeout=120))
    return {"total_s": ok - t0, "phases_ms": _phases(marks.marks, t0, ok)}


def _restart(kept: Bus, row: int, into: int, standby: bool) -> dict[str, Any]:
    """Kill the serving worker; a new one (or the standby started first) serves again:
    its first task swaps CPU row ``row`` into GPU block ``into``."""
    if standby:
        proc, marks, _ = kept.spawn("--standby")
        marks.wait_for("standby", proc)  # everything imported, waiting on the rank's lock
        t0 = kept.kill()
    else:
        kept.kill()
        proc, marks, t0 = kept.spawn()
    ok = kept.first_task(proc, marks, lambda: kept.client.run("swap_in", [row], [into], timeout=120))
    return {"total_s": ok - t0, "phases_ms": _phases(marks.marks, t0, ok)}


def bench_restart(
    tier_bytes: int = 1 << 30, disk_bytes: int = 1 << 28, rounds: int = 3, directory: str = "/var/tmp", say=print
) -> dict[str, Any]:
    """The report of the module docstring; ``tier_bytes`` of CPU tier, ``disk_bytes`` of disk tier."""
    layout = layout_for(tier_bytes)
    disk_blocks = max(1, min(layout.cpu_blocks, disk_bytes // layout.block_bytes))
    work = Path(tempfile.mkdtemp(prefix="zkv-bench-restart-", dir=directory))
    tier_dir = DEFAULT_DIR
    tiers = ["--tier-dir", tier_dir, "--disk-dir", str(work / "disk"), "--disk-blocks", str(disk_blocks)]
    buses: list[Bus] = []
    runs: dict[str, list[dict[str, Any]]] = {"restart_with_tiers": [], "fresh_start_no_tiers": []}
    runs["standby_takeover"] = []
    baselines: dict[str, list[float]] = {"import_torch_s": [], "python_s": []}
    exact = True
    try:
        kept = Bus(layout, tiers, work / "workers.log")
        buses.append(kept)
        fresh = Bus(layout, ["--tier-dir", "none"], work / "workers.log")
        buses.append(fresh)
        kept.start()
        fresh.start()
        c = kept.client
        size = layout.cpu_blocks * layout.block_bytes / 2**30
        say(f"restart: filling a {size:.2f} GiB CPU tier, spilling {disk_blocks} blocks to disk ...")
        digests = _populate(c, layout, disk_blocks)
        for i in range(rounds):
            say(f"restart: round {i + 1} of {rounds} ...")
            baselines["import_torch_s"].append(_timed("import torch"))
            baselines["python_s"].append(_timed("pass"))
            runs["fresh_start_no_tiers"].append(_fresh_start(fresh))
            for name, standby, into in (("restart_with_tiers", False, 1), ("standby_takeover", True, 2)):
                row = (i * 7919 + into * 104729) % layout.cpu_blocks
                runs[name].append(_restart(kept, row, into, standby))
                exact &= c.run("checksum", [into], tier="gpu").per_rank[0]["digests"] == [digests[row % GPU_BLOCKS]]
            disk = (i * 31) % disk_blocks
            exact &= c.run("checksum", [disk], tier="disk").per_rank[0]["digests"] == [digests[disk % GPU_BLOCKS]]
        gen_reason = c.status().gen_reason
    finally:
        for bus in buses:
            bus.close()
        if buses:  # the last worker was killed: its tier file and lock stay behind
            name = bus_name(buses[0].cluster.endpoints.backend)
            clean_tiers(tier_dir, name)
            clean_locks(tier_dir, name)
        shutil.rmtree(work, ignore_errors=True)
    return {
        "tier_bytes": layout.cpu_blocks * layout.block_bytes,
        "disk_bytes": disk_blocks * layout.block_bytes,
        "block_bytes": layout.block_bytes,
        "rounds": rounds,
        **{name: {"median": statistics.median(v), "rounds": [round(x, 3) for x in v]} for name, v in baselines.items()},
        **{name: _median(r) for name, r in runs.items()},
        "exact": exact,
        "gen_reason": gen_reason,
    }


def summary(res: dict[str, Any]) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    lines = [
        f"restart of a rank killed with kill -9: CPU tier {gib(res['tier_bytes'])}, disk tier {gib(res['disk_bytes'])}"
        f" ({res['block_bytes'] // 1024} KiB blocks), median of {res['rounds']} alternating rounds;"
        f" blocks back exact: {'yes' if res['exact'] else 'NO'}",
        f"  baselines: python -c 'import torch' {res['import_torch_s']['median']:.2f} s,"
        f" python -c pass {res['python_s']['median']:.2f} s",
    ]
    for name, what in (
        ("fresh_start_no_tiers", "fresh start, no tiers (exec -> first task ok)"),
        ("restart_with_tiers", "restart with its tiers (exec -> first task ok)"),
        ("standby_takeover", "standby takeover (kill -> first task ok)"),
    ):
        r = res[name]
        phases = ", ".join(f"{p} {ms:.0f}" for p, ms in r["phases_ms"].items())
        lines.append(f"  {what}: {r['total_s']:.3f} s  [ms: {phases}]")
    return "\n".join(lines)
