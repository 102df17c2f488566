"""What a zkv tool that runs vLLM shows: its own lines and, on a terminal,
progress bars inside its long phases; vLLM's output in a log file.

vLLM's engine processes inherit this process's standard output and error, and
write there what no logging level quiets (its import warnings, torch's C++
warnings, progress bars of their own, ``leaked shared_memory`` at exit): dozens
of lines around a handful of results.  ``vllm_output_to(log)`` points file
descriptors 1 and 2, which those processes, C code and logging handlers made
earlier write to, at ``log`` while the engine runs, and keeps ``sys.stdout``
and ``sys.stderr`` (``print``, ``click.echo``, the bars) on the terminal.
The tools do it unless the user asked to see vLLM (``VLLM_LOGGING_LEVEL`` set).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import Any, Iterator


def log_path(name: str) -> Path:
    """Where a tool named ``name`` keeps vLLM's output: the runtime directory, one file
    per tool, replaced by its next run (it outlives the run, to be read after it)."""
    from ...net.endpoints import runtime_dir

    return runtime_dir() / f"{name}.log"


@contextlib.contextmanager
def vllm_output_to(log: Path | None) -> Iterator[None]:
    """File descriptors 1 and 2 to ``log`` (truncated) for the block, ``sys.stdout`` and
    ``sys.stderr`` still on what they were; ``None``: nothing changes."""
    if log is None:
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = (os.dup(1), os.dup(2))
    before = sys.stdout, sys.stderr
    ours = [os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace") for fd in saved]
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        sys.stdout, sys.stderr = ours
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        os.close(target)
        for stream in (*ours, *before):
            with contextlib.suppress(ValueError, OSError):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        sys.stdout, sys.stderr = before
        for stream in ours:
            stream.close()


def tail(log: Path | None, lines: int = 20) -> str:
    """The end of ``log``, to show when a run failed ('' without one)."""
    if log is None or not log.exists():
        return ""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def progress(desc: str, total: int | None, unit: str = "it") -> Any:
    """A progress bar on the terminal (``sys.stderr``), none when it is not one: a tqdm."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False, dynamic_ncols=True)


@contextlib.contextmanager
def ticking(desc: str) -> Iterator[None]:
    """A bar that counts the seconds of a phase with no steps to count (an engine's start)."""
    bar = progress(desc, None, "s")
    done = threading.Event()

    def tick() -> None:
        while not done.wait(1.0):
            bar.update(1)

    ticker = threading.Thread(target=tick, name="zkv-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join(timeout=2.0)
        bar.close()


__all__ = ["log_path", "progress", "tail", "ticking", "vllm_output_to"]
