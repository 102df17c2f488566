"""What a killed engine leaves in /dev/shm is removed (zkv/harness/vllm/leftovers.py), and
nothing another process still holds: real processes holding real ``psm_*`` segments
(Python's ``multiprocessing.shared_memory``, what vLLM's broadcast rings are), killed
with their process group as a server is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from zkv.harness.vllm import leftovers

_MAKE = (
    "import sys; from multiprocessing import shared_memory\n"
    "m = shared_memory.SharedMemory(create=True, size=4096)\n"
    "print(m.name, flush=True); sys.stdin.read()\n"
)
_ATTACH = (
    "import sys; from multiprocessing import shared_memory\n"
    "m = shared_memory.SharedMemory(name=sys.argv[1])\n"
    "print('attached', flush=True); sys.stdin.read()\n"
)


def _group(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, as a server's
    )


def test_a_killed_group_s_segments_go_but_not_one_another_process_still_holds():
    maker, other = _group(_MAKE), _group(_MAKE)
    holder = None
    try:
        mine, theirs = (Path("/dev/shm") / p.stdout.readline().strip() for p in (maker, other))
        assert mine.exists() and theirs.exists() and mine.name.startswith(leftovers.PREFIXES)
        holder = _group(_ATTACH, theirs.name)  # another process uses the other group's segment
        assert holder.stdout.readline().strip() == "attached"
        assert mine in leftovers.held_by(leftovers.group(maker.pid)), "named before the group goes"

        assert leftovers.kill_group(maker) == [mine]
        assert not mine.exists(), "kill -9 unlinks nothing: the harness did"
        assert leftovers.kill_group(other) == [] and theirs.exists(), "still held by another process"
        assert leftovers.kill_group(holder) == [theirs] and not theirs.exists(), "its last holder gone: removed"
        assert {mine, theirs} <= leftovers.seen()
    finally:
        for proc in (maker, other, holder):
            if proc is not None and proc.poll() is None:
                leftovers.kill_group(proc)
