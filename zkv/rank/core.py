"""A rank's control state machine, with no sockets (sans-IO).

It owns the inflight count (only the rank's I/O thread touches it, so it needs
no lock) and decides, for each event, what to send and what the executor must
do.  The rule it exists for (docs/protocol.md §10.4): a pause is acknowledged only when
every task dispatched before the pause (``upto``, counted per registration
session) has been received *and* finished, so a PUB pause that overtakes tasks
on the DEALER cannot be acked early; after the ack no task starts until resume.
"""

from __future__ import annotations

import collections
from dataclasses import replace
from typing import Any, Callable

from ..wire import fast as F
from ..wire import protocol as P
from ..wire import sockets as S
from ..wire.layout import CacheLayout
from ..wire.messages import Ack, Done, Error, Heartbeat, Ready, Refused, Reregister, Task, Welcome
from ..wire.vocab import ControlOp, RankOutcome
from .actions import Acked, AllocateCache, Execute, FreeCache, Note, RankAction, ToBroker
from .cache_phase import CachePhase, CacheState
from .registration import RankPhase, RankRefused, Registration

# one decoder per socket, of the kinds it receives (wire/sockets.py)
_decode_dealer = F.decoder(S.RANK_DEALER)  # a message of tasks: each header takes only S.TASK_HEADER (§10.3)
_decode_control = F.decoder(S.RANK_SUB)


