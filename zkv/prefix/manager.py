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
* GPU pressure: unreferenced GPU leaves (no child on the GPU) are evicted, LRU
  first, deeper first on ties, in one swap_out task.  Their GPU blocks are freed
  whatever the outcome: on ``ok`` the nodes live on as ON_CPU; on any other
  outcome they are dropped with their (CPU-only) subtrees.  Rolling them back
  onto the GPU would keep the very blocks the caller is waiting for.
* CPU pressure: LRU CPU leaves are dropped to make room; if none is left, the
  GPU victim is dropped instead of swapped.  Parents get CPU room before their
  children (a child without its prefix is useless).
* Failed swap-in: the nodes stay ON_CPU with their CPU blocks; the match stops
  before them.
* Timeout: a timed-out task may still run (a slow rank), so the blocks it
  writes (CPU blocks for swap_out, GPU blocks for swap_in) go to quarantine
  instead of the free list; they are freed when the bus reports the task
  *settled* (``bus.settled()``: every rank has since reported, so nothing
  writes those blocks any more; checked at the start of match / allocate /
  evict and by ``reclaim_quarantine()``), when the caller reports the bus
  drained (``on_bus_drained()``, after a completed pause that a clear
  follows: no rank runs anything then), or on reset.  A bus without
  ``settled()`` (an older client, a test double) is polled instead: a late
  outcome for the task frees its blocks.  ``failed``, ``cancelled`` and ``rejected`` are taken to
  mean no rank will write the destination any more; those blocks are freed.
  Pass ``quarantine_timed_out=False`` to free at once.

Single-threaded: call every method from one thread (the engine's scheduler
loop).  Waiting is ``bus.wait(task, swap_timeout)``; nothing sleeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .allocator import BlockAllocator
from .radix import ROOT_KEY, LeafQueue, NodeState, RadixNode, RadixTree, block_keys

OUTCOMES = ("ok", "failed", "cancelled", "rejected", "timeout")
SWAP_OPS = ("swap_out", "swap_in")


class PrefixCacheError(Exception):
    """Base of the prefix cache's errors (stand-in for zkv's ZkvError until they are unified)."""


class CacheClearedError(PrefixCacheError):
    """The KV caches are cleared (between set_cleared() and resume()); nothing can be allocated."""


class OutOfGpuBlocksError(PrefixCacheError):
    """Not enough GPU blocks even after evicting every unreferenced cached block."""


class InvalidBlockError(PrefixCacheError, ValueError):
    """A block id passed in is not one the caller owns at that position."""


class InvalidLeaseError(PrefixCacheError, ValueError):
    """A lease released twice."""


class TaskOutcomeLike(Protocol):
    task: int
    outcome: str
    reason: str
    bytes: int


class BusLike(Protocol):
    """What the manager needs from the bus (``zkv.client.Client`` has all of it).

    Optional: ``settled() -> list[int]``, the ids of tasks that ended ``timeout``
    and whose every rank has reported since (their copies are over).  When the
    bus has it, the manager releases quarantined blocks through it and never
    calls ``poll`` (which would hand it outcomes of tasks other code awaits).
    Without it, the manager polls for late outcomes of its timed-out tasks.
    """

    def submit(self, op: str, src: Sequence[int], dst: Sequence[int], timeout: float = 30.0) -> int: ...

    def wait(self, task: int, timeout: float | None = None) -> TaskOutcomeLike: ...

    def poll(self, timeout: float = 0.0) -> list[TaskOutcomeLike]: ...


@dataclass(eq=False)
class BlockLease:
    """GPU blocks lent to one request, in order; give them back with ``release()``.

    Leases from before a reset/clear are stale: releasing one is a no-op.
    """

    block_ids: list[int]
    epoch: int
    gpu_hit_blocks: int = 0   # match only: blocks that were already on the GPU
    cpu_hit_blocks: int = 0   # match only: blocks swapped in from the CPU
    released: bool = False
    nodes: list[RadixNode] = field(default_factory=list, repr=False)
    keys: list[bytes] = field(default_factory=list, repr=False)  # match only: block keys of the tokens asked for

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class InsertResult:
    new_blocks: int           # blocks that became new tree nodes
    duplicate_blocks: int     # already cached on the GPU elsewhere: the caller's block stays private
    adopted_from_cpu: int     # cached on the CPU only: the node moved onto the caller's block


