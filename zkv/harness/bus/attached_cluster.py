"""A local cluster whose ranks serve KV tensors that separate engine processes own.

One stand-in engine process per rank (``zkv.harness.bus.demo_engine``)
allocates its cache in shared memory and exports a manifest; each rank is a
``zkv worker --attach MANIFEST`` process.  ``reallocate()`` is the engine's
part of a clear/resume cycle: between the clear and the resume every engine
frees its cache, allocates a new one and exports it as the next generation,
which the workers map when the resume reaches them.  This is what
``zkv up --demo --attach`` and the cross-process tests run.
"""

from __future__ import annotations

from typing import Sequence

from ...wire.layout import CacheLayout
from .cluster import LocalCluster, Teardown
from .ipc_check import EngineProcess


class AttachedCluster(LocalCluster):
    """``LocalCluster`` plus one engine process per rank that owns the rank's cache."""

    def __init__(
        self,
        ranks: int = 2,
        layout: CacheLayout | None = None,
        *,
        engine_layout: str = "fastdeploy",
        generation: int = 1,
        **kwargs,
    ):
        super().__init__(ranks, layout, **kwargs)
        self.engine_layout = engine_layout
        self.generation = generation
        self.engines: dict[int, EngineProcess] = {}

    def manifest(self, rank: int) -> str:
        return str(self.directory / f"rank{rank}.manifest")

    def _shape(self, blocks: int | None = None) -> list[str]:
        lay = self.layout
        return [
            "--blocks",
            str(blocks or lay.gpu_blocks),
            "--layers",
            str(lay.layers),
            "--block-size",
            str(lay.block_size),
            "--kv-heads",
            str(lay.kv_heads),
            "--head-dim",
            str(lay.head_dim),
            "--dtype",
            lay.dtype,
        ]

    def start_engines(self) -> None:
        for rank in range(self.ranks):
            if rank not in self.engines:
                self.engines[rank] = EngineProcess(
                    self.engine_layout, self.manifest(rank), self.generation, "cpu", self._shape()
                )

    def start_worker(self, rank: int, extra: Sequence[str] = (), layout: CacheLayout | None = None):
        return super().start_worker(rank, ["--attach", self.manifest(rank), *extra], layout)

    def start(self, timeout: float = 60.0) -> "AttachedCluster":
        try:
            self.start_engines()
            super().start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def reallocate(self, blocks: int | None = None) -> int:
        """Every engine frees and reallocates its cache (``blocks`` of them) and
        exports the next generation; call it between a clear and the resume."""
        self.generation += 1
        for engine in self.engines.values():
            engine.realloc(self.generation, blocks)
        return self.generation

    def stop(self, timeout: float = 10.0) -> Teardown:
        """Stop the workers and the broker first (they unmap), then the engines (they free)."""
        end = super().stop(timeout)
        for rank, engine in self.engines.items():
            engine.close()
            end.codes[f"engine{rank}"] = engine.proc.returncode
        self.engines.clear()
        return end
