"""A simulated bus for the model-based test: BrokerCore, N RankCores with a
simulated executor and memory, and one client's ResultBook, on a network
whose every connection is a queue the test drains in any order.

What the network can do (each is a method the state machine calls): deliver
one message of one connection (so connections reorder freely against each
other), lose a PUB message, kill / restart / freeze / thaw a rank, restart the
broker (it keeps only its state file), and move the clock (small steps or
jumps).  The memory model records what every block holds, so the test can
tell a *silent* loss: a checksum that ends ``ok`` while a block the client
wrote in this generation holds something else.
"""

from __future__ import annotations

import collections
import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

from zkv.broker.core import BrokerConfig, BrokerCore, Publish, SaveState, ToClient, ToRank
from zkv.client.results import ResultBook
from zkv.rank.cache_phase import CachePhase
from zkv.rank.core import Acked, AllocateCache, Execute, FreeCache, RankCore, ToBroker
from zkv.rank.registration import RankRefused
from zkv.wire import bounds
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout
from zkv.wire.messages import Result
from zkv.wire.vocab import RankOutcome

LAYOUT = CacheLayout(layers=1, gpu_blocks=8, cpu_blocks=8, block_size=1, kv_heads=1, head_dim=1)
OTHER = LAYOUT.with_changes(gpu_blocks=6, cpu_blocks=4)
ALLOC_LIMIT = 1000  # the simulated executor fails to allocate more GPU blocks than this
CLIENT = b"client-M"
STRANGER = b"client-S"  # a client of its own: reads, pings and bad frames only (its writes would be the model's)
MODEL_REPLY_TO = "ipc:///model"
CFG = {"heartbeat_ms": 100, "liveness_ms": 1000, "control_repeat_ms": 50, "op_timeout_ms": 2000}


class ModelViolation(AssertionError):
    pass


def cpu_shape(layout: CacheLayout) -> tuple:
    return (layout.layers, layout.cpu_blocks, layout.kv_heads, layout.block_size, layout.head_dim, layout.dtype)


@dataclass
class Memory:
    """One rank's tensors, as far as the model cares: block -> what was written."""

    layout: CacheLayout | None = LAYOUT
    gpu: dict | None = field(default_factory=dict)
    cpu: dict | None = field(default_factory=dict)


@dataclass
class Rank:
    core: RankCore
    mem: Memory = field(default_factory=Memory)
    alive: bool = True
    frozen: bool = False
    dealer_in: collections.deque = field(default_factory=collections.deque)
    sub_in: collections.deque = field(default_factory=collections.deque)
    work: collections.deque = field(default_factory=collections.deque)  # the executor's FIFO
    acked_pause: bool = False


@dataclass
class Request:
    kind: str
    deadline: float
    answered: bool = False
    lost: bool = False  # the broker restarted before answering: the client's own timeout covers it


