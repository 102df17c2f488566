"""One epoch of the prefix cache's blocks: the radix tree, the GPU, CPU and
disk rows under it (one ``RowBook``: its pools, and the rows timed-out
tasks hold), and the LRU queues of eviction candidates on each tier.  A reset
replaces the whole object (a GPU generation move only its GPU side:
``drop_gpu_tier``); the manager (requests, leases) and the swap runner
(tasks) work on it through these methods.

Shape rule (what makes a match cheap): residency is prefix-closed in tier
order.  A node on the GPU has its parent on the GPU, a node on the CPU has
its parent on the GPU or the CPU, disk nodes hang anywhere below; so the
path of a match is a GPU run, then a CPU run, then a disk run
(``split_path``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

from ..rows.book import RowBook
from ..rows.pool import RowPool
from ..wire.moves import TIER_ORDER
from ..wire.vocab import Tier
from .radix import LeafQueue, NodeState, RadixNode, RadixTree

#: the tiers, nearest first; ``Tiers.allocator`` takes these
TIER_NAMES = TIER_ORDER
#: what ``locate`` calls each resting state
WHERE = {NodeState.ON_GPU: Tier.GPU, NodeState.ON_CPU: Tier.CPU, NodeState.ON_DISK: Tier.DISK}
_ON_GPU, _ON_CPU, _ON_DISK = NodeState.ON_GPU, NodeState.ON_CPU, NodeState.ON_DISK


def is_gpu_victim(node: RadixNode) -> bool:
    return (
        node.attached
        and node.state is NodeState.ON_GPU
        and node.ref_count == 0
        and node.num_gpu_children == 0
        and node.parent is not None
    )  # never the root


def is_cpu_victim(node: RadixNode) -> bool:
    """A CPU node whose children, if any, are all on the disk."""
    return node.attached and node.state is NodeState.ON_CPU and not node.num_cpu_children


def is_disk_victim(node: RadixNode) -> bool:
    return node.attached and node.state is NodeState.ON_DISK and not node.children


def next_in_chain(node: RadixNode, is_victim: Callable[[RadixNode], bool]) -> RadixNode | None:
    """``node``'s parent, when it is what the eviction queue would give next now
    that ``node`` is taken: the nodes touched at one tick of the manager's clock
    lie on one path (a lease, an insert), so a parent of the same
    ``last_access`` that has become a candidate comes right after ``node`` in
    LRU-then-deepest order.  A chain is taken without a round trip through the
    queue; None: ask the queue."""
    parent = node.parent
    if parent is not None and parent.last_access == node.last_access and is_victim(parent):
        return parent
    return None


def split_path(path: list[RadixNode]) -> tuple[list[RadixNode], list[RadixNode], list[RadixNode]]:
    """A match's path as its GPU nodes, CPU nodes and disk nodes (the shape rule makes it these three)."""
    gpu = 0
    while gpu < len(path) and path[gpu].state is NodeState.ON_GPU:
        gpu += 1
    cpu = gpu
    while cpu < len(path) and path[cpu].state is NodeState.ON_CPU:
        cpu += 1
    return path[:gpu], path[gpu:cpu], path[cpu:]


