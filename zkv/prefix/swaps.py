"""The prefix cache manager's swap runner: the tier moves (eviction under GPU
pressure, swap_out / swap_in, the disk tier's spill / load), the running of
every task over the bus, and the quarantine of blocks a timed-out task may
still write (held in the epoch's ``RowBook``).  The manager holds one and
passes it the epoch's ``Tiers`` (tree, book of rows, eviction queues) on
every call; the runner owns the bus and the swap counters.

Policies
--------
* GPU pressure: unreferenced GPU leaves (no child on the GPU) are evicted, LRU
  first, deeper first on ties, in one swap_out task.  Their GPU blocks are freed
  whatever the outcome: on ``ok`` the nodes live on as ON_CPU; on any other
  outcome they are dropped with their (off-GPU) subtrees.  Rolling them back
  onto the GPU would keep the very blocks the caller is waiting for.
* CPU pressure: with a disk tier, LRU CPU leaves (no child off the disk) are
  spilled to it in one spill task first, parents first; disk room comes from
  free blocks, then from dropping LRU disk leaves, and a CPU leaf that still
  finds none is dropped.  The spilled CPU blocks are freed whatever the
  outcome: on ``ok`` the nodes live on as ON_DISK; on any other they are
  dropped with their (disk-only) subtrees.  What still lacks room (no disk
  tier, the disk full, a failed spill) is dropped, LRU CPU leaves first; if
  none is left, the GPU victim is dropped instead of swapped.  Parents get
  room before their children (a child without its prefix is useless).
* Load (a match whose path reaches the disk): the disk run comes to the CPU
  in one load task (fewer blocks when the CPU has no more room), then with
  the CPU run in the match's one swap_in.  ``ok``: the nodes are ON_CPU and
  their disk blocks freed.  ``failed`` (a block whose digest did not check,
  docs/protocol.md §6.3: it is lost): the run is dropped with its subtree,
  never served.  Any other outcome: the nodes stay ON_DISK and the match
  stops before them.
* Failed swap-in: the nodes stay ON_CPU with their CPU blocks; the match stops
  before them.
* Late writes: every task's destination rows are driven by the epoch's
  ``RowBook`` from submit to settlement (``RowBook.begin`` / ``end``): its
  one rule (``zkv.rows.ending``) reads the outcome itself.  ``ok`` leaves them
  with the tree; an outcome whose copies are over (never dispatched, or
  every rank reported: ``failed``, ``cancelled``, ``rejected``) frees them; any
  other (a timeout, a failure because a rank died while another still
  copied) holds them out of reach (the quarantine) until the bus reports the
  task *settled* (``bus.settled()``: its missing ranks reported since;
  checked at the start of match / allocate / evict and by
  ``reclaim_quarantine()``), the caller reports the bus drained
  (``on_bus_drained()``, after a completed pause that a clear follows), or
  the bus's generations move under them (a rank that kept its memory may
  still copy: they stay held in the new pool).  A bus whose ``settled`` is
  None (an older client, a test double) is polled instead: a late outcome
  for the task frees its blocks.
* Generations: a task that touches a tier the bus lost since the tree
  followed its generations (``gens``; ``generations.moved_under``: ``gen``
  for swaps, ``cpu_gen`` for spill and load) is not submitted, and one whose
  ``ok`` comes after such a loss is taken as ``cancelled``: either would run
  on memory the tree does not describe.
"""

from __future__ import annotations

import warnings
from typing import Callable, cast

from ..rows.bus import SWAP_OPS, Bus, settled_tasks
from ..rows.ending import Settle
from ..rows.loss import LOST_NONE, UNKNOWN, Gens, lost_between, moved_under, read_gens
from ..wire.moves import MOVES
from ..wire.outcome import TaskOutcome
from ..wire.protocol import OUTCOMES
from ..wire.vocab import Op, Outcome, Tier
from .errors import OutOfGpuBlocksError
from .radix import NodeState, RadixNode, depth_order, first_depth
from .tiers import TIER_NAMES, Tiers, hand_out, in_order, is_gpu_victim

