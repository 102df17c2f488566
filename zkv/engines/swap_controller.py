"""Swap whole conversations of a transformers engine between its cache and
zkv's CPU tier, through the bus.

One controller drives one or more engine *replicas* in lockstep, one per
zkv rank (rank ``r``'s agent is attached to ``replicas[r]``'s cache).  They
run the same model on the same requests in the same order, so their
deterministic allocators hand out the same block ids; every table the
controller puts in a task is checked to be the same on every replica, and
one task then moves every rank's copy, exactly as one task moves every TP
shard under the same ids (docs/engine-transformers.md).

Order of a swap-out: the conversation is parked (its KV complete) -> task
``swap_out(src=its blocks, dst=CPU rows)`` -> only on ``ok`` are the blocks
released to the engine's pool.  A swap-in: ``take_blocks`` -> task
``swap_in(src=rows, dst=new blocks)`` -> only on ``ok`` is the new table
installed.  Anything else leaves the engine as it was: a failed swap-out
keeps the conversation resident, a failed swap-in gives the blocks back and
the turn recomputes its prefill.  Every task's rows are driven by the
controller's ``RowBook`` from submit to settlement: its one rule reads the
outcome (``zkv.rows.ending``), so a task that may still copy late (a timeout,
a failure a rank did not report) keeps what it writes (rows, or taken
blocks) out of reach until the client reports it settled or a clear drains
the bus.  The book owns the CPU rows (a row given back twice raises); the
engines own their blocks, which a held task carries beside its rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..rows.book import RowBook
from ..rows.bus import Bus, settled_tasks
from ..rows.ending import Settle
from ..wire.outcome import TaskOutcome
from ..wire.vocab import Op, Tier
from .idle_policy import IdlePolicy
from .transformers.engine import CacheFull, NoFreeBlocks, TransformersCBEngine


class ReplicasDiverged(RuntimeError):
    """Two replicas disagree on a block table or an output: one task cannot serve them."""


@dataclass
class SwapStats:
    swap_outs: int = 0
    swap_ins: int = 0  # prefills replaced by a swap-in
    recomputes: int = 0  # returning conversations whose prefill was recomputed
    resident_turns: int = 0  # returning conversations whose KV never left the engine
    failed: dict[str, int] = field(default_factory=dict)  # "swap_out:timeout" -> count
    blocks_out: int = 0
    blocks_in: int = 0
    swap_out_s: list[float] = field(default_factory=list)
    swap_in_s: list[float] = field(default_factory=list)
    tokens_swapped_in: int = 0
    last_reason: str = ""  # why the last failed task failed

    def failure(self, op: str, outcome: str, reason: str = "") -> None:
        key = f"{op}:{outcome}"
        self.last_reason = reason or outcome
        self.failed[key] = self.failed.get(key, 0) + 1


class SwapController:
    """Conversations over ``replicas`` with KV swapped out to zkv's CPU tier when idle."""

    def __init__(
        self,
        replicas: Sequence[TransformersCBEngine],
        bus: Bus,
        cpu_rows: int,
        *,
        policy: IdlePolicy | None = None,
        timeout: float = 10.0,
    ):
        if not replicas:
            raise ValueError("at least one engine replica")
        if type(cpu_rows) is not int or cpu_rows < 1:
            raise ValueError(f"cpu_rows must be a positive int, got {cpu_rows!r}")
        self.replicas = list(replicas)
        self.bus = bus
        self.cpu_rows = cpu_rows
        self.policy = policy or IdlePolicy()
        self.timeout = timeout
        self.stats = SwapStats()
        self.tick = 0
        self.book = RowBook({Tier.CPU: cpu_rows})  # hands out rows 0, 1, 2 ...; holds what late tasks write
        self._swapped: dict[str, list[int]] = {}  # conversation -> its CPU rows, in block order

    # ------------------------------------------------------------- requests

    def submit(self, conversation: str, tokens: list[int], max_new_tokens: int) -> None:
        """A new conversation's first turn (on every replica)."""
        for engine in self.replicas:
            engine.submit(conversation, tokens, max_new_tokens=max_new_tokens)

    def continue_turn(self, conversation: str, new_tokens: list[int], max_new_tokens: int) -> str:
        """The next turn: ``"resident"``, ``"swapped_in"`` or ``"recomputed"`` (how its KV got there)."""
        self.reap()
        self.policy.gone(conversation)
        how = "resident" if self.replicas[0].conversation(conversation).resident else "recomputed"
        if conversation in self._swapped:
            how = "swapped_in" if self.swap_in(conversation) else "recomputed"
        reused = {
            engine.continue_request(conversation, new_tokens, max_new_tokens=max_new_tokens) for engine in self.replicas
        }
        if reused != {how != "recomputed"}:
            raise ReplicasDiverged(f"{conversation!r}: replicas disagree on resident KV ({reused}, expected {how})")
        if how == "resident":
            self.stats.resident_turns += 1
        elif how == "recomputed":
            self.stats.recomputes += 1
        return how

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Step every replica until all requests parked; swap out for room when the cache is full."""
        for steps in range(max_steps):
            # Every replica makes the same call, a failed one included: a step that found the cache full may
            # still have moved the engine's pool state, and the replicas must stay identical.
            outcomes: list[bool | None] = []
            for engine in self.replicas:
                try:
                    outcomes.append(engine.step())
                except CacheFull:
                    outcomes.append(None)
            if any(o != outcomes[0] for o in outcomes[1:]):
                raise ReplicasDiverged(f"replicas disagree on the step (None: cache full): {outcomes}")
            if outcomes[0] is None:
                if not self._make_room():
                    raise CacheFull(f"no parked conversation left to swap out ({len(self.swapped)} swapped already)")
                continue
            if not outcomes[0]:
                return steps
        raise RuntimeError(f"engine still busy after {max_steps} steps")

    def result(self, conversation: str):
        """The turn's output (replica 0's), checked equal on every replica; the policy learns it parked."""
        outputs = [engine.result(conversation) for engine in self.replicas]
        if any(o is None for o in outputs):
            raise RuntimeError(f"no output for {conversation!r} on some replica")
        first = outputs[0]
        for other in outputs[1:]:
            if other.generated_tokens != first.generated_tokens:
                raise ReplicasDiverged(f"{conversation!r}: replicas generated different tokens")
        if conversation in self.replicas[0].parked():
            self.policy.parked(conversation, self.tick)
        return first

    def end_tick(self) -> list[str]:
        """The caller's clock advances (one round of turns served): swap out what the policy picks."""
        self.tick += 1
        return self.maintain()

    def maintain(self) -> list[str]:
        """Swap out the conversations the policy picks now; return those that went."""
        self.reap()
        engine = self.replicas[0]
        resident = {
            c: len(engine.block_table(c))
            for c in self.policy.resident
            if c in engine.parked() and engine.conversation(c).resident
        }
        gone = []
        for conv in self.policy.victims(self.tick, engine.free_block_count(), resident):
            if self.swap_out(conv):
                gone.append(conv)
        return gone

    def forget(self, conversation: str) -> None:
        self.policy.gone(conversation)
        rows = self._swapped.pop(conversation, None)
        if rows is not None:
            self.book.give_back(Tier.CPU, rows)
        for engine in self.replicas:
            engine.forget(conversation)

    def drop_cpu_copy(self, conversation: str) -> None:
        """Forget a swapped-out conversation's CPU rows (CPU tier full, or lost): its next turn recomputes."""
        self.book.give_back(Tier.CPU, self._swapped.pop(conversation))

    @property
    def swapped(self) -> list[str]:
        return list(self._swapped)

    def rows_of(self, conversation: str) -> list[int]:
        return list(self._swapped[conversation])

    # ----------------------------------------------------------------- swaps

    def swap_out(self, conversation: str) -> bool:
        """Move a parked conversation's KV to CPU rows; on ``ok`` release its blocks. False: it stays resident."""
        table = self._same("block table", [engine.block_table(conversation) for engine in self.replicas])
        if self.book.pool(Tier.CPU).num_free < len(table):
            self.stats.failure(Op.SWAP_OUT, "cpu_full")
            return False
        rows = self.book.take(Tier.CPU, len(table))
        outcome, settle, elapsed = self._run(Op.SWAP_OUT, table, rows, writes=rows)
        if settle is not Settle.FILLED:  # the book has the rows now: free, or held for a late copy
            self.stats.failure(Op.SWAP_OUT, outcome.outcome, outcome.reason)
            return False
        for engine in self.replicas:
            engine.release_blocks(conversation)
        self.policy.gone(conversation)
        self._swapped[conversation] = rows
        self.stats.swap_outs += 1
        self.stats.blocks_out += len(table)
        self.stats.swap_out_s.append(elapsed)
        return True

    def swap_in(self, conversation: str) -> bool:
        """Move a swapped conversation back into fresh blocks; False: it will recompute its prefill."""
        rows = self._swapped.pop(conversation)
        try:
            needed = self._same("blocks needed", [engine.blocks_needed(conversation) for engine in self.replicas])
            if needed != len(rows):
                raise ReplicasDiverged(f"{conversation!r} needs {needed} blocks but {len(rows)} rows hold it")
            blocks = self._take(needed)
            if blocks is None:
                self.stats.failure(Op.SWAP_IN, "no_free_blocks")
                return False
            outcome, settle, elapsed = self._run(Op.SWAP_IN, rows, blocks, reads=rows, blocks=blocks)
            if settle is not Settle.FILLED:
                self.stats.failure(Op.SWAP_IN, outcome.outcome, outcome.reason)
                if settle is Settle.FREED:  # no copy writes them: the engines have them back now
                    for engine in self.replicas:
                        engine.return_blocks(blocks)
                return False  # HELD: the blocks go back when the task settles (``reap``)
            for engine in self.replicas:
                engine.install_block_table(conversation, blocks)
        finally:
            self.book.give_back(Tier.CPU, rows)  # read only: free once the task is over (a late read spoils nothing)
        self.stats.swap_ins += 1
        self.stats.blocks_in += len(blocks)
        self.stats.swap_in_s.append(elapsed)
        self.stats.tokens_swapped_in += self.replicas[0].conversation(conversation).kv_len
        return True

    def reap(self, wait: float = 0.0) -> int:
        """Give back what timed-out tasks held once the client says they settled (waiting up to ``wait`` s)."""
        settled = settled_tasks(self.bus, wait) if self.book.num_held_tasks else []
        for entry in self.book.settle(settled):  # frees the rows
            if entry.payload:
                for engine in self.replicas:
                    engine.return_blocks(entry.payload)
        return len(settled)

    @property
    def quarantined(self) -> int:
        return self.book.num_held_tasks

    # ------------------------------------------------------------- RL cycle

    def cleared(self) -> None:
        """The bus drained and the engines were cleared: every swapped conversation recomputes,
        nothing is held (no copy runs after a drain)."""
        self._swapped.clear()
        self.book.drain()
        self.book = RowBook({Tier.CPU: self.cpu_rows})
        self.policy.reset()

    # --------------------------------------------------------------- private

    def _run(
        self,
        op: str,
        src: list[int],
        dst: list[int],
        *,
        writes: list[int] | None = None,
        reads: list[int] | None = None,
        blocks: list[int] | None = None,
    ) -> tuple[TaskOutcome, Settle, float]:
        """One task, its CPU rows (``writes`` or ``reads``) and the engines' ``blocks`` it writes
        driven by the book from submit to settlement.  A submit the bus refuses never began:
        what it wrote is let go here (``FREED``)."""
        start = time.perf_counter()
        try:
            task = self.bus.submit(op, src, dst, self.timeout)
        except Exception as err:  # refused at once: nothing runs
            if writes:
                self.book.give_back(Tier.CPU, writes)
            return TaskOutcome(0, "rejected", str(err), never_ran=True), Settle.FREED, 0.0
        self.book.begin(task, writes={Tier.CPU: writes or []}, reads={Tier.CPU: reads or []}, payload=blocks)
        outcome = self.bus.wait(task, self.timeout)
        return outcome, self.book.end(task, outcome), time.perf_counter() - start

    def _take(self, count: int) -> list[int] | None:
        """The same fresh ids on every replica, making room once (prefix cache, then LRU swap-outs); None if none.

        Every replica makes the same call, a refused one included (a refusal still tidies the engine's pool)."""
        for attempt in range(2):
            taken: list[list[int] | None] = []
            for engine in self.replicas:
                try:
                    taken.append(engine.take_blocks(count))
                except NoFreeBlocks:
                    taken.append(None)
            if all(t is not None for t in taken):
                return self._same("taken blocks", taken)
            if any(t is not None for t in taken):
                raise ReplicasDiverged(f"only some replicas had {count} free blocks: {taken}")
            if attempt:
                return None
            for engine in self.replicas:
                engine.evict_prefix_cache()
            self._make_room(count)
        return None

    def _make_room(self, count: int = 1) -> bool:
        """Swap out least recently used parked conversations until ``count`` blocks are free; False if none could go."""
        engine = self.replicas[0]
        moved = False
        for conv in self.policy.resident:
            if engine.free_block_count() >= count and moved:
                break
            if conv in engine.parked() and engine.conversation(conv).resident and self.swap_out(conv):
                moved = True
        return moved

    def _same(self, what: str, values: list[Any]) -> Any:
        if any(v != values[0] for v in values[1:]):
            raise ReplicasDiverged(f"replicas disagree on the {what}: {values}")
        return values[0]