class Bus:
    def __init__(self, world: int):
        self.world = world
        self.now = 1000.0
        self.disk: dict[str, Any] | None = None
        self.broker = BrokerCore(BrokerConfig(world=world, **CFG))
        self.sessions = itertools.count(1)  # every registration its own session, restarts too
        self.ranks = {r: Rank(self._core(r)) for r in range(world)}
        self.to_broker: dict[int, collections.deque] = {r: collections.deque() for r in range(world)}
        self.client_in: collections.deque = collections.deque()
        self.results_in: dict[int, collections.deque] = {r: collections.deque() for r in range(world)}
        self.book = ResultBook()
        self.book_gen_seen = self.book.gen
        self.outcomes: dict[int, str] = {}
        self.tasks: dict[int, dict] = {}  # task -> {"op", "tier", "blocks", "seed"}
        self.expect: dict[tuple[str, int], dict[int, Any]] = {}  # (tier, block) -> rank -> value, this generation
        self.poisoned: set[tuple[str, int]] = set()  # blocks a task may still write: unknown content
        self.requests: dict[int, Request] = {}
        self.next_task = 1
        self.next_req = 1
        self.copies_after_ack = 0
        self.silent_losses: list[str] = []
        self.replies: dict[int, Any] = {}  # req -> the reply or error it got
        self.out_of_bounds: list[str] = []  # frames a party sent that its peer's decoder refuses
        self.unnamed_moves: list[str] = []  # generation moves without a reason
        self.stranger_ids = itertools.count(1)
        for r in self.ranks:
            self._rank_actions(r, self.ranks[r].core.start(self.now))

    # --- wiring ------------------------------------------------------------------

    def _in_bounds(self, who: str, frame: bytes) -> None:
        """What a party sends must pass the decoder its peer uses (docs/protocol.md §2.1)."""
        try:
            P.decode(frame)
        except P.ProtocolError as err:
            self.out_of_bounds.append(f"{who} sent {err.code}: {err.reason}")

    def _broker_actions(self, actions) -> None:
        for a in actions:
            if isinstance(a, (ToRank, ToClient)):  # a task's body is the client's bytes, forwarded as they came
                sent = a.frames[0::2] if isinstance(a, ToRank) and len(a.frames) > 1 else a.frames
            else:
                sent = [a.frame] if isinstance(a, Publish) else []
            for frame in sent:
                self._in_bounds("the broker", frame)
            if isinstance(a, ToRank):
                if a.identity.startswith(b"stranger"):
                    continue
                rank = int(a.identity.split(b"-")[1])
                if self.ranks[rank].alive:
                    self.ranks[rank].dealer_in.append(a.frames)
            elif isinstance(a, Publish):
                for sr in self.ranks.values():
                    if sr.alive:
                        sr.sub_in.append(a.frame)
            elif isinstance(a, ToClient):
                msg = P.decode(a.frames[0])
                if a.client == STRANGER:
                    continue
                req = getattr(msg, "req", None)
                if req is not None and req in self.requests:
                    self.requests[req].answered = True
                    self.replies[req] = msg
                if msg.kind == "error" and msg.code == "internal":
                    raise ModelViolation(f"internal error: {msg.reason}")
                self.client_in.append(msg)
            elif isinstance(a, SaveState):
                self.disk = dict(a.snapshot)

    def _rank_actions(self, rank: int, actions) -> None:
        sr = self.ranks[rank]
        for a in actions:
            if isinstance(a, ToBroker):
                self._in_bounds(f"rank {rank}", a.frame)
                self.to_broker[rank].append(a.frame)
            elif isinstance(a, Acked):
                sr.acked_pause = a.op in ("pause", "clear")
            elif isinstance(a, (Execute, FreeCache, AllocateCache)):
                if isinstance(a, AllocateCache):
                    sr.acked_pause = False
                sr.work.append(a)

    def _call(self, handler, *args) -> None:
        """One broker entry point; a generation that moved in it, a clear's
        move included, must say why (status ``gen_reason``)."""
        broker = self.broker
        gen, reason, state = broker.gen, broker.gens.reason, broker.state
        self._broker_actions(handler(*args))
        if broker.gen == gen:
            return
        if not broker.gens.reason or broker.gens.reason == reason:
            self.unnamed_moves.append(f"generation {gen} -> {broker.gen} (state {state} -> {broker.state})")

    # --- client ------------------------------------------------------------------

    def submit(self, op: str, tier: str, blocks: list[int], seed: int = 0) -> int:
        task = self.next_task
        self.next_task += 1
        self.book.add(task, self.now, 10.0)
        self.tasks[task] = {"op": op, "tier": tier, "blocks": blocks, "seed": seed}
        key = "dst" if op == "fill" else "src"
        body = P.encode_body(op, **{key: blocks}, tier=tier, seed=seed)
        frames = [P.encode("submit", task=task, reply_to=MODEL_REPLY_TO), body]
        self._call(self.broker.on_client, CLIENT, frames, self.now)
        return task

    def request(self, kind: str, timeout_ms: int = 1500, **fields) -> int:
        req = self.next_req
        self.next_req += 1
        control = kind in ("pause", "clear", "resume")
        # the broker answers a control op by its deadline (0: its default; out of bounds: at once); others at once
        wait_ms = timeout_ms or CFG["op_timeout_ms"]
        self.requests[req] = Request(
            kind, self.now + (wait_ms / 1000 if control and wait_ms <= bounds.MAX_TIMEOUT_MS else 0)
        )
        if control:
            fields["timeout_ms"] = timeout_ms
        self._call(self.broker.on_client, CLIENT, [P.encode(kind, req=req, **fields)], self.now)
        return req

    def stranger_client(self, frames: list[bytes]) -> None:
        """A client that is not the model's: whatever it is answered must be in bounds."""
        self._call(self.broker.on_client, STRANGER, frames, self.now)

    def stranger_rank(self, frames: list[bytes]) -> bytes:
        """A backend peer the model does not run (it may register, then it is silent)."""
        identity = b"stranger-%d" % next(self.stranger_ids)
        self._call(self.broker.on_rank, identity, frames, self.now)
        return identity

    def busy_blocks(self) -> set[tuple[str, int]]:
        """Blocks an open task touches (the model issues no two tasks on one block at once)."""
        return {(t["tier"], b) for task, t in self.tasks.items() if task in self.book.open for b in t["blocks"]}

    def deliver_client(self) -> None:
        if not self.client_in:
            return
        msg = self.client_in.popleft()
        if msg.kind == "outcome":
            self._final(self.book.on_outcome(msg.task, msg.outcome, msg.reason, self.now, msg.gen))
        elif msg.kind == "reply" and msg.op == "clear":  # as zkv.client.Client does
            for out in self.book.cleared(msg.extra["gen"], "cleared", self.now):
                self._final(out)
        elif msg.kind == "reply" and msg.op in ("resume", "status"):
            self.book.gen_known = True
            for out in self.book.learn_gen(msg.extra["gen"], msg.extra.get("gen_reason", ""), self.now):
                self._final(out)
        self._drain_moved()

    def deliver_result(self, rank: int) -> None:
        if self.results_in[rank]:
            self._final(self.book.on_result(self.results_in[rank].popleft(), self.now))
            self._drain_moved()

    def _drain_moved(self) -> None:
        moved, self.book.moved = self.book.moved, []
        for out in moved:
            self._final(out)

    def _final(self, out) -> None:
        if self.book.gen != self.book_gen_seen:  # a new generation: nothing the client wrote is there
            self.book_gen_seen = self.book.gen
            self.expect.clear()
            self.poisoned = set(self.busy_blocks())
        if out is None:
            return
        if out.task in self.outcomes:
            raise ModelViolation(f"task {out.task} ended twice: {self.outcomes[out.task]} then {out.outcome}")
        self.outcomes[out.task] = out.outcome
        t = self.tasks[out.task]
        keys = [(t["tier"], b) for b in t["blocks"]]
        if t["op"] == "fill":
            for i, key in enumerate(keys):
                if out.ok:
                    self.expect[key] = {r: (t["seed"], r, i) for r in range(self.world)}
                    self.poisoned.discard(key)
                else:  # it may have written some ranks, or still will
                    self.expect.pop(key, None)
                    self.poisoned.add(key)
        elif out.ok:
            for i, key in enumerate(keys):
                want = self.expect.get(key)
                if want is None or key in self.poisoned:
                    continue
                for r, res in out.per_rank.items():
                    if res["digests"][i] != want[r]:
                        self.silent_losses.append(
                            f"task {out.task}: {key} on rank {r} holds {res['digests'][i]}, "
                            f"the client wrote {want[r]} in generation {self.book.gen}"
                        )

    # --- network and processes -----------------------------------------------------

    def deliver_broker(self, rank: int) -> None:
        if self.to_broker[rank]:
            frame = self.to_broker[rank].popleft()
            self._call(self.broker.on_rank, f"rank-{rank}".encode(), [frame], self.now)

    def deliver_dealer(self, rank: int) -> None:
        sr = self.ranks[rank]
        if sr.alive and not sr.frozen and sr.dealer_in:
            frames = sr.dealer_in.popleft()
            if len(frames) == 2:
                acts = sr.core.on_task(frames[0], frames[1], self.now)
            else:
                try:
                    acts = sr.core.on_broker(frames[0], self.now)
                except RankRefused as err:
                    raise ModelViolation(f"rank {rank} refused: {err}") from None
            self._rank_actions(rank, acts)

    def deliver_pub(self, rank: int, lose: bool = False) -> None:
        sr = self.ranks[rank]
        if sr.alive and not sr.frozen and sr.sub_in:
            frame = sr.sub_in.popleft()
            if not lose:
                self._rank_actions(rank, sr.core.on_control(frame, self.now))

    def execute(self, rank: int) -> None:
        """The rank's executor runs the next item of its FIFO."""
        sr = self.ranks[rank]
        if not sr.alive or sr.frozen or not sr.work:
            return
        item = sr.work.popleft()
        mem = sr.mem
        if isinstance(item, FreeCache):
            mem.gpu = None
            if not item.keep_cpu:
                mem.cpu = None
            self._rank_actions(rank, sr.core.on_cache_done(1))
            return
        if isinstance(item, AllocateCache):
            if item.layout.gpu_blocks > ALLOC_LIMIT:
                mem.layout, mem.gpu, mem.cpu = None, None, None
                self._rank_actions(rank, sr.core.on_cache_done(0, "RuntimeError: out of memory"))
                return
            kept = mem.cpu is not None and mem.layout is not None and cpu_shape(mem.layout) == cpu_shape(item.layout)
            mem.cpu = mem.cpu if kept else {}
            mem.gpu, mem.layout = {}, item.layout
            self._rank_actions(rank, sr.core.on_cache_done(0, "", kept))
            return
        self._run_task(rank, item)

    def _run_task(self, rank: int, ex: Execute) -> None:
        sr, mem = self.ranks[rank], self.ranks[rank].mem
        outcome, reason, digests = "ok", ex.refuse, None
        try:
            body = P.decode_body(ex.body)
        except P.ProtocolError as err:  # the runner's answer to a bad body: failed, with the code
            self._finish(rank, ex, "failed", str(err)[:1000], None)
            return
        tier = mem.gpu if body.tier == "gpu" else mem.cpu
        ids = list(body.dst if body.op == "fill" else body.src)
        if ex.refuse:
            outcome = "failed"
        elif min(ids) < 0:
            outcome, reason = "failed", "block id out of range"
        elif ex.session != sr.core.registration.session:
            outcome, reason = "failed", "stale session"
        elif tier is None or mem.layout is None:
            outcome, reason = "failed", "caches are cleared on this rank"
        elif max(ids) >= (mem.layout.gpu_blocks if body.tier == "gpu" else mem.layout.cpu_blocks):
            outcome, reason = "failed", "block id out of range"
        if outcome == "ok":
            if sr.acked_pause:
                self.copies_after_ack += 1
            layout = self.broker.layout
            if layout is not None and mem.layout != layout and self.broker.state == "running":
                raise ModelViolation(f"rank {rank} copies on layout {mem.layout} while the broker holds {layout}")
            if body.op == "fill":
                for i, b in enumerate(ids):
                    tier[b] = (body.seed, rank, i)
            else:
                digests = [tier.get(b) for b in ids]
        self._finish(rank, ex, outcome, reason, digests)

    def _finish(self, rank: int, ex: Execute, said: str, reason: str, digests) -> None:
        outcome = RankOutcome(said)
        result = Result(
            task=ex.task, rank=rank, world=self.world, outcome=outcome, reason=reason, gen=ex.gen, digests=digests
        )
        if ex.reply_to == MODEL_REPLY_TO:  # a stranger's results go to its own PULL
            self.results_in[rank].append(result)
        self._rank_actions(rank, self.ranks[rank].core.on_finished(ex.seq, ex.n, outcome, 0, ex.gen))

    def settle(self, rounds: int = 20) -> None:
        """Deliver everything that can move (frozen and dead ranks stay as they are)."""
        for _ in range(rounds):
            before = self._pending_count()
            for r in self.ranks:
                while self.ranks[r].dealer_in and self.ranks[r].alive and not self.ranks[r].frozen:
                    self.deliver_dealer(r)
                while self.ranks[r].sub_in and self.ranks[r].alive and not self.ranks[r].frozen:
                    self.deliver_pub(r)
                while self.ranks[r].work and self.ranks[r].alive and not self.ranks[r].frozen:
                    self.execute(r)
                while self.to_broker[r]:
                    self.deliver_broker(r)
                while self.results_in[r]:
                    self.deliver_result(r)
            while self.client_in:
                self.deliver_client()
            if self._pending_count() == 0 or self._pending_count() == before:
                return

    def _pending_count(self) -> int:
        n = (
            len(self.client_in)
            + sum(len(q) for q in self.to_broker.values())
            + sum(len(q) for q in self.results_in.values())
        )
        return n + sum(
            len(sr.dealer_in) + len(sr.sub_in) + len(sr.work)
            for sr in self.ranks.values()
            if sr.alive and not sr.frozen
        )

    def kill_rank(self, rank: int) -> None:
        sr = self.ranks[rank]
        sr.alive = False
        sr.dealer_in.clear()
        sr.sub_in.clear()
        sr.work.clear()
        self.results_in[rank].clear()  # a dead PUSH loses what it had queued

    def _core(self, rank: int, adopt_layout: bool = True) -> RankCore:
        core = RankCore(rank, self.world, LAYOUT, heartbeat_ms=100, liveness_ms=1000, sessions=self.sessions.__next__)
        core.adopt_layout = adopt_layout
        return core

    def start_rank(self, rank: int, adopt_layout: bool = True) -> None:
        """A new process: fresh memory, generation 0, its command-line layout; it
        takes the bus's layout when that differs, as a supervisor's restart does
        (``adopt_layout``; without it the broker refuses it)."""
        self.ranks[rank] = Rank(self._core(rank, adopt_layout))
        self._rank_actions(rank, self.ranks[rank].core.start(self.now))

    def restart_broker(self) -> None:
        """The broker process dies and a new one starts from its state file."""
        for req in self.requests.values():
            if not req.answered:
                req.lost = True
        for q in self.to_broker.values():
            q.clear()
        for sr in self.ranks.values():
            sr.dealer_in.clear()
            sr.sub_in.clear()
        self.client_in.clear()
        for task in list(self.book.open):
            self.poisoned.update((self.tasks[task]["tier"], b) for b in self.tasks[task]["blocks"])
        self.broker = BrokerCore(BrokerConfig(world=self.world, **CFG), restore=self.disk)

    def thaw(self, rank: int) -> None:
        """A frozen rank runs again (SIGCONT): its loop wakes first, before it reads what
        queued meanwhile (``on_wake``, as ``RankWorker.serve`` calls it at every wake), so a
        freeze past half the liveness window holds the queued tasks until the broker says
        whether they are still this rank's."""
        sr = self.ranks[rank]
        if sr.frozen:
            sr.frozen = False
            if sr.alive:
                self._rank_actions(rank, sr.core.on_wake(self.now))

    def advance(self, dt: float) -> None:
        self.now += dt
        self._call(self.broker.on_tick, self.now)
        for r, sr in self.ranks.items():
            if sr.alive and not sr.frozen:
                self._rank_actions(r, sr.core.on_wake(self.now))
                self._rank_actions(r, sr.core.on_tick(self.now))
        for out in self.book.expire(self.now):
            self._final(out)

    # --- invariants ------------------------------------------------------------------

    def pause_within(self, seconds: float) -> int:
        """Ask for a pause and run the bus (0.1 s steps) until it is answered or ``seconds`` passed."""
        req = self.request("pause", timeout_ms=2000)
        for _ in range(round(seconds / 0.1)):
            self.settle()
            if req in self.replies:
                break
            self.advance(0.1)
        return req

    def recovers(self, on_copy: bool = True) -> str | None:
        """Once every rank runs again and the clock moves on, the broker's
        in-flight tasks drain and a pause completes; else why not (on a copy,
        unless the example ends here).  No in-bound sequence may wedge the bus."""
        bus = copy.deepcopy(self) if on_copy else self
        for r, sr in bus.ranks.items():
            bus.thaw(r)
            if not sr.alive:
                bus.start_rank(r)
        for _ in range(40):  # 4 s of bus time: liveness (1 s), the op timeout (2 s) and a retry
            bus.settle()
            registered = all(sr.core.registered for sr in bus.ranks.values())
            if registered and not bus.broker.inflight and bus.broker.pending is None:
                break
            bus.advance(0.1)
        req = bus.pause_within(3.0)
        reply = bus.replies.get(req)
        why = None
        if reply is None or reply.kind != "reply":
            why = f"a pause after recovery got {reply}"
        elif bus.broker.inflight:
            why = f"tasks still in flight after a pause: {sorted(bus.broker.inflight)}"
        elif bus.broker.control.own_resume.retry_at is not None:
            why = "the broker still retries its own resume behind a client's pause"
        return why

    def check(self) -> None:
        if self.out_of_bounds:
            raise ModelViolation("out of bounds: " + "; ".join(self.out_of_bounds))
        if self.unnamed_moves:
            raise ModelViolation("a generation moved without a reason: " + "; ".join(self.unnamed_moves))
        if self.copies_after_ack:
            raise ModelViolation(f"{self.copies_after_ack} copies between a pause ack and the next resume")
        if self.silent_losses:
            raise ModelViolation("silent loss: " + "; ".join(self.silent_losses))
        late = [
            (req, r.kind) for req, r in self.requests.items() if not r.answered and not r.lost and r.deadline < self.now
        ]
        if late:
            raise ModelViolation(f"requests not answered by their deadline: {late}")
        if self.broker.counters.get("internal_errors"):
            raise ModelViolation("the broker counted an internal error")
        # one layout and one generation among the ranks that serve the broker's current epoch
        if self.broker.state == "running" and self.broker.pending is None:
            for sr in self.ranks.values():
                core = sr.core
                if not (sr.alive and core.registered and core.epoch == self.broker.epoch):
                    continue
                if core.gen != self.broker.gen:
                    raise ModelViolation(f"rank {core.rank} serves generation {core.gen}, the broker {self.broker.gen}")
                if core.cache.phase is CachePhase.SERVING and sr.mem.layout != self.broker.layout:
                    raise ModelViolation(
                        f"rank {core.rank} serves layout {sr.mem.layout}, the broker holds {self.broker.layout}"
                    )
        for _task, out in self.outcomes.items():
            assert out in P.OUTCOMES
