"""The Python client: submit swap tasks, collect one outcome per task, and
drive pause / clear / resume.

It owns a DEALER to the broker's frontend and a PULL socket that ranks push
results to (its address travels in every task as ``reply_to``).  It is
single-threaded: every wait is one ``zmq.Poller`` over both sockets with a
timeout, and every message that arrives while waiting for something else is
filed, never dropped.
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import time
import uuid
from pathlib import Path
from typing import Any, Sequence, TypeVar

import zmq

from ..net.curve import RESULTS_DOMAIN, Curve
from ..net.endpoints import Endpoints, certainly_absent, make_socket, runtime_dir
from ..net.frames import ready_messages, send_message
from ..net.handshakes import HandshakeProbe, mismatch_reason
from ..net.reply_address import advertised, default_bind
from ..wire import bounds
from ..wire import fast as F
from ..wire import protocol as P
from ..wire import sockets as S
from ..wire.errors import ZkvError
from ..wire.messages import MESSAGES, Error, OutcomeMsg, Reply, Result, Submit
from ..wire.outcome import TaskOutcome
from ..wire.replies import Answer, CancelReply, ControlReply, PingReply, StatusReply, typed
from ..wire.vocab import ControlOp
from .results import ResultBook

# one decoder per socket, of the kinds it receives (wire/sockets.py)
_decode_broker = F.decoder(S.CLIENT_DEALER)
_decode_result = F.decoder(S.CLIENT_PULL)
# A task's timeout travels as its submit ``timeout_ms``: the broker ends it
# ``timeout`` (``ran: false``) if it is still queued then.  The client's own
# deadline is this much later, so that the broker's word (did it run?) comes first.
BROKER_WORD_S = 0.25
# A request not answered this soon, by a client never answered yet, starts a probe of the
# broker's handshake beside its wait (``HandshakeProbe``): one refused for security the two ends
# do not share (no reply would ever come) fails the request at once.
PROBE_AFTER_S = 0.2
_A = TypeVar("_A", PingReply, CancelReply, StatusReply, ControlReply)


def deadline_ms(timeout: float) -> int:
    """A caller's timeout as a submit's ``timeout_ms``: at least 1 (0 means
    none), at most the bound every peer checks (docs/protocol.md §2.1)."""
    if not math.isfinite(timeout) or timeout * 1000 >= bounds.MAX_TIMEOUT_MS:
        return bounds.MAX_TIMEOUT_MS
    return max(1, int(timeout * 1000))


CLIENT_PREFIX = "client-"  # a client's result socket in the runtime directory: client-<pid>-<random>.sock


def remove_dead_clients(directory: Path) -> list[Path]:
    """Remove the result sockets of clients whose process is gone (killed, or ended
    without ``close()``): their pid names no live process and nothing listens on
    them.  Returns what was removed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    removed = []
    for name in names:
        pid = name[len(CLIENT_PREFIX) :].partition("-")[0]
        if not name.startswith(CLIENT_PREFIX) or not name.endswith(".sock") or not pid.isdigit():
            continue
        path = directory / name
        if not _alive(int(pid)) and certainly_absent(f"ipc://{path}") is not None:
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


