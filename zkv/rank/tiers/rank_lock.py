"""One live worker per rank of a bus on a host, and a standby that takes over.

A worker whose CPU tier lives in a tier file (``zkv worker --tier-dir``)
holds an exclusive ``flock`` on ``zkv-rank-<bus>-r<rank>.lock`` beside it
for as long as it runs: its tier files and disk file are per rank, so a
second worker of the rank there could only fail on them, or worse, serve
beside the first.  The kernel drops the lock the moment the holder dies
(kill -9 included), so a *standby* (``zkv worker --standby``), a worker that
has done everything else a start does (the interpreter, torch, its modules:
seconds, docs/benchmarks.md "Restart"), blocks on the lock and goes on the
instant the serving worker is gone: it maps the CPU tier again, opens the
disk tier and registers, as any restarted rank does.

The holder unlinks the file when it stops cleanly; a waiter that then wins
the lock of the unlinked file sees that the path names another file (or
none) and takes the lock again on the path's.  No torch here.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Callable

from .tier_file import TierPlace

PREFIX = "zkv-rank-"


def lock_path(place: TierPlace) -> Path:
    """The lock file of ``place``'s rank of its bus, beside its tier files."""
    return Path(place.directory) / f"{PREFIX}{place.bus}-r{place.rank}.lock"


class RankBusy(Exception):
    """Another live process serves this rank of this bus on this host."""

    def __init__(self, path: Path, pid: int):
        super().__init__(f"{path} is held by pid {pid or '?'}")
        self.path, self.pid = path, pid


class RankLock:
    """The lock of ``place``'s rank (see the module docstring); ``acquire``, then ``release`` when done."""

    def __init__(self, place: TierPlace):
        self.path = lock_path(place)
        self._fd = -1

    def acquire(self, wait: bool = False, on_wait: Callable[[int], None] | None = None) -> None:
        """Hold the lock; when another process holds it, raise ``RankBusy``, or with
        ``wait`` call ``on_wait(holder pid)`` and block until that process is gone."""
        os.makedirs(self.path.parent, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pid = _holder(fd)
                    if not wait:
                        raise RankBusy(self.path, pid) from None
                    if on_wait is not None:
                        on_wait(pid)
                    fcntl.flock(fd, fcntl.LOCK_EX)  # the GIL is released while it blocks; a signal ends it
                if self._names(fd):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                    self._fd = fd
                    return
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the holder unlinked it as it stopped: lock the path's file

    def _names(self, fd: int) -> bool:
        """Whether the path still names the file ``fd`` holds."""
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        """Stop holding it (the file goes: nobody else may be serving this rank now)."""
        if self._fd < 0:
            return
        if self._names(self._fd):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1


def serving_pid(place: TierPlace) -> int | None:
    """The pid of the live process that holds ``place``'s rank lock (0: one whose pid
    the file does not say), or None when nobody does.  Only looks: a lock taken to
    find out is let go at once, its file left where it was."""
    try:
        fd = os.open(lock_path(place), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    finally:
        os.close(fd)  # drops the shared lock, if it was taken
    return None


def clean_locks(directory: str, bus: str | None = None, dry_run: bool = False) -> list[Path]:
    """Remove the rank locks (of ``bus``, when given) no live worker holds: those a
    killed worker left; return their paths (``dry_run``: those it would remove)."""
    from .tier_file import remove_tier  # numpy: not on a worker's start path

    removed: list[Path] = []
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(PREFIX) or not name.endswith(".lock"):
            continue
        if bus is not None and not name.startswith(f"{PREFIX}{bus}-r"):
            continue
        path = Path(directory) / name
        try:
            if remove_tier(path, dry_run):  # a waiter that then locks the unlinked file takes the path's
                removed.append(path)
        except OSError:
            continue
    return removed


def _holder(fd: int) -> int:
    try:
        return int(os.pread(fd, 16, 0).split()[0])
    except (ValueError, IndexError, OSError):
        return 0


__all__ = ["RankBusy", "RankLock", "clean_locks", "serving_pid"]
