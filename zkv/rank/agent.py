"""``RankAgent``: a rank of the bus inside an inference engine's process.

The engine hands over its own KV tensors; the agent runs the rank's I/O
loop and copy executor on background threads of that process, over those
tensors (zkv allocates only its CPU tier, and on CUDA a small staging
buffer).  The lifecycle is explicit, as pyzmq's ``ThreadAuthenticator``:
``start(timeout)`` returns once the broker registered the rank (or raises),
``stop(timeout)`` joins; both are idempotent and bounded.  Nothing
process-wide changes: no torch thread count, no signal handlers, no
warning filters, and the agent's sockets live in a ZMQ context of its own.

Clear and resume (docs/engines.md): on a clear the rank drops every view of
the engine's memory before it acks; the engine frees, updates, reallocates,
calls ``attach(new)`` and then resumes the bus (``attach`` may come before
the clear too: the new cache waits for the next resume).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import zmq

from ..net.curve import Curve
from ..wire.layout import CacheLayout
from .memory.geometry import LayoutGiven
from .memory.regions import EngineCache, TensorEntry
from .registration import RankRefused
from .sources import EngineMemory
from .store import BlockStore
from .tiers.disk_tier import DiskSpec
from .tiers.tier_file import TierPlace, bus_name
from .worker import RankWorker

CacheLike = EngineCache | Sequence[TensorEntry]


def _as_cache(cache: CacheLike, generation: int) -> EngineCache:
    if isinstance(cache, EngineCache):
        return cache
    return EngineCache.from_tensors(list(cache), generation=generation)


class RankAgent:
    """One rank on the engine's own tensors.

    ``cache``: an ``EngineCache``, or what a layout adapter returns
    (``zkv.engines.vllm.flash_attn(kv_caches)`` and the like).
    ``cpu_rows``: blocks of zkv's CPU tier.  ``layout``: what the rank
    announces; None derives it from the cache (its block count and bytes per
    block), a ``CacheLayout`` or a map of fields (say ``{"layers": 32,
    "kv_heads": 8, ...}``: the block counts are then the cache's and
    ``cpu_rows``) must agree with the cache, else ``CacheError("bad_layout")``
    names both values (``rank.memory.geometry``).
    ``compute_stream``: the engine's CUDA stream that copies wait for.
    ``disk_dir`` / ``disk_blocks``: a disk tier below the CPU tier (as
    ``zkv worker --disk-dir``; ``spill`` / ``load`` tasks).  ``tier_dir``: keep
    the CPU tier in a file there (as ``zkv worker --tier-dir``), so that it
    outlives this process.  ``source``: where each resume takes the engine's
    cache when none was handed over with ``attach`` (an engine whose tensors
    stay where they are across a clear: vLLM).  ``on_task_done(task, outcome)``:
    called on the rank's thread after each task ran here, for an engine that
    must know when this rank's own copy is over (vLLM's TP workers).
    ``store``: the keyed store below the CPU tier, by URL (as ``zkv worker
    --store``; ``put`` / ``get`` tasks, docs/protocol.md §6.4)."""

    def __init__(
        self,
        rank: int,
        world: int,
        backend: str,
        control: str,
        cache: CacheLike,
        cpu_rows: int,
        *,
        compute_stream: Any = None,
        curve: Curve | None = None,
        layout: LayoutGiven = None,
        liveness_ms: int = 2000,
        disk_dir: str | None = None,
        disk_blocks: int = 4096,
        tier_dir: str | None = None,
        source: Callable[[], EngineCache] | None = None,
        on_task_done: Callable[[int, str], None] | None = None,
        store: str | None = None,
    ):
        self.rank = rank
        self.world = world
        self._endpoints = (backend, control)
        self._curve = curve
        self._liveness_ms = liveness_ms
        disk = DiskSpec(disk_dir, disk_blocks) if disk_dir is not None else None  # below the CPU tier
        place = TierPlace(bus_name(backend), rank, tier_dir) if tier_dir is not None else None
        self._on_task_done = on_task_done
        self._store_url = store
        self.store = BlockStore.attached(
            _as_cache(cache, 1),
            cpu_rows,
            layout=layout,
            rank=rank,
            compute_stream=compute_stream,
            disk=disk,
            place=place,
            source=source,
        )
        self._ctx: zmq.Context | None = None
        self._worker: RankWorker | None = None
        self._thread: threading.Thread | None = None
        self._settled = threading.Event()  # registered, or the loop ended
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    @property
    def layout(self) -> CacheLayout:
        return self.store.layout

    @property
    def reserved_blocks(self) -> tuple[int, ...]:
        """The block ids the engine keeps for itself in the cache the rank serves
        (its adapter declared them; docs/engines.md "Reserved rows"): what a prefix
        cache manager on this engine must never hand out (they are not on the wire)."""
        cache = self.store.cache
        return cache.descriptor.reserved if cache is not None else ()

    def start(self, timeout: float = 10.0, *, wait: bool = True) -> None:
        """Connect, register, and return once the broker welcomed this rank.

        Raises ``TimeoutError`` (the agent is stopped again) if that takes
        longer than ``timeout`` seconds, ``RankRefused`` if the broker will
        not take the rank.  A second call on a started agent does nothing.
        ``wait=False`` returns once the loop runs: for an engine that builds
        its workers before the process that hosts the broker (vLLM), the rank
        registers whenever the broker comes up (``registered`` says when)."""
        with self._lock:
            if self._thread is not None:
                return
            self._ctx = zmq.Context()
            try:
                self._worker = RankWorker(
                    self.rank,
                    self.world,
                    *self._endpoints,
                    ctx=self._ctx,
                    liveness_ms=self._liveness_ms,
                    curve=self._curve,
                    cache=self.store,
                    store=self._store_url,
                )
            except BaseException:
                self._ctx.destroy(linger=0)
                self._ctx = None
                raise
            self._worker.registered = self._settled  # set on the first welcome; _run sets it when the loop ends
            for lane in (self._worker.executor, self._worker.store_lane):
                if lane is not None:
                    lane.runner.on_done = self._on_task_done
            self._thread = threading.Thread(target=self._run, name=f"zkv-rank-{self.rank}", daemon=True)
            self._thread.start()
        if not wait:
            return
        self._settled.wait(timeout)
        if self._settled.is_set() and self._error is None and self.is_alive():
            return
        error = self._error
        self.stop(timeout=max(1.0, timeout))
        if isinstance(error, RankRefused):
            raise error
        if error is not None:
            raise RuntimeError(f"rank {self.rank} stopped before it registered: {error!r}") from error
        raise TimeoutError(
            f"rank {self.rank} was not registered by the broker at {self._endpoints[0]} within {timeout} s"
        )

    def _run(self) -> None:
        worker = self._worker
        assert worker is not None
        try:
            worker.serve()
        except BaseException as err:  # noqa: BLE001 - start() reports it; the engine's process goes on
            self._error = err
        finally:
            self._settled.set()

    @property
    def registered(self) -> bool:
        """The broker welcomed this rank at least once (and the loop still runs)."""
        return self._settled.is_set() and self._error is None and self.is_alive()

    @property
    def paused(self) -> bool:
        """This rank acked a pause or clear and no resume since: no copy starts here now."""
        worker = self._worker
        return worker is not None and worker.executor.paused_ack.is_set()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def attach(self, cache: CacheLike, generation: int | None = None) -> None:
        """Hand the engine's new cache to the rank for the next resume (a new
        generation: default one past the current).  Any thread."""
        current = self.store.generation or 0
        gen = generation if generation is not None else current + 1
        if isinstance(cache, EngineCache) and (generation is not None or cache.generation <= current):
            cache.generation = gen
        memory = self.store.memory
        assert isinstance(memory, EngineMemory)
        memory.hand_over(_as_cache(cache, gen))

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop, join it (bounded), and drop every reference to the
        engine's memory.  Raises ``TimeoutError`` if the loop did not end in
        ``timeout`` seconds.  Idempotent."""
        with self._lock:
            worker, thread = self._worker, self._thread
        if worker is not None and thread is not None and thread.is_alive():
            worker.stop()
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"rank {self.rank} did not stop within {timeout} s")
        with self._lock:
            if self._ctx is not None and not (thread is not None and thread.is_alive()):
                self._ctx.destroy(linger=0)  # the loop ended: its sockets are closed, this closes any left
                self._ctx = None
        self.store.close()

    def stats(self) -> dict[str, Any]:
        worker = self._worker
        return worker.stats() if worker is not None else {}

    def __enter__(self) -> "RankAgent":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
