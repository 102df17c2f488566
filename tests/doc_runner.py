"""Run one documented shell block (tests/doc_blocks.py) the way a user would:
each command line in bash, in a fresh directory, with a private
``ZKV_RUNTIME_DIR`` (where ``zkv up`` binds and every ``zkv`` command looks,
zkv/net/endpoints.py), the checkout's ``bin/zkv`` first on ``PATH``, every
wait bounded, and every process it started stopped with Ctrl-C at the end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from doc_blocks import ROOT, Block, Command, split_and

LINE_TIMEOUT = 90.0  # one command (a cluster start on 2 loaded cores takes ~15 s)
LONG_TIMEOUT = 600.0  # a command under a long rule or in a long block
READY_TIMEOUT = 90.0  # a background command printing its ready line
STOP_TIMEOUT = 30.0  # a Ctrl-C'd process exiting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Background:
    """A command running in its own process group; its output is collected by a
    thread so that a test can wait (bounded) for a line."""

    def __init__(self, text: str, cwd: Path, env: dict[str, str]):
        self.text = text
        self.proc = subprocess.Popen(
            ["bash", "-o", "pipefail", "-c", text],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._done = False
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._cond:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._done = True
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: self._done or any(text in line for line in self.lines), timeout)
            seen = any(text in line for line in self.lines)
        if not seen:
            why = "exited" if ok else f"printed nothing like it within {timeout:.0f} s"
            raise AssertionError(f"`{self.text}` {why} before printing {text!r}:\n{self.output}")

    def interrupt(self, timeout: float = STOP_TIMEOUT) -> int:
        """Ctrl-C, as a terminal sends it: SIGINT to the whole process group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            raise AssertionError(
                f"`{self.text}` did not stop within {timeout:.0f} s of Ctrl-C:\n{self.output}"
            ) from None
        with self._cond:  # the reader has seen end of file once the process is gone
            self._cond.wait_for(lambda: self._done, 10)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class BlockRun:
    """One run of one block; ``run()`` returns the transcript or raises
    AssertionError with it."""

    def __init__(self, block: Block, long: bool):
        self.block = block
        self.long = long or block.reason("long") is not None
        self.work = Path(tempfile.mkdtemp(prefix="zkvdoc-", dir="/tmp"))  # short: ipc:// paths end at ~107 bytes
        self.runtime = self.work / "run"
        env = {k: v for k, v in os.environ.items() if not k.startswith("ZKV_")}  # nothing from a user's bus
        path = os.pathsep.join(p for p in (str(ROOT / "bin"), env.get("PATH", "")) if p)
        pythonpath = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env.update(PATH=path, PYTHONPATH=pythonpath, PYTHON=sys.executable, ZKV_RUNTIME_DIR=str(self.runtime))
        env.update(MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
        self.env = env
        self.values = {"{port}": str(free_port()), "{port2}": str(free_port()), "{runtime}": str(self.runtime)}
        self.values["{root}"] = str(ROOT)
        self.transcript: list[str] = []
        self.background: list[Background] = []
        self.made: set[str] = set()

    def sub(self, text: str) -> str:
        for m in self.block.named("sub"):
            new = m.args[1]
            for key, value in self.values.items():
                new = new.replace(key, value)
            text = text.replace(m.args[0], new)
        return text

    def run(self) -> str:
        try:
            for m in self.block.named("background"):
                self._start(self.sub(m.args[0]), self.sub(m.args[2]))
            for command in self.block.commands():
                self._command(command)
            self._stop_all()
            out = "\n".join(self.transcript)
            for m in self.block.named("expect"):
                self._expect(out, self.sub(m.args[0]), f"block {self.block.id}")
            return out
        finally:
            for bg in self.background:
                bg.kill()
            shutil.rmtree(self.work, ignore_errors=True)

    def _fail(self, why: str) -> None:
        raise AssertionError(f"{self.block.id}: {why}\n--- transcript ---\n" + "\n".join(self.transcript))

    def _expect(self, out: str, text: str, what: str) -> None:
        if not any(text in line for line in out.splitlines()):
            self._fail(f"{what}: no output line contains {text!r}")

    def _start(self, text: str, ready: str) -> Background:
        self.transcript.append(f"$ {text} &")
        bg = Background(text, self.work, self.env)
        self.background.append(bg)
        try:
            bg.wait_for(ready, LONG_TIMEOUT if self.long else READY_TIMEOUT)  # a vLLM server's start: minutes
        except AssertionError as err:
            self._fail(str(err))
        return bg

    def _stop_all(self) -> None:
        for bg in reversed(self.background):
            code = bg.interrupt()
            self.transcript.append(f"[Ctrl-C `{bg.text}`: exit {code}]\n{bg.output}")
            if code != 0:
                self._fail(f"`{bg.text}` exited {code} on Ctrl-C")
        self.background.clear()

    def _command(self, command: Command) -> None:
        found = self.block.rules(command)
        rules = dict(found)
        expects = [args[0] for name, args in found if name == "expect"]
        shown = command.command
        if "skip" in rules:
            self.transcript.append(f"# not run: {shown} ({' '.join(rules['skip'])})")
            return
        if "long" in rules and not self.long:
            self.transcript.append(f"# not run without ZKV_DOCS_LONG=1: {shown}")
            return
        if command.elided:
            self.transcript.append(f"# not run: {shown} (options elided)")
            return
        parts = [p for p in split_and(self.sub(command.text)) if not p.startswith("pip install")]
        if not parts:
            self.transcript.append(f"# not run: {shown} (pip install: the test runs in the environment it installs)")
            return
        text = " && ".join(parts)
        self._given(text)
        if "serve" in rules:
            self._start(text, self.sub(rules["serve"][0]))
            return
        if "interrupt" in rules:
            bg = self._start(text, self.sub(rules["interrupt"][0]))
            self.background.remove(bg)
            code = bg.interrupt()
            self.transcript.append(f"[Ctrl-C: exit {code}]\n{bg.output}")
            out = bg.output
        else:
            code, out = self._run(text, LONG_TIMEOUT if self.long or "long" in rules else LINE_TIMEOUT)
        if code != 0:
            self._fail(f"`{text}` exited {code}")
        for text_ in expects:
            self._expect(out, self.sub(text_), f"`{text}`")

    def _run(self, text: str, timeout: float) -> tuple[int, str]:
        self.transcript.append(f"$ {text}")
        proc = subprocess.Popen(
            ["bash", "-o", "pipefail", "-c", text],
            cwd=self.work,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            raw, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raw, _ = proc.communicate(timeout=10)
            self.transcript.append(raw.decode(errors="replace"))
            self._fail(f"`{text}` did not finish within {timeout:.0f} s")
        except BaseException:  # a test timeout: leave nothing running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            raise
        out = raw.decode(errors="replace").rstrip("\n")
        self.transcript.append(out)
        return proc.returncode, out

    def _given(self, text: str) -> None:
        for m in self.block.named("given"):
            name = m.args[0]
            if name in self.made or name not in text:
                continue
            self.made.add(name)
            self.transcript.append(f"# given {name}:")
            code, _ = self._run(self.sub(m.args[1]), LONG_TIMEOUT)
            if code != 0 or not (self.work / name).exists():
                self._fail(f"making {name} failed (exit {code})")
