"""``ShmArena``: an engine's CPU KV tensors in shared-memory files a zkv worker
can map (``manifest.export_manifest``), and the files gone when the engine is.

The engine owns the files: it drops its tensors and calls ``close()``, which
unlinks them (mappings already open stay valid until unmapped).  So that an
engine that forgets, exits or is stopped with SIGTERM leaves no host memory
behind, every open arena of this process is also closed at interpreter exit
(``atexit``) and on SIGTERM / SIGHUP.  The signal handler is installed once,
from the main thread only (the first arena made there, or
``install_exit_cleanup()``): it closes this process's arenas, then chains to
the handler it replaced (the program's own, which decides what happens next,
or the default action: the process dies of the signal as it would have).
An ignored signal stays ignored, and a handler set outside Python (which
cannot be chained to) is left alone.  A process killed with SIGKILL cannot
clean up: its files hold no lock any more, and ``zkv shm clean`` removes
them (``rank/memory/shm_files.py``).  A forked child never closes its parent's arenas.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import uuid
from typing import Any, Sequence, cast

import torch

from .shm_files import SHM_DIR, SHM_PREFIX, file_name, hold

_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_open: dict[int, "ShmArena"] = {}  # id -> arena, every open arena of this process (and of a forking parent)
_atexit_done = False
_previous: dict[int, Any] = {}  # signal -> the handler ours replaced (chained to), for the signals we handle
_settled: set[int] = set()  # the signals looked at: handled, or found not ours to handle


class ShmArena:
    """Engine side: CPU tensors backed by files under ``directory`` that a worker can map.

    Files are ``zkv-<pid>-<tag>-<n>-<name>``; the arena holds a lock on each
    until it closes.  ``cleanup_on_exit``: close at interpreter exit and on
    SIGTERM / SIGHUP (see the module docstring).  A context manager: ``with
    ShmArena() as arena: ...`` closes it."""

    def __init__(self, directory: str = SHM_DIR, tag: str | None = None, cleanup_on_exit: bool = True):
        self.directory = directory
        self.tag = tag or uuid.uuid4().hex[:12]
        self.pid = os.getpid()
        self.paths: dict[int, str] = {}  # storage data_ptr -> file
        self._fds: list[int] = []  # one per file, each holding the owner's lock
        if cleanup_on_exit:
            _open[id(self)] = self
            install_exit_cleanup()

    def tensor(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor in a new shared file ``zkv-<pid>-<tag>-<n>-<name>``."""
        nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size())
        path = os.path.join(self.directory, file_name(self.pid, self.tag, len(self._fds), name))
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        self._fds.append(fd)
        try:
            hold(fd)
            os.ftruncate(fd, nbytes)
            storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(path, True, nbytes))
        except BaseException:
            os.unlink(path)
            raise
        self.paths[storage.data_ptr()] = path
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * int(shape[i + 1])
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape), tuple(strides))

    def path_of(self, storage: torch.UntypedStorage) -> str | None:
        return self.paths.get(storage.data_ptr())

    def close(self) -> None:
        """Unlink every file and drop the locks (idempotent; safe from a signal handler)."""
        _open.pop(id(self), None)
        while self.paths:
            _, path = self.paths.popitem()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        while self._fds:
            os.close(self._fds.pop())

    def __enter__(self) -> "ShmArena":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def close_all() -> None:
    """Close every open arena this process made (not a forking parent's)."""
    pid = os.getpid()
    for arena in list(_open.copy().values()):
        if arena.pid == pid:
            arena.close()


def _on_signal(signum: int, frame: Any) -> None:
    close_all()
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of it, as the default action would have


def install_exit_cleanup() -> bool:
    """Close this process's arenas at exit and on SIGTERM / SIGHUP; True once the
    signal handlers are settled.  Idempotent; from another thread than the
    main one only the exit hook is installed (call it again from the main thread)."""
    global _atexit_done
    if not _atexit_done:
        atexit.register(close_all)
        _atexit_done = True
    if threading.current_thread() is not threading.main_thread():
        return len(_settled) == len(_SIGNALS)
    for signum in _SIGNALS:
        if signum in _settled:
            continue
        current = signal.getsignal(signum)
        if current is signal.SIG_DFL or (callable(current) and current is not _on_signal):
            _previous[signum] = current
            signal.signal(signum, _on_signal)
        _settled.add(signum)  # SIG_IGN, or a handler set outside Python (None): left alone
    return True


__all__ = ["SHM_DIR", "SHM_PREFIX", "ShmArena", "close_all", "install_exit_cleanup"]
