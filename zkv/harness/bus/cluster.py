"""A local cluster: one broker and N rank workers as real processes.

This is what ``zkv up`` runs and what the end-to-end tests start: every
process is launched through the CLI (``python -m zkv broker`` / ``worker``),
so the tests exercise exactly what a user runs.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ...client.client import Client, ZkvError
from ...net.endpoints import Endpoints
from ...testing.runner import zygote
from ...wire.layout import CacheLayout
from ...wire.replies import StatusReply
from .lifeline import die_with_parent

KILL_WAIT_S = 5.0  # after SIGKILL: how long stop() waits for a process to be gone


@dataclass
class Teardown:
    """How a cluster's processes ended at ``stop()``: exit codes by name ("broker",
    "rank0", …; None: not gone within the bound), those that had ended on their own
    before the stop (a crash during the work: what a run must report), those that did
    not stop within the timeout of SIGTERM and were killed, and the tier files a
    process still held (left in place)."""

    codes: dict[str, int | None] = field(default_factory=dict)
    exited_before: dict[str, int] = field(default_factory=dict)
    killed: list[str] = field(default_factory=list)
    left: list[Path] = field(default_factory=list)

    def said(self, timeout: float = 10.0) -> str:
        """What the stop itself met, in plain words ('' for a clean stop; ``exited_before``
        is the caller's to report: it happened during the work)."""
        parts = []
        if self.killed:
            parts.append(f"{' and '.join(self.killed)} did not stop within {timeout:g} s of SIGTERM and were killed")
            stuck = [name for name in self.killed if self.codes.get(name) is None]
            if stuck:
                parts.append(f"{' and '.join(stuck)} not gone {KILL_WAIT_S:g} s after SIGKILL")
        if self.left:
            parts.append(f"tier files a live process still holds, left in place: {', '.join(map(str, self.left))}")
        elif parts:
            parts.append("their tier files were removed")
        return "; ".join(parts)


def _reaped(proc: Any, deadline: float) -> int | None:
    """``proc``'s exit code once it is gone, or None if it is not by ``deadline``."""
    try:
        return proc.wait(timeout=max(0.05, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def layout_args(layout: CacheLayout) -> list[str]:
    return [
        "--layers",
        str(layout.layers),
        "--gpu-blocks",
        str(layout.gpu_blocks),
        "--cpu-blocks",
        str(layout.cpu_blocks),
        "--block-size",
        str(layout.block_size),
        "--kv-heads",
        str(layout.kv_heads),
        "--head-dim",
        str(layout.head_dim),
        "--dtype",
        layout.dtype,
    ]


class LocalCluster:
    """Start, wait for, and stop a broker and ``ranks`` workers on ipc:// endpoints.

    Its processes die with the process that started them, kill -9 included
    (``die_with_parent``, ``lifeline.py``): a benchmark, demo or test that
    crashes leaves no bus behind to load the machine.  The kernel ties each
    child to the *thread* that started it, so start a cluster (and its
    workers) from a thread that outlives it, or pass ``die_with_parent=False``."""

    def __init__(
        self,
        ranks: int = 2,
        layout: CacheLayout | None = None,
        *,
        directory: str | Path | None = None,
        broker_args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        quiet: bool = False,
        endpoints: Endpoints | None = None,
        tier_dir: str | None = None,
        die_with_parent: bool = True,
    ):
        self.ranks = ranks
        self.die_with_parent = die_with_parent  # every process gets SIGTERM when this one dies (lifeline.py)
        self.layout = layout or CacheLayout()
        self._own_dir = directory is None
        # ipc:// paths are limited to ~107 bytes: keep the directory short.
        self.directory = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="zkv-", dir="/tmp"))
        self.directory.mkdir(parents=True, exist_ok=True)
        self.endpoints = endpoints or Endpoints.in_dir(self.directory)
        self.broker_args = list(broker_args)
        self.worker_args = list(worker_args)
        self.quiet = quiet
        self.tier_dir = tier_dir  # where the workers keep their CPU tiers (given in worker_args); None: the default
        self.broker: subprocess.Popen | None = None
        self.workers: dict[int, subprocess.Popen] = {}

    def _spawn(self, args: list[str]) -> Any:
        """A ``zkv`` process (a ``subprocess.Popen``, or a worker forked from the
        harness's zygote when this process asked for one: ``zygote.py``)."""
        out = subprocess.DEVNULL if self.quiet else None
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args[0] == "worker" and zygote.wanted():
            env.pop(zygote.ENV, None)
            return zygote.spawn(args, env, stdout=out, stderr=out)
        lifeline = functools.partial(die_with_parent, os.getpid()) if self.die_with_parent else None
        return subprocess.Popen(
            [sys.executable, "-m", "zkv", *args], stdout=out, stderr=out, env=env, preexec_fn=lifeline
        )

    def _ep_args(self) -> list[str]:
        ep = self.endpoints
        return ["--backend", ep.backend, "--control", ep.control]

    def start_broker(self) -> None:
        self.broker = self._spawn(
            [
                "broker",
                "--frontend",
                self.endpoints.frontend,
                *self._ep_args(),
                "--world-size",
                str(self.ranks),
                *self.broker_args,
            ]
        )

    def _tier_dir(self) -> str:
        """Where the workers keep their CPU tiers and rank locks ("none": nowhere)."""
        from ...rank.tiers.tier_file import DEFAULT_DIR

        return self.tier_dir or os.environ.get("ZKV_TIER_DIR") or DEFAULT_DIR

    def served_elsewhere(self, rank: int) -> int | None:
        """The pid of a process not started here that serves ``rank`` on this host (a
        standby that took over), by the rank's lock in the tier directory; else None."""
        from ...rank.tiers.rank_lock import serving_pid
        from ...rank.tiers.tier_file import TierPlace, bus_name

        where = self._tier_dir()
        if where == "none":
            return None
        pid = serving_pid(TierPlace(bus_name(self.endpoints.backend), rank, where))
        mine = self.workers.get(rank)
        return None if pid is None or (mine is not None and mine.pid == pid and mine.poll() is None) else pid

    def start_worker(self, rank: int, extra: Sequence[str] = (), layout: CacheLayout | None = None) -> subprocess.Popen:
        """Start ``rank``'s worker on ``layout`` (default: the cluster's start layout)."""
        proc = self._spawn(
            [
                "worker",
                "--rank",
                str(rank),
                "--world-size",
                str(self.ranks),
                *self._ep_args(),
                *layout_args(layout or self.layout),
                *self.worker_args,
                *extra,
            ]
        )
        self.workers[rank] = proc
        return proc

    def start(self, timeout: float = 60.0) -> "LocalCluster":
        self.start_broker()
        for rank in range(self.ranks):
            self.start_worker(rank)
        self.wait_ready(timeout)
        return self

    def client(self, **kwargs) -> Client:
        return Client(self.endpoints.frontend, **kwargs)

    def wait_ready(self, timeout: float = 60.0, ranks: int | None = None) -> StatusReply:
        """Block (bounded) until ``ranks`` ranks are registered: the broker
        answers the status request the moment the last one registers."""
        want = self.ranks if ranks is None else ranks
        with self.client() as c:
            try:
                return c.status(timeout=timeout, wait_ranks=want)
            except ZkvError as err:
                self._check_alive()
                raise TimeoutError(f"cluster not ready within {timeout} s: {err}") from None

    def _check_alive(self) -> None:
        if self.broker is not None and self.broker.poll() is not None:
            raise RuntimeError(f"broker exited with {self.broker.returncode}")
        for rank, proc in self.workers.items():
            if proc.poll() is not None:
                raise RuntimeError(f"rank {rank} exited with {proc.returncode}")

    def kill_worker(self, rank: int, sig: int = signal.SIGKILL) -> None:
        proc = self.workers[rank]
        proc.send_signal(sig)
        proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> "Teardown":
        """SIGTERM everything, wait (``timeout`` in all), SIGKILL what remains and wait for
        that too (``KILL_WAIT_S``); then remove what the cluster made (its CPU tiers and rank
        locks, its own directory), whatever happened before.  Bounded, and never raises: a
        process not gone in time is named in the ``Teardown``, not thrown."""
        procs: dict[str, Any] = {f"rank{r}": p for r, p in self.workers.items()}
        if self.broker is not None:
            procs["broker"] = self.broker
        end = Teardown()
        try:
            for name, p in procs.items():
                code = p.poll()
                if code is not None:
                    end.codes[name] = end.exited_before[name] = code
                else:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for name, p in procs.items():
                if name not in end.codes:
                    end.codes[name] = _reaped(p, deadline)
                    if end.codes[name] is None:
                        p.kill()
                        end.killed.append(name)
            deadline = time.monotonic() + KILL_WAIT_S
            for name in end.killed:
                end.codes[name] = _reaped(procs[name], deadline)
        finally:
            end.left = self._remove_files()
        return end

    def _remove_files(self) -> list[Path]:
        """Remove the CPU tiers and rank locks of this bus that no live process holds (a
        clean stop leaves none; a crashed rank's stays for its restart until then), and
        the cluster's own directory; return the tier files a live process still holds."""
        from ...rank.tiers.rank_lock import clean_locks
        from ...rank.tiers.tier_file import bus_name, clean_tiers, list_tiers  # numpy: not on zkv's import path

        left: list[Path] = []
        where = self._tier_dir()
        if where != "none":
            bus = bus_name(self.endpoints.backend)
            try:
                clean_tiers(where, bus)
                clean_locks(where, bus)  # those of workers killed and not restarted
                left = [t.path for t in list_tiers(where) if t.bus == bus]
            except OSError:
                left = [Path(where)]
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
        return left

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