@dataclass
class _Quarantine:
    tier: str
    block_ids: list[int]


def _is_gpu_victim(node: RadixNode) -> bool:
    return (node.attached and node.state is NodeState.ON_GPU and node.ref_count == 0
            and node.num_gpu_children == 0 and node.parent is not None)  # never the root


def _is_cpu_victim(node: RadixNode) -> bool:
    return node.attached and node.state is NodeState.ON_CPU and not node.children



def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")

class PrefixCacheManager:
    """Radix prefix cache over a GPU and a CPU tier, moving blocks through ``bus``."""

    def __init__(self, bus: BusLike, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 swap_timeout: float = 10.0, quarantine_timed_out: bool = True) -> None:
        _check_block_size(block_size)
        self._bus = bus
        self.swap_timeout = swap_timeout
        self.quarantine_timed_out = quarantine_timed_out
        self._block_size = block_size
        self._num_gpu_blocks = num_gpu_blocks
        self._num_cpu_blocks = num_cpu_blocks
        self._epoch = 0
        self._cleared = False
        self._clock = itertools.count(1)
        self._swap_stats = {op: dict.fromkeys(("issued", "blocks", "bytes", *OUTCOMES), 0) for op in SWAP_OPS}
        self._counters = dict.fromkeys((
            "lookups", "lookups_while_cleared", "queried_blocks", "gpu_hit_blocks", "cpu_hit_blocks",
            "swapped_out_blocks", "dropped_gpu_blocks", "dropped_cpu_blocks", "duplicate_inserts",
            "late_outcomes", "reclaimed_blocks", "resets", "generation_resets",
        ), 0)
        self._bus_gen: int | None = None  # the bus's cache generation the tree belongs to
        self._start_epoch(num_gpu_blocks, num_cpu_blocks)

    # ------------------------------------------------------------------ state

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def cleared(self) -> bool:
        return self._cleared

    @property
    def epoch(self) -> int:
        """Bumped by every reset; leases carry the epoch they were made in."""
        return self._epoch

    def _start_epoch(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._gpu = BlockAllocator(num_gpu_blocks, "gpu")
        self._cpu = BlockAllocator(num_cpu_blocks, "cpu")
        self._tree = RadixTree()
        self._gpu_victims = LeafQueue()
        self._cpu_victims = LeafQueue()
        self._private_owner: dict[int, BlockLease] = {}
        self._live_leases: set[BlockLease] = set()
        self._quarantine: dict[int, _Quarantine] = {}

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
        self._reap_late_outcomes()
        keys = block_keys(tokens, self._block_size)
        lease.keys = keys
        self._counters["queried_blocks"] += len(keys)
        path = self._tree.walk(keys)
        now = next(self._clock)
        split = 0
        while split < len(path) and path[split].state is NodeState.ON_GPU:
            split += 1
        gpu_run, cpu_run = path[:split], path[split:]
        self._hold(lease, gpu_run, now)  # before any eviction the swap-in may cause
        if cpu_run:
            self._hold(lease, self._swap_in(cpu_run), now)
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
        return reuse + block_keys(tokens[len(reuse) * bs: blocks * bs], bs, parent_key=parent)

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
        self._reap_late_outcomes()
        block_ids = self._take_gpu_blocks(num_blocks, allow_fewer=False)
        lease = BlockLease(block_ids, self._epoch)
        for block in block_ids:
            self._private_owner[block] = lease
        self._live_leases.add(lease)
        return lease

    def insert(self, tokens: Sequence[int], gpu_block_ids: Sequence[int], known_keys: Sequence[bytes] = ()) -> InsertResult:
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
            raise InvalidBlockError(
                f"{len(ids)} block ids for {len(tokens) // self._block_size} full blocks of tokens")
        if len(set(ids)) != len(ids):
            raise InvalidBlockError("the same block id appears twice")
        keys = self._keys_for(tokens, len(ids), known_keys)
        existing = self._tree.walk(keys)
        for position, block in enumerate(ids):
            node = existing[position] if position < len(existing) else None
            if node is not None and node.state is NodeState.ON_GPU and node.gpu_block == block:
                continue
            if block not in self._private_owner:
                raise InvalidBlockError(
                    f"block {block!r} at position {position} is neither a block from allocate() "
                    "nor the cached block there")

        now = next(self._clock)
        new = duplicate = adopted = 0
        parent = self._tree.root
        for position, block in enumerate(ids):
            node = existing[position] if position < len(existing) else None
            if node is None:
                owner = self._private_owner.pop(block)
                node = self._tree.add_child(parent, keys[position], NodeState.ON_GPU, gpu_block=block)
                self._hold(owner, [node], now)
                new += 1
            elif node.state is NodeState.ON_CPU:
                owner = self._private_owner.pop(block)
                self._cpu.free([node.cpu_block])  # type: ignore[list-item]
                node.cpu_block = None
                node.gpu_block = block
                self._tree.set_state(node, NodeState.ON_GPU)
                self._hold(owner, [node], now)
                adopted += 1
            else:
                if node.gpu_block != block:
                    duplicate += 1
                node.last_access = now
                self._offer(node)
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
                self._gpu_victims.offer(node)  # an unreferenced GPU leaf now
        owned = [block for block in lease.block_ids if self._private_owner.get(block) is lease]
        for block in owned:
            del self._private_owner[block]
        self._gpu.free(owned)

    def locate(self, tokens: Sequence[int]) -> list[str]:
        """Where the cached prefix of ``tokens`` lives, one entry per full block:
        ``"gpu"`` or ``"cpu"`` (``"swapping_*"`` only during a swap).  Read-only:
        no lease, no swap, no LRU update; an empty list while cleared."""
        if self._cleared:
            return []
        return ["gpu" if node.state is NodeState.ON_GPU else "cpu" if node.state is NodeState.ON_CPU
                else node.state.value for node in self._tree.walk(block_keys(tokens, self._block_size))]

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` GPU blocks of unreferenced cache now; returns how many."""
        if self._cleared or num_blocks <= 0:
            return 0
        self._follow_generation()
        self._reap_late_outcomes()
        return self._evict_gpu(num_blocks)

    def _follow_generation(self) -> None:
        """A bus whose cache generation moved without our clear (a rank came
        back with fresh memory, a broker lost its state): what the tree says
        the blocks hold is gone, so reset exactly as after a clear."""
        gen = getattr(self._bus, "gen", None)
        if type(gen) is not int:
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
        freed = 0
        for entry in self._quarantine.values():
            (self._gpu if entry.tier == "gpu" else self._cpu).free(entry.block_ids)
            freed += len(entry.block_ids)
        self._quarantine.clear()
        return freed

    def reclaim_quarantine(self) -> int:
        """Free the quarantined blocks of timed-out tasks that have settled since.

        Asks ``bus.settled()`` (or polls a bus without it); match, allocate and
        evict do this on their own whenever blocks are quarantined.  Returns how
        many blocks were freed.  Never waits.
        """
        before = self._counters["reclaimed_blocks"]
        self._reap_late_outcomes()
        return self._counters["reclaimed_blocks"] - before

    def reset(self) -> None:
        """Forget every cached block and lease, with fresh allocators of the same size.

        Waits on nothing: call it when no task can still touch the caches (after
        the bus's pause/clear), since quarantined blocks are forgotten too.
        """
        self._counters["resets"] += 1
        self._epoch += 1
        gen = getattr(self._bus, "gen", None)
        self._bus_gen = gen if type(gen) is int else None
        self._start_epoch(self._num_gpu_blocks, self._num_cpu_blocks)

    def set_cleared(self) -> None:
        """The caches are gone: reset, then answer "no hit" and refuse allocations until resume()."""
        self._cleared = True
        self._num_gpu_blocks = self._num_cpu_blocks = 0
        self.reset()

    def resume(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int | None = None) -> None:
        """Serve again on freshly allocated caches (possibly a new layout)."""
        if block_size is not None:
            _check_block_size(block_size)
            self._block_size = block_size
        self._num_gpu_blocks = num_gpu_blocks
        self._num_cpu_blocks = num_cpu_blocks
        self._cleared = False
        self.reset()

    # ------------------------------------------------------------ reporting

    def stats(self) -> dict[str, Any]:
        counters = self._counters
        queried = counters["queried_blocks"]
        nodes_by_state = dict.fromkeys((state.name for state in NodeState), 0)
        for node in self._tree.iter_nodes():
            nodes_by_state[node.state.name] += 1
        quarantined = {"gpu": 0, "cpu": 0}
        for entry in self._quarantine.values():
            quarantined[entry.tier] += len(entry.block_ids)
        return {
            "epoch": self._epoch,
            "cleared": self._cleared,
            "block_size": self._block_size,
            "gpu_hit_rate": counters["gpu_hit_blocks"] / queried if queried else 0.0,
            "cpu_hit_rate": counters["cpu_hit_blocks"] / queried if queried else 0.0,
            "gpu": {"total": self._gpu.num_blocks, "used": self._gpu.num_used, "free": self._gpu.num_free},
            "cpu": {"total": self._cpu.num_blocks, "used": self._cpu.num_used, "free": self._cpu.num_free},
            "nodes": nodes_by_state,
            "quarantined_blocks": quarantined,
            "quarantined_tasks": len(self._quarantine),
            "swaps": {op: dict(values) for op, values in self._swap_stats.items()},
            **counters,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError unless every block has exactly one owner and the tree is consistent.

        O(tree + blocks); for tests and debugging.  Assumes no swap is being awaited.
        """
        self._gpu.check()
        self._cpu.check()
        gpu_owner: dict[int, object] = {}
        cpu_owner: dict[int, object] = {}

        def claim(owners: dict[int, object], block: int | None, owner: object, tier: str) -> None:
            if block is None:
                raise AssertionError(f"{owner!r} should hold a {tier} block")
            if block in owners:
                raise AssertionError(f"{tier} block {block} owned by {owners[block]!r} and {owner!r}")
            owners[block] = owner

        refs: dict[int, int] = {}
        for lease in self._live_leases:
            if lease.released or lease.epoch != self._epoch:
                raise AssertionError("a released or stale lease is still live")
            for node in lease.nodes:
                refs[id(node)] = refs.get(id(node), 0) + 1
                if not node.attached:
                    raise AssertionError(f"lease holds detached {node!r}")
        count = 0
        for node in self._tree.iter_nodes():
            count += 1
            parent = node.parent
            if parent is None or parent.children.get(node.key) is not node or node.depth != parent.depth + 1:
                raise AssertionError(f"{node!r} is not linked to its parent")
            if not node.attached:
                raise AssertionError(f"{node!r} is in the tree but marked detached")
            if node.state is NodeState.ON_GPU:
                claim(gpu_owner, node.gpu_block, node, "gpu")
                if node.cpu_block is not None:
                    raise AssertionError(f"{node!r} on the GPU also holds a CPU block")
                if parent is not self._tree.root and parent.state is not NodeState.ON_GPU:
                    raise AssertionError(f"{node!r} is on the GPU but its parent is not")
            elif node.state is NodeState.ON_CPU:
                claim(cpu_owner, node.cpu_block, node, "cpu")
                if node.gpu_block is not None:
                    raise AssertionError(f"{node!r} on the CPU also holds a GPU block")
                if node.ref_count:
                    raise AssertionError(f"{node!r} on the CPU is referenced")
            else:
                raise AssertionError(f"{node!r} is still swapping outside a call")
            if node.ref_count != refs.get(id(node), 0):
                raise AssertionError(
                    f"{node!r}: ref_count {node.ref_count}, live leases hold {refs.get(id(node), 0)}")
            pinned = sum(child.state is NodeState.ON_GPU for child in node.children.values())
            if node.num_gpu_children != pinned:
                raise AssertionError(f"{node!r}: num_gpu_children {node.num_gpu_children}, actual {pinned}")
        if count != len(self._tree):
            raise AssertionError(f"tree counts {len(self._tree)} nodes, found {count}")
        for block, lease in self._private_owner.items():
            if lease not in self._live_leases or block not in lease.block_ids:
                raise AssertionError(f"private gpu block {block} belongs to no live lease")
            claim(gpu_owner, block, lease, "gpu")
        for task, entry in self._quarantine.items():
            for block in entry.block_ids:
                owners = gpu_owner if entry.tier == "gpu" else cpu_owner
                claim(owners, block, f"quarantine of task {task}", entry.tier)
        for owners, allocator in ((gpu_owner, self._gpu), (cpu_owner, self._cpu)):
            if sorted(owners) != allocator.allocated_ids():
                raise AssertionError(f"{allocator.tier}: owned blocks != allocated blocks "
                                     f"(owned only: {sorted(set(owners) - set(allocator.allocated_ids()))}, "
                                     f"allocated only: {sorted(set(allocator.allocated_ids()) - set(owners))})")
        if self._cleared and (len(self._tree) or self._gpu.num_blocks or self._cpu.num_blocks):
            raise AssertionError("cleared, yet caches are held")

    # ------------------------------------------------------------- internals

    def _hold(self, lease: BlockLease, nodes: list[RadixNode], now: int) -> None:
        for node in nodes:
            node.ref_count += 1
            node.last_access = now
            lease.nodes.append(node)

    def _offer(self, node: RadixNode) -> None:
        """Queue ``node`` for eviction if it has become a candidate on either tier."""
        if _is_gpu_victim(node):
            self._gpu_victims.offer(node)
        elif _is_cpu_victim(node):
            self._cpu_victims.offer(node)

    def _pop_victim(self, queue: LeafQueue, is_victim: Any) -> RadixNode | None:
        if len(queue) > 4 * len(self._tree) + 64:
            queue.rebuild(self._tree.iter_nodes(), is_victim)
        return queue.pop(is_victim)

    def _take_gpu_blocks(self, count: int, allow_fewer: bool) -> list[int]:
        shortfall = count - self._gpu.num_free
        if shortfall > 0:
            self._evict_gpu(shortfall)
        if self._gpu.num_free < count:
            if not allow_fewer:
                quarantined = sum(len(e.block_ids) for e in self._quarantine.values() if e.tier == "gpu")
                raise OutOfGpuBlocksError(
                    f"need {count} GPU blocks, {self._gpu.num_free} free after evicting every unreferenced block"
                    f" ({quarantined} quarantined behind timed-out swaps)")
            count = self._gpu.num_free
        return self._gpu.alloc(count)

    def _take_cpu_block(self) -> int | None:
        if not self._cpu.num_free:
            victim = self._pop_victim(self._cpu_victims, _is_cpu_victim)
            if victim is None:
                return None
            self._drop_subtree(victim)
        return self._cpu.alloc(1)[0]

    def _evict_gpu(self, count: int) -> int:
        """Free ``count`` GPU blocks (fewer if the cache runs out): swap LRU leaves out, or drop them."""
        victims: list[RadixNode] = []
        while len(victims) < count:
            node = self._pop_victim(self._gpu_victims, _is_gpu_victim)
            if node is None:
                break
            self._tree.set_state(node, NodeState.SWAPPING_OUT)
            victims.append(node)
            self._offer(node.parent)  # type: ignore[arg-type]  # may have just become a leaf
        victims.sort(key=lambda node: node.depth)  # parents get CPU room first
        moving: list[RadixNode] = []
        for node in victims:
            if not node.attached:
                continue  # went with an ancestor's subtree
            cpu_block = self._take_cpu_block()
            if cpu_block is None:
                self._drop_subtree(node)
            else:
                node.cpu_block = cpu_block
                moving.append(node)
        if moving:
            self._swap_out(moving)
        return len(victims)

    def _swap_out(self, moving: list[RadixNode]) -> None:
        gpu_ids = [node.gpu_block for node in moving]
        cpu_ids = [node.cpu_block for node in moving]
        outcome, task = self._run_swap("swap_out", gpu_ids, cpu_ids)  # type: ignore[arg-type]
        if outcome == "ok":
            self._gpu.free(gpu_ids)  # type: ignore[arg-type]
            for node in moving:
                node.gpu_block = None
                self._tree.set_state(node, NodeState.ON_CPU)
            for node in moving:
                self._offer(node)
                self._offer(node.parent)  # type: ignore[arg-type]
            self._counters["swapped_out_blocks"] += len(moving)
            return
        for node in moving:
            node.cpu_block = None
        self._settle_unsafe("cpu", cpu_ids, outcome, task)  # type: ignore[arg-type]
        for node in moving:
            if node.attached:
                self._drop_subtree(node)

    def _swap_in(self, cpu_run: list[RadixNode]) -> list[RadixNode]:
        """Bring a run of CPU nodes to the GPU in one task; returns those that arrived."""
        for node in cpu_run:
            self._tree.set_state(node, NodeState.SWAPPING_IN)  # shields them from CPU eviction
        gpu_ids = self._take_gpu_blocks(len(cpu_run), allow_fewer=True)
        moving, staying = cpu_run[: len(gpu_ids)], cpu_run[len(gpu_ids):]
        for node in staying:
            self._tree.set_state(node, NodeState.ON_CPU)
        for node, block in zip(moving, gpu_ids):
            node.gpu_block = block
        cpu_ids = [node.cpu_block for node in moving]
        outcome, task = "ok", None
        if moving:
            outcome, task = self._run_swap("swap_in", cpu_ids, gpu_ids)  # type: ignore[arg-type]
        if outcome == "ok":
            for node in moving:
                node.cpu_block = None
                self._tree.set_state(node, NodeState.ON_GPU)
            self._cpu.free(cpu_ids)  # type: ignore[arg-type]
        else:
            for node in moving:
                node.gpu_block = None
                self._tree.set_state(node, NodeState.ON_CPU)
            self._settle_unsafe("gpu", gpu_ids, outcome, task)
            moving = []
        for node in cpu_run:
            if node.state is NodeState.ON_CPU:
                self._offer(node)
        return moving

    def _run_swap(self, op: str, src: list[int], dst: list[int]) -> tuple[str, int | None]:
        """Submit one swap task and wait for it; a refused submit counts as ``rejected``."""
        counters = self._swap_stats[op]
        counters["issued"] += 1
        counters["blocks"] += len(src)
        try:
            task = self._bus.submit(op, src, dst, timeout=self.swap_timeout)
        except Exception:  # the bus refused it at once: nothing runs
            counters["rejected"] += 1
            return "rejected", None
        try:
            result = self._bus.wait(task, timeout=self.swap_timeout)
            outcome = result.outcome
            counters["bytes"] += getattr(result, "bytes", 0) or 0
        except Exception:  # cannot tell whether it runs: treat like a timeout
            outcome = "timeout"
        if outcome not in OUTCOMES:
            outcome = "failed"
        counters[outcome] += 1
        return outcome, task

    def _settle_unsafe(self, tier: str, block_ids: list[int], outcome: str, task: int | None) -> None:
        """Free the destination blocks of a swap that did not succeed, or quarantine them
        if the task may still write them."""
        if outcome == "timeout" and task is not None and self.quarantine_timed_out:
            self._quarantine[task] = _Quarantine(tier, block_ids)
        else:
            (self._gpu if tier == "gpu" else self._cpu).free(block_ids)

    def _reap_late_outcomes(self) -> None:
        """Free quarantined blocks whose task has settled (asks the bus only while any are held)."""
        if not self._quarantine:
            return
        settled = getattr(self._bus, "settled", None)
        try:
            if callable(settled):
                tasks = list(settled())
            else:
                tasks = [result.task for result in self._bus.poll(0.0)]
        except Exception:  # the bus is gone or closing: keep the quarantine, try again later
            return
        for task in tasks:
            entry = self._quarantine.pop(task, None)
            if entry is not None:
                self._counters["late_outcomes"] += 1
                self._counters["reclaimed_blocks"] += len(entry.block_ids)
                (self._gpu if entry.tier == "gpu" else self._cpu).free(entry.block_ids)

    def _drop_subtree(self, top: RadixNode) -> None:
        """Forget ``top`` and everything below it, freeing their blocks."""
        parent = top.parent
        gpu_ids: list[int] = []
        cpu_ids: list[int] = []
        for node in self._tree.subtree_children_first(top):
            if node.ref_count:
                raise AssertionError(f"dropping referenced {node!r}")
            if node.gpu_block is not None:
                gpu_ids.append(node.gpu_block)
                node.gpu_block = None
            if node.cpu_block is not None:
                cpu_ids.append(node.cpu_block)
                node.cpu_block = None
            self._tree.remove_leaf(node)
        self._gpu.free(gpu_ids)
        self._cpu.free(cpu_ids)
        self._counters["dropped_gpu_blocks"] += len(gpu_ids)
        self._counters["dropped_cpu_blocks"] += len(cpu_ids)
        if parent is not None and parent is not self._tree.root:
            self._offer(parent)
