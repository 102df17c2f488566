"""The prefix cache's ownership invariant, checked against its allocators:
every used GPU block has exactly one owner (a tree node, a lease, the
quarantine), every used CPU or disk block one (a node, the quarantine), and
the tree's shape holds (residency prefix-closed in tier order: a GPU node's
parent on the GPU, a CPU node's on the GPU or the CPU; reference counts =
live leases).  A plain function of the state it checks; the manager passes its own
(``PrefixCacheManager.check_invariants``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..wire.vocab import Tier
from .lease import BlockLease
from .radix import NodeState, RadixNode, pins_cpu
from .tiers import TIER_NAMES, Tiers

#: tier order of each resting state (a node's may not be below its parent's)
_LEVEL = {NodeState.ON_GPU: 0, NodeState.ON_CPU: 1, NodeState.ON_DISK: 2}

#: block -> what owns it (a node, a lease, a quarantine entry)
Owners = dict[int, object]


def check_invariants(
    tiers: Tiers,
    live_leases: Collection[BlockLease],
    private_owner: Mapping[int, BlockLease],
    epoch: int,
    cleared: bool,
) -> None:
    """Raise AssertionError unless every block has exactly one owner and the tree is consistent.

    O(tree + blocks); for tests and debugging.  Assumes no swap is being awaited.
    """
    owners: dict[str, Owners] = {tier: {} for tier in TIER_NAMES}
    tiers.book.check()
    refs = _lease_references(live_leases, epoch)
    _check_tree(tiers, refs, owners)
    _check_private_blocks(private_owner, live_leases, owners[Tier.GPU])
    _check_quarantine(tiers, owners)
    _check_owned_is_allocated(tiers, owners)
    _check_cleared(tiers, cleared)


def _claim(owners: Owners, block: int | None, owner: object, tier: str) -> None:
    """``owner`` holds ``block``, which nothing else may hold."""
    if block is None:
        raise AssertionError(f"{owner!r} should hold a {tier} block")
    if block in owners:
        raise AssertionError(f"{tier} block {block} owned by {owners[block]!r} and {owner!r}")
    owners[block] = owner


def _lease_references(live_leases: Collection[BlockLease], epoch: int) -> dict[int, int]:
    """Live leases are unreleased, of this epoch and hold attached nodes; returns the references per node id."""
    refs: dict[int, int] = {}
    for lease in live_leases:
        if lease.released or lease.epoch != epoch:
            raise AssertionError("a released or stale lease is still live")
        for bottom, above in lease.held:
            node: RadixNode | None = bottom
            while node is not above:
                if node is None or not node.attached:
                    raise AssertionError(f"lease holds a detached node or a stretch that misses its end: {node!r}")
                refs[id(node)] = refs.get(id(node), 0) + 1
                node = node.parent
    return refs


def _check_tree(tiers: Tiers, refs: Mapping[int, int], owners: Mapping[str, Owners]) -> None:
    """Every node is linked, resident on one tier and counted right; the tree's size is its count of nodes."""
    tree = tiers.tree
    count = 0
    for node in tree.iter_nodes():
        count += 1
        parent = _check_link(node)
        _check_residency(node, parent, tree.root, owners)
        _check_counts(node, refs)
    if count != len(tree):
        raise AssertionError(f"tree counts {len(tree)} nodes, found {count}")


def _check_link(node: RadixNode) -> RadixNode:
    """A node in the tree is its parent's child one level down, and marked attached; returns the parent."""
    parent = node.parent
    if not node.keys:
        raise AssertionError(f"{node!r} holds no block")
    if parent is None or parent.children.get(node.keys[0]) is not node or node.depth != parent.depth + len(node.keys):
        raise AssertionError(f"{node!r} is not linked to its parent")
    if not node.attached:
        raise AssertionError(f"{node!r} is in the tree but marked detached")
    return parent


def _check_residency(node: RadixNode, parent: RadixNode, root: RadixNode, owners: Mapping[str, Owners]) -> None:
    """A node owns a block of exactly one tier per key, no nearer than its parent's; only GPU
    nodes are referenced."""
    level = _LEVEL.get(node.state)
    if level is None:
        raise AssertionError(f"{node!r} is still moving outside a call")
    tier = TIER_NAMES[level]
    blocks = {Tier.GPU: node.gpu_blocks, Tier.CPU: node.cpu_blocks, Tier.DISK: node.disk_blocks}
    resident = blocks.pop(tier)
    if resident is None or len(resident) != len(node.keys):
        raise AssertionError(f"{node!r} on the {tier} should hold one {tier} block per key")
    for block in resident:
        _claim(owners[tier], block, node, tier)
    for other, held in blocks.items():
        if held is not None:
            raise AssertionError(f"{node!r} on the {tier} also holds a {other} block")
    if parent is not root and _LEVEL.get(parent.state, 3) > level:
        raise AssertionError(f"{node!r} is on the {tier} but its parent is further away ({parent.state.name})")
    if node.ref_count and tier != Tier.GPU:
        raise AssertionError(f"{node!r} on the {tier} is referenced")


def _check_counts(node: RadixNode, refs: Mapping[int, int]) -> None:
    """A node's reference count is its live leases', and it counts its GPU children right."""
    if node.ref_count != refs.get(id(node), 0):
        raise AssertionError(f"{node!r}: ref_count {node.ref_count}, live leases hold {refs.get(id(node), 0)}")
    pinned = sum(child.state is NodeState.ON_GPU for child in node.children.values())
    if node.num_gpu_children != pinned:
        raise AssertionError(f"{node!r}: num_gpu_children {node.num_gpu_children}, actual {pinned}")
    off_disk = sum(pins_cpu(child.state) for child in node.children.values())
    if node.num_cpu_children != off_disk:
        raise AssertionError(f"{node!r}: num_cpu_children {node.num_cpu_children}, actual {off_disk}")


def _check_private_blocks(
    private_owner: Mapping[int, BlockLease], live_leases: Collection[BlockLease], gpu_owner: Owners
) -> None:
    """A private GPU block belongs to the live lease that allocated it."""
    for block, lease in private_owner.items():
        if lease not in live_leases or block not in lease.block_ids:
            raise AssertionError(f"private gpu block {block} belongs to no live lease")
        _claim(gpu_owner, block, lease, Tier.GPU)


def _check_quarantine(tiers: Tiers, owners: Mapping[str, Owners]) -> None:
    """The quarantine (the rows the book let go while a late copy may still write them)
    owns them: no node or lease does."""
    for tier in owners:
        for block in tiers.book.let_go(Tier(tier)):
            _claim(owners[tier], block, "the quarantine", tier)


def _check_owned_is_allocated(tiers: Tiers, tier_owners: Mapping[str, Owners]) -> None:
    """The blocks with an owner are exactly the blocks each pool of the book handed out."""
    for tier, owners in tier_owners.items():
        allocator = tiers.allocator(tier)
        if sorted(owners) != allocator.allocated_ids():
            raise AssertionError(
                f"{allocator.tier}: owned blocks != allocated blocks "
                f"(owned only: {sorted(set(owners) - set(allocator.allocated_ids()))}, "
                f"allocated only: {sorted(set(allocator.allocated_ids()) - set(owners))})"
            )


def _check_cleared(tiers: Tiers, cleared: bool) -> None:
    """Cleared caches hold no tree and no blocks."""
    if cleared and (len(tiers.tree) or tiers.gpu.num_blocks or tiers.cpu.num_blocks or tiers.disk.num_blocks):
        raise AssertionError("cleared, yet caches are held")
