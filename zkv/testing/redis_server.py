"""A real ``redis-server`` for the tests and the benchmark of the distributed tier:
started on a free loopback port with a memory bound and an LRU policy (what zkv
asks of its operators: docs/operations.md, "Keyed stores"), waited for by its
own answer, stopped at the end.  ``tests/redis_setup.sh`` installs it
(``REDIS`` is None without it)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REDIS = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process; ``url`` is its address for ``zkv worker --store``."""

    def __init__(self, directory: Path, maxmemory: str = "256mb", timeout: float = 1.0):
        if REDIS is None:
            raise RuntimeError("redis-server is not installed (bash tests/redis_setup.sh)")
        self.directory = directory
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0?timeout={timeout}"
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen | None = None

    def start(self, within: float = 30.0) -> "RedisServer":
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [str(REDIS), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", str(self.directory)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.wait_up(within)
        return self

    def wait_up(self, within: float) -> None:
        """Until the server answers PING (it is up), or it died, or ``within`` seconds."""
        import redis

        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        end = time.monotonic() + within
        try:
            while True:
                assert self.proc is not None and self.proc.poll() is None, "redis-server exited at start"
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                assert time.monotonic() < end, f"redis-server on port {self.port} never answered"
                time.sleep(0.05)  # its socket is not there yet: nothing to wait on but the clock
        finally:
            client.close()

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
