"""What a vLLM engine leaves in ``/dev/shm`` when it is killed, or stops without
cleaning up: its shared-memory broadcast rings (``psm_*``: Python's
``multiprocessing.shared_memory``, 160-250 MB each here) and its semaphores
(``sem.mp-*``).  A killed process unlinks nothing, and the engine's resource
tracker, which would, dies with its process group.

``held_by(pids)`` names the files those processes hold (mapped or open): call it
before they go.  ``remove_unheld(paths)`` then removes those no live process holds
any more, never one another process still uses.  Every file ``held_by`` saw is
remembered (``seen()``), so a test session can check that what its engines held
is gone at its end.  Linux only (``/proc``)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterable

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")
_seen: set[Path] = set()


def _ours(name: str) -> bool:
    return name.startswith(PREFIXES)


def _held(pid: int) -> set[Path]:
    """The vLLM shm files process ``pid`` maps or has open (none if it is gone)."""
    found: set[Path] = set()
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith(f"{SHM}/") and _ours(path[len(str(SHM)) + 1 :].removesuffix(" (deleted)")):
                    found.add(Path(path.removesuffix(" (deleted)")))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith(f"{SHM}/") and _ours(Path(target).name):
                found.add(Path(target))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return found


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a server started in a session of its own)."""
    out = []
    for pid in _pids():
        try:
            if os.getpgid(pid) == pgid:
                out.append(pid)
        except ProcessLookupError:
            continue
    return out


def descendants(root: int) -> list[int]:
    """``root``'s live child processes, theirs, and so on."""
    parent: dict[int, int] = {}
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stat:
                parent[pid] = int(stat.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [root]
    while frontier:
        kids = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += kids
        frontier = kids
    return found


def gone_within(pid: int, timeout: float) -> bool:
    """Wait (on a pidfd, bounded) until ``pid`` exits, child of ours or not."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], max(0.0, timeout))[0])
    finally:
        os.close(fd)


def holders(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that hold vLLM shm files: an engine's own processes (its core, its
    workers), not a resource tracker or a server a test started beside it."""
    return [pid for pid in pids if _held(pid)]


def held_by(pids: Iterable[int]) -> set[Path]:
    """The vLLM shm files these processes hold (remembered for ``seen``)."""
    found: set[Path] = set()
    for pid in pids:
        found |= _held(pid)
    _seen.update(found)
    return found


def remove_unheld(paths: Iterable[Path]) -> list[Path]:
    """Remove those of ``paths`` no live process holds; return what was removed."""
    wanted = {Path(p) for p in paths if Path(p).exists()}
    if not wanted:
        return []
    for pid in _pids():
        wanted -= _held(pid)
        if not wanted:
            return []
    removed = []
    for path in sorted(wanted):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            continue
    return removed


def let_go(pgid: int, held: set[Path], timeout: float = 10.0) -> list[Path]:
    """Once a group's leader is gone: wait (bounded) for its other processes to end, then
    remove what the group held and nobody holds now."""
    deadline = time.monotonic() + timeout
    for pid in group(pgid):
        gone_within(pid, deadline - time.monotonic())
    return remove_unheld(held)


def kill_group(proc: subprocess.Popen) -> list[Path]:
    """kill -9 of ``proc``'s process group (a session of its own: ``start_new_session``), and
    of what it leaves in /dev/shm; returns what was removed."""
    if proc.poll() is not None:
        return []
    held = held_by(group(proc.pid))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    return let_go(proc.pid, held)


def seen() -> set[Path]:
    """Every file ``held_by`` saw in this process's life."""
    return set(_seen)


__all__ = [
    "PREFIXES",
    "SHM",
    "descendants",
    "gone_within",
    "group",
    "held_by",
    "kill_group",
    "let_go",
    "remove_unheld",
    "seen",
]
