"""Client-side prefix cache manager: which KV blocks are cached, on which tier,
and the swap tasks that move them, issued over the bus and awaited with a timeout.

Ownership model (what makes "no leak, no double owner" checkable)
------------------------------------------------------------------
Every used GPU block has exactly one owner: a tree node, a lease (a block from
``allocate()`` not yet inserted), or the quarantine (see below).  Every used
CPU and disk block is owned by a tree node or the quarantine.
``check_invariants()`` verifies this against the book of rows (``RowBook``).

A request holds its blocks through :class:`BlockLease` objects:

* ``match(tokens)`` leases the cached prefix (reference counts on the nodes);
* ``allocate(n)`` leases ``n`` private blocks for the request to compute into;
* ``insert(tokens, ids)`` hands full computed blocks to the tree; the lease
  that allocated a block keeps a reference on the node that now owns it, so the
  block stays on the GPU while the request still reads it;
* ``release(lease)`` drops the references and frees private blocks still owned.

Tree shape: residency is prefix-closed in tier order (a GPU node's parent is
on the GPU, a CPU node's on the GPU or the CPU, ``tiers.py``), so a match is a
run of GPU nodes, then of CPU nodes, then of disk nodes: the disk run comes to
the CPU in ONE load task, then the CPU run with it in ONE swap_in task.  Only
nodes on the GPU carry references.  The disk tier is off unless
``num_disk_blocks`` > 0 (the ranks' ``--disk-blocks``, or fewer).

Policies
--------
* Duplicate insert (the key is already cached on the GPU under another block):
  the tree keeps its block; the new block stays the caller's and is freed when
  the lease that allocated it is released (the caller may still be reading
  it).  If the cached copy is on the CPU, the new GPU block is adopted instead
  and the CPU (or disk) copy freed: the data is already where it is needed.
* GPU and CPU pressure, failed swaps and timeouts: see ``swaps.py``; the
  disk tier's spills and loads: ``swaps.py`` too.
* Generations (``rows/loss.py``): a move of the bus's ``gen`` alone drops
  the GPU nodes with their subtrees and keeps what lies wholly off the GPU
  (``gpu_generation_drops``); a move of ``cpu_gen`` (or of ``gen`` on a bus
  that names no ``cpu_gen``) resets everything (``generation_resets``).

Single-threaded: call every method from one thread (the engine's scheduler
loop).  Waiting is ``bus.wait(task, swap_timeout)``; nothing sleeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

from ..rows.bus import Bus
from ..rows.loss import Loss, lost_between
from .errors import CacheClearedError, InvalidBlockError, InvalidLeaseError, OutOfGpuBlocksError, PrefixCacheError
from .invariants import check_invariants
from .lease import BlockLease, InsertResult
from .radix import NodeState, RadixNode, block_keys, check_block_size, keys_reusing
from .report import COUNTERS, stats_of
from .swaps import SwapRunner
from .tiers import WHERE, Tiers, split_path

__all__ = ["BlockLease", "CacheClearedError", "InsertResult", "InvalidBlockError", "InvalidLeaseError"]
__all__ += ["OutOfGpuBlocksError", "PrefixCacheError", "PrefixCacheManager"]


class PrefixCacheManager:
    """Radix prefix cache over a GPU, a CPU and (optionally) a disk tier, moving blocks through ``bus``.

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
        num_disk_blocks: int = 0,
        *,
        max_run: int | None = None,
    ) -> None:
        """``max_run``: the most blocks one tree node takes (None: a request's run, however
        long; 1: a node per block, which serves the same, only slower: for tests that hold
        the two to each other)."""
        check_block_size(block_size)
        self._max_run = max_run
        self._reserved = tuple(sorted(set(reserved_gpu_blocks)))
        self._swaps = SwapRunner(bus, swap_timeout, quarantine_timed_out)
        self._block_size = block_size
        self._num_gpu_blocks = num_gpu_blocks
        self._num_cpu_blocks = num_cpu_blocks
        self._num_disk_blocks = num_disk_blocks  # kept across clears: the ranks' setting, not the layout's
        self._epoch = 0
        self._cleared = False
        self._clock = itertools.count(1)
        self._counters = dict.fromkeys((c for c in COUNTERS if c not in self._swaps.counters), 0)
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
        """Bumped by every reset and GPU generation move; leases carry the epoch they were made in."""
        return self._epoch

    @property
    def reserved_gpu_blocks(self) -> tuple[int, ...]:
        """GPU ids the engine keeps for itself, never handed out (docs/engines.md "Reserved rows")."""
        return self._reserved

    def _start_epoch(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        disk_blocks = 0 if self._cleared else self._num_disk_blocks
        reserved = self._reserved if num_gpu_blocks else ()
        old = getattr(self, "_tiers", None)
        self._tiers = Tiers(num_gpu_blocks, num_cpu_blocks, reserved, disk_blocks, self._max_run)
        if old is not None:  # rows a late copy may still write stay out of reach until it settles
            self._tiers.book.carry(old.book)
        self._forget_leases()

    def _forget_leases(self) -> None:
        self._private_owner: dict[int, BlockLease] = {}
        self._live_leases: set[BlockLease] = set()

    # ------------------------------------------------------------- requests

    def match(self, tokens: Sequence[int]) -> BlockLease:
        """Lease the longest cached prefix of ``tokens`` (full blocks only) on the GPU.

        Its disk blocks are loaded to the CPU, then its CPU blocks swapped in (one
        task each, awaited); where one fails or times out the lease stops.  Empty
        while the caches are cleared or when the bus lost a tier meanwhile.  Pass
        ``tokens[:-1]`` when the last token must be computed anyway (its logits).
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
        gpu_run, cpu_run, disk_run = split_path(tiers.tree.walk_split(keys))
        now = next(self._clock)
        self._hold(lease, gpu_run, now)  # before any eviction the load or swap-in may cause
        cpu_blocks = sum(len(node.keys) for node in cpu_run)
        off_gpu = cpu_run + self._swaps.load(tiers, disk_run) if disk_run else cpu_run
        swapped = self._swaps.swap_in(tiers, off_gpu) if off_gpu else []
        self._hold(lease, swapped, now)
        block_ids: list[int] = []
        for node in gpu_run:
            block_ids += node.gpu_blocks  # type: ignore[arg-type]
        gpu_hits = len(block_ids)
        for node in swapped:
            block_ids += node.gpu_blocks  # type: ignore[arg-type]
        lease.block_ids = block_ids
        self._live_leases.add(lease)
        if self._swaps.tree_is_stale():  # a tier went while we waited
            self.release(lease)
            self._follow_generation()
            return BlockLease([], self._epoch, keys=keys)
        swapped_in = len(block_ids) - gpu_hits
        lease.gpu_hit_blocks = gpu_hits
        lease.cpu_hit_blocks = min(swapped_in, cpu_blocks)
        lease.disk_hit_blocks = swapped_in - lease.cpu_hit_blocks
        counters = self._counters
        counters["gpu_hit_blocks"] += lease.gpu_hit_blocks
        counters["cpu_hit_blocks"] += lease.cpu_hit_blocks
        counters["disk_hit_blocks"] += lease.disk_hit_blocks
        return lease

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
        lease = BlockLease(block_ids, self._epoch, allocated=True)
        self._private_owner.update(dict.fromkeys(block_ids, lease))
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
        keys = keys_reusing(tokens, self._block_size, len(ids), known_keys)
        tree = self._tiers.tree
        existing, covered = tree.walk(keys)
        self._check_insert_ids(ids, existing, covered)
        if existing and existing[-1].depth > covered:  # the blocks end inside the last run: cut it there
            last = existing[-1]
            existing[-1] = tree.split(last, len(last.keys) - (last.depth - covered))
        now = next(self._clock)
        duplicate, adopted, from_disk = self._touch_or_adopt(existing, ids, now)
        parent = existing[-1] if existing else tree.root
        for start, end, owner in self._owner_stretches(ids, covered, len(ids)):
            stretch = ids[start:end]
            for block in stretch:
                del self._private_owner[block]
            made = tree.add_run(parent, keys[start:end], NodeState.ON_GPU, stretch)
            self._hold(owner, made, now)
            parent = made[-1]
        self._counters["duplicate_inserts"] += duplicate
        return InsertResult(len(ids) - covered, duplicate, adopted - from_disk, from_disk)

    def _check_insert_ids(self, ids: list[int], existing: list[RadixNode], covered: int) -> None:
        """Every id is the cached block at its position or a block from ``allocate()``;
        raises before anything changes.  ``existing``, ``covered``: the tree's walk."""
        private = self._private_owner
        start = 0
        for node in existing:
            end = min(start + len(node.keys), covered)
            cached = node.gpu_blocks if node.state is NodeState.ON_GPU else None
            if cached is not None and cached[: end - start] == ids[start:end]:
                start = end
                continue
            for position in range(start, end):
                if (cached is None or cached[position - start] != ids[position]) and ids[position] not in private:
                    raise InvalidBlockError(_not_insertable(ids[position], position))
            start = end
        if not all(map(private.__contains__, ids[covered:])):
            position = next(at for at in range(covered, len(ids)) if ids[at] not in private)
            raise InvalidBlockError(_not_insertable(ids[position], position))

    def _touch_or_adopt(self, existing: list[RadixNode], ids: list[int], now: int) -> tuple[int, int, int]:
        """The runs an insert finds cached: touched where on the GPU (a different id there is a
        duplicate, left with its lease), else moved onto the caller's blocks, one run per lease
        that allocated them, each held by its lease.  Returns (duplicates, adopted, of those
        from the disk)."""
        tiers = self._tiers
        duplicate = adopted = from_disk = 0
        start = 0
        for node in existing:
            end = start + len(node.keys)
            cached = node.gpu_blocks
            if node.state is NodeState.ON_GPU and cached is not None:
                if cached != ids[start:end]:
                    duplicate += sum(1 for mine, theirs in zip(cached, ids[start:end]) if mine != theirs)
                node.last_access = now
                tiers.offer(node)
            else:
                for first, last, owner in self._owner_stretches(ids, start, end):
                    run = tiers.tree.split(node, last - first) if last < end else node
                    from_disk += (last - first) * (run.state is NodeState.ON_DISK)
                    tiers.adopt(run, ids[first:last])
                    for block in ids[first:last]:
                        del self._private_owner[block]
                    self._hold(owner, [run], now)
                    adopted += last - first
            start = end
        return duplicate, adopted, from_disk

    def _owner_stretches(self, ids: list[int], start: int, end: int) -> list[tuple[int, int, BlockLease]]:
        """``ids[start:end]`` (blocks from ``allocate()``) as (start, end, lease) stretches of one lease each."""
        owners = list(map(self._private_owner.__getitem__, ids[start:end]))
        if not owners:
            return []
        if owners.count(owners[0]) == len(owners):
            return [(start, end, owners[0])]  # the common case: one allocate() gave them all
        bounds = [0, *(at for at in range(1, len(owners)) if owners[at] is not owners[at - 1]), len(owners)]
        return [(start + a, start + b, owners[a]) for a, b in zip(bounds, bounds[1:])]

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
        offer = self._tiers.gpu_victims.offer
        for node, above in lease.held:
            while node is not above:  # the nodes cut since keep the stretch's ends
                node.ref_count -= 1
                node.last_access = now
                if not node.ref_count and not node.num_gpu_children:
                    offer(node)  # an unreferenced GPU leaf now
                node = node.parent  # type: ignore[assignment]
        if lease.allocated:  # a match's lease holds tree blocks only
            owned = [block for block in lease.block_ids if self._private_owner.get(block) is lease]
            for block in owned:
                del self._private_owner[block]
            self._tiers.gpu.free(owned)

    def locate(self, tokens: Sequence[int]) -> list[str]:
        """Where the cached prefix of ``tokens`` lives, one entry per full block:
        ``"gpu"``, ``"cpu"`` or ``"disk"`` (another state only during a task).
        Read-only: no lease, no swap, no LRU update; an empty list while cleared."""
        if self._cleared:
            return []
        path, matched = self._tiers.tree.walk(block_keys(tokens, self._block_size))
        where: list[str] = []
        for node in path:
            where += [WHERE.get(node.state) or node.state.value] * len(node.keys)
        return where[:matched]

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` GPU blocks of unreferenced cache now; returns how many."""
        if self._cleared or num_blocks <= 0:
            return 0
        self._follow_generation()
        self._swaps.reap(self._tiers)
        return self._swaps.evict_gpu(self._tiers, num_blocks)

    def _follow_generation(self) -> None:
        """A bus whose generations moved without our clear (a rank came back
        with fresh memory, a broker lost its state): forget the tiers that
        went, as the module doc says (``rows/loss.py``)."""
        gens = self._swaps.bus_gens()
        lost = lost_between(self._swaps.gens, gens)
        if lost is Loss.ALL:
            self._counters["generation_resets"] += 1
            self.reset()
        elif lost is Loss.GPU:
            self._counters["gpu_generation_drops"] += 1
            self._epoch += 1  # every lease held GPU blocks: all stale now
            self._tiers.drop_gpu_tier(self._num_gpu_blocks, self._reserved if self._num_gpu_blocks else ())
            self._forget_leases()
        if gens[0] is not None:
            self._swaps.gens = gens

    # ----------------------------------------------------------- clear cycle

    def on_bus_drained(self) -> int:
        """Every rank acknowledged a pause, so no task runs any more: free quarantined blocks.

        Only true of tasks the ranks already received: a task still queued at the
        broker runs after a plain resume.  So call this after a pause that a clear
        follows (``cycle.drain_and_clear`` does), or when the paused bus's
        ``status()`` shows ``queued == 0``.  Returns how many blocks were freed."""
        return SwapRunner.release_quarantine(self._tiers)

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

        Waits on nothing: blocks a late copy may still write stay quarantined in
        the new allocators until their task settles or the bus drains.
        """
        self._counters["resets"] += 1
        self._epoch += 1
        self._swaps.gens = self._swaps.bus_gens()
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
        num_disk_blocks: int | None = None,
    ) -> None:
        """Serve again on freshly allocated caches (possibly a new layout; the
        reserved GPU ids and the disk tier's size stay the same unless given)."""
        reserved = self._reserved if reserved_gpu_blocks is None else tuple(sorted(set(reserved_gpu_blocks)))
        if reserved and not 0 <= reserved[0] <= reserved[-1] < num_gpu_blocks:
            raise ValueError(f"reserved GPU ids {list(reserved)} are not all blocks of the {num_gpu_blocks}")
        if block_size is not None:
            check_block_size(block_size)
            self._block_size = block_size
        self._reserved = reserved
        self._num_gpu_blocks = num_gpu_blocks
        self._num_cpu_blocks = num_cpu_blocks
        if num_disk_blocks is not None:
            self._num_disk_blocks = num_disk_blocks
        self._cleared = False
        self.reset()

    # ------------------------------------------------------------ reporting

    def stats(self) -> dict[str, Any]:
        """Counters, hit rates and the tiers' occupancy (``report.py``)."""
        return stats_of(self._tiers, self._swaps, self._counters, self._epoch, self._cleared, self._block_size)

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block has exactly one owner and the
        tree is consistent (``invariants.py``; for tests and debugging)."""
        check_invariants(self._tiers, self._live_leases, self._private_owner, self._epoch, self._cleared)

    # ------------------------------------------------------------- internals

    def _hold(self, lease: BlockLease, nodes: list[RadixNode], now: int) -> None:
        """``lease`` holds ``nodes``, a stretch of one path, shallowest first."""
        if not nodes:
            return
        for node in nodes:
            node.ref_count += 1
            node.last_access = now
        lease.held.append((nodes[-1], nodes[0].parent))  # type: ignore[arg-type]


def _not_insertable(block: int, position: int) -> str:
    return f"block {block!r} at position {position} is neither a block from allocate() nor the cached block there"
