"""Several local buses at once, for the fleet's tests, benchmark and docs:
``buses`` LocalClusters (a broker and ``ranks`` worker processes each),
started together so that their processes' imports overlap, and stopped
together.  Each bus lives in its own short directory (ipc:// paths)."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path
from typing import Sequence

from ...wire.layout import CacheLayout
from ..bus.cluster import LocalCluster

#: Small caches: a fleet's tests and benchmark time the control path, not copies.
LAYOUT = CacheLayout(layers=2, gpu_blocks=16, cpu_blocks=32, block_size=4, kv_heads=2, head_dim=8)


class FleetRig:
    """``with FleetRig(3) as rig``: ``rig.frontends`` are the buses' addresses,
    ``rig.clusters[i]`` each bus's processes (to kill or restart); ``ranks``
    is every bus's world size, or one per bus."""

    def __init__(
        self,
        buses: int = 3,
        ranks: int | Sequence[int] = 2,
        layout: CacheLayout | None = None,
        *,
        broker_args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        quiet: bool = True,
    ):
        self.root = Path(tempfile.mkdtemp(prefix="zkvf-", dir="/tmp"))
        per_bus = [ranks] * buses if isinstance(ranks, int) else list(ranks)
        if len(per_bus) != buses:
            raise ValueError(f"{len(per_bus)} rank counts for {buses} buses")
        self.clusters = [
            LocalCluster(
                per_bus[i],
                layout or LAYOUT,
                directory=self.root / f"b{i}",
                broker_args=broker_args,
                worker_args=["--tier-dir", "none", *worker_args],
                quiet=quiet,
            )
            for i in range(buses)
        ]

    @property
    def frontends(self) -> list[str]:
        return [c.endpoints.frontend for c in self.clusters]

    def start(self, timeout: float = 120.0) -> "FleetRig":
        try:
            for c in self.clusters:
                c.start_broker()
                for rank in range(c.ranks):
                    c.start_worker(rank)
            for c in self.clusters:
                c.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for c in self.clusters:  # every process is told first, so that they stop together
            for proc in [*c.workers.values(), *([c.broker] if c.broker is not None else [])]:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        for c in self.clusters:
            c.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "FleetRig":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
