"""The prefix cache's ownership invariant, checked against its allocators:
every used GPU block has exactly one owner (a tree node, a lease, the
quarantine), every used CPU block one (a node, the quarantine), and the
tree's shape holds (GPU residency prefix-closed, reference counts = live
leases).  A plain function of the state it checks; the manager passes its own
(``PrefixCacheManager.check_invariants``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from .lease import BlockLease
from .quarantine import Quarantine
from .radix import NodeState
from .swaps import HeldBlocks
from .tiers import Tiers


def check_invariants(
    tiers: Tiers,
    live_leases: Collection[BlockLease],
    private_owner: Mapping[int, BlockLease],
    quarantine: Quarantine[HeldBlocks],
    epoch: int,
    cleared: bool,
) -> None:
    """Raise AssertionError unless every block has exactly one owner and the tree is consistent.

    O(tree + blocks); for tests and debugging.  Assumes no swap is being awaited.
    """
    tree = tiers.tree
    tiers.gpu.check()
    tiers.cpu.check()
    gpu_owner: dict[int, object] = {}
    cpu_owner: dict[int, object] = {}

    def claim(owners: dict[int, object], block: int | None, owner: object, tier: str) -> None:
        if block is None:
            raise AssertionError(f"{owner!r} should hold a {tier} block")
        if block in owners:
            raise AssertionError(f"{tier} block {block} owned by {owners[block]!r} and {owner!r}")
        owners[block] = owner

    refs: dict[int, int] = {}
    for lease in live_leases:
        if lease.released or lease.epoch != epoch:
            raise AssertionError("a released or stale lease is still live")
        for node in lease.nodes:
            refs[id(node)] = refs.get(id(node), 0) + 1
            if not node.attached:
                raise AssertionError(f"lease holds detached {node!r}")
    count = 0
    for node in tree.iter_nodes():
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
            if parent is not tree.root and parent.state is not NodeState.ON_GPU:
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
            raise AssertionError(f"{node!r}: ref_count {node.ref_count}, live leases hold {refs.get(id(node), 0)}")
        pinned = sum(child.state is NodeState.ON_GPU for child in node.children.values())
        if node.num_gpu_children != pinned:
            raise AssertionError(f"{node!r}: num_gpu_children {node.num_gpu_children}, actual {pinned}")
    if count != len(tree):
        raise AssertionError(f"tree counts {len(tree)} nodes, found {count}")
    for block, lease in private_owner.items():
        if lease not in live_leases or block not in lease.block_ids:
            raise AssertionError(f"private gpu block {block} belongs to no live lease")
        claim(gpu_owner, block, lease, "gpu")
    for task, entry in quarantine.items():
        for block in entry.block_ids:
            owners = gpu_owner if entry.tier == "gpu" else cpu_owner
            claim(owners, block, f"quarantine of task {task}", entry.tier)
    for owners, allocator in ((gpu_owner, tiers.gpu), (cpu_owner, tiers.cpu)):
        if sorted(owners) != allocator.allocated_ids():
            raise AssertionError(
                f"{allocator.tier}: owned blocks != allocated blocks "
                f"(owned only: {sorted(set(owners) - set(allocator.allocated_ids()))}, "
                f"allocated only: {sorted(set(allocator.allocated_ids()) - set(owners))})"
            )
    if cleared and (len(tree) or tiers.gpu.num_blocks or tiers.cpu.num_blocks):
        raise AssertionError("cleared, yet caches are held")
