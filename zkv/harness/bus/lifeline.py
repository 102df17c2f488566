"""The life of a ``zkv up``: its children die with it, and another command can
find and stop it.

- ``die_with_parent(parent)``: run in a child between fork and exec
  (``subprocess.Popen(preexec_fn=...)``); the kernel sends the child SIGTERM
  when its parent dies, kill -9 included (``prctl(PR_SET_PDEATHSIG)``), so a
  killed ``zkv up`` leaves no broker or rank behind.  A parent that died
  before the call is caught too (the child's parent is then another process).
- ``UpLock``: ``up.lock`` in the runtime directory, holding the ``zkv up``'s
  pid under an exclusive ``flock`` for as long as it runs; ``running(dir)``
  reads it (None when no live process holds it: the kernel drops the lock
  with its holder) and ``stop(pid, timeout)`` sends SIGTERM and waits on a
  pidfd, bounded (``zkv down``).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import select
import signal
from pathlib import Path

LOCK_NAME = "up.lock"
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM when ``parent`` dies (Linux; a no-op elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class UpLock:
    """``up.lock`` in ``directory``, held with this process's pid until ``release``."""

    def __init__(self, directory: str | Path):
        self.path = Path(directory) / LOCK_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Drop the lock (the file stays: one nobody holds names no running zkv up)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def running(directory: str | Path) -> int | None:
    """The pid of the live ``zkv up`` of ``directory``, or None."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # nobody holds it: a leftover of a process that is gone
        except BlockingIOError:
            pass
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else None
    finally:
        os.close(fd)


def stop(pid: int, timeout: float) -> bool:
    """SIGTERM ``pid`` and wait until it exits, at most ``timeout`` seconds; True when it did."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        os.kill(pid, signal.SIGTERM)
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(int(timeout * 1000)))
    except ProcessLookupError:
        return True
    finally:
        os.close(fd)
