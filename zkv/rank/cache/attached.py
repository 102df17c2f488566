"""One rank's engine-attached cache across clears: the engine's regions,
zkv's CPU tier and the copy engine, with the clear and resume rules.

Clear drops every reference zkv holds on engine memory (views, mappings,
the device staging buffer) before it returns, so the rank can ack and the
engine can really free; zkv's CPU tier goes too unless ``keep_cpu``.
Resume takes the engine's new cache as a new generation (strictly greater:
after a weight update the old KV is wrong even at the same address) and
keeps the CPU tier only if its rows still fit (same regions and page sizes,
same row count); the caller reports whether it was kept, so a client that
asked for ``keep_cpu`` learns when its CPU blocks are gone.

One thread (the rank's executor) drives an instance."""

from __future__ import annotations

from typing import Any, Sequence

from .copier import CopyEngine
from .errors import CacheError
from .regions import EngineCache
from .tier import CpuTier


class AttachedCache:
    """The rank side of an engine's cache; ``cache`` is None while cleared."""

    def __init__(self, cache: EngineCache, cpu_rows: int, compute_stream: Any = None, pin: bool | None = None):
        self.compute_stream = compute_stream
        self.pin = pin
        self.generation = cache.generation
        self.cache: EngineCache | None = cache
        self.tier: CpuTier | None = CpuTier.for_cache(cache.descriptor, cpu_rows, pin)
        self.copier: CopyEngine | None = CopyEngine(cache, self.tier, compute_stream)

    @property
    def attached(self) -> bool:
        return self.cache is not None

    def _live(self) -> CopyEngine:
        if self.copier is None:
            raise CacheError("released", "caches are cleared on this rank (engine memory detached)")
        return self.copier

    def swap_out(self, src_blocks: Sequence[int], dst_rows: Sequence[int], wait_event: Any = None) -> int:
        return self._live().swap_out(src_blocks, dst_rows, wait_event)

    def swap_in(self, src_rows: Sequence[int], dst_blocks: Sequence[int], wait_event: Any = None) -> int:
        return self._live().swap_in(src_rows, dst_blocks, wait_event)

    def clear(self, keep_cpu: bool = False) -> dict[str, Any]:
        """Detach from engine memory (idempotent); return what was dropped, for the ack."""
        engine_bytes = sum(b.nbytes for b in self.cache.descriptor.buffers) if self.cache is not None else 0
        if self.copier is not None:
            self.copier.close()
            self.copier = None
        if self.cache is not None:
            self.cache.release()
            self.cache = None
        cpu_freed = 0
        if not keep_cpu and self.tier is not None:
            cpu_freed = self.tier.nbytes
            self.tier = None
        return {"engine_bytes_detached": engine_bytes, "cpu_bytes_freed": cpu_freed, "cpu_kept": self.tier is not None}

    def resume(self, cache: EngineCache, cpu_rows: int) -> bool:
        """Attach the engine's new cache; return whether the CPU tier (and its blocks) was kept."""
        if self.cache is not None:
            raise CacheError("bad_layout", "resume needs a cleared rank: clear first, then the engine frees and reallocates")
        if type(cache.generation) is not int or cache.generation <= self.generation:
            raise CacheError("stale_manifest", f"generation {cache.generation} is not newer than {self.generation}")
        kept = self.tier is not None and self.tier.fits(cache.descriptor) and self.tier.rows == cpu_rows
        if not kept:
            self.tier = None  # drop the old rows before allocating new ones
            self.tier = CpuTier.for_cache(cache.descriptor, cpu_rows, self.pin)
        assert self.tier is not None
        self.copier = CopyEngine(cache, self.tier, self.compute_stream)
        self.cache = cache
        self.generation = cache.generation
        return kept