class Tiers:
    """The tree, the book of every tier's rows and each tier's eviction queue, of one epoch.

    ``gpu``, ``cpu`` and ``disk`` are the book's pools, named for the hot paths."""

    __slots__ = ("tree", "book", "gpu", "cpu", "disk", "gpu_victims", "cpu_victims", "disk_victims")

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        gpu_reserved: Iterable[int] = (),
        num_disk_blocks: int = 0,
        max_run: int | None = None,
    ) -> None:
        self.tree = RadixTree(max_run)
        sizes = {Tier.GPU: num_gpu_blocks, Tier.CPU: num_cpu_blocks, Tier.DISK: num_disk_blocks}
        self.book = RowBook(sizes, {Tier.GPU: gpu_reserved})  # the engine's own GPU rows: never handed out
        self.gpu, self.cpu, self.disk = (self.book.pools[tier] for tier in TIER_NAMES)
        self.gpu_victims = LeafQueue()
        self.cpu_victims = LeafQueue()
        self.disk_victims = LeafQueue()

    def allocator(self, tier: Tier | str) -> RowPool:
        return self.gpu if tier == Tier.GPU else self.cpu if tier == Tier.CPU else self.disk

    def offer(self, node: RadixNode) -> None:
        """Queue ``node`` for eviction if it has become a candidate on its tier: its
        state is read once, and only that tier's rule (``is_*_victim``) is asked."""
        state = node.state
        if state is _ON_GPU:
            if is_gpu_victim(node):
                self.gpu_victims.offer(node)
        elif state is _ON_CPU:
            if is_cpu_victim(node):
                self.cpu_victims.offer(node)
        elif state is _ON_DISK and is_disk_victim(node):
            self.disk_victims.offer(node)

    def next_victim(self, last: RadixNode | None, is_victim: Callable[[RadixNode], bool]) -> RadixNode | None:
        """The next candidate of an eviction that has just taken ``last`` (None:
        the first): its chain's next node (``next_in_chain``), else, once the
        parent of ``last`` is offered, the queue's pick (``is_victim`` names the
        tier: ``is_gpu_victim`` or ``is_cpu_victim``)."""
        if last is not None:
            node = next_in_chain(last, is_victim)
            if node is not None:
                return node
            self.offer_parent(last)  # may have just become a leaf
        return self.pop_gpu_victim() if is_victim is is_gpu_victim else self.pop_cpu_victim()

    def pop_gpu_victim(self) -> RadixNode | None:
        return self._pop(self.gpu_victims, is_gpu_victim)

    def pop_cpu_victim(self) -> RadixNode | None:
        return self._pop(self.cpu_victims, is_cpu_victim)

    def pop_disk_victim(self) -> RadixNode | None:
        return self._pop(self.disk_victims, is_disk_victim)

    def drop_subtree(self, top: RadixNode) -> tuple[int, int, int]:
        """Forget ``top`` and everything below it, freeing their blocks; returns (GPU, CPU, disk) blocks freed."""
        freed = self._free(self._detach(top, check_refs=True))
        self.offer_parent(top)
        return freed

    def drop_cpu_leaves(self, want_free: int) -> tuple[int, int, int]:
        """Drop LRU CPU leaves (``pop_cpu_victim``, each with its disk subtree) until ``want_free``
        CPU blocks are free or no leaf is left, a leaf's deepest blocks first (``take_deepest``);
        one free per tier for the lot.  Returns the (GPU, CPU, disk) blocks freed, as
        ``drop_subtree`` does for one."""
        free = self.cpu.num_free
        dropped: tuple[list[int], list[int], list[int]] = ([], [], [])
        last: RadixNode | None = None
        while free < want_free:
            top = self.next_victim(last, is_cpu_victim)
            if top is None:
                return self._free(dropped)  # no CPU leaf left (the last one's parent was offered)
            top = self.take_deepest(top, want_free - free)
            for acc, ids in zip(dropped, self._detach(top, check_refs=True)):
                acc.extend(ids)
            free = self.cpu.num_free + len(dropped[1])
            last = top
        if last is not None:
            self.offer_parent(last)  # may be the next leaf to go
        return self._free(dropped)

    def take_deepest(self, node: RadixNode, count: int) -> RadixNode:
        """``node`` when it holds ``count`` blocks or fewer, else its deepest ``count`` cut
        from it (``RadixTree.split``; the rest stays, with the node's state)."""
        size = len(node.keys)
        if size > count:
            self.tree.split(node, size - count)
        return node

    def offer_parent(self, node: RadixNode) -> None:
        """Queue ``node``'s parent if it has become a candidate (never the root)."""
        parent = node.parent
        if parent is not None and parent is not self.tree.root:
            self.offer(parent)

    def _free(self, ids_by_tier: tuple[list[int], list[int], list[int]]) -> tuple[int, int, int]:
        """Free (GPU, CPU, disk) block ids, one call per tier; returns how many of each."""
        for allocator, ids in zip((self.gpu, self.cpu, self.disk), ids_by_tier):
            if ids:
                allocator.free(ids)
        return len(ids_by_tier[0]), len(ids_by_tier[1]), len(ids_by_tier[2])

    def adopt(self, node: RadixNode, gpu_blocks: list[int]) -> None:
        """A run cached off the GPU moves onto ``gpu_blocks`` (a caller's copy of its data)."""
        if node.cpu_blocks is not None:
            self.cpu.free(node.cpu_blocks)
            node.cpu_blocks = None
        if node.disk_blocks is not None:
            self.disk.free(node.disk_blocks)
            node.disk_blocks = None
        node.gpu_blocks = gpu_blocks
        self.tree.set_state(node, NodeState.ON_GPU)

    def drop_gpu_tier(self, num_gpu_blocks: int, gpu_reserved: Iterable[int]) -> int:
        """The GPU blocks are gone (a move of the bus's ``gen`` alone): forget every
        node on the GPU with its subtree (a child without its prefix is useless),
        keep the nodes whose whole path is off the GPU, renew the book's GPU
        pool (GPU rows a late copy may still write stay out of reach in it: a
        rank that kept its memory may still be copying).  References die
        with the leases (the caller's new epoch).  Returns how many nodes went."""
        root = self.tree.root
        gone = 0
        for top in [child for child in root.children.values() if child.state is NodeState.ON_GPU]:
            _, cpu_ids, disk_ids = self._detach(top, check_refs=False)
            self.cpu.free(cpu_ids)
            self.disk.free(disk_ids)
            gone += 1
        self.book.renew(Tier.GPU, num_gpu_blocks, gpu_reserved)
        self.gpu = self.book.pools[Tier.GPU]
        self.gpu_victims.clear()
        return gone

    def _detach(self, top: RadixNode, check_refs: bool) -> tuple[list[int], list[int], list[int]]:
        """Remove ``top``'s subtree from the tree; returns its blocks per tier (not yet freed),
        deepest first."""
        gpu_ids: list[int] = []
        cpu_ids: list[int] = []
        disk_ids: list[int] = []
        for node in self.tree.subtree_children_first(top):
            if node.ref_count and check_refs:
                raise AssertionError(f"dropping referenced {node!r}")
            node.ref_count = 0
            if node.gpu_blocks is not None:
                gpu_ids += reversed(node.gpu_blocks)
                node.gpu_blocks = None
            if node.cpu_blocks is not None:
                cpu_ids += reversed(node.cpu_blocks)
                node.cpu_blocks = None
            if node.disk_blocks is not None:
                disk_ids += reversed(node.disk_blocks)
                node.disk_blocks = None
            self.tree.remove_leaf(node)
        return gpu_ids, cpu_ids, disk_ids

    def _pop(self, queue: LeafQueue, is_victim: Callable[[RadixNode], bool]) -> RadixNode | None:
        if len(queue._heap) > 4 * self.tree._num_nodes + 64:  # fields, not __len__: once per pop
            queue.rebuild(self.tree.iter_nodes(), is_victim)
        return queue.pop(is_victim)


