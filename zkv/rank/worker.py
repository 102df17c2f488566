"""A rank worker: an I/O loop around :class:`RankCore` plus a copy executor.

Threads and ownership (no socket is shared between threads):
- the I/O thread owns the DEALER to the broker, the SUB for control, and the
  inproc PULL on which the executor reports; it alone touches RankCore, so
  the inflight count has a single owner;
- the executor thread takes work from a FIFO, so a cache free or allocate
  queued after tasks runs after them, and a long copy never stalls the loop;
- the block store (``BlockStore``, on zkv's own tensors or an engine's) is
  used by one thread at a time: the executor, or, while nothing is queued
  on it, the I/O thread running a small task itself (``runner.py``: the
  hand-over cost more than a 1-block copy).  Each thread has its own PUSH
  sockets to clients' result addresses.

Nothing here changes the process (threads, signals, warnings): the entry
point does that (``zkv worker`` calls ``set_torch_threads``), so a rank can
run inside an engine's process (``zkv.rank.agent.RankAgent``).

A client that went away never blocks the rank: results are sent NOBLOCK and
what cannot be queued is counted as undeliverable.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable

import torch
import zmq

from ..net.curve import Curve
from ..net.endpoints import StopSignal, make_socket
from ..net.frames import ready_messages, send_message
from ..net.handshakes import HandshakeWatch
from ..obs import startup
from ..wire import bounds
from ..wire.layout import CacheLayout
from ..wire.vocab import ControlOp
from .actions import Acked, AllocateCache, Execute, FreeCache, Note, ToBroker
from .batching import DoneBatcher, InlinePolicy, is_keyed
from .core import RankCore
from .executor import COPY_LANE, STORE_LANE, Executor
from .memory.geometry import LayoutGiven
from .registration import RankRefused
from .reports import Finished
from .result_links import ResultSenders
from .store import BlockStore, pick_device
from .tiers.disk_tier import DiskSpec
from .tiers.store_tier import open_store
from .tiers.tier_file import TierPlace, bus_name

log = logging.getLogger("zkv.worker")
WAIT_NOTE_S = 5.0  # a rank not yet welcomed says what it waits for after this
WAIT_NOTE_EVERY_S = 30.0  # and again at this rate while it still waits

_ids = itertools.count()


def new_session() -> int:
    """A registration session: unguessable, and never one an earlier process
    of this rank used (the broker reads a new one as a restart)."""
    return secrets.randbits(52)


def set_torch_threads(threads: int = 1) -> None:
    """For a rank's own process (its entry point calls it, never an import):
    block copies are memory-bound, and intra-op threads only fight the other
    ranks and the I/O thread for cores (measured: 2 threads copy 10x slower
    than 1 on a loaded 2-core machine)."""
    torch.set_num_threads(threads)


class RankWorker:
    """One rank: connect to the broker, register, and serve until stopped.

    ``cache``: the store to serve (on an engine's memory,
    ``BlockStore.attached``); without it the rank allocates its own
    (``BlockStore.owned``) for ``layout``."""

    def __init__(
        self,
        rank: int,
        world: int,
        backend: str,
        control: str,
        layout: CacheLayout | None = None,
        *,
        device: str | torch.device | None = None,
        ctx: zmq.Context | None = None,
        liveness_ms: int = 2000,
        curve: Curve | None = None,
        cache: BlockStore | None = None,
        tier_dir: str | None = None,
        tier_digests: bool = False,
        disk: DiskSpec | None = None,
        adopt_layout: bool = False,
        note: Callable[[str], None] | None = None,
        store: str | None = None,
    ):
        self.ctx = ctx or zmq.Context.instance()
        self.note = note or log.warning  # lines for the operator: a layout adopted, a broker that does not answer
        self.backend, self.curve = backend, curve
        self._joining_since: float | None = None  # when this rank last began waiting for a welcome
        self._next_wait_note = 0.0
        self._said_waiting = False
        self._owns_cache = cache is None  # ours to close when the loop ends (a tier file stays for a restart)
        if cache is None:
            if layout is None:
                raise ValueError("a rank needs a layout to allocate its cache, or a cache to serve")
            place = TierPlace(bus_name(backend), rank, tier_dir, tier_digests) if tier_dir else None
            device = device if device is not None else pick_device(rank)
            cache = BlockStore.owned(layout, device, rank, place=place, disk=disk)
        if store is not None:  # the keyed store below the CPU tier (tiers/store_tier.py)
            cache.keyed = open_store(store)
        self.cache = cache
        self.core = RankCore(rank, world, cache.layout, liveness_ms=liveness_ms, stats=self.stats, sessions=new_session)
        self.core.tiers = lambda: cache.kept_tiers(self.core.fresh)
        self.core.adopt_layout = adopt_layout
        self.registered = threading.Event()  # set once the broker first welcomed this rank
        uid = next(_ids)
        # Unguessable, like every inproc name in zkv (no reply_to can name one anyway).
        self._report_address = f"inproc://zkv-rank-{rank}-report-{uid}-{secrets.token_hex(8)}"
        self.dealer = make_socket(self.ctx, zmq.DEALER)
        # A connection identity of our own, not "rank-R": ROUTER_HANDOVER gives an
        # identity to whoever claims it, so a guessable one would let any process
        # (a misconfigured worker) evict us.  The broker binds the rank number to
        # this identity only when it accepts our READY.
        self.dealer.setsockopt(zmq.IDENTITY, f"rank-{rank}-{secrets.token_hex(8)}".encode())
        self.sub = make_socket(self.ctx, zmq.SUB)
        if curve is not None:
            curve.make_client(self.dealer)
            curve.make_client(self.sub)
        # With Curve, a handshake the broker refuses is never answered: watch for it to say so
        self._handshakes = HandshakeWatch(self.dealer) if curve is not None else None
        self.dealer.connect(backend)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(control)
        self.reports = self.ctx.socket(zmq.PULL)
        self.reports.setsockopt(zmq.LINGER, 0)
        self.reports.bind(self._report_address)
        self._stopper = StopSignal(self.ctx, f"rank-{rank}")
        self._stop = self._stopper.socket
        self.executor = Executor(self.ctx, self._report_address, self.cache, rank, world, curve)
        # The keyed store's moves on a lane of their own: a slow store delays no copy.
        self.store_lane = (
            Executor(
                self.ctx,
                self._report_address,
                self.cache,
                rank,
                world,
                curve,
                lane=STORE_LANE,
                reports=self.executor.reports,
                book=self.executor.book,
            )
            if self.cache.keyed is not None
            else None
        )
        # While nothing is queued on the executor, a small task runs right here
        # on the I/O thread (runner.py), with sockets of its own.
        self._inline = InlinePolicy()
        self._dones = DoneBatcher()  # done frames of this wakeup, sent as one message
        # Results the I/O thread's tasks hold for a client that reads batches: they leave
        # with the dones of the wakeup, before them (``_flush_held``).
        self._inline_senders = ResultSenders(self.ctx, curve, self.executor.stats, holds=True)

    @classmethod
    def on_manifest(
        cls,
        manifest: str,
        rank: int,
        world: int,
        backend: str,
        control: str,
        layout: LayoutGiven = None,
        **options: Any,
    ) -> "RankWorker":
        """A rank serving the tensors an engine process exported in ``manifest``
        (``zkv worker --attach``).  ``layout``: None (derived from the engine's
        memory), a ``CacheLayout`` or a map of fields, checked against it
        (``BlockStore.from_manifest``); its ``cpu_blocks`` sizes zkv's CPU tier.
        Each resume reads the manifest again, for a newer cache.  With
        ``tier_dir`` the CPU tier is a tier file that outlives this process,
        as a rank of its own memory's (a restart attached to the same engine
        maps it again).  Raises ``CacheError`` when it cannot be mapped or
        does not fit ``layout`` (nothing stays mapped).
        ``options``: those of the constructor (``liveness_ms``, ``curve``, ``ctx``,
        ``disk``, ``tier_dir``, ``tier_digests``)."""
        disk, tier_dir = options.pop("disk", None), options.pop("tier_dir", None)
        digests = options.pop("tier_digests", False)
        place = TierPlace(bus_name(backend), rank, tier_dir, digests) if tier_dir else None
        store = BlockStore.from_manifest(manifest, layout, rank, disk=disk, place=place)
        return cls(rank, world, backend, control, cache=store, **options)

    def stop(self) -> None:
        """Ask a running loop (in any thread) to return."""
        self._stopper.stop()

    def stats(self) -> dict[str, Any]:
        s: dict[str, Any] = dict(self.executor.stats)
        if self.store_lane is not None:
            for name, n in self.store_lane.stats.items():
                s[name] = s.get(name, 0) + n
        s.update(self.core.counters)
        held = self.cache.tier_nbytes()
        s.update(
            gen=self.core.gen,
            epoch=self.core.epoch,
            op=self.core.op.value,
            cache_bytes=self.cache.nbytes(held) if self.cache.allocated else 0,
            device=str(self.cache.device),
        )
        s.update(self.executor.book.to_stats())
        s.update({f"cache_bytes_{tier}": n for tier, n in held.items()})
        tier = self.cache.tier
        if tier is not None:  # what the CPU tier holds, whether it outlived a process, what failed
            s["cpu_tier"] = tier.to_stats(self.cache.cpu_tier_found)
        if self.cache.disk is not None:
            s["disk"] = self.cache.disk.to_stats()
        if self.cache.keyed is not None:
            s["store"] = self.cache.keyed.url
        return s

    def serve(self) -> None:
        """Run until stop(), KeyboardInterrupt, or the broker refuses this rank."""
        self.executor.start()
        if self.store_lane is not None:
            self.store_lane.start()
        poller = zmq.Poller()
        for sock in (self.dealer, self.sub, self.reports, self._stop):
            poller.register(sock, zmq.POLLIN)
        core = self.core
        core.registration.host = socket.gethostname()[:255]  # POSIX HOST_NAME_MAX
        self._act(core.start(time.monotonic(), pid=os.getpid()))
        startup.mark("ready")
        try:
            while True:
                events = dict(poller.poll(int(max(1.0, core.next_deadline(time.monotonic()) * 1000))))
                if self._stop in events:
                    return
                self._act(core.on_wake(time.monotonic()))
                if self.reports in events:
                    self._drain_reports()
                if self.dealer in events:
                    self.core.counters["dealer_wakeups"] += 1
                    self._drain_dealer()
                if self.sub in events:
                    self._drain(self.sub, lambda frames: core.on_control(frames[0], time.monotonic()))
                self._act(core.on_tick(time.monotonic()))
                self._flush_held()
                if core.registered and not self.registered.is_set():
                    startup.mark("welcome")
                    self.registered.set()
                self._say_waiting(time.monotonic())
        finally:
            self._inline_senders.flush()
            for lane in (self.executor, self.store_lane):
                if lane is not None:
                    lane.work.put(None)
                    lane.join(timeout=10)
            if self._handshakes is not None:
                self._handshakes.close()
            for sock in (self.dealer, self.sub, self.reports, self._stop):
                sock.close(linger=0)
            self._inline_senders.close()
            if self._owns_cache:
                self.cache.close()

    def _say_waiting(self, now: float) -> None:
        """A rank that waits for the broker's welcome says so after ``WAIT_NOTE_S`` and
        then every ``WAIT_NOTE_EVERY_S`` (a broker down, a Curve key it refuses: the
        handshake fails in silence), and once it is welcomed, after how long."""
        core = self.core
        if core.registered:
            if self._joining_since is not None and self._said_waiting:
                self.note(f"rank {core.rank}: registered with the broker after {now - self._joining_since:.0f} s")
            self._joining_since, self._said_waiting = None, False
            if self._handshakes is not None:  # the handshake went through: nothing more to watch
                self._handshakes.close()
                self._handshakes = None
            return
        if self._joining_since is None:
            self._joining_since, self._next_wait_note = now, now + WAIT_NOTE_S
            return
        if now < self._next_wait_note:
            return
        self._next_wait_note = now + WAIT_NOTE_EVERY_S
        self._said_waiting = True
        failed = self._handshake_failures()
        if failed:
            why = (
                f"the broker refused the Curve handshake ({failed}): is this rank's public key in the broker's "
                "--curve-ranks directory, and is --curve-server the broker's public key?"
            )
        elif self.curve is not None:
            why = (
                "is the broker up there, is this rank's public key in the broker's --curve-ranks directory, "
                "and is --curve-server the broker's public key? (a refused Curve key is never answered)"
            )
        else:
            why = "is zkv broker running with this --backend (and --control) address?"
        self.note(
            f"rank {core.rank}/{core.world}: waiting for the broker at {self.backend} to answer its registration "
            f"({now - self._joining_since:.0f} s so far): {why}"
        )

    def _handshake_failures(self) -> str:
        """The handshake failures the DEALER's monitor saw so far (their event names), '' for none."""
        if self._handshakes is None:
            return ""
        self._handshakes.read()
        return self._handshakes.failures

    def _drain(self, sock: zmq.Socket, handle) -> None:
        for frames in ready_messages(sock, 512):
            try:
                actions = handle(frames)
            except RankRefused:
                raise
            except Exception:  # a bug must not take the rank down: log, count, serve on
                log.exception("internal error handling a message")
                self.core.counters["internal_errors"] += 1
                continue
            self._act(actions)

    def _drain_dealer(self) -> None:
        core = self.core

        def handle(frames: list[bytes]) -> list:
            now = time.monotonic()
            if len(frames) == 1:
                return core.on_broker(frames[0], now)
            if len(frames) % 2 or len(frames) > 2 * bounds.MAX_BATCH:  # tasks come as header/body pairs
                core.counters["bad_broker_msgs"] += 1
                return []
            out: list = []
            for i in range(0, len(frames), 2):
                out += core.on_task(frames[i], frames[i + 1], now)
            return out

        self._drain(self.dealer, handle)

    def _flush_held(self) -> None:
        """Send what this wakeup held: results first (a task's result never trails its
        done), then the dones as one message."""
        if self._inline_senders.held:
            self._inline_senders.flush()
        if self._dones.frames:
            self._to_broker(self._dones.take())

    def _to_broker(self, frames: list[bytes]) -> None:
        try:
            send_message(self.dealer, frames)
        except zmq.Again:
            self.core.counters["broker_send_dropped"] += len(frames)

    def _drain_reports(self) -> None:
        core = self.core
        reports = self.executor.reports
        inline = self._inline

        def handle(frames: list[bytes]) -> list:
            lane, rep = reports.popleft()  # appended before its frame was sent (by either lane)
            if lane == COPY_LANE:
                inline.queued -= 1
            if isinstance(rep, Finished):
                startup.mark("first_task")
                return core.on_finished(rep.seq, rep.n, rep.outcome, rep.nbytes, rep.gen)
            startup.mark("cache")
            return core.on_cache_done(rep.freed, rep.error, rep.cpu_kept)

        self._drain(self.reports, handle)

    def _execute(self, action: Execute) -> None:
        """A task to run: on the store lane (a put or a get), right here (small, nothing queued
        ahead of it: ``InlinePolicy``), or on the copy executor, in order."""
        ex, store_lane, inline, dones = self.executor, self.store_lane, self._inline, self._dones
        if store_lane is not None and is_keyed(action.body):
            store_lane.work.put(action)
        elif inline.inline(action.body, self.cache.layout):
            if dones.frames and dones.due(time.perf_counter()):
                self._flush_held()  # before a copy: the credits held would wait for it too
            ex.stats["tasks_inline"] += 1
            done = ex.runner.run(action, self._inline_senders)
            startup.mark("first_task")
            self._act(self.core.on_finished(done.seq, done.n, done.outcome, done.nbytes, done.gen))
        else:
            if self._inline_senders.held:  # the executor's result must not overtake them
                self._flush_held()
            inline.queued += 1
            ex.work.put(action)

    def _act(self, actions: list) -> None:
        ex, store_lane = self.executor, self.store_lane
        ex.session = self.core.registration.session  # before any task of this batch is queued
        if store_lane is not None:
            store_lane.session = ex.session
        inline, dones = self._inline, self._dones
        for action in actions:
            kind = type(action)
            if kind is Execute:
                self._execute(action)
            elif kind is ToBroker:
                if action.done:  # the credits of this wakeup go out together (_flush_held)
                    if dones.add(action.frame, time.perf_counter()):
                        self._flush_held()
                    continue
                self._flush_held()
                self._to_broker([action.frame])
            elif kind is Acked:
                if action.op is ControlOp.PAUSE or action.op is ControlOp.CLEAR:
                    ex.paused_ack.set()
                else:
                    ex.paused_ack.clear()
            elif kind is Note:
                self.note(action.text)
            elif kind is FreeCache or kind is AllocateCache:
                if kind is AllocateCache:
                    ex.paused_ack.clear()
                inline.queued += 1
                ex.work.put(action)
