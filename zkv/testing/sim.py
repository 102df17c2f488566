"""An in-memory wiring of BrokerCore and RankCores, for exact interleavings.

No sockets and no threads: every message sits in a queue until the test
delivers it, so a test can make a PUB pause overtake DEALER tasks, drop a PUB
message, deliver a stale ack, or kill a rank at exactly the step it wants.
The executor is simulated too: tasks wait in ``running[rank]`` until the test
finishes them, and the simulation records which copies started after an ack.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

from zkv.broker.core import BrokerConfig, BrokerCore, Publish, ToClient, ToRank
from zkv.client.results import ResultBook
from zkv.rank.core import Acked, AllocateCache, Execute, FreeCache, RankCore, ToBroker
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout
from zkv.wire.messages import MESSAGES, Control, Error, Message, OutcomeMsg, Reply, Result, Submit
from zkv.wire.vocab import ControlOp, Op, RankOutcome

LAYOUT = CacheLayout(layers=1, gpu_blocks=16, cpu_blocks=32, block_size=4, kv_heads=1, head_dim=4)
CLIENT = b"client-A"


@dataclass
class SimRank:
    core: RankCore
    dealer_in: collections.deque = field(default_factory=collections.deque)  # frames from broker
    sub_in: collections.deque = field(default_factory=collections.deque)  # PUB frames
    running: collections.deque = field(default_factory=collections.deque)  # Execute awaiting finish
    cache_ops: collections.deque = field(default_factory=collections.deque)
    acked_pause: bool = False
    copies_after_ack: int = 0
    copies: int = 0


class Sim:
    """One ``BrokerCore`` and ``world`` ``RankCore`` objects wired through
    queues that move only when the test says so, on a clock it sets.

    Every message waits in a queue until the test delivers it: ``deliver_broker``
    (rank -> broker), ``deliver_dealer`` (broker -> rank tasks and replies),
    ``deliver_pub`` (the control PUB, or drop it), ``finish`` (the simulated
    executor completes tasks), ``tick`` (advance ``now`` and run the broker's
    timers).  So a test picks the exact interleaving: a pause overtaking tasks,
    a lost PUB message, a stale ack, a rank that dies at a given step.
    ``settle`` delivers everything until nothing moves.  ``outcomes`` holds each
    task's single outcome (a second one fails the test at once) and every
    ``SimRank`` counts ``copies_after_ack``.  No sockets, threads or torch.
    """

    def __init__(self, world: int = 2, now: float = 100.0, **cfg):
        self.now = now
        self.broker = BrokerCore(BrokerConfig(world=world, **cfg))
        self.sessions = itertools.count(1)  # every registration of every rank its own session, in order
        self.ranks = {r: SimRank(RankCore(r, world, LAYOUT, sessions=self.sessions.__next__)) for r in range(world)}
        self.to_broker: collections.deque = collections.deque()  # (identity, frame)
        self.client_in: list[Message] = []  # frontend messages to CLIENT
        self.results: list[Result] = []  # rank results pushed to reply_to
        self.book = ResultBook()
        self.outcomes: dict[int, str] = {}
        self.next_task = 1
        self.next_req = 1
        self.published: list[Control] = []

    # --- wiring ------------------------------------------------------------------

    def _broker_actions(self, actions) -> None:
        for a in actions:
            if isinstance(a, ToRank):
                rank = int(a.identity.split(b"-")[1])
                self.ranks[rank].dealer_in.append(a.frames)
            elif isinstance(a, Publish):
                self.published.append(P.decode(a.frame))
                for sr in self.ranks.values():
                    sr.sub_in.append(a.frame)
            elif isinstance(a, ToClient):
                msg = P.decode(a.frames[0])
                self.client_in.append(msg)
                if isinstance(msg, OutcomeMsg):
                    self._final(self.book.on_outcome(msg.task, msg.outcome, msg.reason, self.now, msg.gen))
                elif isinstance(msg, Reply) and msg.op in (ControlOp.CLEAR, ControlOp.RESUME):  # as Client does
                    self.book.gen_known = True
                    for out in self.book.learn_gen(msg.extra["gen"], "cleared", self.now):
                        self._final(out)
                self._drain_moved()

    def _rank_actions(self, rank: int, actions) -> None:
        sr = self.ranks[rank]
        for a in actions:
            if isinstance(a, ToBroker):
                self.to_broker.append((f"rank-{rank}".encode(), a.frame))
            elif isinstance(a, Execute):
                sr.running.append(a)
            elif isinstance(a, (FreeCache, AllocateCache)):
                sr.cache_ops.append(a)
            elif isinstance(a, Acked):
                sr.acked_pause = a.op in (ControlOp.PAUSE, ControlOp.CLEAR)

    def _drain_moved(self) -> None:
        moved, self.book.moved = self.book.moved, []
        for out in moved:
            self._final(out)

    def _final(self, out) -> None:
        if out is not None:
            assert out.task not in self.outcomes, f"task {out.task} ended twice"
            self.outcomes[out.task] = out.outcome

    # --- steps ---------------------------------------------------------------------

    def start_rank(self, rank: int) -> None:
        self._rank_actions(rank, self.ranks[rank].core.start(self.now))

    def submit(self, op: str = Op.SWAP_OUT, src=(0,), dst=(0,)) -> int:
        task = self.next_task
        self.next_task += 1
        self.book.add(task, self.now, 30.0)
        header = Submit(task=task, reply_to="ipc:///sim/client").to_wire()
        frames = [header, P.encode_body(op, list(src), list(dst))]
        self._broker_actions(self.broker.on_client(CLIENT, frames, self.now))
        return task

    def request(self, kind: str, **fields) -> int:
        req = self.next_req
        self.next_req += 1
        self._broker_actions(self.broker.on_client(CLIENT, [MESSAGES[kind](req=req, **fields).to_wire()], self.now))
        return req

    def reply(self, req: int) -> Reply | Error | None:
        for msg in self.client_in:
            if isinstance(msg, (Reply, Error)) and msg.req == req:
                return msg
        return None

    def deliver_broker(self, n: int | None = None) -> int:
        """Deliver rank -> broker messages (all, or the first n)."""
        count = 0
        while self.to_broker and (n is None or count < n):
            identity, frame = self.to_broker.popleft()
            self._broker_actions(self.broker.on_rank(identity, [frame], self.now))
            count += 1
        return count

    def deliver_dealer(self, rank: int, n: int | None = None) -> int:
        sr = self.ranks[rank]
        count = 0
        while sr.dealer_in and (n is None or count < n):
            frames = sr.dealer_in.popleft()
            if len(frames) == 2:
                acts = sr.core.on_task(frames[0], frames[1], self.now)
            else:
                acts = sr.core.on_broker(frames[0], self.now)
            self._rank_actions(rank, acts)
            count += 1
        return count

    def deliver_pub(self, rank: int, drop: bool = False) -> int:
        sr = self.ranks[rank]
        count = 0
        while sr.sub_in:
            frame = sr.sub_in.popleft()
            count += 1
            if not drop:
                self._rank_actions(rank, sr.core.on_control(frame, self.now))
        return count

    def finish(self, rank: int, n: int | None = None, outcome: str = RankOutcome.OK) -> int:
        """Complete running tasks on a rank (the simulated executor)."""
        sr = self.ranks[rank]
        count = 0
        while sr.running and (n is None or count < n):
            ex = sr.running.popleft()
            if not ex.refuse:
                sr.copies += 1
                if sr.acked_pause:
                    sr.copies_after_ack += 1
            nbytes = 0 if ex.refuse else LAYOUT.block_bytes
            result = Result(
                task=ex.task,
                rank=rank,
                world=len(self.ranks),
                outcome=RankOutcome.FAILED if ex.refuse else RankOutcome(outcome),
                reason=ex.refuse,
                gen=ex.gen,
                bytes=nbytes,
            )
            self.results.append(result)
            self._final(self.book.on_result(result, self.now))
            self._drain_moved()
            self._rank_actions(rank, sr.core.on_finished(ex.seq, ex.n, result.outcome, nbytes, ex.gen))
            count += 1
        return count

    def finish_cache_ops(self, rank: int) -> None:
        sr = self.ranks[rank]
        while sr.cache_ops:
            op = sr.cache_ops.popleft()
            freed = LAYOUT.block_bytes * (LAYOUT.gpu_blocks + LAYOUT.cpu_blocks) if isinstance(op, FreeCache) else 0
            self._rank_actions(rank, sr.core.on_cache_done(freed))

    def settle(self, rounds: int = 50) -> None:
        """Deliver everything everywhere until nothing moves (bounded)."""
        for _ in range(rounds):
            moved = self.deliver_broker()
            for r in self.ranks:
                moved += self.deliver_dealer(r) + self.deliver_pub(r) + self.finish(r)
                if self.ranks[r].cache_ops:
                    self.finish_cache_ops(r)
                    moved += 1
            if not moved:
                return
        raise AssertionError("simulation did not settle")

    def tick(self, dt: float) -> None:
        self.now += dt
        self._broker_actions(self.broker.on_tick(self.now))

    def pause_and_clear(self) -> None:
        """Drive the bus to ``cleared`` with every message delivered."""
        self.request("pause")
        self.settle()
        self.request("clear")
        self.settle()

    def up(self) -> "Sim":
        for r in self.ranks:
            self.start_rank(r)
        self.settle()
        return self
