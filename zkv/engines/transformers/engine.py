"""zkv's one door into Hugging Face transformers' continuous batching.

Pinned: transformers==5.23.0 (``build.PINNED_VERSION``). Every private transformers
name zkv touches is used in this file and nowhere else, so an upgrade touches
this file only: ``ContinuousBatchingManager._create_batch_processor`` /
``.batch_processor`` / ``.output_router.output_queue`` /
``.background_thread_status`` (``_paused``) / ``._wake_up_loop``, ``ContinuousBatchProcessor.prepare_next_batch``
/ ``._generation_step`` / ``.update_batch`` / ``.scheduler`` / ``.cache``,
``Scheduler.finish_request`` / ``.active_requests`` / ``.waiting_requests``,
``PagedAttentionCache.cache_tensor`` / ``.cache_allocators`` / ``.pool`` /
``.bytes_per_sector`` / ``.evict_cached_blocks``, the full-attention
allocator's ``block_table`` / ``free_blocks`` / ``ledger`` / ``index`` /
``bytes_per_block`` / ``blocks_per_sector``, ``CachePool.allocate_sector`` /
``get_free_blocks`` / ``free_blocks`` / ``count_free_blocks`` /
``num_free_sectors``, and ``RequestState`` (``position_offset``,
``remaining_prefill_tokens``, ``status``).

The cache (one flat ``uint8`` tensor, block-major, the first
``scratch_blocks`` rows engine trash) is described in layout.py.

A finished request that was submitted with ``keep=True`` is *parked*: its
block table stays (so its KV survives between turns) and ``continue_request``
adds the next turn on top of it. A parked conversation can be swapped out
(``release_blocks``), and back in (``take_blocks`` + ``install_block_table``);
one whose KV is not resident falls back to recomputing its prefill.

Threading: every call that reads or changes block tables needs a quiescent
engine: either the caller steps it (``step``/``run_until_idle``, no loop
thread) or the call runs inside ``paused()`` while transformers' loop thread
runs. Calls outside both raise ``EngineNotQuiescent``.
"""

from __future__ import annotations

import contextlib
import gc
import queue
import threading
import time
from dataclasses import dataclass, replace
from math import ceil
from typing import Iterator

import torch
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus

from .layout import KVLayout

_FULL_ATTENTION = "full_attention"


class EngineNotQuiescent(RuntimeError):
    """A block-table call came while transformers' loop thread may be running."""


class NoFreeBlocks(RuntimeError):
    """The engine's pool cannot give the blocks asked for."""


class CacheFull(RuntimeError):
    """A step found no room for any request: parked conversations must be swapped out (``release_blocks``)."""


@dataclass(frozen=True)
class Conversation:
    """A parked conversation: ``tokens`` so far, KV for the first ``kv_len`` of them."""

    request_id: str
    tokens: tuple[int, ...]
    kv_len: int
    resident: bool  # its KV is in the engine's cache under its block table