class RankCore:
    """Events in, actions out.  ``now`` is seconds on a monotonic clock.  ``sessions()``
    makes each registration's session (see ``Registration``)."""

    def __init__(
        self,
        rank: int,
        world: int,
        layout: CacheLayout,
        heartbeat_ms: int = 500,
        liveness_ms: int = 2000,
        stats: Callable[[], dict[str, Any]] | None = None,
        *,
        sessions: Callable[[], int],
    ):
        self.rank = rank
        self.world = world
        self.layout = layout  # the layout of the memory this rank holds (or last held)
        self.bus_layout = layout  # the layout the broker last named
        self.fresh = True  # this process's memory was never part of a bus generation
        self.adopt_layout = False  # a new process takes the bus's layout when its own differs (else it is refused)
        self.cache = CacheState()  # the cache's phase in the clear/resume cycle, and what its acks repeat
        self.registration = Registration(sessions, heartbeat_ms, liveness_ms)  # phase, session, the link's clock
        self.stats = stats  # counters sent in heartbeats and acks
        self.tiers: Callable[[], dict[str, Any]] | None = None  # the READY's kept_tiers and cpu_gen
        self.gen = 0
        self.epoch = 0
        self.op = ControlOp.RUN
        self.upto = 0
        self.received = 0  # tasks received in this session (their ``n``)
        self.inflight = 0
        self.acked_epoch: int | None = None  # the epoch last acked in this registration
        self.held: list[Execute] = []  # tasks that overtook the control message allowing them
        self.probe_held: list[tuple[bytes, bytes]] = []
        # the one book of outcomes
        self.counters: collections.Counter[str] = collections.Counter(tasks_ok=0, tasks_failed=0)

    # --- registration ----------------------------------------------------------

    def start(self, now: float, pid: int | None = None) -> list[RankAction]:
        """(Re)register with a fresh session: the broker restarts our counts.
        Only for a new process or a registration the broker ended (or we
        gave up on); an unanswered READY is repeated by ``_repeat_ready``."""
        if pid is not None:
            self.registration.pid = pid
        self.registration.begin(now)
        self.received = 0
        return self._send_ready(now)

    def _send_ready(self, now: float) -> list[RankAction]:
        reg = self.registration
        reg.last_ready_sent = now
        self.counters["ready_sent"] += 1
        fields: dict[str, Any] = {"rank": self.rank, "world": self.world, "session": reg.session, "gen": self.gen}
        fields.update(layout=self.layout, pid=reg.pid, host=reg.host or None, fresh=self.fresh)
        fields.update(has_cache=self.cache.phase.serves)
        if self.adopt_layout:
            fields["adopt_layout"] = True
        return [ToBroker(Ready(**fields, **(self.tiers() if self.tiers else {})).to_wire())]

    def _repeat_ready(self, now: float) -> list[RankAction]:
        """The READY is unanswered: send it again with the *same* session.  It
        may have reached the broker while its welcome is still on the way (the
        two TCP directions recover from an outage apart): a new session would
        read as a restart there and fail the tasks it dispatched meanwhile, and
        a repeat every half liveness window keeps such a registration alive at
        the broker until the welcome arrives (and queues few while the broker
        is away).  The broker answers a duplicate with another welcome."""
        self.counters["ready_repeated"] += 1
        return self._send_ready(now)

    def on_wake(self, now: float) -> list[RankAction]:
        """Called each time the loop wakes (at least every heartbeat).  A loop
        that did not run for half the liveness window was frozen (SIGSTOP,
        swapping, a stalled VM), and the broker may have declared us dead and
        failed the tasks queued meanwhile.  Ask it (a probe heartbeat) and hold
        every task until it answers: ``hb{probe}`` means we are still its rank
        and the tasks run; ``reregister`` means they were failed, so we
        register again and they are refused, never copied."""
        if self.registration.woke(now):
            self.counters["frozen"] += 1
            return [ToBroker(Heartbeat(inflight=self.inflight, probe=True).to_wire())]
        return []

    def _end_probe(self, now: float) -> list[RankAction]:
        """Run the tasks held during a probe through the normal path (a task
        of a session we left is refused there)."""
        self.registration.probe_answered()
        held, self.probe_held = self.probe_held, []
        out: list[RankAction] = []
        for header, body in held:
            out += self.on_task(header, body, now)
        return out

    @property
    def registered(self) -> bool:
        """Welcomed in the current session (probing or not)."""
        return self.registration.registered

    def _restart(self, now: float) -> list[RankAction]:
        """Register again; tasks held by a probe then go through the normal
        path, where their old session refuses them."""
        probing = self.registration.probing
        out = self.start(now)
        return out + self._end_probe(now) if probing else out

    @property
    def paused(self) -> bool:
        return self.op is ControlOp.PAUSE or self.op is ControlOp.CLEAR

    # --- broker messages ---------------------------------------------------------

    def on_broker(self, frame: bytes, now: float) -> list[RankAction]:
        try:
            msg: Welcome | Heartbeat | Task | Refused | Reregister | Error = _decode_dealer(frame)
        except P.ProtocolError:
            self.counters["bad_broker_msgs"] += 1
            return []
        self.registration.last_broker_msg = now
        if isinstance(msg, Heartbeat):
            return self._end_probe(now) if msg.probe and self.registration.probing else []
        if isinstance(msg, Welcome):  # its layout typed and checked by the decoder
            if msg.session is not None and msg.session != self.registration.session:
                self.counters["stale_welcomes"] += 1  # answers a READY we since replaced
                return []
            return self._welcome(msg, msg.layout, now)
        if isinstance(msg, Reregister):
            if not self.registered:
                self.counters["stale_reregisters"] += 1  # our READY is already on its way
                return []
            return self._restart(now)
        if isinstance(msg, Refused):
            raise RankRefused(msg.reason)
        if isinstance(msg, Error):
            self.counters["broker_errors"] += 1
        return []  # a lone "task" has no body (tasks come in pairs: see on_task)

    def on_task(self, header: bytes, body: bytes, now: float) -> list[RankAction]:
        """A task header + body from the broker."""
        reg = self.registration
        reg.last_broker_msg = now
        if reg.phase is RankPhase.PROBING:  # is it still ours to run?  wait for the broker's answer
            self.probe_held.append((header, body))
            return []
        try:
            msg: Task = _decode_dealer(header, S.TASK_HEADER)
        except P.ProtocolError:
            self.counters["bad_broker_msgs"] += 1
            return []
        session, n, gen = msg.session, msg.n, msg.gen
        current = session is None or session == reg.session
        if current:  # ``received`` counts this session's tasks only
            self.received = max(self.received, n)
        refuse = ""
        if not current:
            # Sent to an earlier registration of ours, which the broker gave up on
            # (and failed its tasks): running it could copy into reused blocks.
            self.counters["refused_stale_session"] += 1
            refuse = "dispatched to an earlier registration of this rank; the broker already failed it"
        elif not P.is_result_address(msg.reply_to):
            refuse = "reply_to is not a tcp:// or ipc:// address"  # the executor will not connect it either
        elif gen != self.gen:
            refuse = f"task from cache generation {gen} but the rank is at generation {self.gen}"
        elif not self.cache.phase.serves or self.op is ControlOp.CLEAR:
            refuse = "caches are cleared on this rank"
        self.inflight += 1
        ex = Execute(
            msg.seq,
            n,
            msg.task,
            msg.reply_to,
            gen,
            body,
            refuse,
            msg.reply_key,
            reg.session,
            msg.cpu_gen,
            msg.batch_results is True,
        )
        if not refuse and self.op is ControlOp.PAUSE and n > self.upto:
            # Dispatched after the pause we acked: the broker is running again
            # and its newer control message is still on the PUB connection
            # (which this DEALER message overtook).  Hold it; no copy starts
            # until that message arrives.
            self.counters["held_until_control"] += 1
            self.held.append(ex)
            return []
        return [ex]

    def _release_held(self) -> list[RankAction]:
        """After a new control state: run the held tasks it allows."""
        if not self.held:
            return []
        out: list[RankAction] = []
        keep = []
        for ex in self.held:
            if self.op is ControlOp.PAUSE and ex.n > self.upto:
                keep.append(ex)
            elif self.op is ControlOp.CLEAR or not self.cache.phase.serves:
                out.append(replace(ex, refuse="caches are cleared on this rank"))
            else:
                out.append(ex)
        self.held = keep
        return out

    def on_control(self, frame: bytes, now: float) -> list[RankAction]:
        """A control message from the broker's PUB socket."""
        try:
            ctl = _decode_control(frame)
        except P.ProtocolError:
            self.counters["bad_control_msgs"] += 1
            return []
        if not self.registered:
            self.counters["control_before_welcome"] += 1
            return []  # the welcome will carry the state
        upto = ctl.upto[self.rank] if self.rank < len(ctl.upto) else 0
        return self._apply(ctl.epoch, ctl.op, ctl.gen, upto, ctl.layout, bool(ctl.keep_cpu), now)

    def _welcome(self, msg: Welcome, layout: CacheLayout, now: float) -> list[RankAction]:
        if msg.upto > self.received:
            # The broker sent tasks of this session before this welcome and
            # they never came: the connection they took died (a welcome
            # answering a repeated READY came on the new one).  Register
            # afresh, so the broker fails them now instead of waiting forever.
            self.counters["tasks_lost_in_transit"] += msg.upto - self.received
            return self._restart(now)
        reg = self.registration
        reg.welcomed()
        reg.heartbeat_ms = msg.heartbeat_ms
        # 0 for a new session; for the answer to a repeated READY, the tasks
        # dispatched since the first welcome, which came before it.
        self.received = msg.upto
        reg.last_heartbeat_sent = now  # and one now: it tells the broker the welcome arrived (tasks wait for that)
        if reg.probing:  # frozen while joining: is this registration still the broker's?  (RankPhase)
            self.counters["frozen"] += 1
        stats = self.stats() if self.stats else {}
        hello: list[RankAction] = [
            ToBroker(Heartbeat(inflight=self.inflight, stats=stats, probe=reg.probing or None).to_wire())
        ]
        self.acked_epoch = None  # a new broker may reuse epoch numbers we acked
        # Never allocate here: a rank allocates only within a resume (the
        # broker starts one when this rank's memory does not match the bus).
        self.bus_layout = layout
        if self.fresh and self.bus_layout != self.layout:  # only with adopt_layout: the broker refuses it otherwise
            self.counters["layouts_adopted"] += 1
            hello.append(
                Note(
                    f"rank {self.rank} adopts the bus's layout {self.bus_layout.to_wire()} (started with "
                    f"{self.layout.to_wire()}): its caches are allocated anew at the broker's resume"
                )
            )
        self.fresh = False
        self.gen = msg.gen
        self.counters["welcomes"] += 1
        # The welcome is authoritative, even at a lower epoch.
        return hello + self._apply(msg.epoch, msg.op, msg.gen, msg.upto, None, bool(msg.keep_cpu), now, welcome=True)

    def _apply(
        self,
        epoch: int,
        op: ControlOp,
        gen: int,
        upto: int,
        layout: CacheLayout | None,
        keep_cpu: bool,
        now: float,
        welcome: bool = False,
    ) -> list[RankAction]:
        if epoch < self.epoch and not welcome:
            self.counters["stale_controls"] += 1
            return []
        if epoch == self.epoch and op is self.op and not welcome:
            self.counters["repeat_controls"] += 1
            if op is ControlOp.PAUSE:
                self.upto = upto
            return self._maybe_ack(repeat=True)
        self.epoch, self.op = epoch, op
        self.gen = gen  # every new epoch names the bus's generation
        out: list[RankAction] = []
        if op is ControlOp.PAUSE:
            self.upto = upto
        elif op is ControlOp.CLEAR:
            if self.cache.clear():
                out.append(FreeCache(keep_cpu))
        else:  # RESUME, or RUN: a (restarted) broker that is running
            if layout is not None:
                self.bus_layout = layout
            if not self.cache.phase.serves or self.bus_layout != self.layout:
                self.layout = self.bus_layout
                self.cache.allocate()
                out.append(AllocateCache(self.layout))
            if op is ControlOp.RUN:
                out.append(Acked(op, epoch))  # nothing to ack on the wire, but no longer paused
        # Ack first: a resume's ack lifts the "paused" mark before the tasks it
        # releases reach the executor.  (Under a pause, released tasks are
        # already counted in flight, so the ack still waits for them.)
        return out + self._maybe_ack() + self._release_held()

    def _maybe_ack(self, repeat: bool = False) -> list[RankAction]:
        """Ack the current op if its condition holds (again, on a repeat)."""
        op, cache = self.op, self.cache
        if op is ControlOp.RUN or cache.phase.busy:
            return []
        if op is ControlOp.RESUME and cache.phase is CachePhase.ALLOC_FAILED:
            # said again on a repeat: the broker fails the resume
            self.counters["acks"] += 1
            return [
                ToBroker(
                    Ack(
                        epoch=self.epoch,
                        op=op,
                        gen=self.gen,
                        layout=self.layout,
                        error=cache.error,
                    ).to_wire()
                )
            ]
        if op is ControlOp.PAUSE and (self.received < self.upto or self.inflight):
            return []
        if op is ControlOp.CLEAR and self.inflight:
            return []
        if self.acked_epoch == self.epoch and not repeat:
            return []
        self.acked_epoch = self.epoch
        fields: dict[str, Any] = {"gen": self.gen}
        if op is ControlOp.PAUSE:
            fields["upto"] = self.upto
        if op is ControlOp.CLEAR:
            fields["freed"] = cache.freed
        if op is ControlOp.RESUME:
            fields["layout"] = self.layout
            if cache.cpu_kept is not None:
                fields["cpu_kept"] = cache.cpu_kept
        if self.stats is not None:
            fields["stats"] = self.stats()  # fresh counters: status is exact right after a pause
        self.counters["acks"] += 1
        # Acked first: whoever learns of this ack (the broker, then the client whose pause it ends)
        # finds this rank's own state already paused, as a submitter beside it reads it.
        return [Acked(op, self.epoch), ToBroker(Ack(epoch=self.epoch, op=op, **fields).to_wire())]

    # --- executor events -----------------------------------------------------------

    def on_finished(self, seq: int, n: int, outcome: RankOutcome, nbytes: int, gen: int) -> list[RankAction]:
        self.inflight -= 1
        self.counters["tasks_" + outcome] += 1
        out: list[RankAction] = [
            ToBroker(Done(seq=seq, n=n, outcome=outcome, gen=gen, bytes=nbytes).to_wire(), done=True)
        ]
        return out + self._maybe_ack()

    def on_cache_done(self, freed: int = 0, error: str = "", cpu_kept: bool | None = None) -> list[RankAction]:
        """The executor finished a FreeCache / AllocateCache.  A failed
        allocation leaves no cache (tasks are refused) and fails the resume
        with its reason; the next resume tries again."""
        if error:
            self.counters["alloc_failed"] += 1
        self.cache.done(freed, error, cpu_kept)
        return self._maybe_ack()

    # --- clock ---------------------------------------------------------------------

    def on_tick(self, now: float) -> list[RankAction]:
        reg = self.registration
        if reg.phase is RankPhase.JOINING:
            return self._repeat_ready(now) if reg.ready_due(now) else []
        if reg.broker_silent(now):
            self.counters["broker_silent"] += 1  # the broker will declare us dead, or has: a new registration
            return self._restart(now)
        if reg.heartbeat_due(now):
            reg.last_heartbeat_sent = now
            return [ToBroker(Heartbeat(inflight=self.inflight, stats=self.stats() if self.stats else {}).to_wire())]
        return []

    def next_deadline(self, now: float) -> float:
        return self.registration.next_deadline(now)
