"""The broker's I/O loop: three sockets around :class:`BrokerCore`.

It drains every ready message per wakeup (measured ~25% more throughput
than one per wakeup), hands frames to the core, and performs the actions.
The poll timeout is the core's next deadline, so an idle broker sleeps in
``zmq_poll`` instead of spinning, and never misses a heartbeat or timeout.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import zmq

from ..net.curve import CLIENTS_DOMAIN, RANKS_DOMAIN, Curve
from ..net.endpoints import Endpoints, StopSignal, check_bind_address, make_socket
from ..net.frames import Coalescer, raw_send, ready_messages, send_message
from ..obs.book import BusBook
from ..wire import bounds
from .core import BrokerConfig, BrokerCore, Publish, Record, SaveState, ToClient, ToRank
from .owner_lock import OwnerLock, ipc_directories
from .state_file import StateFile, default_state_path

log = logging.getLogger("zkv.broker")
_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: zmq.Flag arithmetic costs a microsecond a send

_DRAIN_BATCH = 512  # messages per socket per wakeup, so one side cannot starve the other


class Broker:
    """Bind the frontend, backend and control sockets and serve until stopped."""

    def __init__(
        self,
        endpoints: Endpoints,
        config: BrokerConfig | None = None,
        *,
        ctx: zmq.Context | None = None,
        recorder: Callable[[dict], None] | None = None,
        allow_remote: bool = False,
        curve: Curve | None = None,
        state_file: str | Path | None = None,
        book: BusBook | None = None,
    ):
        self.endpoints = endpoints
        addresses = (endpoints.frontend, endpoints.backend, endpoints.control)
        for address in addresses:
            check_bind_address(address, allow_remote, secure=curve is not None)
        # The durable control state (state_file.py): a restart keeps what a
        # client set.  Default: next to an ipc:// frontend; tcp needs --state-file.
        path = Path(state_file) if state_file else default_state_path(endpoints.frontend)
        self.owner = OwnerLock(ipc_directories(addresses, path))  # before any file there is touched
        try:
            self._open(endpoints, config, recorder, ctx, curve, path, book)
        except BaseException:
            self.owner.release()
            raise

    def _open(
        self,
        endpoints: Endpoints,
        config: BrokerConfig | None,
        recorder: Callable[[dict], None] | None,
        ctx: zmq.Context | None,
        curve: Curve | None,
        path: Path | None,
        book: BusBook | None,
    ) -> None:
        """Load the state and bind, as the holder of this place's owner lock."""
        self.state_file = StateFile(path) if path is not None else None
        if self.state_file is None:
            log.warning("no broker state file (tcp frontend without --state-file): a restart starts the bus running")
        restore = self.state_file.load() if self.state_file is not None else None
        world = (config or BrokerConfig()).world
        if restore is not None and restore["world"] != world:  # another bus: start afresh, say so
            log.warning("ignoring %s: it is for world size %s, this broker has %s", path, restore["world"], world)
            restore = None
        self.core = BrokerCore(config, recording=recorder is not None, restore=restore, book=book)
        self.counts = self.core.book.events  # what this loop counts, beside the core
        self.recorder = recorder
        self.ctx = ctx or zmq.Context.instance()
        self.auth = curve.start_authenticator(self.ctx, curve.broker_domains()) if curve is not None else None
        self.frontend = make_socket(self.ctx, zmq.ROUTER, router=True)
        self.backend = make_socket(self.ctx, zmq.ROUTER, router=True)
        self.control = make_socket(self.ctx, zmq.PUB)
        bound: list[str] = []
        try:
            if curve is not None:  # roles: client keys on the frontend, rank keys on the backend and control
                curve.make_server(self.frontend, CLIENTS_DOMAIN)
                curve.make_server(self.backend, RANKS_DOMAIN)
                curve.make_server(self.control, RANKS_DOMAIN)
            for sock, address in ((self.frontend, endpoints.frontend), (self.backend, endpoints.backend)):
                sock.bind(address)
                bound.append(address)
            self.control.bind(endpoints.control)
        except BaseException:  # a start that fails leaves no socket, file or ZAP thread behind
            self._close_sockets((self.frontend, self.backend, self.control), bound)
            raise
        self.stop_grace_s = 1.0
        self._unreachable: list[bytes] = []  # rank identities a send found gone, for the core
        self._tasks_out = Coalescer(bounds.MAX_BATCH)  # tasks of one wakeup, per rank identity
        self._stopper = StopSignal(self.ctx, "broker")
        self._stop = self._stopper.socket

    def stop(self) -> None:
        """Ask a running loop (in any thread) to return."""
        self._stopper.stop()

    def close(self) -> None:
        ep = self.endpoints
        self._close_sockets(
            (self.frontend, self.backend, self.control, self._stop), [ep.frontend, ep.backend, ep.control]
        )
        if self.state_file is not None:
            self.state_file.close()
        self.owner.release()

    def _close_sockets(self, sockets: tuple, addresses: list[str]) -> None:
        for sock in sockets:
            sock.close(linger=0)
        for address in addresses:
            if address.startswith("ipc://"):  # ours: the owner lock kept every other broker away
                Path(address[len("ipc://") :]).unlink(missing_ok=True)  # leave no stale socket files
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    def serve(self) -> None:
        """Run until stop() or KeyboardInterrupt; sockets are closed on return."""
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        poller.register(self.backend, zmq.POLLIN)
        poller.register(self._stop, zmq.POLLIN)
        core = self.core
        due = core.next_deadline(time.monotonic())
        try:
            while True:
                events = dict(poller.poll(int(max(1.0, due * 1000))))
                if self._stop in events:
                    break
                if self.backend in events:
                    self.counts["backend_wakeups"] += 1
                    self._drain(self.backend, core.on_rank)
                if self.frontend in events:
                    self.counts["frontend_wakeups"] += 1
                    self._drain(self.frontend, core.on_client)
                # The clock's work only once some of it is due: what a message
                # made due is in the deadline asked for after it was handled.
                now = time.monotonic()
                due = core.next_deadline(now)
                if due <= 0.0:
                    self._act(core.on_tick(now))
                    due = core.next_deadline(time.monotonic())
                self._flush_tasks()
        except KeyboardInterrupt:
            pass
        try:
            self._finish_inflight()
        finally:
            self.close()

    def _finish_inflight(self) -> None:
        """On stop, take no new requests but collect (bounded by
        ``stop_grace_s``) the ``done`` of tasks already on the ranks, so their
        outcomes are booked and recorded.  A second Ctrl-C cuts it short."""
        deadline = time.monotonic() + self.stop_grace_s
        while self.core.inflight and time.monotonic() < deadline:
            if self.backend.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                self._drain(self.backend, self.core.on_rank)
            self._act(self.core.on_tick(time.monotonic()))
            self._flush_tasks()

    def _drain(self, sock: zmq.Socket, handler: Callable) -> None:
        for frames in ready_messages(sock, _DRAIN_BATCH):
            try:
                actions = handler(frames[0], frames[1:], time.monotonic())
            except Exception:  # a bug must not take the bus down: log, count, serve on
                log.exception("internal error handling a message from %r", frames[0])
                self.counts["internal_errors"] += 1
                continue
            self._act(actions)
        self._flush_tasks()

    def _act(self, actions: list) -> None:
        """Perform the core's actions.  A task (a 2-frame ToRank) waits in
        ``_tasks_out`` with the other tasks of this wakeup for its rank and
        goes out as one message (docs/protocol.md §3); anything else to that
        rank, and any publish, first sends what waits, so order is kept."""
        for action in actions:
            if isinstance(action, ToRank):
                if len(action.frames) == 2:
                    full = self._tasks_out.add(action.identity, action.frames)
                    if full is not None:
                        self._send(self.backend, action.identity, full)
                    continue
                waiting = self._tasks_out.take(action.identity)
                if waiting is not None:
                    self._send(self.backend, action.identity, waiting)
                self._send(self.backend, action.identity, action.frames)
            elif isinstance(action, ToClient):
                self._send(self.frontend, action.client, action.frames)
            elif isinstance(action, Publish):
                self._flush_tasks()
                try:
                    raw_send(self.control, action.frame, _NOBLOCK)
                except zmq.Again:
                    self.counts["publish_dropped"] += 1  # the repeat heals it
            elif isinstance(action, SaveState) and self.state_file is not None:
                try:
                    self.state_file.save(action.snapshot)
                except OSError as err:
                    self.counts["state_save_failed"] += 1
                    log.error("cannot save the broker state to %s: %s", self.state_file.path, err)
            elif isinstance(action, Record) and self.recorder is not None:
                self.recorder(action.event)
        while self._unreachable:  # a rank whose connection is gone: the core may hand its number over
            self._act(self.core.on_unreachable(self._unreachable.pop(), time.monotonic()))

    def _flush_tasks(self) -> None:
        if self._tasks_out:
            for identity, frames in self._tasks_out.drain():
                self._send(self.backend, identity, frames)  # type: ignore[arg-type]

    def _send(self, sock: zmq.Socket, identity: bytes, frames: list[bytes]) -> None:
        try:
            send_message(sock, [identity, *frames])
        except zmq.ZMQError as err:  # EHOSTUNREACH (gone peer) or EAGAIN (peer not reading)
            self.counts["undeliverable"] += 1
            if sock is self.backend and err.errno == zmq.EHOSTUNREACH:
                self._unreachable.append(identity)
            log.debug("undeliverable to %r: %s", identity, err)
