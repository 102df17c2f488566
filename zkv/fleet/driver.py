"""The thin concurrent driver of a fleet operation: one thread per bus, each
with that bus's own ``Client`` (a client is not thread-safe; a bus's client
is used by one thread at a time), one monotonic deadline shared by all, and
every wait bounded by what is left of it.  What to do next is asked of the
sans-IO ``FleetOp`` (``decision.py``).

A bus that does not answer in time is never waited on past the deadline,
and its client is closed then (linger 0): a request still queued towards a
broker that is down is dropped, never delivered to it when it comes back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence, TypeVar

import zmq

from ..client.client import BROKER_WORD_S, Client
from ..net.endpoints import certainly_absent
from ..wire import bounds
from ..wire.errors import ZkvError
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


class BusLink:
    """One bus of a fleet and its client, made on first use and kept between operations."""

    def __init__(self, spec: BusSpec):
        self.spec = spec
        self._client: Client | None = None
        self._lock = threading.Lock()
        self.closed = False

    def _checkout(self, timeout: float) -> Client:
        with self._lock:
            client, self._client = self._client, None
        if client is None:
            curve = self.spec.curve()
            ctx = _context(self.spec.curve_ranks if curve is not None else None)
            if curve is None:
                client = Client(self.spec.broker, reply_to=RESULT_BIND, ctx=ctx, request_timeout=timeout)
            else:
                with _contexts_lock:  # a context's shared ZAP handler is set up by its first Curve client
                    client = Client(
                        self.spec.broker, reply_to=RESULT_BIND, ctx=ctx, request_timeout=timeout, curve=curve
                    )
        return client

    def _checkin(self, client: Client) -> None:
        with self._lock:
            if self._client is None and not self.closed:
                self._client = client
                return
        client.close()

    def ask(self, kind: str, fields: dict[str, Any], deadline: float, t0: float) -> BusAnswer:
        """Send one request and wait for its reply until ``deadline`` at most."""
        at = lambda: (time.monotonic() - t0) * 1000  # noqa: E731
        left = deadline - time.monotonic()
        if left <= 0:
            return BusAnswer(Answer.NO_REPLY, at(), "no_reply", "no time was left before the deadline")
        why = certainly_absent(self.spec.broker, timeout=min(PROBE_S, left))
        if why is not None:
            return BusAnswer(Answer.UNREACHABLE, at(), "unreachable", f"no broker answers at {self.spec.broker}: {why}")
        try:
            client = self._checkout(left)
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
            if err.code in ("no_reply", "unreachable"):
                client.close()  # drops what is still queued to it (linger 0)
                answer = Answer.NO_REPLY if err.code == "no_reply" else Answer.UNREACHABLE
                return BusAnswer(answer, at(), err.code, err.reason)
            self._checkin(client)
            return BusAnswer(Answer.ERROR, at(), err.code, err.reason)
        except zmq.ZMQError as err:
            client.close()
            return BusAnswer(Answer.UNREACHABLE, at(), "unreachable", f"socket error: {err}")
        self._checkin(client)
        return BusAnswer(Answer.NOOP if reply.get("noop") else Answer.OK, at(), reply=reply)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


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
    once every bus is done (or, should a thread outlive every bound, at the
    last deadline: the report then names what is missing)."""
    cond = threading.Condition()
    last = deadline + rollback_s + JOIN_GRACE_S

    def bus(link: BusLink) -> None:
        name = link.spec.name
        answer = _ask(link, fleet_op.op, fields, deadline, t0)
        with cond:
            fleet_op.answered(name, answer)
            cond.notify_all()
            while (step := fleet_op.step(name)) is Step.WAIT:
                if not cond.wait(max(0.0, last - time.monotonic())):
                    return
        if step is Step.ROLLBACK:
            back = _ask(link, "resume", {}, time.monotonic() + rollback_s, t0)
            with cond:
                fleet_op.rolled_back(name, back)

    threads = [threading.Thread(target=bus, args=(link,), name=f"zkv-fleet-{link.spec.name}") for link in links]
    for t in threads:
        t.daemon = True
        t.start()
    for t in threads:
        t.join(max(0.0, last - time.monotonic()))
    with cond:
        return finish(fleet_op)


def _ask(link: BusLink, kind: str, fields: dict[str, Any], deadline: float, t0: float) -> BusAnswer:
    """``link.ask``, with a bug in it reported as that bus's answer instead of a thread dying silently."""
    try:
        return link.ask(kind, fields, deadline, t0)
    except Exception as err:  # noqa: BLE001 - the fleet's report must name it
        log.exception("fleet %s on bus %s", kind, link.spec.name)
        return BusAnswer(Answer.ERROR, (time.monotonic() - t0) * 1000, "internal", f"{type(err).__name__}: {err}")
