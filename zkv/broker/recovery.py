"""How the broker keeps one layout and one generation across restarts and
failures (issue 9), split out of ``core.py``: its durable snapshot,
the reconciliation of a registering rank with the bus, generation moves, and
the roll-back of a failed resume.  A mixin of :class:`BrokerCore`; it works on
the core's state and emits the same actions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..wire.layout import CacheLayout

if TYPE_CHECKING:
    from .core import Action, PendingOp

# What a restarted broker resumes as, for each state it may have died in: an
# operation that had not completed did not happen, and "not running" is the
# safe side (a pause that was under way is completed by the ranks' acks).
STABLE = {"running": "running", "pausing": "paused", "paused": "paused", "clearing": "cleared", "cleared": "cleared"}
_OP_OF_STATE = {"running": "run", "paused": "pause", "cleared": "clear"}


class Recovery:
    """Durable state, reconciliation and generation moves (mixed into BrokerCore)."""

    if TYPE_CHECKING:  # what the mixin uses of BrokerCore
        cfg: Any
        counters: Any
        pending: PendingOp | None
        queue: Any
        recording: bool
        _begin: Any
        _finish_task: Any
        _publish: Any
        _ready_ranks: Any
        _record_action: Any
        _save_action: Any
        _saved_key: tuple | None

    def snapshot(self) -> dict[str, Any]:
        """What a restarted broker needs to keep the state a client set."""
        state = STABLE.get(self.state)
        if state is None:  # resuming: the resume had not completed
            state = self.pending.previous_state if self.pending is not None else "running"
            state = STABLE.get(state, "running")
        return {"state": state, "epoch": self.epoch, "gen": self.gen, "gen_used": self.gen_used,
                "layout": self.layout.to_wire() if self.layout else None, "keep_cpu": self.keep_cpu,
                "world": self.cfg.world, "gen_reason": self.gen_reason}

    def _restore(self, snap: dict[str, Any]) -> None:
        if snap["world"] != self.cfg.world:
            raise ValueError(f"the state file is for world size {snap['world']}, this broker has {self.cfg.world}")
        self.state = snap["state"]
        self.epoch = snap["epoch"] + 1  # a new epoch: every rank re-learns the state from it
        self.gen = snap["gen"]
        self.gen_used = snap.get("gen_used", True)
        self.gen_reason = snap.get("gen_reason", "")
        self.keep_cpu = bool(snap.get("keep_cpu")) and self.state == "cleared"
        self.layout = CacheLayout.from_wire(snap["layout"]) if snap.get("layout") else None
        self.control_op = _OP_OF_STATE[self.state]
        self.control_extra = {"keep_cpu": True} if self.keep_cpu else {}
        self.counters["restored"] += 1

    def _save_if_changed(self, out: list[Action]) -> None:
        key = (self.state, self.epoch, self.gen, self.gen_used, self.layout, self.keep_cpu, self.gen_reason,
               self.pending.previous_state if self.pending is not None else None)
        if key != self._saved_key:
            self._saved_key = key
            out.insert(0, self._save_action(self.snapshot()))  # durable before any reply says it happened

    def _roll_back_resume(self, op: PendingOp, now: float, out: list[Action]) -> None:
        """A failed resume leaves no rank on a layout or generation the broker
        does not hold: a new epoch puts every rank back where the bus was
        (cleared: free again, at a new generation since some may have
        allocated; paused: pause again).  A resume the broker started itself
        (to bring a rank in line) is retried after two heartbeats, and the
        bus stays not running until it converges."""
        self.epoch += 1
        if op.previous_state == "cleared":
            self.gen += 1
            self.gen_used = False
            self.state, self.control_op = "cleared", "clear"
            self.control_extra = {"keep_cpu": True} if self.keep_cpu else {}
        elif op.previous_state == "paused":
            self.state, self.control_op, self.control_extra = "paused", "pause", {}
        else:
            self.state, self.control_op = "resuming", "pause"
            self.control_extra = {}
            self.retry_at = now + min(self.cfg.op_timeout_ms, 2 * self.cfg.heartbeat_ms) / 1000
        self.counters["resume_rollbacks"] += 1
        self._publish(now, out)

    def _reconcile(self, rank: int, msg: dict, layout: CacheLayout, now: float, out: list[Action]) -> None:
        """Bring a registering rank in line with the bus, never serve it as it is
        when its memory is not the bus's (DESIGN §11, §12).

        Its memory is *lost* for the bus when the process is new (``fresh``),
        holds no cache, another layout, or another generation.  Then, if a task
        ever ran at the current generation (or the rank is ahead of a broker
        that lost its state), the bus moves to a new generation that every
        client learns; and a rank that must allocate does so only within a
        resume (one the broker starts itself when the bus is running)."""
        rank_gen = msg["gen"]
        if self.state in ("clearing", "cleared"):  # cleared stays cleared: the welcome frees it
            if rank_gen > self.gen:
                self._move_gen(rank_gen + 1, f"rank {rank} reported generation {rank_gen}, above the broker's {self.gen}", now, out)
            return
        has_cache = msg.get("has_cache") is not False
        needs_alloc = not has_cache or layout != self.layout
        lost = bool(msg.get("fresh")) or needs_alloc or rank_gen != self.gen
        if not lost:
            return
        if rank_gen > self.gen and not self.gen_used and self._ready_ranks() == 1:
            # The first rank of a broker that lost its state: take its
            # generation, and count it as used (the old broker served it).
            self.gen, self.gen_used = rank_gen, True
            self.counters["gen_adopted"] += 1
            lost = bool(msg.get("fresh")) or needs_alloc
            if not lost:
                return
        if rank_gen > self.gen:
            self._move_gen(rank_gen + 1, f"rank {rank} reported generation {rank_gen}, above the broker's {self.gen}", now, out)
        elif self.gen_used:
            why = "restarted with fresh memory" if msg.get("fresh") else (
                "holds no cache" if not has_cache else "holds another layout" if layout != self.layout else
                f"held generation {rank_gen}")
            self._move_gen(self.gen + 1, f"rank {rank} {why}: the blocks of generation {self.gen} are gone", now, out)
        elif needs_alloc:
            self._restate(now, out)

    def _move_gen(self, gen: int, reason: str, now: float, out: list[Action]) -> None:
        """The bus's cache content is gone: a new generation, queued tasks
        (submitted against the old one) cancelled, every rank told at a new epoch."""
        self.gen, self.gen_used, self.gen_reason = gen, False, reason
        self.counters["gen_moves"] += 1
        if self.recording:
            out.append(self._record_action({"ev": "gen", "t": now, "gen": gen, "reason": reason}))
        while self.queue:
            self._finish_task(self.queue.popleft(), "cancelled", f"cache generation moved to {gen}: {reason}", now, out, notify=True)
        self._restate(now, out)

    def _restate(self, now: float, out: list[Action]) -> None:
        """Publish the current state again at a new epoch (new gen and layout
        reach every rank); a running bus goes through a resume so that a rank
        that must allocate does it there, and tasks wait until all acked."""
        self.epoch += 1
        if self.pending is not None:
            self.pending.epoch = self.epoch
        elif self.state in ("running", "resuming"):
            self.epoch -= 1
            self._begin(None, {}, "resume", "resuming", now, out, layout=self.layout.to_wire() if self.layout else None)
            return
        self._publish(now, out)
