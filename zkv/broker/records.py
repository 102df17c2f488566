"""The broker core's configuration and the records it keeps: one per rank,
per task and for the control operation in progress."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..wire.layout import CacheLayout
from ..wire.outcome import RankFold
from ..wire.replies import RankStatus
from .state import BusState, ControlOp


@dataclass
class BrokerConfig:
    world: int = 2
    max_inflight_per_rank: int = 64
    max_queue: int = 100_000
    heartbeat_ms: int = 500
    liveness_ms: int = 2_000
    control_repeat_ms: int = 100
    op_timeout_ms: int = 30_000
    allow_partial: bool = False  # a dead rank completes (not fails) a pending op
    # Per-client bounds (docs/architecture.md, "Strangers"): a flooding or vanished client holds at most
    # this much broker state, and every piece of it expires.
    max_open_per_client: int = 10_000  # queued + in-flight tasks of one connection
    max_waiters_per_client: int = 16  # held status{wait_ranks} requests of one connection
    max_waiters: int = 1024  # held status requests of all connections

    def timeout_s(self, timeout_ms: int | None) -> float:
        """A request's own ``timeout_ms``, else the op timeout, in seconds."""
        return (timeout_ms or self.op_timeout_ms) / 1000.0


@dataclass
class RankState:
    rank: int
    identity: bytes
    session: int
    pid: int
    last_seen: float
    alive: bool = True
    host: str = ""
    inflight: int = 0
    dispatched: int = 0  # per-session count; a pause names it as ``upto``
    # The rank has its welcome: it sent something other than a ready since.
    # A rank *back* (from an outage, a restart) gets tasks only then, so none
    # is sent down a connection whose way back is still in TCP backoff, or
    # dies before the welcome gets through: its ready can arrive first.
    welcomed: bool = True
    acked_epoch: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    def to_status(self, now: float) -> RankStatus:
        """This rank's entry of a status reply (docs/protocol.md §8.4)."""
        return RankStatus(
            rank=self.rank,
            alive=self.alive,
            pid=self.pid,
            host=self.host,
            inflight=self.inflight,
            dispatched=self.dispatched,
            acked_epoch=self.acked_epoch,
            last_seen_ms=round((now - self.last_seen) * 1000, 1),
            stats=self.stats,
        )


@dataclass(slots=True)
class Task:
    client: bytes
    task: int
    reply_to: str
    body: bytes
    submitted: float
    reply_key: str | None = None  # the client's Curve public key, for its PULL
    expires: float | None = None  # submit timeout_ms: a task still queued then never runs
    seq: int = 0
    gen: int = 0  # the generation it was accepted, then dispatched, at: its outcome names it
    fold: RankFold | None = None
    reported: bool = False  # the broker already sent the client a final outcome
    batch_results: bool = False  # its client reads several results in one message (docs/protocol.md §10.3)


@dataclass
class PendingOp:
    """The pause, clear or resume every live rank has yet to ack."""

    op: ControlOp
    epoch: int
    started: float
    deadline: float
    waiters: list[tuple[bytes, int]]
    previous_state: BusState  # the state it began from (a broker-started resume: running)
    layout: CacheLayout | None = None  # a resume: the layout the bus holds once it completes (None: unchanged)
    cancelled: int = 0  # a clear: queued tasks it cancelled
    freed: int = 0  # a clear: what the ranks' acks say they freed
    joined: dict[tuple[bytes, int], float] = field(default_factory=dict)  # a joiner's own, earlier deadline
    # A failed resume rolling back: the error (code, reason) its waiters get
    # once every live rank acked the rollback epoch (or at ``deadline``).
    failure: tuple[str, str] | None = None