class TransformersCBEngine:
    """A continuous-batching manager with the hooks zkv needs on its KV cache."""

    def __init__(self, manager) -> None:
        self._manager = manager
        self._keep: set[str] = set()  # requests to park when they finish
        self._conversations: dict[str, Conversation] = {}
        self._taken: set[int] = set()  # blocks take_blocks handed out and nobody installed yet
        self._results: dict[str, object] = {}
        self._lock = threading.Lock()  # the finish hook runs on the loop thread when there is one
        self._generation = 0
        self._ensure_processor()

    # ----------------------------------------------------------------- cache

    @property
    def layout(self) -> KVLayout:
        cache, alloc = self._cache(), self._allocator()
        return KVLayout(
            num_blocks=cache.cache_tensor.numel() // alloc.bytes_per_block,
            scratch_blocks=2 * alloc.blocks_per_sector,
            layers=len(alloc.layer_indices),
            block_size=alloc.tokens_per_page,
            kv_heads=alloc.num_key_value_heads,
            head_dim=alloc.head_dim,
            dtype=alloc.cache_dtype,
            generation=self._generation,
        )

    @property
    def cache_tensor(self) -> torch.Tensor:
        """The engine's own flat ``uint8`` cache (not a copy)."""
        return self._cache().cache_tensor

    def block_rows(self) -> torch.Tensor:
        """The cache as ``(num_blocks, block_bytes)`` bytes: one row per block id."""
        return self.cache_tensor.view(-1, self._allocator().bytes_per_block)

    # -------------------------------------------------------------- requests

    def submit(
        self, request_id: str, input_ids: list[int], max_new_tokens: int | None = None, keep: bool = True
    ) -> None:
        """Queue a new request; with ``keep`` its KV is parked when it finishes."""
        if request_id in self._conversations:
            raise ValueError(f"conversation {request_id!r} is parked: continue_request or forget it")
        if keep:
            self._keep.add(request_id)
        self._manager.add_request(input_ids=list(input_ids), request_id=request_id, max_new_tokens=max_new_tokens)

    def continue_request(self, request_id: str, new_tokens: list[int], max_new_tokens: int | None = None) -> bool:
        """Next turn of a parked conversation. True: on its resident KV; False: its prefill is recomputed."""
        self._check_quiescent()
        conv = self.conversation(request_id)
        del self._conversations[request_id]
        self._keep.add(request_id)
        tokens = list(conv.tokens) + list(new_tokens)
        if not conv.resident:
            self._manager.add_request(input_ids=tokens, request_id=request_id, max_new_tokens=max_new_tokens)
            return False
        generation_config = self._manager.generation_config
        state = RequestState(
            request_id=request_id,
            initial_tokens=tokens,
            max_new_tokens=generation_config.max_new_tokens if max_new_tokens is None else max_new_tokens,
            eos_token_id=generation_config.eos_token_id,
        )
        # Straight into the active set: a waiting (PENDING) request would be prefix-matched from position 0
        state.position_offset = conv.kv_len
        state.remaining_prefill_tokens = tokens[conv.kv_len :]
        state.status = RequestStatus.PREFILLING
        self._processor().scheduler.active_requests[request_id] = state
        self._manager._wake_up_loop.set()
        return True

    def step(self) -> bool:
        """One engine step in the caller's thread (no loop thread); False when nothing was left to run."""
        if self._manager.is_running():
            raise EngineNotQuiescent("step() drives the engine itself: stop transformers' loop thread first")
        processor = self._processor()
        try:
            if not processor.prepare_next_batch():
                return False
        except RuntimeError as error:
            # transformers offloads only active requests; parked conversations hold blocks it cannot reclaim.
            # Nothing was scheduled, so the engine is unchanged and the step can be retried after a swap-out.
            if "no requests can be offloaded" in str(error):
                raise CacheFull(f"{error} ({len(self.parked())} parked conversations hold blocks)") from error
            raise
        processor._generation_step(self._manager.model)
        processor.update_batch()
        return True

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        for steps in range(max_steps):
            if not self.step():
                return steps
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def result(self, request_id: str, timeout: float = 0.0):
        """The finished output of ``request_id`` (a ``GenerationOutput``); None if none came within ``timeout`` s."""
        output_queue = self._manager.output_router.output_queue
        deadline = time.monotonic() + timeout
        while request_id not in self._results:
            try:
                output = (
                    output_queue.get(timeout=max(0.0, deadline - time.monotonic()))
                    if timeout
                    else output_queue.get_nowait()
                )
            except queue.Empty:
                return None
            self._results[output.request_id] = output
        return self._results.pop(request_id)

    # ---------------------------------------------------------------- blocks

    def conversation(self, request_id: str) -> Conversation:
        with self._lock:
            conv = self._conversations.get(request_id)
            if conv is None:
                raise KeyError(f"no parked conversation {request_id!r}")
            if conv.resident and request_id not in self._allocator().block_table:
                # The engine dropped every block table (its reset when the loop thread starts): recompute
                conv = self._conversations[request_id] = replace(conv, resident=False)
        return conv

    def parked(self) -> list[str]:
        with self._lock:
            return list(self._conversations)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids in token order (a copy)."""
        self._check_quiescent()
        table = self._allocator().block_table.get(request_id)
        if table is None:
            raise KeyError(f"request {request_id!r} has no blocks in the engine")
        return list(table)

    def release_blocks(self, request_id: str) -> list[int]:
        """After a swap-out: give a parked conversation's blocks back to the engine (shared ones stay shared)."""
        self._check_quiescent()
        conv = self.conversation(request_id)
        if not conv.resident:
            raise ValueError(f"conversation {request_id!r} has no resident blocks to release")
        table = self.block_table(request_id)
        self._allocator().free_blocks(request_id, no_cache=True)  # its hashes go too: the ids will hold other KV
        self._conversations[request_id] = replace(conv, resident=False)
        return table

    def free_block_count(self) -> int:
        """Blocks the engine can still hand out, prefix-cached ones (evictable) included."""
        self._check_quiescent()
        cache, alloc = self._cache(), self._allocator()
        free = cache.pool.count_free_blocks(alloc.index) + cache.pool.num_free_sectors * alloc.blocks_per_sector
        return free + len(alloc.ledger.cached_blocks)

    def blocks_needed(self, request_id: str) -> int:
        """How many blocks a swap-in of this conversation installs."""
        return ceil(self.conversation(request_id).kv_len / self._allocator().tokens_per_page)

    def take_blocks(self, count: int) -> list[int]:
        """Fresh block ids from the engine's pool, for a swap-in to write into."""
        self._check_quiescent()
        if type(count) is not int or count <= 0:
            raise ValueError(f"count must be a positive int, got {count!r}")
        cache, alloc = self._cache(), self._allocator()

        def sectors_missing() -> int:
            missing = count - cache.pool.count_free_blocks(alloc.index)
            return ceil(missing / alloc.blocks_per_sector) if missing > 0 else 0

        sectors = sectors_missing()
        if sectors > cache.pool.num_free_sectors:
            cache.pool.try_to_free_sectors()  # whole free trees become free sectors: count again
            sectors = sectors_missing()
        if sectors > cache.pool.num_free_sectors:
            raise NoFreeBlocks(
                f"the engine has {cache.pool.count_free_blocks(alloc.index)} free blocks and "
                f"{cache.pool.num_free_sectors} free sectors, {count} blocks asked: "
                "evict_prefix_cache() or release another conversation first"
            )
        for _ in range(sectors):
            cache.pool.allocate_sector(alloc.index)
        blocks = cache.pool.get_free_blocks(alloc.index, count)
        self._taken.update(blocks)
        return blocks

    def return_blocks(self, blocks: list[int]) -> None:
        """Give back taken blocks a swap-in will not install (it failed or timed out)."""
        self._check_quiescent()
        unknown = [b for b in blocks if b not in self._taken]
        if unknown:
            raise ValueError(f"blocks {unknown} were not handed out by take_blocks")
        self._taken.difference_update(blocks)
        self._cache().pool.free_blocks(self._allocator().index, list(blocks))

    def install_block_table(self, request_id: str, blocks: list[int]) -> None:
        """After a swap-in wrote the conversation's KV into ``blocks``: make them its block table."""
        self._check_quiescent()
        conv = self.conversation(request_id)
        if conv.resident:
            raise ValueError(f"conversation {request_id!r} is resident already")
        blocks = list(blocks)
        if len(blocks) != self.blocks_needed(request_id):
            raise ValueError(f"{request_id!r} needs {self.blocks_needed(request_id)} blocks, got {len(blocks)}")
        if len(set(blocks)) != len(blocks) or not all(type(b) is int and b in self._taken for b in blocks):
            raise ValueError(f"blocks must be distinct ids handed out by take_blocks, got {blocks}")
        self._taken.difference_update(blocks)
        self._allocator().block_table[request_id] = blocks
        self._conversations[request_id] = replace(conv, resident=True)

    def forget(self, request_id: str) -> None:
        """Drop a parked conversation; its full blocks stay in the engine's prefix cache."""
        self._check_quiescent()
        conv = self.conversation(request_id)
        if conv.resident:
            self._allocator().free_blocks(request_id)
        del self._conversations[request_id]
        self._keep.discard(request_id)

    def evict_prefix_cache(self) -> int:
        """Return every unreferenced prefix-cached block to the pool (needed after an in-place weight update)."""
        self._check_quiescent()
        count = len(self._allocator().ledger.cached_blocks)
        self._cache().evict_cached_blocks()
        return count

    # ------------------------------------------------------- pause and RL cycle

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold transformers' own pause while its loop thread runs; a no-op when the caller steps the engine."""
        if not self._manager.is_running():
            yield
            return
        with self._manager.pause():
            yield

    def clear(self) -> None:
        """RL clear: drop the engine's cache allocation. Parked conversations keep their tokens and recompute later."""
        if self._manager.is_running():
            raise EngineNotQuiescent("clear() frees the cache: stop transformers' loop thread first")
        scheduler = self._processor().scheduler
        busy = bool(scheduler.active_requests or scheduler.waiting_requests)
        del scheduler  # a local reference would keep the cache alive through the collection below
        if busy:
            raise RuntimeError("clear() with requests in flight: let them finish or cancel them first")
        with self._lock:
            self._conversations = {k: replace(c, resident=False) for k, c in self._conversations.items()}
        self._taken.clear()
        self._manager.batch_processor = None  # the only owner of the cache, its allocators and IO tensors
        gc.collect()  # the processor sits in reference cycles: without this the cache outlives clear()

    def rebuild(self) -> KVLayout:
        """RL resume: a new cache allocation (a new generation) under the model's current weights."""
        if self._manager.batch_processor is not None:
            raise RuntimeError("rebuild() needs a cleared engine: call clear() first")
        self._generation += 1
        self._ensure_processor()
        return self.layout

    # --------------------------------------------------------------- private

    def _ensure_processor(self) -> None:
        """Create the batch processor (and its cache) now, and hook the request-finish path to park conversations."""
        manager = self._manager
        if manager.batch_processor is None:
            manager.batch_processor = manager._create_batch_processor()
        processor = manager.batch_processor
        names = list(processor.cache.cache_allocators)
        if names != [_FULL_ATTENTION]:
            raise ValueError(f"only full-attention models are supported, this one has {names}")
        scheduler = processor.scheduler
        original = type(scheduler).finish_request.__get__(scheduler)

        def finish_request(request_id: str) -> None:
            state = scheduler.active_requests.get(request_id)
            table = self._allocator().block_table
            if (
                request_id in self._keep
                and state is not None
                and state.status == RequestStatus.FINISHED
                and request_id in table
            ):
                with self._lock:
                    self._keep.discard(request_id)
                    tokens = tuple(state.initial_tokens) + tuple(state.generated_tokens)
                    self._conversations[request_id] = Conversation(request_id, tokens, state.position_offset, True)
                scheduler.active_requests.pop(request_id, None)
                return
            if state is not None and state.status == RequestStatus.FAILED:
                with self._lock:
                    self._keep.discard(request_id)
            original(request_id)  # also the engine's own offload, which requeues the request: it stays kept

        scheduler.finish_request = finish_request

    def _processor(self):
        processor = self._manager.batch_processor
        if processor is None:
            raise RuntimeError("the engine's cache is cleared: rebuild() first")
        return processor

    def _cache(self):
        return self._processor().cache

    def _allocator(self):
        return self._cache().cache_allocators[_FULL_ATTENTION]

    def _check_quiescent(self) -> None:
        status = self._manager.background_thread_status
        if self._manager.is_running() and not (status._paused and status.is_pause_requested(local=True)):
            raise EngineNotQuiescent("the loop thread is running: call this inside engine.paused()")
