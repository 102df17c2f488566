"""Engines' shared-memory files (``/dev/shm/zkv-<pid>-<tag>-<n>-<name>``): their
names, the lock their owner holds, and finding the ones whose owner is gone.

An engine's ``ShmArena`` (``rank/memory/shm.py``) creates the files, holds a
shared ``flock`` on each while it lives and unlinks them when it closes (on
exit and on SIGTERM too).  A process killed with SIGKILL leaves them behind,
holding host memory until someone removes them: ``zkv shm list`` / ``zkv shm
clean`` (docs/operations.md).  A file is an *orphan* only when both say so:
nobody holds its lock (the kernel drops it when the last holder dies), and
the pid in its name is no running process.  Either alone is not enough: a
pid is reused, and is another number in another pid namespace (a container
sharing ``/dev/shm``), while the lock is not yet held in the instant between
creating a file and locking it.  A file without a pid in its name is never
an orphan.  No torch here, so ``zkv shm`` starts fast.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
from dataclasses import dataclass

SHM_DIR = "/dev/shm"
SHM_PREFIX = "zkv-"
_OWNER = re.compile(r"zkv-([1-9][0-9]{0,9})-")


def safe_name(text: str, limit: int = 64) -> str:
    """``text`` with every character but letters, digits and ``._-`` replaced, at most ``limit`` long."""
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:limit] or "_"


def file_name(pid: int, tag: str, index: int, name: str) -> str:
    """The name of an arena's ``index``-th file: ``zkv-<pid>-<tag>-<index>-<name>``."""
    return f"{SHM_PREFIX}{pid}-{safe_name(tag)}-{index}-{safe_name(name)}"


def owner_pid(name: str) -> int | None:
    """The pid in a file's name (None for a name without one: never cleaned)."""
    m = _OWNER.match(name)
    return int(m.group(1)) if m else None


def hold(fd: int) -> None:
    """The owner's lock on a file it created (shared: a process it forks holds it too)."""
    fcntl.flock(fd, fcntl.LOCK_SH)


def pid_running(pid: int) -> bool:
    """Whether ``pid`` is a process here that has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True  # no /proc to ask: kill(0) said it exists


@dataclass(frozen=True)
class ShmFile:
    """One ``zkv-*`` file: its size, the pid its name gives, and who still holds it.

    ``held``: a process holds its lock (None: the file cannot be opened to ask,
    e.g. another user's).  ``orphan``: nobody holds it and its pid is gone."""

    path: str
    nbytes: int
    pid: int | None
    pid_running: bool
    held: bool | None

    @property
    def orphan(self) -> bool:
        return self.held is False and self.pid is not None and not self.pid_running


def _open_regular(path: str) -> int | None:
    """An fd on ``path`` if it is a regular file (never following a link), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _locked_by_someone(fd: int) -> bool:
    """Try the exclusive lock no owner leaves free; True if someone holds the file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def _inspect(path: str) -> tuple[ShmFile, int | None] | None:
    """The file at ``path`` and, when it is free, an fd holding its exclusive lock."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    pid = owner_pid(os.path.basename(path))
    fd = _open_regular(path)
    held: bool | None = None
    if fd is not None:
        held = _locked_by_someone(fd)
        if held:
            os.close(fd)
            fd = None
    running = pid is not None and pid_running(pid)
    return ShmFile(path, st.st_size, pid, running, held), fd


def list_files(directory: str = SHM_DIR) -> list[ShmFile]:
    """Every regular ``zkv-*`` file in ``directory``, sorted by name."""
    found = []
    for name in sorted(os.listdir(directory)):
        if not name.startswith(SHM_PREFIX):
            continue
        seen = _inspect(os.path.join(directory, name))
        if seen is not None:
            found.append(seen[0])
            if seen[1] is not None:
                os.close(seen[1])
    return found


def clean(directory: str = SHM_DIR, dry_run: bool = False) -> list[ShmFile]:
    """Remove every orphan in ``directory`` (``dry_run``: only name them); return them.

    Each file is unlinked while this process holds its exclusive lock and
    only if the name still leads to the file that was checked."""
    removed = []
    for name in sorted(os.listdir(directory)):
        if not name.startswith(SHM_PREFIX):
            continue
        path = os.path.join(directory, name)
        seen = _inspect(path)
        if seen is None:
            continue
        info, fd = seen
        if fd is None:
            continue
        try:
            if not info.orphan:
                continue
            st = os.fstat(fd)
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                continue  # replaced since it was checked
            if not dry_run:
                os.unlink(path)
            removed.append(info)
        except FileNotFoundError:
            continue
        finally:
            os.close(fd)
    return removed


__all__ = ["SHM_DIR", "SHM_PREFIX", "ShmFile", "clean", "file_name", "hold", "list_files", "owner_pid", "safe_name"]
