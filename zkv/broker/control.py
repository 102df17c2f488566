"""The control machine: pause, clear and resume requests (what starts no op
is in ``admission.py``), joining or refusing a request while one is in progress, publishing the
control message at each epoch (and repeating it until every rank acked),
counting the ranks' acks, and the success or failure that ends an operation.
The states it moves the bus between are looked up in ``state.py``."""

from __future__ import annotations

from dataclasses import replace

from ..obs.book import BusBook
from ..wire.layout import CacheLayout
from ..wire.messages import Ack, Clear, Pause, Resume
from ..wire.replies import ControlReply
from ..wire.vocab import Outcome
from .actions import Action, Publish, Record, answer_to, error
from .admission import Refusal, check_clear, noop_reply, resume_layout
from .announce import control_frame, welcome_frame
from .generation import Generation
from .joining import Request, due_joiner_errors, join, join_refusal
from .ranks import RankTable
from .records import BrokerConfig, PendingOp, RankState
from .restate import Restate
from .state import (
    IN_PROGRESS,
    ON_SUCCESS,
    OP_OF_STATE,
    ROLLED_BACK,
    RUNNING_OR_RESUMING,
    BusState,
    ControlOp,
    on_failure,
)
from .tasks import TaskTable


class ControlMachine:
    """The bus state, its epoch, the op published to the ranks, and the op in progress."""

    def __init__(
        self, cfg: BrokerConfig, book: BusBook, recording: bool, ranks: RankTable, gens: Generation, tasks: TaskTable
    ):
        self.cfg = cfg
        self.book = book
        self.counters = book.events
        self.recording = recording
        self.ranks = ranks
        self.gens = gens
        self.tasks = tasks
        self.state = BusState.RUNNING
        self.epoch = 0
        self.op = ControlOp.RUN  # what ranks must do at this epoch
        self.op_layout: CacheLayout | None = None  # the layout the control message names (a resume's)
        self.op_keep_cpu = False  # the control message names keep_cpu (a clear's)
        self.pending: PendingOp | None = None
        # a failed broker-started resume: its retries, backed off (restate.py)
        self.own_resume = Restate(min(cfg.op_timeout_ms, 2 * cfg.heartbeat_ms) / 1000)
        self.last_publish = 0.0

    def restore(self, state: BusState, epoch: int) -> None:
        """A restarted broker's state and a new epoch (``recovery.py``)."""
        self.state = state
        self.epoch = epoch
        self.op = OP_OF_STATE[state]
        self.op_layout, self.op_keep_cpu = None, self.gens.keep_cpu

    def _run_tasks(self, now: float, out: list[Action]) -> None:
        if self.state is BusState.RUNNING:
            self.tasks.dispatch(now, out)

    # --- requests ------------------------------------------------------------------

    def _join_or_busy(self, client: bytes, msg: Request, op: ControlOp, now: float, out: list[Action]) -> bool:
        """A request during a pending op: join it if it asks for what the op does, else refuse it."""
        pending = self.pending
        if pending is None:
            return False
        refusal = join_refusal(pending, op, msg, self.gens.layout, self.op_keep_cpu, self.gens.weights)
        if refusal is not None:
            self._refuse(op, client, msg, refusal, out)
        else:
            join(pending, client, msg.req, now + self.cfg.timeout_s(msg.timeout_ms))
        return True

    def _starts_no_op(self, op: ControlOp, client: bytes, msg: Request, now: float, out: list[Action]) -> bool:
        """Join the op in progress, say busy, or answer a noop on a bus already there."""
        if self._join_or_busy(client, msg, op, now, out):
            return True
        action = noop_reply(op, client, msg.req, self.state, self.epoch, self.gens.gen)
        if action is None:
            return False
        self.book.control_finished(op, "noop")
        out.append(action)
        return True

    def _refuse(self, op: ControlOp, client: bytes, msg: Request, refusal: Refusal, out: list[Action]) -> None:
        self.book.control_finished(op, refusal.code)
        out.append(error(client, refusal.code, refusal.reason, req=msg.req))

    def pause(self, client: bytes, msg: Pause, now: float, out: list[Action]) -> None:
        op = self.pending
        if op is not None and op.op == ControlOp.RESUME and not op.waiters:
            # The broker's own resume, no client waiting on it (or its
            # rollback): a pause takes over at a new epoch, never ``busy``.
            self.pending = None
            self.counters["restate_preempted"] += 1
        if self._starts_no_op(ControlOp.PAUSE, client, msg, now, out):
            return
        self.own_resume.stop()  # a client acted: the bus stays paused, no retry
        self.begin([(client, msg.req)], self.cfg.timeout_s(msg.timeout_ms), ControlOp.PAUSE, now, out)

    def clear(self, client: bytes, msg: Clear, now: float, out: list[Action]) -> None:
        if msg.weights is not None and msg.keep_cpu:
            why = "weights names new weights: a clear that keeps the CPU tier keeps the weights its blocks are of"
            self._refuse(ControlOp.CLEAR, client, msg, Refusal("bad_field", why), out)
            return
        if msg.weights is not None and self.state == BusState.CLEARED and self.pending is None:
            if not self.gens.keep_cpu:  # nothing of any weights is held: the name is taken as it is
                self.gens.weights = msg.weights
        if self._starts_no_op(ControlOp.CLEAR, client, msg, now, out):
            return
        try:
            check_clear(self.state, self.gens.gen)
        except Refusal as refusal:
            self._refuse(ControlOp.CLEAR, client, msg, refusal, out)
            return
        cancelled = self.tasks.cancel_queued("caches were cleared while the task was queued", now, out)
        keep_cpu = bool(msg.keep_cpu)
        self.gens.cleared(keep_cpu, f"clear epoch {self.epoch + 1} freed the caches", msg.weights)
        # The op's books go in before the first check: with no live rank the
        # clear completes inside begin.
        timeout_s = self.cfg.timeout_s(msg.timeout_ms)
        self.begin([(client, msg.req)], timeout_s, ControlOp.CLEAR, now, out, keep_cpu=keep_cpu, cancelled=cancelled)

    def resume(self, client: bytes, msg: Resume, now: float, out: list[Action]) -> None:
        if self._join_or_busy(client, msg, ControlOp.RESUME, now, out):
            return
        try:  # before the noop: a running bus refuses a layout it does not hold (docs/protocol.md §8.3)
            layout = resume_layout(msg.layout, self.state, self.gens.layout)
        except Refusal as refusal:
            self._refuse(ControlOp.RESUME, client, msg, refusal, out)
            return
        if self._starts_no_op(ControlOp.RESUME, client, msg, now, out):
            return
        self.own_resume.stop()
        self.begin([(client, msg.req)], self.cfg.timeout_s(msg.timeout_ms), ControlOp.RESUME, now, out, layout=layout)

    def begin(
        self,
        waiters: list[tuple[bytes, int]],
        timeout_s: float,
        op: ControlOp,
        now: float,
        out: list[Action],
        layout: CacheLayout | None = None,
        keep_cpu: bool = False,
        cancelled: int = 0,
    ) -> None:
        """Start ``op`` at a new epoch; ``layout`` (a resume) and ``keep_cpu``
        (a clear) travel in its control message."""
        # A resume the broker started itself began from a running bus; a pause
        # that took over from it, from the resume (it goes back to retrying).
        resuming = self.state == BusState.RESUMING and op == ControlOp.RESUME
        previous = BusState.RUNNING if resuming else self.state
        self.pending = PendingOp(op, self.epoch + 1, now, now + timeout_s, waiters, previous, layout, cancelled)
        self.epoch += 1
        self.op = op
        self.op_layout, self.op_keep_cpu = layout, keep_cpu
        self.state = IN_PROGRESS[op]
        self.publish(now, out)
        self._check_pending(now, out)

    # --- the control message ---------------------------------------------------------

    def publish(self, now: float, out: list[Action]) -> None:
        self.last_publish = now
        upto = self.ranks.upto()
        out.append(Publish(control_frame(self.epoch, self.op, self.gens.gen, upto, self.op_layout, self.op_keep_cpu)))

    def welcome(self, rs: RankState) -> bytes:
        """A registered rank's welcome: the bus's state now.  A rank joining
        during a resume with a new layout gets the new layout."""
        layout = self.op_layout or self.gens.layout
        assert layout is not None  # the first ready named one
        return welcome_frame(
            self.epoch,
            self.op,
            self.gens.gen,
            rs.dispatched,
            layout,
            self.cfg.heartbeat_ms,
            rs.session,
            self.op_keep_cpu,
        )

    def restate(self, now: float, out: list[Action]) -> None:
        """Publish the current state again at a new epoch (new gen and layout
        reach every rank); a running bus goes through a resume so that a rank
        that must allocate does it there, and tasks wait until all acked."""
        if self.pending is not None:
            self.epoch += 1
            self.pending.epoch = self.epoch
        elif self.state in RUNNING_OR_RESUMING:
            self.begin([], self.cfg.op_timeout_ms / 1000.0, ControlOp.RESUME, now, out, layout=self.gens.layout)
            return
        else:
            self.epoch += 1
        self.publish(now, out)

    # --- acks and the end of an op -------------------------------------------------

    def ack(self, rs: RankState, msg: Ack, now: float, out: list[Action]) -> None:
        if msg.epoch != self.epoch or msg.op != self.op:
            self.counters["stale_acks"] += 1
            return
        if self.op == ControlOp.PAUSE and msg.upto != rs.dispatched:
            self.counters["stale_acks"] += 1
            return
        named = self.op_layout
        if self.op == ControlOp.RESUME and named is not None and not self.gens.is_acked_layout(msg.layout, named):
            self.counters["stale_acks"] += 1  # resumed with another layout: wait for the repeat
            return
        if msg.stats:
            rs.stats = msg.stats
        if msg.error and self.op == ControlOp.RESUME:
            self.counters["alloc_failed"] += 1
            if self.pending is not None and self.pending.op == ControlOp.RESUME:
                self._fail_pending(
                    "alloc_failed",
                    f"rank {rs.rank} could not allocate its caches for resume epoch {self.epoch}: {msg.error}",
                    now,
                    out,
                )
            return
        if rs.acked_epoch == self.epoch:
            self.counters["repeat_acks"] += 1
            return
        rs.acked_epoch = self.epoch
        if msg.cpu_kept is False:
            self.gens.cpu_not_kept(rs.rank)
        if self.pending is not None and self.pending.op == ControlOp.CLEAR:
            self.pending.freed += msg.freed or 0
        self._check_pending(now, out)

    def _lagging(self, epoch: int) -> list[int]:
        return sorted(rs.rank for rs in self.ranks.live() if rs.acked_epoch != epoch)

    def _check_pending(self, now: float, out: list[Action]) -> None:
        op = self.pending
        if op is None:
            return
        if any(rs.acked_epoch != op.epoch for rs in self.ranks.live()):
            return
        self.pending = None
        if op.failure is not None:  # every live rank is back where the bus is
            self._answer_failure(op, out)
            return
        self.book.control_finished(op.op, Outcome.OK, now - op.started)
        self.state = ON_SUCCESS[op.op]
        resume = op.op == ControlOp.RESUME
        cpu_kept, note = None, ""
        if resume:
            self.own_resume.succeeded()
            if self.gens.keep_cpu:
                self.op_keep_cpu = False
            cpu_kept, note = self.gens.resumed(op.layout)
        gens = self.gens
        answer = ControlReply(
            0,
            control=op.op,
            epoch=op.epoch,
            gen=gens.gen,
            cpu_gen=gens.cpu_gen,
            state=self.state,
            elapsed_ms=round((now - op.started) * 1000, 3),
            cancelled=op.cancelled,
            freed=op.freed,
            layout=gens.layout if resume else None,
            cpu_kept=cpu_kept,
            note=note,
            gen_reason=(gens.reason or None) if resume else None,
            ranks_acked=len(self.ranks.live()),
            world=self.cfg.world,  # fewer acked than the world: the op completed without some ranks
        )
        self.counters[f"{op.op}_ok"] += 1
        if self.recording:
            out.append(Record({"ev": "control", "op": op.op, "t": now, "ok": True, **answer.wire_fields()}))
        for client, req in op.waiters:
            out.append(answer_to(client, replace(answer, req=req)))
        self._run_tasks(now, out)

    def _fail_pending(self, code: str, reason: str, now: float, out: list[Action]) -> None:
        op = self.pending
        assert op is not None
        self.pending = None
        self.book.control_finished(op.op, code, now - op.started)
        self.counters[f"{op.op}_failed"] += 1
        if self.recording:
            out.append(Record({"ev": "control", "op": op.op, "t": now, "ok": False, "code": code, "reason": reason}))
        if op.op == ControlOp.RESUME:
            self._roll_back_resume(op, code, reason, now, out)
            return
        for client, req in op.waiters:
            out.append(error(client, code, reason, req=req))
        if op.op == ControlOp.PAUSE:
            # Undo the half-done pause: a new epoch that tells every rank to run.
            self.epoch += 1
            self.state, self.op = on_failure(op.op, op.previous_state)
            self.op_layout, self.op_keep_cpu = self.gens.layout, False
            self.publish(now, out)
            self._run_tasks(now, out)
            if self.state == BusState.RESUMING:  # it took over from the broker's own resume: back to its retries
                self.own_resume.retry_at = now + self.own_resume.first_s
        else:
            self.state, self.op = on_failure(op.op, op.previous_state)  # gen moved on; laggards get repeats

    def _roll_back_resume(self, op: PendingOp, code: str, reason: str, now: float, out: list[Action]) -> None:
        """A failed resume leaves no rank on a layout or generation the broker
        does not hold: a new epoch puts every rank back where the bus was
        (cleared: free again, at a new generation since some may have
        allocated; paused: pause again).  Its requests are answered once
        every live rank acked that epoch (or died), or at the resume's own
        deadline: a rank whose allocation is still queued would otherwise
        take the cache an engine hands over after the error.  A resume the
        broker started itself (to bring a rank in line) is retried after two
        heartbeats, and the bus stays not running until it converges."""
        self.epoch += 1
        self.state, self.op = on_failure(ControlOp.RESUME, op.previous_state)
        self.op_layout, self.op_keep_cpu = None, False
        if self.state == BusState.CLEARED:
            self.gens.reallocated(
                f"resume epoch {op.epoch} failed ({code}): the bus is cleared again, without what any rank allocated"
            )
            self.op_keep_cpu = self.gens.keep_cpu
        rolled_back = ROLLED_BACK[self.state]
        if self.state == BusState.RESUMING:  # a resume the broker started: retry it, backed off
            rolled_back += f" (retried in {self.own_resume.failed(code, reason, now):g} s)"
        self.counters["resume_rollbacks"] += 1
        self.publish(now, out)
        op.epoch, op.failure = self.epoch, (code, f"{reason}; {rolled_back}")
        self.pending = op
        self._check_pending(now, out)
        if self.pending is op and now >= op.deadline:  # it timed out: no time is left to wait
            self._answer_failure(op, out)

    def _answer_failure(self, op: PendingOp, out: list[Action], lagging: list[int] | None = None) -> None:
        """A failed resume's requests get its error; ``lagging``: the ranks
        that had not acked the rollback by the deadline (they get repeats)."""
        assert op.failure is not None
        if self.pending is op:
            self.pending = None
        code, reason = op.failure
        if lagging:
            reason += f" (ranks {lagging} had not confirmed it by the deadline)"
        for client, req in op.waiters:
            out.append(error(client, code, reason, req=req))

    def rank_lost(self, reason: str, now: float, out: list[Action]) -> None:
        """A rank died: the op in progress completes without it, or fails."""
        if self.pending is not None:
            if self.cfg.allow_partial or self.pending.failure is not None:  # a dead rank rolls nothing back
                self._check_pending(now, out)
            else:
                self._fail_pending(
                    "rank_dead", f"{self.pending.op} epoch {self.pending.epoch} failed: {reason}", now, out
                )

    # --- the clock ---------------------------------------------------------------------

    def retry(self, now: float, out: list[Action]) -> None:
        """A failed broker-started resume, once its retry is due."""
        if self.pending is None and self.own_resume.due(now):
            self.counters["resume_retries"] += 1
            self.restate(now, out)

    def repeat(self, now: float, out: list[Action]) -> None:
        """PUB is lossy: publish again until every live rank acked this epoch.
        A restored running bus (op ``run``) has nothing to publish: ``control.op``
        is pause, clear or resume (docs/protocol.md §4.6); ranks learn ``run`` in a welcome."""
        if self.epoch and (now - self.last_publish) * 1000 >= self.cfg.control_repeat_ms and self._unacked():
            self.counters["control_repeats"] += 1
            self.publish(now, out)

    def _unacked(self) -> bool:
        """Whether a publish is still owed: a live rank has not acked this epoch's op."""
        return self.op is not ControlOp.RUN and any(rs.acked_epoch != self.epoch for rs in self.ranks.live())

    def expire(self, now: float, out: list[Action]) -> None:
        """Requests past their own deadline, then the op past its deadline."""
        if self.pending is not None and self.pending.joined:
            out.extend(due_joiner_errors(self.pending, now, self._lagging(self.pending.epoch)))
        if self.pending is not None and now >= self.pending.deadline:
            if self.pending.failure is not None:
                self._answer_failure(self.pending, out, self._lagging(self.pending.epoch))
                return
            ms = round((self.pending.deadline - self.pending.started) * 1000)
            self._fail_pending(
                f"{self.pending.op}_timeout",
                f"ranks {self._lagging(self.pending.epoch)} did not acknowledge "
                f"{self.pending.op} epoch {self.pending.epoch} within {ms} ms",
                now,
                out,
            )

    def deadlines(self) -> list[float]:
        due = []
        if self.epoch and self._unacked():  # once every rank acked, no repeat is due: the loop sleeps
            due.append(self.last_publish + self.cfg.control_repeat_ms / 1000)
        if self.pending is not None:
            due.append(self.pending.deadline)
            due.extend(self.pending.joined.values())
        if self.own_resume.retry_at is not None and self.pending is None:  # retry() waits for the op in progress
            due.append(self.own_resume.retry_at)
        return due
