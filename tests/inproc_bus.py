"""A broker and ranks on threads of this process, on ipc:// sockets in a temp
dir: the real loops (metrics booked in their cores), without the seconds a
process start costs."""

from __future__ import annotations

import threading

from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.client.client import Client
from zkv.net.endpoints import Endpoints
from zkv.rank.worker import RankWorker
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=32, cpu_blocks=64, block_size=4, kv_heads=2, head_dim=8)


class InProcessBus:
    """A broker and ``world`` ranks, each on its own thread."""

    def __init__(self, directory, world: int = 2, recorder=None):
        self.endpoints = Endpoints.in_dir(directory)
        config = BrokerConfig(world=world, heartbeat_ms=100)
        self.broker = Broker(self.endpoints, config, recorder=recorder)
        self.ranks = [
            RankWorker(r, world, self.endpoints.backend, self.endpoints.control, LAYOUT, device="cpu")
            for r in range(world)
        ]
        self.threads = [threading.Thread(target=x.serve, daemon=True) for x in (self.broker, *self.ranks)]

    def __enter__(self) -> "InProcessBus":
        for t in self.threads:
            t.start()
        with Client(self.endpoints.frontend) as c:
            c.status(timeout=30, wait_ranks=len(self.ranks))
        return self

    def __exit__(self, *exc) -> None:
        for x in (*self.ranks, self.broker):
            x.stop()
        for t in self.threads:
            t.join(timeout=10)
        assert not any(t.is_alive() for t in self.threads)
