"""The thin concurrent driver of a fleet operation: one thread per bus, kept
for the fleet's life, that alone owns that bus's ``Client`` (a client is not
thread-safe), one monotonic deadline shared by all buses, and every wait
bounded by what is left of it.  What to do next is asked of the sans-IO
``FleetOp`` (``decision.py``).

The threads are started once: a thread start costs more than a pause's
round trip on a loaded machine, and a fleet pause must cost about what the
slowest bus's pause does.  A bus that does not answer in time is never
waited on past the deadline, and its client is closed then (linger 0): a
request still queued towards a broker that is down is dropped, never
delivered to it when it comes back.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

import zmq

from ..client.client import BROKER_WORD_S, Client
from ..net.endpoints import certainly_absent
from ..wire import bounds
from ..wire.errors import ZkvError
from ..wire.replies import ControlReply, StatusReply
from ..wire.vocab import ControlOp
from .decision import Answer, BusAnswer, FleetOp, Step
from .spec import BusSpec

PROBE_S = 0.5  # the most a look for a listening broker may take (a TCP connect to a silent host)
JOIN_GRACE_S = 2.0  # beyond every bounded wait: making a client, a probe
# A fleet client submits no tasks: its result socket binds on loopback, whatever ZKV_RESULT_ADDR says
# (one fixed address cannot be bound by every bus's client).
RESULT_BIND = "tcp://127.0.0.1:*"

log = logging.getLogger("zkv.fleet")
T = TypeVar("T")

_contexts: dict[str | None, zmq.Context] = {}
_contexts_lock = threading.Lock()


def _context(ranks_dir: str | None) -> zmq.Context:
    """One ZMQ context per directory of rank keys: a context has one ZAP
    handler, which authorizes one directory for a client's result socket
    (``net/curve.py``).  Kept for the process, like that handler."""
    with _contexts_lock:
        if ranks_dir is None:
            return zmq.Context.instance()
        ctx = _contexts.get(ranks_dir)
        if ctx is None:
            ctx = _contexts[ranks_dir] = zmq.Context()
        return ctx


_NOBLOCK = int(zmq.NOBLOCK)
_DOWN = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class BusLink:
    """One bus of a fleet: its thread, and its client (made on first use,
    kept between operations, touched only by that thread).

    Before a request the link looks for a listening broker (``certainly_absent``)
    unless its connection is known to be up: the last request was answered
    and the socket's monitor has not seen it drop since.  So a broker that
    died is reported unreachable at once, and a healthy bus costs no probe."""

    def __init__(self, spec: BusSpec):
        self.spec = spec
        self._client: Client | None = None
        self._monitor: zmq.Socket | None = None
        self._up = False
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on this bus's thread (started on first use)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"zkv-fleet-{self.spec.name}", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()
        self._drop()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread once its queued work is done; it closes the client (a link
        whose ``ask`` was called from one thread of the caller's: closed here)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout)
            self._thread = None
        else:
            self._drop()

    def _drop(self) -> None:
        self._up = False
        if self._client is not None:
            if self._monitor is not None:
                self._client.dealer.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._client.close()
            self._client = None

    def _connected(self, timeout: float) -> Client:
        if self._client is None:
            curve = self.spec.curve()
            ctx = _context(self.spec.curve_ranks if curve is not None else None)
            self._client = Client(self.spec.broker, reply_to=RESULT_BIND, ctx=ctx, request_timeout=timeout, curve=curve)
            self._monitor = self._client.dealer.get_monitor_socket(_DOWN)
        return self._client

    def _still_up(self) -> bool:
        """The connection answered last time and has not dropped since (drains the monitor)."""
        monitor = self._monitor
        while monitor is not None and monitor.poll(0):
            frames = monitor.recv_multipart(_NOBLOCK)
            if int.from_bytes(frames[0][:2], "little") & _DOWN:
                self._up = False
        return self._up

    def ask(self, kind: str, fields: dict[str, Any], deadline: float, t0: float) -> BusAnswer:
        """Send one request and wait for its reply until ``deadline`` at most (on this bus's thread)."""
        at = lambda: (time.monotonic() - t0) * 1000  # noqa: E731
        left = deadline - time.monotonic()
        if left <= 0:
            return BusAnswer(Answer.NO_REPLY, at(), "no_reply", "no time was left before the deadline")
        if not self._still_up():
            why = certainly_absent(self.spec.broker, timeout=min(PROBE_S, left))
            if why is not None:
                self._drop()
                reason = f"no broker answers at {self.spec.broker}: {why}"
                return BusAnswer(Answer.UNREACHABLE, at(), "unreachable", reason)
        try:
            client = self._connected(left)
        except (ValueError, OSError, zmq.ZMQError) as err:  # a key file that cannot be read, an address in use
            return BusAnswer(Answer.UNREACHABLE, at(), "unreachable", f"cannot make a client for it: {err}")
        left = deadline - time.monotonic()
        extra = dict(fields)
        if kind != "status" or fields.get("wait_ranks"):
            # The broker's own deadline comes first, so that its word (which ranks lag) arrives before ours.
            word = min(BROKER_WORD_S, left / 4)
            extra["timeout_ms"] = max(1, min(int((left - word) * 1000), bounds.MAX_TIMEOUT_MS))
        client.dealer.setsockopt(zmq.SNDTIMEO, max(1, int(min(left, 5.0) * 1000)))
        try:
            reply = client.request(kind, max(0.0, deadline - time.monotonic()), **extra)
        except ZkvError as err:
            if err.code not in ("no_reply", "unreachable"):
                self._up = True
                return BusAnswer(Answer.ERROR, at(), err.code, err.reason)
            self._drop()  # drops what is still queued to it (linger 0)
            answer = Answer.NO_REPLY if err.code == "no_reply" else Answer.UNREACHABLE
            reason = err.reason
            if answer is Answer.NO_REPLY and self.spec.curve() is not None:
                reason += (
                    " (with Curve, a broker that refuses the handshake never answers: check that curve_server is "
                    "this broker's public key and that the client's key is in its --curve-clients)"
                )
            return BusAnswer(answer, at(), err.code, reason)
        except zmq.ZMQError as err:
            self._drop()
            return BusAnswer(Answer.UNREACHABLE, at(), "unreachable", f"socket error: {err}")
        self._up = True
        assert isinstance(reply, (ControlReply, StatusReply)), reply
        noop = isinstance(reply, ControlReply) and reply.noop
        return BusAnswer(Answer.NOOP if noop else Answer.OK, at(), reply=reply)


def run(
    links: Sequence[BusLink],
    fleet_op: FleetOp,
    fields: dict[str, Any],
    deadline: float,
    rollback_s: float,
    t0: float,
    finish: Callable[[FleetOp], T],
) -> T:
    """Run ``fleet_op`` on every link at once and return ``finish(fleet_op)``
    once it is settled (or, should a bus's thread outlive every bound, at the
    last deadline: the report then names what is missing).

    Nothing waits on the others: each answer is handed to ``fleet_op`` as it
    comes, and a rollback it calls for is queued on that bus's thread at once
    (a bus that acked is resumed as soon as another failed)."""
    cond = threading.Condition()
    by_name = {link.spec.name: link for link in links}
    started: set[str] = set()
    over = False
    last = deadline + rollback_s + 2 * JOIN_GRACE_S

    def roll_back_what_is_due() -> None:  # under cond
        for name in fleet_op.names:
            if not over and name not in started and fleet_op.step(name) is Step.ROLLBACK:
                started.add(name)
                by_name[name].submit(lambda name=name: rollback(name))  # type: ignore[misc]

    def forward(name: str) -> None:
        answer = _ask(by_name[name], fleet_op.op, fields, deadline, t0)
        with cond:
            if name in fleet_op.answers:
                return  # a straggler: the deadline already named it
            fleet_op.answered(name, answer)
            roll_back_what_is_due()
            cond.notify_all()

    def rollback(name: str) -> None:
        back = _ask(by_name[name], ControlOp.RESUME, {}, time.monotonic() + rollback_s, t0)
        with cond:
            fleet_op.rolled_back(name, back)
            cond.notify_all()

    for link in links:
        link.submit(lambda name=link.spec.name: forward(name))  # type: ignore[misc]
    with cond:
        cond.wait_for(lambda: fleet_op.all_answered, max(0.0, deadline + JOIN_GRACE_S - time.monotonic()))
        for name in fleet_op.names:  # a bus whose thread is still busy past every bound: no answer, in time
            if name not in fleet_op.answers:
                why = "no answer before the fleet's deadline (its thread was still busy)"
                fleet_op.answered(name, BusAnswer(Answer.NO_REPLY, (time.monotonic() - t0) * 1000, "no_reply", why))
        roll_back_what_is_due()
        cond.wait_for(lambda: fleet_op.settled, max(0.0, last - time.monotonic()))
        over = True  # a straggler's answer after this starts nothing
        return finish(fleet_op)


def _ask(link: BusLink, kind: str, fields: dict[str, Any], deadline: float, t0: float) -> BusAnswer:
    """``link.ask``, with a bug in it reported as that bus's answer instead of a thread dying silently."""
    try:
        return link.ask(kind, fields, deadline, t0)
    except Exception as err:  # noqa: BLE001 - the fleet's report must name it
        log.exception("fleet %s on bus %s", kind, link.spec.name)
        return BusAnswer(Answer.ERROR, (time.monotonic() - t0) * 1000, "internal", f"{type(err).__name__}: {err}")
