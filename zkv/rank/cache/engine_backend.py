"""The engine-attached ``CacheBackend``: a rank serving KV memory an engine owns.

The device tier is the engine's cache (``EngineCache`` regions); the CPU
tier is zkv's block-major ``CpuTier``; ``AttachedCache`` holds both across
clears.  On a clear every view and mapping of engine memory is dropped
before ``free`` returns (so before the rank acks).  On a resume
(``allocate``) the rank takes the next cache from one of two places:

- in process, the one the engine handed over with ``hand_over`` (what
  ``RankAgent.attach`` calls) before or during the resume;
- across processes, ``source()``: ``zkv worker --attach MANIFEST`` re-reads
  its manifest, which the engine rewrote with a newer generation.

The new cache must be a newer generation and fit the bus layout
(``gpu_blocks`` = its block count); otherwise the resume fails with a
``CacheError`` naming the reason, nothing stays mapped, and the rank stays
cleared and serving (a later resume tries again).

``fill`` and ``checksum`` work on both tiers: ``checksum`` of a block is the
BLAKE2b of its page in every region, in region order, which is exactly a
CPU tier row, so a block and the row it was swapped to have one digest.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from ...wire.layout import CacheLayout
from ...wire.protocol import TaskBody
from .attached import AttachedCache
from .backend import Freed, TaskInvalid, check_task
from .errors import CacheError
from .owned import block_digests
from .regions import EngineCache


def bus_layout(cache: EngineCache, cpu_rows: int, base: CacheLayout | None = None) -> CacheLayout:
    """The layout an attached rank announces: the engine's block count and
    zkv's CPU rows; the other fields describe the model (zkv copies byte pages
    and does not use them)."""
    return (base or CacheLayout()).with_changes(gpu_blocks=cache.num_blocks, cpu_blocks=cpu_rows)


class EngineBackend:
    """A ``CacheBackend`` over an engine's cache (see the module docstring)."""

    def __init__(self, cache: EngineCache, cpu_rows: int, *, layout: CacheLayout | None = None, rank: int = 0,
                 compute_stream: Any = None, pin: bool | None = None,
                 source: Callable[[], EngineCache] | None = None):
        self.rank = rank
        self.layout = bus_layout(cache, cpu_rows, layout)
        self.attached = AttachedCache(cache, cpu_rows, compute_stream, pin)
        self.source = source
        self.cpu_kept = False
        self._device = cache.device
        self._pending: EngineCache | None = None
        self._lock = threading.Lock()  # hand_over runs on the engine's thread

    # --- the engine's side --------------------------------------------------------

    def hand_over(self, cache: EngineCache) -> None:
        """Queue the engine's next cache for the next resume (any thread)."""
        with self._lock:
            old, self._pending = self._pending, cache
        if old is not None:
            old.release()

    @property
    def generation(self) -> int:
        return self.attached.generation

    # --- CacheBackend -------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def allocated(self) -> bool:
        return self.attached.attached

    def validate(self, body: TaskBody) -> None:
        cache, tier = self.attached.cache, self.attached.tier
        if cache is None or tier is None:
            raise TaskInvalid("caches are cleared on this rank (engine memory detached)")
        check_task(body, cache.num_blocks, tier.rows)

    def swap(self, op: str, src: Sequence[int], dst: Sequence[int]) -> int:
        try:
            if op == "swap_out":
                return self.attached.swap_out(src, dst)
            return self.attached.swap_in(src, dst)
        except CacheError as err:
            raise TaskInvalid(str(err)) from None

    def _views(self, tier: str) -> list[torch.Tensor]:
        if tier == "gpu":
            assert self.attached.cache is not None
            return self.attached.cache.views
        assert self.attached.tier is not None
        return self.attached.tier.columns

    def fill(self, tier: str, ids: Sequence[int], seed: int) -> int:
        """Write deterministic random bytes (per seed, rank and id order) into blocks."""
        rng = torch.Generator().manual_seed((seed * 1_000_003 + self.rank) % 2**64)
        index = torch.tensor(list(ids), dtype=torch.long)
        views = self._views(tier)
        for view in views:
            values = torch.randint(0, 256, (len(ids), view.shape[1]), dtype=torch.uint8, generator=rng)
            view.index_copy_(0, index.to(view.device), values.to(view.device))
        if views and views[0].is_cuda:
            torch.cuda.synchronize(views[0].device)
        return len(ids) * sum(v.shape[1] for v in views)

    def checksum(self, tier: str, ids: Sequence[int]) -> list[bytes]:
        """A 16-byte BLAKE2b digest of every block (its page in every region)."""
        return block_digests(self._views(tier), ids)

    def free(self, keep_cpu: bool = False) -> Freed:
        """Detach from engine memory (and drop the CPU tier unless kept)."""
        ack = self.attached.clear(keep_cpu)
        return Freed(ack["engine_bytes_detached"] + ack["cpu_bytes_freed"], ack["cpu_kept"])

    def allocate(self, layout: CacheLayout) -> int:
        """Attach the engine's next cache for ``layout`` (a resume); raise CacheError if it cannot."""
        with self._lock:
            new, self._pending = self._pending, None
        if new is None:
            if self.allocated and layout == self.layout:
                return self.nbytes()  # already serving exactly this
            if self.source is None:
                raise CacheError("no_cache", "no new engine cache to attach for this resume "
                                 "(in process: RankAgent.attach(new tensors) before the resume)")
            new = self.source()  # CacheError: missing, bad or unreadable manifest (nothing mapped)
        try:
            if new.num_blocks != layout.gpu_blocks:
                raise CacheError("bad_layout", f"the engine's new cache has {new.num_blocks} blocks, the bus layout "
                                 f"says gpu_blocks={layout.gpu_blocks} (resume with that gpu_blocks)")
            if self.attached.attached:
                self.attached.clear(keep_cpu=True)  # a resume that changes the layout without a clear
            self.cpu_kept = self.attached.resume(new, layout.cpu_blocks)
        except BaseException:
            new.release()
            raise
        self.layout = layout
        self._device = new.device
        return self.nbytes()

    def tier_nbytes(self) -> dict[str, int]:
        cache, tier = self.attached.cache, self.attached.tier
        return {"gpu": sum(b.nbytes for b in cache.descriptor.buffers) if cache is not None else 0,
                "cpu": tier.nbytes if tier is not None else 0}

    def nbytes(self) -> int:
        return sum(self.tier_nbytes().values())

    def close(self) -> None:
        """Drop everything (the rank stops): engine views, the pending cache, the tier."""
        self.attached.clear(keep_cpu=False)
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.release()
