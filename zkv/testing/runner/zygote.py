"""Rank worker processes forked from one that already imported torch, for the test harness.

A worker process spends most of its start importing torch (3-4 s of CPU on
a small machine), and a test run starts a couple of hundred of them.  The
zygote is a child process that imports the worker's modules once and then
forks a worker per request; the harness gets a ``ZygoteProc``, which has
the part of ``subprocess.Popen`` that ``LocalCluster`` and the tests use
(``pid``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``,
``returncode``).  A forked worker is a real process of its own: its own pid,
sockets, memory and signals; kill -9 kills it alone.

The zygote forks only while it has no threads (it never runs a torch op, a
ZeroMQ context or a thread), so the child starts as a fresh process would,
with the modules already loaded.  Requests and answers are JSON datagrams on
a SOCK_SEQPACKET pair; the worker's stdout and stderr travel with the
request as file descriptors, so it writes where a Popen child would.
Opt-in: ``LocalCluster`` uses it only in the process that set
``ZKV_HARNESS_ZYGOTE`` to its own pid (``tests/conftest.py``), never in a
process that inherited the variable (``zkv up`` started by a test)."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Sequence

ENV = "ZKV_HARNESS_ZYGOTE"
_MAX_MSG = 1 << 20


def wanted() -> bool:
    """Whether this process asked for a zygote (the variable names this very process)."""
    return os.environ.get(ENV) == str(os.getpid())


class ZygoteProc:
    """A forked worker as ``LocalCluster`` sees a ``subprocess.Popen``."""

    def __init__(self, zygote: "Zygote", pid: int, args: Sequence[str]):
        self._zygote = zygote
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._zygote.pump(min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it exited; its exit code is on its way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The client end: one zygote process per harness process, started on first use."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(ENV, None)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", f"from zkv.testing.runner.zygote import serve; serve({theirs.fileno()})"],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self._sock = mine
        self._lock = threading.RLock()
        self._procs: dict[int, ZygoteProc] = {}
        self._exits: dict[int, int] = {}  # exits heard before their proc was filed
        self._spawned: list[int] = []

    @property
    def pid(self) -> int:
        """The zygote process's pid (a test that freezes it sees workers' exits go unreported)."""
        return self._proc.pid

    def spawn(self, argv: Sequence[str], env: dict[str, str], stdout: Any = None, stderr: Any = None) -> ZygoteProc:
        """Fork a ``zkv`` command (``argv`` after ``zkv``) with ``env``; stdout / stderr as Popen's."""
        fds, opened = [], []
        for stream, default in ((stdout, 1), (stderr, 2)):
            if stream == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_WRONLY)
                opened.append(fd)
            elif stream is None:
                fd = default
            else:
                fd = stream if isinstance(stream, int) else stream.fileno()
            fds.append(fd)
        request = json.dumps({"argv": list(argv), "env": env, "cwd": os.getcwd()}).encode()
        with self._lock:
            try:
                socket.send_fds(self._sock, [request], fds)
            finally:
                for fd in opened:
                    os.close(fd)
            deadline = time.monotonic() + 30.0
            while not self._spawned:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("the zygote did not fork a worker within 30 s")
                self.pump(left)
            pid = self._spawned.pop(0)
            proc = ZygoteProc(self, pid, ["zkv", *argv])
            if pid in self._exits:
                proc.returncode = self._exits.pop(pid)
            self._procs[pid] = proc
            return proc

    def pump(self, timeout: float) -> None:
        """Read what the zygote said within ``timeout``: forked pids and exit codes."""
        with self._lock:
            wait = timeout
            while True:
                ready, _, _ = select.select([self._sock], [], [], wait)
                if not ready:
                    return
                data = self._sock.recv(_MAX_MSG)
                if not data:
                    raise RuntimeError(f"the zygote exited ({self._proc.poll()})")
                msg = json.loads(data)
                if "pid" in msg:
                    self._spawned.append(msg["pid"])
                else:
                    proc = self._procs.get(msg["exit"])
                    if proc is None:
                        self._exits[msg["exit"]] = msg["code"]
                    else:
                        proc.returncode = msg["code"]
                wait = 0.0  # drain what else is there, then return

    def close(self) -> None:
        self._sock.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


def current() -> Zygote | None:
    """This process's zygote, if one was started."""
    return _zygote


def spawn(argv: Sequence[str], env: dict[str, str], stdout: Any = None, stderr: Any = None) -> ZygoteProc:
    """Fork a ``zkv`` command from this process's zygote (started on first use)."""
    global _zygote
    with _zygote_lock:
        if _zygote is None:
            _zygote = Zygote()
            atexit.register(_zygote.close)
        zygote = _zygote
    return zygote.spawn(argv, env, stdout, stderr)


# --- the zygote process ---------------------------------------------------------------


def _child(sock: socket.socket, wakes: tuple[int, int], request: dict, fds: list[int]) -> None:
    """In the forked worker: become the process a Popen of ``python -m zkv ARGV`` would be."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        sock.close()
        for wake in wakes:
            os.close(wake)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as CPython sets it at start
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            if fd > 2:
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.argv = ["zkv", *request["argv"]]
        import runpy

        try:
            runpy.run_module("zkv", run_name="__main__", alter_sys=True)  # python -m zkv ARGV
            code = 0
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        except KeyboardInterrupt:
            code = 130
        finally:
            atexit._run_exitfuncs()  # what the interpreter's exit would run (the shm files' cleanup)
    except BaseException:  # noqa: BLE001 - a worker that fails must still exit, never return into the zygote
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def serve(fd: int) -> None:
    """The zygote process: import once, then fork a worker per request until the harness closes the socket."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    from ...rank import worker  # noqa: F401 - what every worker imports (torch): once, here

    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the harness stops the zygote by closing its socket
    while True:
        ready = select.select([sock.fileno(), wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:  # reap every child that exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if sock.fileno() in ready:
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 2)
            except ConnectionResetError:
                data = b""
            if not data:
                return  # the harness is gone; its workers are its to stop
            request = json.loads(data)
            pid = os.fork()
            if pid == 0:
                _child(sock, (wake_r, wake_w), request, fds)
            for f in fds:
                os.close(f)
            sock.send(json.dumps({"pid": pid}).encode())