class Client:
    """A connection to one broker.  Not thread-safe: one client per thread.

    ``reply_to`` is where the result PULL binds (default: ``ZKV_RESULT_ADDR``,
    else the address routing to a tcp broker, else a private ipc path);
    ``advertise`` (``ZKV_RESULT_ADVERTISE``) is the address ranks are told to
    push to when it is not the bound one (NAT, a 0.0.0.0 bind)."""

    def __init__(
        self,
        broker: str | None = None,
        *,
        reply_to: str | None = None,
        advertise: str | None = None,
        ctx: zmq.Context | None = None,
        request_timeout: float = 30.0,
        curve: Curve | None = None,
    ):
        self.broker = broker or Endpoints.default().frontend
        self.ctx = ctx or zmq.Context.instance()
        self.request_timeout = request_timeout
        self.dealer = make_socket(self.ctx, zmq.DEALER)
        # A DEALER with no usable peer (broker down, handshake refused) blocks
        # on send: bound it, like every other wait.
        self.dealer.setsockopt(zmq.SNDTIMEO, int(min(request_timeout, 5.0) * 1000))
        self.pull = make_socket(self.ctx, zmq.PULL)
        self.auth = None
        self._reply_key: str | None = None
        self._ipc_path: Path | None = None
        self._curve = curve
        self._answered = False  # a reply came, or a probe's handshake ended: no probe is needed any more
        self._probe: HandshakeProbe | None = None
        self._refused = ""  # why the broker refused a probe's handshake (a security mismatch)
        self.closed = False
        try:
            if curve is not None:
                # Our PULL is a Curve server that lets in only authorized ranks.
                curve.make_client(self.dealer)
                self.auth = curve.start_authenticator(self.ctx, curve.results_domains())
                curve.make_server(self.pull, RESULTS_DOMAIN)
                self._reply_key = curve.public_key()
            self.dealer.connect(self.broker)
            if reply_to is None:
                reply_to = default_bind(self.broker)  # reachable from the ranks' hosts (reply_address.py)
            if reply_to is None:
                remove_dead_clients(runtime_dir())
                self._ipc_path = runtime_dir() / f"{CLIENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
                reply_to = f"ipc://{self._ipc_path}"
            self.pull.bind(reply_to)
            self.reply_to = advertised(self.pull.getsockopt_string(zmq.LAST_ENDPOINT), self.broker, advertise)
            self.poller = zmq.Poller()
            self.poller.register(self.dealer, zmq.POLLIN)
            self.poller.register(self.pull, zmq.POLLIN)
            self.book = ResultBook()
            self.finished: dict[int, TaskOutcome] = {}
            self.replies: dict[int, Reply | Error] = {}
            # Task ids start at a random point: results carry only the id, and a
            # restarted client on a fixed result address (ZKV_RESULT_ADDR) must not
            # take its predecessor's late results for its own tasks.
            self._task_ids = itertools.count(secrets.randbelow(2**40) + 1)
            self._req_ids = itertools.count(1)
        except BaseException:  # a failed bind (address in use) keeps no socket, no hold on the ZAP handler
            self.close()
            raise

    # --- tasks ---------------------------------------------------------------------

    def submit(
        self,
        op: str,
        src: Sequence[int] | bytes | None = None,
        dst: Sequence[int] | bytes | None = None,
        timeout: float = 30.0,
        *,
        tier: str | None = None,
        seed: int | None = None,
        task: int | None = None,
        keys: Sequence[bytes] | None = None,
        ns: str | None = None,
    ) -> int:
        """Send one task to every rank; return its id.  The outcome comes from wait/poll.
        ``task``: an id of the caller's (see ``submit_raw``).  ``keys`` and ``ns``: a
        ``put`` or ``get``'s names in the keyed store, one per CPU row (docs/protocol.md §6.4)."""
        extra: dict[str, Any] = {}
        if tier is not None:
            extra["tier"] = tier
        if seed is not None:
            extra["seed"] = seed
        if keys is not None:
            extra["keys"] = P.pack_keys(keys)
        if ns is not None:
            extra["ns"] = ns
        return self.submit_raw(P.encode_body(op, src, dst, **extra), timeout, task=task)

    def submit_raw(self, body: bytes, timeout: float = 30.0, *, task: int | None = None) -> int:
        """Submit an already encoded body (for tools and tests of bad input).
        ``timeout`` is the task's deadline at the broker too: still queued
        then, it ends ``timeout`` and never runs (``TaskOutcome.ran`` is False).
        ``task``: an id the caller chose (an engine whose other processes must
        name the same task: vLLM's job ids), unique among this client's tasks
        and a positive safe integer; default: the client's own counter."""
        if task is None:
            task = next(self._task_ids)
        elif type(task) is not int or not 0 < task <= bounds.MAX_SAFE_INT or task in self.book.open:
            raise ValueError(f"task id {task!r}: a positive int up to {bounds.MAX_SAFE_INT}, not one already open")
        self.book.add(task, time.monotonic(), timeout + BROKER_WORD_S)
        header = Submit(
            task=task,
            reply_to=self.reply_to,
            timeout_ms=deadline_ms(timeout),
            reply_key=self._reply_key,
            batch_results=True,  # _drain_results reads every frame of a message
        ).to_wire()
        try:
            self._send([header, body])
        except ZkvError:
            self.book.open.pop(task, None)  # never sent: not a task
            raise
        return task

    def wait(self, task: int, timeout: float | None = None) -> TaskOutcome:
        """The outcome of ``task``.  Always returns: a ``timeout`` given here
        shortens the task's deadline, and a task past its deadline ends ``timeout``."""
        if task not in self.finished:
            if task not in self.book.open:
                raise KeyError(f"task {task} is unknown or its outcome was already returned")
            if timeout is not None:
                self.book.shorten(task, time.monotonic() + timeout)
        while task not in self.finished:
            self._pump(max(0.0, self.book.open[task].deadline - time.monotonic()))
        return self.finished.pop(task)

    def poll(self, timeout: float = 0.0) -> list[TaskOutcome]:
        """Outcomes finished since the last call, waiting up to ``timeout`` for the first."""
        deadline = time.monotonic() + timeout
        self._pump(0.0)
        while not self.finished and time.monotonic() < deadline:
            self._pump(max(0.0, deadline - time.monotonic()))
        done = list(self.finished.values())
        self.finished.clear()
        return done

    def run(
        self,
        op: str,
        src: Sequence[int] | None = None,
        dst: Sequence[int] | None = None,
        timeout: float = 30.0,
        **extra: Any,
    ) -> TaskOutcome:
        """Submit and wait: the one-call form for scripts and the CLI."""
        return self.wait(self.submit(op, src, dst, timeout, **extra))

    def cancel(self, task: int, timeout: float | None = None) -> CancelReply:
        """Cancel ``task`` if the broker has not dispatched it yet: the reply's
        ``cancelled`` says whether it was in time and ``state`` what the task
        was (``queued``, ``dispatched``, ``done``, ``unknown``).  A cancelled
        task's outcome (``cancelled``, never ran) is filed before this returns;
        a dispatched one runs to its own outcome (docs/protocol.md §7.6)."""
        return self._ask(CancelReply, timeout, task=task)

    def settled(self, timeout: float = 0.0) -> list[int]:
        """Tasks that ended before every rank reported (a timeout, a rank that
        died, a generation move) and have since settled (every missing rank
        reported late, or the broker said they never ran), so nothing will
        write their destination blocks any more.  Waits up to ``timeout``
        for the first one; outcomes that arrive meanwhile are kept for wait/poll."""
        deadline = time.monotonic() + timeout
        self._pump(0.0)
        while not self.book.settled and time.monotonic() < deadline:
            self._pump(max(0.0, deadline - time.monotonic()))
        return self.book.take_settled()

    @property
    def open_tasks(self) -> int:
        return len(self.book.open)

    # --- requests ------------------------------------------------------------------

    def request(self, kind: str, timeout: float | None = None, **fields: Any) -> Answer:
        """Send a control/status request and wait for its reply (bounded): the
        typed answer of its op (wire/replies.py; an op's results are its own,
        docs/protocol.md §4)."""
        return self.await_reply(self.send_request(kind, **fields), timeout, kind)

    def _ask(self, cls: type[_A], timeout: float | None, op: str = "", **fields: Any) -> _A:
        """``request`` for ``op`` (by default the one ``cls`` answers), whose answer is a ``cls``."""
        answer = self.request(op or cls.OP, timeout, **fields)
        assert isinstance(answer, cls), answer
        return answer

    def send_request(self, kind: str, **fields: Any) -> int:
        """Send a request without waiting; returns its ``req`` for await_reply."""
        req = next(self._req_ids)
        self._send([MESSAGES[kind](req=req, **fields).to_wire()])
        return req

    def _send(self, frames: list[bytes]) -> None:
        """Send one message; a DEALER with no connection the broker accepted would block
        (bounded by SNDTIMEO): a broker that refused our handshake for security we do not
        share is told at once (a probe of its own), before that wait."""
        try:
            send_message(self.dealer, frames)
            return
        except zmq.Again:
            pass
        if not self._answered:
            from ..net.curve import security_mismatch

            why = security_mismatch(self.broker, self._curve, timeout=1.0)
            if why is not None:
                raise ZkvError("unreachable", f"{self.broker} refused this client's handshake: {why}")
        try:
            send_message(self.dealer, frames, block=True)  # bounded by SNDTIMEO
        except zmq.Again:
            raise ZkvError(
                "unreachable",
                f"cannot send to {self.broker}: no connection the broker accepted; is it running "
                f"(and are the CurveZMQ keys right)?",
            ) from None

    def await_reply(self, req: int, timeout: float | None = None, what: str = "request") -> Answer:
        """The reply to ``req``; raises ZkvError on an error reply or none in time.
        Task results that arrive meanwhile are filed for wait/poll."""
        timeout = self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        probe_at = time.monotonic() + PROBE_AFTER_S
        while req not in self.replies:
            if self._refused:
                raise ZkvError("unreachable", f"{self.broker} refused this client's handshake: {self._refused}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise ZkvError(
                    "no_reply", f"no reply to {what} from {self.broker} within {timeout:.3g} s; is the broker running?"
                )
            if self._probe is None and not self._answered and time.monotonic() >= probe_at:
                self._start_probe()
            wait = left if self._probe is not None or self._answered else min(left, probe_at - time.monotonic())
            self._pump(max(0.0, wait))
        self._answered = True
        self._end_probe()
        reply = self.replies.pop(req)
        if isinstance(reply, Error):
            raise ZkvError(reply.code, reply.reason)
        return typed(reply)

    def take_reply(self, req: int) -> Answer | None:
        """The reply to ``req`` (sent with ``send_request``) if it has come, without
        waiting: None when not yet; raises ZkvError on an error reply."""
        self._pump(0.0)
        if req not in self.replies:
            return None
        return self.await_reply(req, 0.0)

    def _control(self, op: ControlOp, timeout: float, **fields: Any) -> ControlReply:
        timeout_ms = min(int(timeout * 1000), bounds.MAX_TIMEOUT_MS)
        return self._ask(ControlReply, timeout + 1, op, timeout_ms=timeout_ms, **fields)

    def pause(self, timeout: float = 30.0) -> ControlReply:
        return self._control(ControlOp.PAUSE, timeout)

    def clear(self, keep_cpu: bool = False, timeout: float = 30.0, weights: str | None = None) -> ControlReply:
        """Free the caches (``keep_cpu``: all but the CPU tier).  ``weights``: a name for the
        weights the engines serve after a clear without ``keep_cpu`` (a trainer's version),
        which ``status`` says until the next such clear: engines of one identity cleared under
        one name go on sharing what they store (docs/protocol.md §8.2)."""
        fields: dict[str, Any] = {"keep_cpu": keep_cpu}
        if weights is not None:
            fields["weights"] = weights
        reply = self._control(ControlOp.CLEAR, timeout, **fields)
        reason = "caches were cleared (zkv clear) before the task's result arrived"
        for out in self.book.cleared(reply.gen, reason, time.monotonic(), reply.cpu_gen):
            self.finished[out.task] = out
        return reply

    def resume(self, layout: dict | None = None, timeout: float = 30.0) -> ControlReply:
        fields: dict[str, Any] = {}
        if layout:
            fields["layout"] = layout
        reply = self._control(ControlOp.RESUME, timeout, **fields)
        self.book.gen_known = True  # our own resume named it: news even to a client that knew none
        self._on_new_gen(reply.gen, "caches were cleared before the task's result arrived", reply.cpu_gen)
        return reply

    def status(self, timeout: float | None = None, wait_ranks: int = 0) -> StatusReply:
        """Broker status; with ``wait_ranks`` the reply waits until that many ranks are up.
        A generation newer than the client's ends its open tasks that ran at an
        older one (``gen_reason`` says why)."""
        if wait_ranks:
            t = self.request_timeout if timeout is None else timeout
            reply = self._ask(
                StatusReply, t + 1, wait_ranks=wait_ranks, timeout_ms=min(int(t * 1000), bounds.MAX_TIMEOUT_MS)
            )
        else:
            reply = self._ask(StatusReply, timeout)
        reason = reply.gen_reason or "the bus moved to a new cache generation"
        self._on_new_gen(reply.gen, reason, reply.cpu_gen)
        return reply

    @property
    def gen(self) -> int | None:
        """The cache generation this client last learned (clear, resume, status,
        results, outcomes); None until it heard of one."""
        return self.book.gen if self.book.gen_known else None

    @property
    def cpu_gen(self) -> int | None:
        """The CPU tier's generation this client last learned (docs/protocol.md
        §8.2): CPU blocks it swapped out at this one are still there.  None
        until it heard of one, and after a generation move heard without one."""
        return self.book.cpu_gen

    def ping(self, timeout: float | None = None) -> PingReply:
        return self._ask(PingReply, timeout)

    def adopt_gen(self, gen: int, reason: str) -> None:
        """Take a generation another part of the application learned (e.g. its
        controller's clear): open tasks that ran at an older generation end
        ``cancelled``; the others end with what their own results say (§7.4)."""
        self._on_new_gen(gen, reason)

    def _on_new_gen(self, gen: int, reason: str, cpu_gen: int | None = None) -> None:
        for out in self.book.learn_gen(gen, reason, time.monotonic(), cpu_gen):
            self.finished[out.task] = out

    # --- the one wait ------------------------------------------------------------

    def _start_probe(self) -> None:
        """Probe the broker's handshake beside the wait (the DEALER's monitor is its owners')."""
        self._probe = HandshakeProbe(self.ctx, self.broker, self._curve)
        self.poller.register(self._probe.socket, zmq.POLLIN)

    def _on_probe(self) -> None:
        assert self._probe is not None
        verdict = self._probe.read()
        if verdict is None:
            return
        if verdict.mismatch:
            self._refused = mismatch_reason(self._curve is not None)
        self._answered = True  # matched, or failed another way (a refused key is silence): one probe told it
        self._end_probe()

    def _end_probe(self) -> None:
        if self._probe is not None:
            self.poller.unregister(self._probe.socket)
            self._probe.close()
            self._probe = None

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for traffic, file all of it, expire deadlines."""
        due = self.book.next_deadline()
        if due is not None:
            timeout = min(timeout, due - time.monotonic())
        timeout = max(0.0, timeout)  # zmq reads a negative timeout as "forever"
        events = dict(self.poller.poll(int(timeout * 1000)))  # whole ms, as pyzmq would
        if self._probe is not None and self._probe.socket in events:
            self._on_probe()
        now = time.monotonic()
        if self.pull in events:
            self._drain_results()
        if self.dealer in events:
            self._drain_broker()
        for out in self.book.expire(now):
            self.finished[out.task] = out
        if self.book.moved:
            for out in self.book.moved:
                self.finished[out.task] = out
            self.book.moved.clear()

    def _drain_broker(self) -> None:
        """Every message queued on the DEALER: outcomes, replies and errors, one frame each."""
        for frames in ready_messages(self.dealer, 4096):
            try:
                self._on_dealer(_decode_broker(frames[0]))
            except P.ProtocolError:
                self.book.counters["bad_messages"] += 1

    def _drain_results(self) -> None:
        """Every result queued on the PULL: a message is one ``result`` frame, or up to
        ``MAX_BATCH`` of them from one rank (docs/protocol.md §10.3); each frame is
        decoded on its own, and a message of more frames is counted and dropped whole."""
        counters = self.book.counters
        for frames in ready_messages(self.pull, 4096):
            if len(frames) > bounds.MAX_BATCH:
                counters["bad_messages"] += 1
                continue
            for frame in frames:
                try:
                    self._on_pull(_decode_result(frame))
                except P.ProtocolError:
                    counters["bad_messages"] += 1

    def _on_pull(self, msg: Result) -> None:  # the PULL's decoder lets through results only
        out = self.book.on_result(msg, time.monotonic())
        if out is not None:
            self.finished[out.task] = out

    def _on_dealer(self, msg: Reply | Error | OutcomeMsg) -> None:
        if isinstance(msg, OutcomeMsg):
            out = self.book.on_outcome(msg.task, msg.outcome, msg.reason, time.monotonic(), msg.gen, msg.ran)
            if out is not None:
                self.finished[out.task] = out
        elif isinstance(msg, (Reply, Error)) and msg.req is not None:
            self.replies[msg.req] = msg
        elif isinstance(msg, Error) and msg.task is not None:
            self.book.counters["task_errors"] += 1
        else:
            self.book.counters["bad_messages"] += 1

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._end_probe()
        self.dealer.close(linger=0)
        self.pull.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        if self._ipc_path is not None:
            self._ipc_path.unlink(missing_ok=True)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