def in_order(nodes: list[RadixNode], tier: Tier, order: list[int] | None) -> list[int]:
    """The blocks ``nodes`` hold on ``tier``, run after run, or in ``order`` (``depth_order``'s)."""
    flat: list[int] = []
    for node in nodes:
        flat += cast(list[int], node.blocks_on(tier))
    return flat if order is None else [flat[index] for index in order]


def hand_out(
    tiers: Tiers, nodes: list[RadixNode], tier: Tier, ids: list[int], order: list[int] | None
) -> tuple[list[RadixNode], list[RadixNode]]:
    """Give the blocks of ``nodes`` the ``ids`` on ``tier``, in ``order`` (``depth_order``'s;
    None: run after run) until they run out.  Returns the runs that got a block for each of
    theirs, and those that got none; a run the ids end inside is cut there
    (``RadixTree.split``), its head served, its rest not."""
    if len(nodes) == 1 and len(nodes[0].keys) == len(ids):  # the common case: one run, all served
        nodes[0].set_blocks(tier, list(ids))
        return [nodes[0]], []
    total = sum(len(node.keys) for node in nodes)
    if order is None:
        flat: list[int | None] = [*ids, *([None] * (total - len(ids)))]
    else:
        flat = [None] * total
        for rank, index in enumerate(order[: len(ids)]):
            flat[index] = ids[rank]
    served: list[RadixNode] = []
    unserved: list[RadixNode] = []
    start = 0
    for node in nodes:
        size = len(node.keys)
        share = flat[start : start + size]
        start += size
        got = size - share.count(None)  # a prefix of the run: its blocks come shallowest first
        if got == size:
            node.set_blocks(tier, cast(list[int], share))
            served.append(node)
        elif not got:
            unserved.append(node)
        else:
            head = tiers.tree.split(node, got)
            head.set_blocks(tier, cast(list[int], share[:got]))
            served.append(head)
            unserved.append(node)
    return served, unserved
