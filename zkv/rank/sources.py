"""Where a rank's device tier comes from: the part of a block store that
differs between zkv's own memory and an engine's.

``OwnedMemory`` allocates one ``[2 * layers, blocks, kv_heads, block_size,
head_dim]`` store per allocation on the rank's device and frees it for real
(on CUDA: synchronize, then hand the memory back to the driver).

``EngineMemory`` never allocates or frees: the engine owns the memory.  The
next cache is one the engine handed over in process (``hand_over``, what
``RankAgent.attach`` calls) or one read again from a manifest (``source``,
``zkv worker --attach``); releasing one only drops zkv's views and mappings,
which the store does before a clear is acked, so the engine's free is a
real free.

Both describe their memory as regions (``EngineCache``), so everything else
(ids, copies, fill, checksum, the CPU tier) is the store's, written once
(``store.BlockStore``).  A source also says what a kept CPU tier must match
(``tier_key``): zkv's own tier keeps its rows for the same model shape;
an engine's tier for the same region pages and row count."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Hashable, Protocol

import torch

from ..wire.layout import CacheLayout
from ..wire.vocab import Dtype
from .copies.staging import STAGING_BYTES
from .errors import CacheError
from .memory import layouts
from .memory.descriptor import CacheDescriptor
from .memory.dtypes import TORCH_DTYPES
from .memory.regions import EngineCache


class MemorySource(Protocol):
    """What a ``BlockStore`` asks of the memory under its device tier."""

    device: torch.device
    compute_stream: Any  # the stream copies wait for (None: the current one)
    staging_bytes: int  # device memory for the CUDA copy path's staging buffers

    @property
    def pin(self) -> bool | None:
        """Whether the CPU tier is pinned (None: when CUDA exists)."""
        ...

    def acquire(self, layout: CacheLayout) -> EngineCache:
        """The next cache for ``layout``; raise (holding nothing) if there is none."""
        ...

    def release(self, cache: EngineCache) -> None:
        """Drop ``cache``: every view zkv holds on it, and the memory if zkv owns it."""
        ...

    def refused(self, cache: EngineCache) -> None:
        """``cache`` came from ``acquire`` but the allocation failed (a layout it does not
        fit): keep it for the next ``acquire`` if that is the engine's way, else release it."""
        ...

    def tier_key(self, layout: CacheLayout, descriptor: CacheDescriptor) -> Hashable:
        """What a CPU tier kept across a clear must match to keep its rows."""
        ...

    def close(self) -> None:
        """The rank stops: drop whatever is still waiting to be attached."""
        ...


class OwnedMemory:
    """zkv's own device tier: per layer a K and a V tensor, slices of one store."""

    compute_stream: Any = None

    def __init__(self, device: torch.device | str = "cpu", staging_bytes: int = STAGING_BYTES):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.staging_bytes = staging_bytes
        self.store: torch.Tensor | None = None  # the current allocation, ``[2 * layers, blocks, ...]``
        self._generations = itertools.count(1)

    @property
    def pin(self) -> bool:
        return self.cuda

    def acquire(self, layout: CacheLayout) -> EngineCache:
        shape = (layout.kv_heads, layout.block_size, layout.head_dim)
        store = torch.zeros(
            (2 * layout.layers, layout.gpu_blocks, *shape), dtype=TORCH_DTYPES[Dtype(layout.dtype)], device=self.device
        )
        tensors = list(store.unbind(0))  # K0, V0, K1, V1, ...
        cache = EngineCache.from_tensors(
            layouts.zkv_native(tensors[0::2], tensors[1::2]), generation=next(self._generations)
        )
        self.store = store
        return cache

    def release(self, cache: EngineCache) -> None:
        cache.release()
        self.store = None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # really return the memory to the driver

    def refused(self, cache: EngineCache) -> None:
        self.release(cache)  # zkv allocates anew for the next layout

    def tier_key(self, layout: CacheLayout, descriptor: CacheDescriptor) -> Hashable:
        return (2 * layout.layers, layout.cpu_blocks, layout.kv_heads, layout.block_size, layout.head_dim, layout.dtype)

    def close(self) -> None:
        pass


class EngineMemory:
    """An engine's device tier: caches handed over or read from a manifest.

    The first cache is attached when the store is made; each resume takes the
    next one (``hand_over`` first, else ``source()``), which must be newer
    and fit the bus layout (the store checks both)."""

    def __init__(
        self,
        first: EngineCache,
        *,
        compute_stream: Any = None,
        pin: bool | None = None,
        source: Callable[[], EngineCache] | None = None,
        staging_bytes: int = STAGING_BYTES,
    ):
        self.device = first.device
        self.compute_stream = compute_stream
        self._pin = pin
        self.source = source
        self.staging_bytes = staging_bytes
        self._pending: EngineCache | None = first
        self._lock = threading.Lock()  # hand_over runs on the engine's thread

    @property
    def pin(self) -> bool | None:
        return self._pin

    def hand_over(self, cache: EngineCache) -> None:
        """Queue the engine's next cache for the next resume (any thread)."""
        with self._lock:
            old, self._pending = self._pending, cache
        if old is not None:
            old.release()

    def acquire(self, layout: CacheLayout) -> EngineCache:
        with self._lock:
            new, self._pending = self._pending, None
        if new is None:
            if self.source is None:
                raise CacheError(
                    "no_cache",
                    "no new engine cache to attach for this resume "
                    "(in process: RankAgent.attach(new tensors) before the resume)",
                )
            new = self.source()  # CacheError: missing, bad or unreadable manifest (nothing mapped)
        self.device = new.device
        return new

    def release(self, cache: EngineCache) -> None:
        cache.release()

    def refused(self, cache: EngineCache) -> None:
        """A cache the engine handed over stays the next resume's (the engine handed over
        one cache, not one per try) unless a newer one came; one read from a manifest is
        read again then (the engine may have exported another)."""
        with self._lock:
            keep = self.source is None and self._pending is None
            if keep:
                self._pending = cache
        if not keep:
            cache.release()

    def tier_key(self, layout: CacheLayout, descriptor: CacheDescriptor) -> Hashable:
        return (descriptor.page_shape, layout.cpu_blocks)

    def close(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.release()
