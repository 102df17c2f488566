"""The prefix cache's disk tier: room on the CPU made by spilling LRU CPU
leaves to the disk, and disk runs of a match loaded back to the CPU.  Both
are tasks the swap runner runs (``swaps.py``) on the epoch's ``Tiers``;
these functions only decide which blocks move and what each outcome leaves.

Policies (the same per tier as the swaps')
--------
* Spill (CPU pressure, a disk tier configured): LRU CPU leaves (no child off
  the disk) go to the disk in ONE spill task, parents first.  Disk room comes
  from free blocks, then from dropping LRU disk leaves; a CPU leaf that still
  finds none is dropped.  The CPU blocks are freed whatever the outcome: on
  ``ok`` the nodes live on as ON_DISK; on any other they are dropped with
  their (disk-only) subtrees, and a timed-out spill's disk blocks are
  quarantined (``SwapRunner.settle_unsafe``).
* Load (a match whose path reaches the disk): the disk run comes to the CPU
  in ONE load task (fewer blocks when the CPU has no more room), then with
  the CPU run in the match's one swap_in.  ``ok``: the nodes are ON_CPU and
  their disk blocks freed.  ``failed`` (a block whose digest did not check,
  docs/protocol.md §6.3: it is lost): the run is dropped with its subtree,
  never served.  Any other outcome: the nodes stay ON_DISK, the match stops
  before them, and a timed-out load's CPU blocks are quarantined.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from .radix import NodeState, RadixNode
from .tiers import Tiers

if TYPE_CHECKING:
    from .swaps import SwapRunner


def make_cpu_room(runner: SwapRunner, tiers: Tiers, count: int) -> None:
    """Free ``count`` more CPU blocks (fewer if the CPU runs out of leaves) by spilling
    LRU CPU leaves; without a disk tier this does nothing (the caller drops)."""
    if count <= 0 or not tiers.disk.num_blocks:
        return
    victims: list[RadixNode] = []
    while len(victims) < count:
        node = tiers.pop_cpu_victim()
        if node is None:
            break
        tiers.tree.set_state(node, NodeState.SPILLING)
        victims.append(node)
        tiers.offer(cast(RadixNode, node.parent))  # may have just become a CPU leaf
    if not victims:
        return
    victims.sort(key=lambda node: node.depth)  # parents get disk room first
    disk_ids = take_disk_blocks(runner, tiers, len(victims))
    moving = victims[: len(disk_ids)]
    for node, block in zip(moving, disk_ids):
        node.disk_block = block
    for node in victims[len(disk_ids) :]:
        if node.attached:
            runner.drop_subtree(tiers, node)  # no disk room left: dropped
    if moving:
        runner.demote(tiers, moving, "spill", "cpu", "disk", NodeState.ON_DISK)


def take_disk_blocks(runner: SwapRunner, tiers: Tiers, count: int) -> list[int]:
    """Up to ``count`` disk blocks, dropping LRU disk leaves for room."""
    while tiers.disk.num_free < count:
        victim = tiers.pop_disk_victim()
        if victim is None:
            break
        runner.drop_subtree(tiers, victim)
    return tiers.disk.alloc(min(count, tiers.disk.num_free))


def load(runner: SwapRunner, tiers: Tiers, disk_run: list[RadixNode]) -> list[RadixNode]:
    """Bring a match's disk run to the CPU in one task; returns the nodes that arrived (a prefix of it)."""
    for node in disk_run:
        tiers.tree.set_state(node, NodeState.LOADING)  # shields them, and the CPU run above, from eviction
    cpu_ids = runner.take_cpu_blocks(tiers, len(disk_run))
    moving, staying = disk_run[: len(cpu_ids)], disk_run[len(cpu_ids) :]
    for node in staying:
        tiers.tree.set_state(node, NodeState.ON_DISK)
    for node, block in zip(moving, cpu_ids):
        node.cpu_block = block
    disk_ids = cast(list[int], [node.disk_block for node in moving])
    outcome, task = "ok", None
    if moving:
        outcome, task = runner.run("load", disk_ids, cpu_ids)
    if outcome == "ok":
        for node in moving:
            node.disk_block = None
            tiers.tree.set_state(node, NodeState.ON_CPU)
        tiers.disk.free(disk_ids)
        runner.counters["loaded_blocks"] += len(moving)
    else:
        for node in moving:
            node.cpu_block = None
            tiers.tree.set_state(node, NodeState.ON_DISK)
        runner.settle_unsafe(tiers, "cpu", cpu_ids, outcome, task)
        if outcome == "failed":
            runner.drop_subtree(tiers, moving[0])  # a lost block is never served: its run goes
        moving = []
    for node in disk_run:
        if node.attached:
            tiers.offer(node)
    return moving
