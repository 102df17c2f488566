"""An engine's shared-memory files go with the engine (docs/operations.md,
"Shared-memory files"): a real engine process holding a ``ShmArena`` removes
them on SIGTERM (through its own handler too, which still decides), and the
files of one killed with SIGKILL are removed by ``zkv shm clean``, which
leaves a live owner's files alone."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from zkv.rank.memory import shm_files

ROOT = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

ENGINE = r"""
import json, signal, sys, threading
import torch
from zkv.rank.memory.shm import ShmArena

directory, mode = sys.argv[1], sys.argv[2]
if mode == "own-handler":
    def handler(signum, frame):
        print("own handler", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
arenas = []
thread = threading.Thread(target=lambda: arenas.append(ShmArena(directory)))
thread.start()
thread.join()
from_thread = signal.getsignal(signal.SIGTERM)
arenas.append(ShmArena(directory))
tensors = [a.tensor(f"k{i}", (4, 64), torch.bfloat16) for i, a in enumerate(arenas)]
print("ready", json.dumps({
    "files": [p for a in arenas for p in a.paths.values()],
    "after_thread": repr(from_thread),
    "sigterm": getattr(signal.getsignal(signal.SIGTERM), "__name__", repr(signal.getsignal(signal.SIGTERM))),
    "sighup": repr(signal.getsignal(signal.SIGHUP)),
}), flush=True)
sys.stdin.readline()
"""


def line_of(proc: subprocess.Popen, timeout: float = 120) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the engine process did not answer in time"
    return proc.stdout.readline().strip()


def default_sighup() -> None:
    """The engine starts with SIGHUP at its default action, as from a terminal, even
    when this test runs under ``nohup`` (which ignores it, and a child inherits that)."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


class Engine:
    """An engine process holding two arenas (one made off the main thread) in ``directory``."""

    def __init__(self, script: Path, directory: str, mode: str = "default"):
        self.proc = subprocess.Popen(
            [sys.executable, str(script), directory, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=ENV,
            preexec_fn=default_sighup,
        )
        self.info: dict = {}

    def ready(self) -> dict:
        line = line_of(self.proc)
        assert line.startswith("ready "), line
        self.info = json.loads(line[len("ready ") :])
        return self.info

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "engine.py"
    path.write_text(ENGINE)
    return path


@pytest.fixture
def shm_dir():
    """A directory of this test's own on the same tmpfs as /dev/shm, so cleaning touches nobody else's files."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = tempfile.mkdtemp(prefix="zkvtest-", dir=base)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def zkv(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "zkv", *args], capture_output=True, text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr
    return out


def test_sigterm_removes_the_files_and_kill_9_leaves_them_to_zkv_shm_clean(script, shm_dir):
    live, killed = Engine(script, shm_dir), Engine(script, shm_dir)
    try:
        info, dead_info = live.ready(), killed.ready()
        assert info["after_thread"] == "<Handlers.SIG_DFL: 0>", "no handler is installed from another thread"
        assert info["sigterm"] == "_on_signal" and "_on_signal" in info["sighup"]
        files, dead_files = info["files"], dead_info["files"]
        assert len(files) == 2 and all(os.path.exists(p) for p in files + dead_files)
        assert all(os.path.basename(p).startswith(f"zkv-{live.proc.pid}-") for p in files)

        killed.proc.send_signal(signal.SIGKILL)
        assert killed.proc.wait(timeout=30) == -signal.SIGKILL
        assert all(os.path.exists(p) for p in dead_files), "SIGKILL leaves the files behind"

        rows = zkv("shm", "list", "--dir", shm_dir, "--json").stdout.splitlines()
        listed = {row["path"]: row for row in map(json.loads, rows)}
        assert {p: listed[p]["state"] for p in files} == dict.fromkeys(files, "held")
        assert {p: listed[p]["state"] for p in dead_files} == dict.fromkeys(dead_files, "orphan")
        assert zkv("shm", "clean", "--dir", shm_dir, "--dry-run").stdout.splitlines()[-1].startswith("would remove 2 ")
        assert all(os.path.exists(p) for p in dead_files), "a dry run removes nothing"

        out = zkv("shm", "clean", "--dir", shm_dir).stdout
        assert out.splitlines()[-1] == f"removed 2 orphaned files, {2 * 4 * 64 * 2} bytes"
        assert not any(os.path.exists(p) for p in dead_files), "the dead engine's files are gone"
        assert all(os.path.exists(p) for p in files), "the live engine's files are left alone"

        live.proc.send_signal(signal.SIGTERM)
        assert live.proc.wait(timeout=30) == -signal.SIGTERM, "it still dies of the signal"
        assert not any(os.path.exists(p) for p in files), "SIGTERM removed every file of both arenas"
        assert os.listdir(shm_dir) == []
    finally:
        live.stop()
        killed.stop()


def test_sigterm_chains_to_the_engines_own_handler_and_an_ignored_signal_stays_ignored(script):
    engine = Engine(script, shm_files.SHM_DIR, "own-handler")  # the real /dev/shm, as an engine uses it
    try:
        info = engine.ready()
        assert info["sigterm"] == "_on_signal" and info["sighup"] == "<Handlers.SIG_IGN: 1>"
        assert all(p.startswith("/dev/shm/zkv-") and os.path.exists(p) for p in info["files"])
        engine.proc.send_signal(signal.SIGTERM)
        assert line_of(engine.proc) == "own handler"
        assert engine.proc.wait(timeout=30) == 3, "the engine's handler decided how it exits"
        assert not any(os.path.exists(p) for p in info["files"])
    finally:
        engine.stop()


def test_only_files_nobody_holds_whose_owner_pid_is_gone_are_orphans(shm_dir):
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=30)
    me = os.getpid()

    def make(name: str) -> str:
        path = os.path.join(shm_dir, name)
        with open(path, "wb") as f:
            f.write(b"x" * 8)
        return path

    orphan = make(shm_files.file_name(dead.pid, "t", 0, "k0"))
    running = make(shm_files.file_name(me, "t", 0, "k0"))  # unlocked, but its pid is a process: left alone
    no_pid = make("zkv-an-old-name")
    held = make(shm_files.file_name(dead.pid, "u", 0, "k0"))  # a pid of another namespace: the lock decides
    os.symlink(orphan, os.path.join(shm_dir, shm_files.file_name(dead.pid, "t", 1, "link")))
    os.mkdir(os.path.join(shm_dir, shm_files.file_name(dead.pid, "t", 2, "dir")))
    make("other-file")
    fd = os.open(held, os.O_RDONLY)
    try:
        shm_files.hold(fd)
        states = {f.path: (f.orphan, f.held, f.pid) for f in shm_files.list_files(shm_dir)}
        assert states == {
            orphan: (True, False, dead.pid),
            running: (False, False, me),
            no_pid: (False, False, None),
            held: (False, True, dead.pid),
        }, "links, directories and other names are not listed"
        assert [f.path for f in shm_files.clean(shm_dir)] == [orphan]
        assert not os.path.exists(orphan) and all(os.path.exists(p) for p in (running, no_pid, held))
    finally:
        os.close(fd)
    assert [f.path for f in shm_files.clean(shm_dir)] == [held], "once its holder let go"
