"""The prefix cache manager's swap runner: eviction under GPU and CPU
pressure, the swap_out / swap_in tasks over the bus, and the quarantine of
blocks a timed-out task may still write.  A mixin of
:class:`~zkv.prefix.manager.PrefixCacheManager`; it works on its tree,
allocators and counters.

Policies
--------
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..wire.protocol import OUTCOMES
from .allocator import BlockAllocator
from .errors import OutOfGpuBlocksError
from .radix import LeafQueue, NodeState, RadixNode, RadixTree


@dataclass
class Quarantine:
    """Blocks a timed-out swap may still write: freed when the task settles."""

    tier: str
    block_ids: list[int]


def is_gpu_victim(node: RadixNode) -> bool:
    return (node.attached and node.state is NodeState.ON_GPU and node.ref_count == 0
            and node.num_gpu_children == 0 and node.parent is not None)  # never the root


def is_cpu_victim(node: RadixNode) -> bool:
    return node.attached and node.state is NodeState.ON_CPU and not node.children


class SwapRunner:
    """Eviction, swaps and quarantine (mixed into PrefixCacheManager)."""

    if TYPE_CHECKING:  # what the mixin uses of PrefixCacheManager
        _bus: Any
        _tree: RadixTree
        _gpu: BlockAllocator
        _cpu: BlockAllocator
        _gpu_victims: LeafQueue
        _cpu_victims: LeafQueue
        _quarantine: dict[int, Quarantine]
        _counters: dict[str, int]
        _swap_stats: dict[str, dict[str, int]]
        swap_timeout: float
        quarantine_timed_out: bool

        def _offer(self, node: RadixNode) -> None: ...

        def _drop_subtree(self, top: RadixNode) -> None: ...

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
            victim = self._pop_victim(self._cpu_victims, is_cpu_victim)
            if victim is None:
                return None
            self._drop_subtree(victim)
        return self._cpu.alloc(1)[0]

    def _evict_gpu(self, count: int) -> int:
        """Free ``count`` GPU blocks (fewer if the cache runs out): swap LRU leaves out, or drop them."""
        victims: list[RadixNode] = []
        while len(victims) < count:
            node = self._pop_victim(self._gpu_victims, is_gpu_victim)
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
            self._quarantine[task] = Quarantine(tier, block_ids)
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