#: the runner's counters, in the order the manager's stats report them
COUNTERS = (
    "swapped_out_blocks",
    "spilled_blocks",
    "loaded_blocks",
    "dropped_gpu_blocks",
    "dropped_cpu_blocks",
    "dropped_disk_blocks",
    "late_outcomes",
    "reclaimed_blocks",
)

# the counters of blocks dropped on each tier, in TIER_NAMES order
_DROPPED = tuple(f"dropped_{tier}_blocks" for tier in TIER_NAMES)
# the counter of each op that moves a tier down
_DEMOTED = {Op.SWAP_OUT: "swapped_out_blocks", Op.SPILL: "spilled_blocks"}


class SwapRunner:
    """Eviction, swap tasks and the quarantine of one manager (see the module docstring)."""

    def __init__(self, bus: Bus, swap_timeout: float, quarantine_timed_out: bool) -> None:
        self.bus = bus
        self.swap_timeout = swap_timeout
        if not quarantine_timed_out:
            warnings.warn(
                "quarantine_timed_out=False frees rows a late copy may still write; the book's one rule "
                "holds them (docs/architecture.md, 'One book of rows'), and the option goes in 0.3",
                DeprecationWarning,
                stacklevel=3,
            )
        self.quarantine_timed_out = quarantine_timed_out
        self.swap_stats = {op: dict.fromkeys(("issued", "blocks", "bytes", *OUTCOMES), 0) for op in SWAP_OPS}
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.gens: Gens = UNKNOWN  # the bus's generations the tree describes (the manager follows them)

    def bus_gens(self) -> Gens:
        """The bus's ``gen`` and ``cpu_gen``, None where it tells none (``zkv.client.Client``)."""
        return read_gens(self.bus)

    def tree_is_stale(self) -> bool:
        """Whether the bus lost a tier since the tree last followed its generations."""
        return lost_between(self.gens, self.bus_gens()) != LOST_NONE

    # ---------------------------------------------------------------- blocks

    def take_gpu_blocks(self, tiers: Tiers, count: int, allow_fewer: bool) -> list[int]:
        shortfall = count - tiers.gpu.num_free
        if shortfall > 0:
            self.evict_gpu(tiers, shortfall)
        if tiers.gpu.num_free < count:
            if not allow_fewer:
                quarantined = tiers.book.held()[Tier.GPU]
                raise OutOfGpuBlocksError(
                    f"need {count} GPU blocks, {tiers.gpu.num_free} free after evicting every unreferenced block"
                    f" ({quarantined} quarantined behind timed-out swaps)"
                )
            count = tiers.gpu.num_free
        return tiers.gpu.alloc(count)

    def take_cpu_blocks(self, tiers: Tiers, count: int) -> list[int]:
        """Up to ``count`` CPU blocks, spilling (or dropping) LRU CPU leaves for room."""
        self.make_cpu_room(tiers, count - tiers.cpu.num_free)
        return tiers.cpu.alloc(min(count, tiers.cpu.num_free))

    def drop_subtree(self, tiers: Tiers, top: RadixNode) -> None:
        self._count_dropped(tiers.drop_subtree(top))

    def _count_dropped(self, freed: tuple[int, int, int]) -> None:
        """Book (GPU, CPU, disk) blocks dropped for want of room."""
        counters = self.counters
        for name, n in zip(_DROPPED, freed):
            counters[name] += n

    def _take_cpu_block(self, tiers: Tiers) -> int | None:
        if not tiers.cpu.num_free:
            victim = tiers.pop_cpu_victim()
            if victim is None:
                return None
            self.drop_subtree(tiers, tiers.take_deepest(victim, 1))
        return tiers.cpu.alloc(1)[0]

    def evict_gpu(self, tiers: Tiers, count: int) -> int:
        """Free ``count`` GPU blocks (fewer if the cache runs out): swap LRU leaves out, or drop
        them.  A leaf's deepest blocks go first: one that holds more than is still asked is cut
        (``Tiers.take_deepest``)."""
        victims: list[RadixNode] = []
        taken = 0
        while taken < count:
            node = tiers.next_victim(victims[-1] if victims else None, is_gpu_victim)
            if node is None:
                break
            node = tiers.take_deepest(node, count - taken)
            tiers.tree.set_state(node, NodeState.SWAPPING_OUT)
            victims.append(node)
            taken += len(node.keys)
        if not victims:
            return 0
        tiers.offer_parent(victims[-1])  # may have just become a leaf
        self.make_cpu_room(tiers, taken - tiers.cpu.num_free)  # one spill for the batch
        # CPU room for the batch at once: drop LRU CPU leaves until every victim has a block (what
        # ``_take_cpu_block`` does block by block), then take the blocks in one allocation.
        cpu = tiers.cpu
        if cpu.num_free < taken:
            self._count_dropped(tiers.drop_cpu_leaves(taken))
        blocks = cpu.alloc(min(taken, cpu.num_free))
        order = depth_order(victims)
        if len(blocks) == taken:
            moving, _ = hand_out(tiers, victims, Tier.CPU, blocks, order)  # parents get CPU room first
        else:
            moving = self._victims_short_of_cpu(tiers, victims, order, blocks)
        if moving:
            self.demote(tiers, moving, Op.SWAP_OUT, NodeState.ON_CPU)
        return taken

    def _victims_short_of_cpu(
        self, tiers: Tiers, victims: list[RadixNode], order: list[int] | None, blocks: list[int]
    ) -> list[RadixNode]:
        """CPU blocks for the victims, parents first, where fewer than they need were free:
        block by block, a victim takes one of ``blocks``, else one freed meanwhile
        (``_take_cpu_block``); a block that finds none is dropped with everything below it.
        Returns the runs that got blocks for all they hold (the rest is dropped)."""
        runs: list[RadixNode] = []
        positions: list[int] = []
        for node in victims:
            runs += [node] * len(node.keys)
            positions += range(len(node.keys))
        got: dict[RadixNode, list[int]] = {node: [] for node in victims}
        heads: dict[RadixNode, RadixNode | None] = {}  # a run cut short: what is left of it above the cut
        blocks.reverse()
        for index in range(len(runs)) if order is None else order:
            node = runs[index]
            if not node.attached:
                continue  # went with an ancestor's subtree, or with a shallower block of its own run
            cpu_block = blocks.pop() if blocks else self._take_cpu_block(tiers)
            if cpu_block is None:
                at = positions[index]
                heads[node] = tiers.tree.split(node, at) if at else None
                self.drop_subtree(tiers, node)  # may free CPU blocks for the next victims
            else:
                got[node].append(cpu_block)
        if blocks:
            tiers.cpu.free(blocks)  # taken for victims that went with an ancestor
        moving: list[RadixNode] = []
        for node in victims:
            kept = heads[node] if node in heads else node
            if kept is not None and kept.attached:
                kept.cpu_blocks = got[node]
                moving.append(kept)
        return moving

    def demote(self, tiers: Tiers, moving: list[RadixNode], op: Op, state: NodeState) -> None:
        """One ``op`` task moving ``moving`` a tier down (``swap_out`` GPU -> CPU, ``spill``
        CPU -> disk: ``wire/moves.py``; their destination blocks already taken), its blocks
        shallowest first.  On ``ok`` the source blocks are freed and the runs live on in
        ``state``; otherwise the destination blocks are freed or quarantined and the runs
        dropped with their subtrees (freeing the room asked for)."""
        move = MOVES[op]
        order = depth_order(moving)
        src_ids = in_order(moving, move.source, order)
        dst_ids = in_order(moving, move.dest, order)
        outcome, settle = self.run(tiers, op, src_ids, dst_ids)
        parents_first = sorted(moving, key=first_depth)
        if outcome == Outcome.OK:
            tiers.allocator(move.source).free(src_ids)
            for node in moving:
                node.set_blocks(move.source, None)
                tiers.tree.set_state(node, state)
            for node in dict.fromkeys([*parents_first, *(cast(RadixNode, n.parent) for n in parents_first)]):
                tiers.offer(node)  # a moved run, or its parent, may be a leaf on its tier now
            self.counters[_DEMOTED[op]] += len(src_ids)
            return
        for node in moving:
            node.set_blocks(move.dest, None)
        self.forget_dest(tiers, move.dest, dst_ids, settle)
        for node in parents_first:
            if node.attached:
                self.drop_subtree(tiers, node)

    def promote(
        self,
        tiers: Tiers,
        run: list[RadixNode],
        op: Op,
        states: tuple[NodeState, NodeState, NodeState],
        take: Callable[[int], list[int]],
    ) -> tuple[list[RadixNode], list[RadixNode], str]:
        """One ``op`` task moving ``run`` (a path's nodes, in order) a tier up (``swap_in`` CPU
        -> GPU, ``load`` disk -> CPU: ``wire/moves.py``).  ``states``: the run's state while it
        moves, where it rests, where it arrives.  ``take(n)`` gives up to ``n`` destination
        blocks; the blocks beyond them stay (a node is cut where they end).  On ``ok`` the
        source blocks of those that moved are freed; otherwise the destination blocks are
        freed or quarantined and the nodes rest where they were.  Returns the nodes that
        were moved, those that stayed, and the task's outcome."""
        move = MOVES[op]
        moving_state, resting, arrived = states
        for node in run:
            tiers.tree.set_state(node, moving_state)  # shields them (and their ancestors) from eviction
        dst_ids = take(sum(len(node.keys) for node in run))
        moving, staying = hand_out(tiers, run, move.dest, dst_ids, None)
        for node in staying:
            tiers.tree.set_state(node, resting)
        src_ids = in_order(moving, move.source, None)
        outcome: str = Outcome.OK
        settle = Settle.FILLED
        if moving:
            outcome, settle = self.run(tiers, op, src_ids, dst_ids)
        if outcome == Outcome.OK:
            for node in moving:
                node.set_blocks(move.source, None)
                tiers.tree.set_state(node, arrived)
            tiers.allocator(move.source).free(src_ids)
        else:
            for node in moving:
                node.set_blocks(move.dest, None)
                tiers.tree.set_state(node, resting)
            self.forget_dest(tiers, move.dest, dst_ids, settle)
        return moving, staying, outcome

    def swap_in(self, tiers: Tiers, cpu_run: list[RadixNode]) -> list[RadixNode]:
        """Bring a path's CPU nodes to the GPU in one task; returns those that arrived."""
        states = (NodeState.SWAPPING_IN, NodeState.ON_CPU, NodeState.ON_GPU)
        moving, staying, outcome = self.promote(
            tiers, cpu_run, Op.SWAP_IN, states, lambda n: self.take_gpu_blocks(tiers, n, allow_fewer=True)
        )
        for node in (*moving, *staying):
            if node.state is NodeState.ON_CPU:
                tiers.offer(node)
        return moving if outcome == Outcome.OK else []

    # ------------------------------------------------------------------ disk

    def make_cpu_room(self, tiers: Tiers, count: int) -> None:
        """Free ``count`` more CPU blocks (fewer if the CPU runs out of leaves) by spilling
        LRU CPU leaves, a leaf's deepest blocks first; without a disk tier this does nothing
        (the caller drops)."""
        if count <= 0 or not tiers.disk.num_blocks:
            return
        victims: list[RadixNode] = []
        taken = 0
        while taken < count:
            node = tiers.pop_cpu_victim()
            if node is None:
                break
            node = tiers.take_deepest(node, count - taken)
            tiers.tree.set_state(node, NodeState.SPILLING)
            victims.append(node)
            taken += len(node.keys)
            tiers.offer(cast(RadixNode, node.parent))  # may have just become a CPU leaf
        if not victims:
            return
        disk_ids = self._take_disk_blocks(tiers, taken)
        moving, unserved = hand_out(tiers, victims, Tier.DISK, disk_ids, depth_order(victims))  # parents first
        for node in sorted(unserved, key=first_depth):
            if node.attached:
                self.drop_subtree(tiers, node)  # no disk room left: dropped
        if moving:
            self.demote(tiers, moving, Op.SPILL, NodeState.ON_DISK)

    def _take_disk_blocks(self, tiers: Tiers, count: int) -> list[int]:
        """Up to ``count`` disk blocks, dropping LRU disk leaves (their deepest blocks first) for room."""
        while tiers.disk.num_free < count:
            victim = tiers.pop_disk_victim()
            if victim is None:
                break
            self.drop_subtree(tiers, tiers.take_deepest(victim, count - tiers.disk.num_free))
        return tiers.disk.alloc(min(count, tiers.disk.num_free))

    def load(self, tiers: Tiers, disk_run: list[RadixNode]) -> list[RadixNode]:
        """Bring a match's disk nodes to the CPU in one task; returns the nodes that arrived (a prefix of them)."""
        states = (NodeState.LOADING, NodeState.ON_DISK, NodeState.ON_CPU)  # LOADING shields the CPU run above too
        moving, staying, outcome = self.promote(
            tiers, disk_run, Op.LOAD, states, lambda n: self.take_cpu_blocks(tiers, n)
        )
        every = (*moving, *staying)
        if outcome == Outcome.OK:
            self.counters["loaded_blocks"] += sum(len(node.keys) for node in moving)
        else:
            if outcome == Outcome.FAILED:
                self.drop_subtree(tiers, moving[0])  # a lost block is never served: its run goes
            moving = []
        for node in every:
            if node.attached:
                tiers.offer(node)
        return moving

    # ----------------------------------------------------------------- tasks

    def run(self, tiers: Tiers, op: str, src: list[int], dst: list[int]) -> tuple[str, Settle]:
        """Submit one task and wait for it, its rows driven by the book (``RowBook.begin`` /
        ``end``).  Returns the outcome to act on and what the destination rows are now:
        ``FILLED`` (still the tree's: kept on ``ok``, to give back otherwise) or let go
        (``FREED`` / ``HELD``: the book has them).  A task the bus refused, or one not run
        because a tier it touches was lost, never began: its rows are given back here."""
        move = MOVES[op]
        counters = self.swap_stats[op]
        counters["issued"] += 1
        counters["blocks"] += len(src)
        if moved_under(op, self.gens, self.bus_gens()):  # its blocks are not what the tree says: do not run it
            counters[Outcome.CANCELLED] += 1
            tiers.book.give_back(move.dest, dst)
            return Outcome.CANCELLED, Settle.FREED
        try:
            task = self.bus.submit(op, src, dst, timeout=self.swap_timeout)
        except Exception:  # the bus refused it at once: nothing runs
            counters[Outcome.REJECTED] += 1
            tiers.book.give_back(move.dest, dst)
            return Outcome.REJECTED, Settle.FREED
        tiers.book.begin(task, writes={move.dest: dst}, reads={move.source: src})
        try:
            result = self.bus.wait(task, timeout=self.swap_timeout)
        except Exception:  # cannot tell whether it runs: a timeout, its copies not over
            result = TaskOutcome(task, Outcome.TIMEOUT, "the bus did not say how the task ended")
        counters["bytes"] += result.bytes or 0
        settle = tiers.book.end(task, result)
        if settle is Settle.HELD and not self.quarantine_timed_out:
            tiers.book.settle([task])  # the deprecated option: freed at once
            settle = Settle.FREED
        outcome = result.outcome if result.outcome in OUTCOMES else Outcome.FAILED
        if outcome == Outcome.OK and moved_under(op, self.gens, self.bus_gens()):
            # The bus lost a tier this task touches since the tree followed it:
            # it ran on memory the tree does not describe (docs/protocol.md §8.2).
            outcome = Outcome.CANCELLED
        counters[outcome] += 1
        return outcome, settle

    @staticmethod
    def forget_dest(tiers: Tiers, tier: Tier, block_ids: list[int], settle: Settle) -> None:
        """A task that did not succeed: its destination rows go, given back if they are
        still the tree's (an ``ok`` that came too late, after a generation move)."""
        if settle is Settle.FILLED:
            tiers.book.give_back(tier, block_ids)

    # ------------------------------------------------------------ quarantine

    def reap(self, tiers: Tiers) -> None:
        """Free quarantined blocks whose task has settled (asks the bus only while any are held)."""
        book = tiers.book
        if not book.num_held_tasks:
            return
        for entry in book.settle(settled_tasks(self.bus)):
            self.counters["late_outcomes"] += 1
            self.counters["reclaimed_blocks"] += entry.num_rows

    @staticmethod
    def release_quarantine(tiers: Tiers) -> int:
        """No task runs any more (a drained bus): free every quarantined block; returns how many."""
        return sum(entry.num_rows for entry in tiers.book.drain())
