"""Client-side prefix cache manager: which KV blocks are cached, on which tier,
and the swap tasks that move them, issued over the bus and awaited with a timeout.

Ownership model (what makes "no leak, no double owner" checkable)
------------------------------------------------------------------
Every used GPU block has exactly one owner: a tree node, a lease (a block from
``allocate()`` not yet inserted), or the quarantine (see below).  Every used
CPU block is owned by a tree node or the quarantine.  ``check_invariants()``
verifies this against the allocators.

A request holds its blocks through :class:`BlockLease` objects:

* ``match(tokens)`` leases the cached prefix (reference counts on the nodes);
* ``allocate(n)`` leases ``n`` private blocks for the request to compute into;
* ``insert(tokens, ids)`` hands full computed blocks to the tree; the lease
  that allocated a block keeps a reference on the node that now owns it, so the
  block stays on the GPU while the request still reads it;
* ``release(lease)`` drops the references and frees private blocks still owned.

Tree shape: a node is on the GPU only if its parent is (GPU residency is
prefix-closed), so a match is a run of GPU nodes followed by a run of CPU nodes
and the CPU run comes back in ONE swap_in task.  Only nodes on the GPU carry
references.

Policies
--------
* Duplicate insert (the key is already cached on the GPU under another block):
  the tree keeps its block; the new block stays the caller's and is freed when
  the lease that allocated it is released (the caller may still be reading
  it).  If the cached copy is on the CPU, the new GPU block is adopted instead
  and the CPU copy freed: the data is already where it is needed.
* GPU and CPU pressure, failed swaps and timeouts: see ``swaps.py``.

Single-threaded: call every method from one thread (the engine's scheduler
loop).  Waiting is ``bus.wait(task, swap_timeout)``; nothing sleeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from .bus import Bus
from .errors import CacheClearedError, InvalidBlockError, InvalidLeaseError, OutOfGpuBlocksError, PrefixCacheError
from .invariants import check_invariants
from .lease import BlockLease, InsertResult
from .radix import ROOT_KEY, NodeState, RadixNode, block_keys
from .report import COUNTERS, stats_of
from .swaps import SwapRunner
from .tiers import Tiers

__all__ = [
    "BlockLease",
    "CacheClearedError",
    "InsertResult",
    "InvalidBlockError",
    "InvalidLeaseError",
    "OutOfGpuBlocksError",
    "PrefixCacheError",
    "PrefixCacheManager",
]


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


class PrefixCacheManager:
    """Radix prefix cache over a GPU and a CPU tier, moving blocks through ``bus``.

    It holds the epoch's ``Tiers`` (tree, allocators, eviction queues), the
    leases, and a ``SwapRunner`` that owns the bus, the swaps and the quarantine.
    """

    def __init__(
        self,
        bus: Bus,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        swap_timeout: float = 10.0,
        quarantine_timed_out: bool = True,
        reserved_gpu_blocks: Iterable[int] = (),
    ) -> None:
        _check_block_size(block_size)
        self._reserved = tuple(sorted(set(reserved_gpu_blocks)))
        self._swaps = SwapRunner(bus, swap_timeout, quarantine_timed_out)
        self._block_size = block_size
        self._num_gpu_blocks = num_gpu_blocks
        self._num_cpu_blocks = num_cpu_blocks
        self._epoch = 0
        self._cleared = False
        self._clock = itertools.count(1)
        self._counters = dict.fromkeys((c for c in COUNTERS if c not in self._swaps.counters), 0)
        self._bus_gen: int | None = None  # the bus's cache generation the tree belongs to
        self._start_epoch(num_gpu_blocks, num_cpu_blocks)

    # ------------------------------------------------------------------ state

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def swap_timeout(self) -> float:
        """Seconds each swap task may take (the swap runner's)."""
        return self._swaps.swap_timeout

    @swap_timeout.setter
    def swap_timeout(self, value: float) -> None:
        self._swaps.swap_timeout = value

    @property
    def cleared(self) -> bool:
        return self._cleared

    @property
    def epoch(self) -> int:
        """Bumped by every reset; leases carry the epoch they were made in."""
        return self._epoch

    @property
    def reserved_gpu_blocks(self) -> tuple[int, ...]:
        """GPU ids the engine keeps for itself, never handed out (docs/engines.md "Reserved rows")."""
        return self._reserved

    def _start_epoch(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._tiers = Tiers(num_gpu_blocks, num_cpu_blocks, self._reserved if num_gpu_blocks else ())
        self._private_owner: dict[int, BlockLease] = {}
        self._live_leases: set[BlockLease] = set()
        self._swaps.forget_quarantine()

    # ------------------------------------------------------------- requests

    def match(self, tokens: Sequence[int]) -> BlockLease:
        """Lease the longest cached prefix of ``tokens`` (full blocks only) on the GPU.

        CPU-resident blocks of the match are swapped in first (one task, awaited);
        if that fails or times out the lease stops before them.  While the caches
        are cleared the answer is an empty lease.  Pass ``tokens[:-1]`` when the
        last token must be computed anyway (for its logits).
        """
        self._counters["lookups"] += 1
        self._follow_generation()
        lease = BlockLease([], self._epoch)
        if self._cleared:
            self._counters["lookups_while_cleared"] += 1
            return lease
        tiers = self._tiers
        self._swaps.reap(tiers)
        keys = block_keys(tokens, self._block_size)
        lease.keys = keys
        self._counters["queried_blocks"] += len(keys)
        path = tiers.tree.walk(keys)
        now = next(self._clock)
        split = 0
        while split < len(path) and path[split].state is NodeState.ON_GPU:
            split += 1
        gpu_run, cpu_run = path[:split], path[split:]
        self._hold(lease, gpu_run, now)  # before any eviction the swap-in may cause
        if cpu_run:
            self._hold(lease, self._swaps.swap_in(tiers, cpu_run), now)
        lease.block_ids = [node.gpu_block for node in lease.nodes]  # type: ignore[misc]
        lease.gpu_hit_blocks = len(gpu_run)
        lease.cpu_hit_blocks = len(lease.nodes) - len(gpu_run)
        self._counters["gpu_hit_blocks"] += lease.gpu_hit_blocks
        self._counters["cpu_hit_blocks"] += lease.cpu_hit_blocks
        self._live_leases.add(lease)
        return lease

    def _keys_for(self, tokens: Sequence[int], blocks: int, known: Sequence[bytes]) -> list[bytes]:
        """Keys of the first ``blocks`` full blocks, reusing ``known`` ones."""
        bs = self._block_size
        reuse = list(known[:blocks])
        if len(reuse) == blocks:
            return reuse
        parent = reuse[-1] if reuse else ROOT_KEY
        return reuse + block_keys(tokens[len(reuse) * bs : blocks * bs], bs, parent_key=parent)

    def allocate(self, num_blocks: int) -> BlockLease:
        """Lease ``num_blocks`` fresh GPU blocks, evicting cached blocks if needed.

        All or nothing: raises OutOfGpuBlocksError (cache may have been evicted
        meanwhile) or CacheClearedError while the caches are cleared.
        """
        if self._cleared:
            raise CacheClearedError("the KV caches are cleared; call resume() before allocating")
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        self._follow_generation()
        self._swaps.reap(self._tiers)
        block_ids = self._swaps.take_gpu_blocks(self._tiers, num_blocks, allow_fewer=False)
        lease = BlockLease(block_ids, self._epoch)
        for block in block_ids:
            self._private_owner[block] = lease
        self._live_leases.add(lease)
        return lease

    def insert(
        self, tokens: Sequence[int], gpu_block_ids: Sequence[int], known_keys: Sequence[bytes] = ()
    ) -> InsertResult:
        """Cache the first ``len(gpu_block_ids)`` full blocks of ``tokens``.

        ``gpu_block_ids[i]`` holds block ``i``: either the block a match returned
        for that position or a private block from ``allocate()``, whose ownership
        passes to the tree (see the module doc for duplicates).  Validated before
        anything changes.  A no-op while the caches are cleared.

        ``known_keys``: the ``keys`` of a lease that ``match`` returned for a
        prefix of these same tokens; only the blocks after them are hashed
        (saves hashing the prompt twice per request).
        """
        if self._cleared:
            return InsertResult(0, 0, 0)
        ids = list(gpu_block_ids)
        if len(ids) > len(tokens) // self._block_size:
            raise InvalidBlockError(f"{len(ids)} block ids for {len(tokens) // self._block_size} full blocks of tokens")
        if len(set(ids)) != len(ids):
            raise InvalidBlockError("the same block id appears twice")
        keys = self._keys_for(tokens, len(ids), known_keys)
        tiers = self._tiers
        tree = tiers.tree
        existing = tree.walk(keys)
        for position, block in enumerate(ids):
            node = existing[position] if position < len(existing) else None
            if node is not None and node.state is NodeState.ON_GPU and node.gpu_block == block:
                continue
            if block not in self._private_owner:
                raise InvalidBlockError(
                    f"block {block!r} at position {position} is neither a block from allocate() "
                    "nor the cached block there"
                )

        now = next(self._clock)
        new = duplicate = adopted = 0
        parent = tree.root
        for position, block in enumerate(ids):
            node = existing[position] if position < len(existing) else None
            if node is None:
                owner = self._private_owner.pop(block)
                node = tree.add_child(parent, keys[position], NodeState.ON_GPU, gpu_block=block)
                self._hold(owner, [node], now)
                new += 1
            elif node.state is NodeState.ON_CPU:
                owner = self._private_owner.pop(block)
                tiers.cpu.free([node.cpu_block])  # type: ignore[list-item]
                node.cpu_block = None
                node.gpu_block = block
                tree.set_state(node, NodeState.ON_GPU)
                self._hold(owner, [node], now)
                adopted += 1
            else:
                if node.gpu_block != block:
                    duplicate += 1
                node.last_access = now
                tiers.offer(node)
            parent = node
        self._counters["duplicate_inserts"] += duplicate
        return InsertResult(new, duplicate, adopted)

    def release(self, lease: BlockLease) -> None:
        """Drop a lease's references and free its blocks that were never inserted."""
        if lease.epoch != self._epoch:
            lease.released = True  # its blocks died with the reset
            return
        if lease.released:
            raise InvalidLeaseError("lease released twice")
        lease.released = True
        self._live_leases.discard(lease)
        now = next(self._clock)
        for node in lease.nodes:
            node.ref_count -= 1
            node.last_access = now
            if not node.ref_count and not node.num_gpu_children:
                self._tiers.gpu_victims.offer(node)  # an unreferenced GPU leaf now
        owned = [block for block in lease.block_ids if self._private_owner.get(block) is lease]
        for block in owned:
            del self._private_owner[block]
        self._tiers.gpu.free(owned)

    def locate(self, tokens: Sequence[int]) -> list[str]:
        """Where the cached prefix of ``tokens`` lives, one entry per full block:
        ``"gpu"`` or ``"cpu"`` (``"swapping_*"`` only during a swap).  Read-only:
        no lease, no swap, no LRU update; an empty list while cleared."""
        if self._cleared:
            return []
        return [
            "gpu" if node.state is NodeState.ON_GPU else "cpu" if node.state is NodeState.ON_CPU else node.state.value
            for node in self._tiers.tree.walk(block_keys(tokens, self._block_size))
        ]

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` GPU blocks of unreferenced cache now; returns how many."""
        if self._cleared or num_blocks <= 0:
            return 0
        self._follow_generation()
        self._swaps.reap(self._tiers)
        return self._swaps.evict_gpu(self._tiers, num_blocks)

    def _follow_generation(self) -> None:
        """A bus whose cache generation moved without our clear (a rank came
        back with fresh memory, a broker lost its state): what the tree says
        the blocks hold is gone, so reset exactly as after a clear."""
        gen = self._swaps.bus_gen()
        if gen is None:
            return
        if self._bus_gen is not None and gen != self._bus_gen:
            self._counters["generation_resets"] += 1
            self.reset()
        self._bus_gen = gen

    # ----------------------------------------------------------- clear cycle

    def on_bus_drained(self) -> int:
        """Every rank acknowledged a pause, so no task runs any more: free quarantined blocks.

        Only true of tasks the ranks already received: a task still queued at
        the broker runs after a plain resume.  So call this after a pause that a
        clear follows (``zkv.prefix.cycle.drain_and_clear`` does), or when the
        paused bus's ``status()`` shows ``queued == 0``.  Returns how many blocks
        were freed.
        """
        return self._swaps.release_quarantine(self._tiers)

    def reclaim_quarantine(self) -> int:
        """Free the quarantined blocks of timed-out tasks that have settled since.

        Asks ``bus.settled()`` (or polls a bus without it); match, allocate and
        evict do this on their own whenever blocks are quarantined.  Returns how
        many blocks were freed.  Never waits.
        """
        counters = self._swaps.counters
        before = counters["reclaimed_blocks"]
        self._swaps.reap(self._tiers)
        return counters["reclaimed_blocks"] - before

    def reset(self) -> None:
        """Forget every cached block and lease, with fresh allocators of the same size.

        Waits on nothing: call it when no task can still touch the caches (after
        the bus's pause/clear), since quarantined blocks are forgotten too.
        """
        self._counters["resets"] += 1
        self._epoch += 1
        self._bus_gen = self._swaps.bus_gen()
        self._start_epoch(self._num_gpu_blocks, self._num_cpu_blocks)

    def set_cleared(self) -> None:
        """The caches are gone: reset, then answer "no hit" and refuse allocations until resume()."""
        self._cleared = True
        self._num_gpu_blocks = self._num_cpu_blocks = 0
        self.reset()

    def resume(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int | None = None,
        reserved_gpu_blocks: Iterable[int] | None = None,
    ) -> None:
        """Serve again on freshly allocated caches (possibly a new layout; the
        reserved GPU ids stay the same unless given)."""
        reserved = self._reserved if reserved_gpu_blocks is None else tuple(sorted(set(reserved_gpu_blocks)))
        if reserved and not 0 <= reserved[0] <= reserved[-1] < num_gpu_blocks:
            raise ValueError(f"reserved GPU ids {list(reserved)} are not all blocks of the {num_gpu_blocks}")
        if block_size is not None:
            _check_block_size(block_size)
            self._block_size = block_size
        self._reserved = reserved
        self._num_gpu_blocks = num_gpu_blocks
        self._num_cpu_blocks = num_cpu_blocks
        self._cleared = False
        self.reset()

    # ------------------------------------------------------------ reporting

    def stats(self) -> dict[str, Any]:
        """Counters, hit rates and the tiers' occupancy (``report.py``)."""
        return stats_of(self._tiers, self._swaps, self._counters, self._epoch, self._cleared, self._block_size)

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block has exactly one owner and the
        tree is consistent (``invariants.py``; for tests and debugging)."""
        check_invariants(
            self._tiers, self._live_leases, self._private_owner, self._swaps.quarantine, self._epoch, self._cleared
        )

    # ------------------------------------------------------------- internals

    def _hold(self, lease: BlockLease, nodes: list[RadixNode], now: int) -> None:
        for node in nodes:
            node.ref_count += 1
            node.last_access = now
            lease.nodes.append(node)
