"""One broker per place: a lock file beside the broker's ipc sockets and state file.

Binding an ``ipc://`` path that a live broker has bound succeeds: new
connections reach the newcomer, it overwrites the state file, and its exit
unlinks the socket files, leaving the first bus alive and unreachable.  So a
broker takes an exclusive ``flock`` on ``broker.lock`` in each directory it
binds sockets or keeps its state in before it touches anything there, and a
second one is refused with the holder's pid.  The kernel drops the lock when
the holder dies, kill -9 included, so a stale file never blocks a restart.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = "broker.lock"


class BrokerInUse(ValueError):
    """Another live broker holds this place."""


class OwnerLock:
    """Exclusive locks on ``broker.lock`` in ``directories``, held until ``release``."""

    def __init__(self, directories: set[Path]):
        self._held: list[tuple[Path, int]] = []
        try:
            for directory in sorted(directories):
                self._held.append(_take(directory / LOCK_NAME))
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Remove the lock files and drop the locks (removal first, while still held)."""
        for path, fd in self._held:
            try:
                path.unlink(missing_ok=True)
            finally:
                os.close(fd)
        self._held.clear()


def _take(path: Path) -> tuple[Path, int]:
    path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(8):  # the holder may remove the file between our open and our flock: retry on a fresh one
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise BrokerInUse(
                f"another broker{holder} is serving {path.parent} (it holds {path}); "
                f"stop it first, or give this one another --runtime-dir / addresses"
            ) from None
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return path, fd
        os.close(fd)  # we locked a file its holder had just removed
    raise BrokerInUse(f"cannot take {path}: it keeps being replaced")


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return f" (pid {text})" if text.isdigit() else ""


def ipc_directories(addresses: tuple[str, ...], state_file: Path | None) -> set[Path]:
    """The directories a broker with these addresses and state file would write in."""
    dirs = {Path(a[len("ipc://") :]).parent for a in addresses if a.startswith("ipc://")}
    if state_file is not None:
        dirs.add(state_file.parent)
    return {d.resolve() for d in dirs}
