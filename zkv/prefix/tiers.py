"""One epoch of the prefix cache's blocks: the radix tree, the GPU and CPU
allocators under it, and the LRU queues of eviction candidates on each tier.
A reset replaces the whole object; the manager (requests, leases) and the
swap runner (tasks, quarantine) work on it through these methods."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .allocator import BlockAllocator
from .radix import LeafQueue, NodeState, RadixNode, RadixTree


def is_gpu_victim(node: RadixNode) -> bool:
    return (
        node.attached
        and node.state is NodeState.ON_GPU
        and node.ref_count == 0
        and node.num_gpu_children == 0
        and node.parent is not None
    )  # never the root


def is_cpu_victim(node: RadixNode) -> bool:
    return node.attached and node.state is NodeState.ON_CPU and not node.children


class Tiers:
    """The tree and both tiers' allocators and eviction queues, of one epoch."""

    __slots__ = ("tree", "gpu", "cpu", "gpu_victims", "cpu_victims")

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, gpu_reserved: Iterable[int] = ()) -> None:
        self.tree = RadixTree()
        self.gpu = BlockAllocator(num_gpu_blocks, "gpu", gpu_reserved)  # the engine's own rows: never handed out
        self.cpu = BlockAllocator(num_cpu_blocks, "cpu")
        self.gpu_victims = LeafQueue()
        self.cpu_victims = LeafQueue()

    def allocator(self, tier: str) -> BlockAllocator:
        return self.gpu if tier == "gpu" else self.cpu

    def offer(self, node: RadixNode) -> None:
        """Queue ``node`` for eviction if it has become a candidate on either tier."""
        if is_gpu_victim(node):
            self.gpu_victims.offer(node)
        elif is_cpu_victim(node):
            self.cpu_victims.offer(node)

    def pop_gpu_victim(self) -> RadixNode | None:
        return self._pop(self.gpu_victims, is_gpu_victim)

    def pop_cpu_victim(self) -> RadixNode | None:
        return self._pop(self.cpu_victims, is_cpu_victim)

    def drop_subtree(self, top: RadixNode) -> tuple[int, int]:
        """Forget ``top`` and everything below it, freeing their blocks; returns (GPU, CPU) blocks freed."""
        parent = top.parent
        gpu_ids: list[int] = []
        cpu_ids: list[int] = []
        for node in self.tree.subtree_children_first(top):
            if node.ref_count:
                raise AssertionError(f"dropping referenced {node!r}")
            if node.gpu_block is not None:
                gpu_ids.append(node.gpu_block)
                node.gpu_block = None
            if node.cpu_block is not None:
                cpu_ids.append(node.cpu_block)
                node.cpu_block = None
            self.tree.remove_leaf(node)
        self.gpu.free(gpu_ids)
        self.cpu.free(cpu_ids)
        if parent is not None and parent is not self.tree.root:
            self.offer(parent)
        return len(gpu_ids), len(cpu_ids)

    def _pop(self, queue: LeafQueue, is_victim: Callable[[RadixNode], bool]) -> RadixNode | None:
        if len(queue) > 4 * len(self.tree) + 64:
            queue.rebuild(self.tree.iter_nodes(), is_victim)
        return queue.pop(is_victim)
