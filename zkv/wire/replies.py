"""The typed answers to requests, one class per reply kind, for both ends:
the broker builds one and sends its ``to_wire()`` (the op's fields beside
``req`` and ``op``: ``wire_fields()``), the client builds one from the decoded
``reply`` message (``from_reply``; docs/protocol.md §7.6, §8.3-§8.5 list the
fields).

A decoded reply keeps the map the frame carried for ``as_dict()``: the CLI's
``--json`` prints it as the broker sent it, fields a newer broker added
included.
"""

from __future__ import annotations

import warnings
from collections.abc import ItemsView, Iterator, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from typing import Any, TypeVar

from . import protocol as P
from .layout import CacheLayout
from .messages import Reply
from .vocab import BusState, ControlOp, TaskState

_W = TypeVar("_W", BusState, ControlOp, TaskState)


def _word(kind: type[_W], value: Any, name: str) -> _W | None:
    """A reply's word as its enum member (None when absent); a word the enum
    does not hold is a broker speaking another protocol: a ``ProtocolError``."""
    if value is None or value == "":
        return None
    try:
        return kind(value)
    except ValueError:
        words = ", ".join(str(w) for w in kind)
        raise P.ProtocolError("bad_field", f"{name}: {P.shown(value)} is not one of {words}") from None


@dataclass(frozen=True)
class _Answer:
    """What every reply has: the request's ``req``, and the frame's own fields."""

    req: int
    fields: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    OP = ""  # the ``op`` a reply of this class answers

    @property
    def op(self) -> str:
        return self.OP

    def wire_fields(self) -> dict[str, Any]:
        """The op's fields as the frame carries them, from the typed values."""
        return {}

    def to_wire(self) -> bytes:
        """The ``reply`` frame of this answer."""
        return Reply(req=self.req, op=self.op, extra=self.wire_fields()).to_wire()

    def as_dict(self) -> dict[str, Any]:
        """The reply as the frame has it (``req``, ``op``, the op's fields, ``v``, ``kind``):
        a decoded one's own map, a built one's ``wire_fields()``."""
        fields = self.fields or self.wire_fields()
        return {"req": self.req, "op": self.op, **fields, "v": P.VERSION, "kind": "reply"}

    # --- read as the map zkv 0.1 returned (deprecated: docs/versions.md) ---------------

    def _map(self) -> dict[str, Any]:
        warnings.warn(
            f"reading a zkv reply as a map is deprecated and stops working in zkv {MAP_REMOVED_IN}: read its "
            f"attributes (reply.state, reply.gen, ...) or reply.as_dict()",
            DeprecationWarning,
            stacklevel=3,
        )
        return self.as_dict()

    def __getitem__(self, key: str) -> Any:
        return self._map()[key]

    def __contains__(self, key: object) -> bool:
        return key in self._map()

    def __iter__(self) -> Iterator[str]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self._map())

    def __bool__(self) -> bool:
        return True  # a reply is there, whatever its length as a map

    def get(self, key: str, default: Any = None) -> Any:
        return self._map().get(key, default)

    def keys(self) -> KeysView[str]:
        return self._map().keys()

    def items(self) -> ItemsView[str, Any]:
        return self._map().items()

    def values(self) -> ValuesView[Any]:
        return self._map().values()


# Code written against zkv 0.1 read replies as maps: a reply still is one (read-only,
# the frame's map), with a DeprecationWarning, for one release.
MAP_REMOVED_IN = "0.3"
Mapping.register(_Answer)


@dataclass(frozen=True)
class PingReply(_Answer):
    """``ping``'s reply: the broker is there (§8.5)."""

    OP = "ping"

    @classmethod
    def from_reply(cls, reply: Reply) -> "PingReply":
        return cls(reply.req, reply.extra)


@dataclass(frozen=True)
class CancelReply(_Answer):
    """``cancel``'s reply (§7.6): ``cancelled`` whether it was in time, ``state``
    what the task was (a ``TaskState``)."""

    task: int = 0
    cancelled: bool = False
    state: TaskState = TaskState.UNKNOWN

    OP = "cancel"

    def wire_fields(self) -> dict[str, Any]:
        return {"task": self.task, "cancelled": self.cancelled, "state": self.state.value}

    @classmethod
    def from_reply(cls, reply: Reply) -> "CancelReply":
        x = reply.extra
        state = _word(TaskState, x.get("state"), "state") or TaskState.UNKNOWN
        return cls(reply.req, x, task=x.get("task", 0), cancelled=bool(x.get("cancelled")), state=state)


_ELAPSED = {ControlOp.PAUSE: "drain_ms", ControlOp.CLEAR: "clear_ms", ControlOp.RESUME: "resume_ms"}


@dataclass(frozen=True)
class ControlReply(_Answer):
    """The reply to ``pause``, ``clear`` or ``resume`` (§8.3); a field the op
    does not return is None (``cpu_gen``, ``ranks_acked`` and ``world`` in a
    no-op's; ``layout``, ``cpu_kept``, ``gen_reason`` outside a resume's)."""

    control: ControlOp = ControlOp.PAUSE
    epoch: int = 0
    gen: int = 0
    state: BusState | None = None  # None: the reply did not say
    cpu_gen: int | None = None
    ranks_acked: int | None = None
    world: int | None = None
    noop: bool = False
    note: str = ""
    elapsed_ms: float = 0.0  # drain_ms, clear_ms or resume_ms
    cancelled: int = 0  # clear: queued tasks ended cancelled
    freed: int = 0  # clear: bytes freed, summed over ranks
    layout: CacheLayout | None = None  # resume: the layout the ranks now hold
    cpu_kept: bool | None = None  # resume after clear{keep_cpu}: whether the CPU tier survived
    gen_reason: str | None = None  # resume: why the generation last moved

    @property
    def op(self) -> str:
        return self.control.value

    def wire_fields(self) -> dict[str, Any]:
        """Which fields a reply carries depends on its op and on whether it was a
        no-op (§8.3): a pause says ``drain_ms`` even as a no-op, a clear its
        ``cancelled`` and ``freed``; a no-op's ``clear_ms`` / ``resume_ms``,
        ``cpu_gen``, ``ranks_acked`` and ``world`` are absent."""
        out: dict[str, Any] = {"epoch": self.epoch, "gen": self.gen}
        if self.cpu_gen is not None:
            out["cpu_gen"] = self.cpu_gen
        if self.control is ControlOp.PAUSE or not self.noop:
            out[_ELAPSED[self.control]] = self.elapsed_ms
        if self.control is ControlOp.CLEAR:
            out.update(cancelled=self.cancelled, freed=self.freed)
        named = {"layout": self.layout.to_wire() if self.layout else None, "cpu_kept": self.cpu_kept}
        out.update((k, v) for k, v in named.items() if v is not None)
        if self.note:
            out["note"] = self.note
        if self.gen_reason:
            out["gen_reason"] = self.gen_reason
        if self.state is not None:
            out["state"] = self.state.value
        counted = {"ranks_acked": self.ranks_acked, "world": self.world}
        out.update((k, v) for k, v in counted.items() if v is not None)
        if self.noop:
            out["noop"] = True
        return out

    @classmethod
    def from_reply(cls, reply: Reply) -> "ControlReply":
        x = reply.extra
        control = ControlOp(reply.op)
        layout = x.get("layout")
        return cls(
            reply.req,
            x,
            control=control,
            epoch=x.get("epoch", 0),
            gen=x.get("gen", 0),
            state=_word(BusState, x.get("state"), "state"),
            cpu_gen=x.get("cpu_gen"),
            ranks_acked=x.get("ranks_acked"),
            world=x.get("world"),
            noop=bool(x.get("noop")),
            note=x.get("note", ""),
            elapsed_ms=float(x.get(_ELAPSED[control], 0.0)),
            cancelled=x.get("cancelled", 0),
            freed=x.get("freed", 0),
            layout=CacheLayout.from_wire(layout) if layout else None,
            cpu_kept=x.get("cpu_kept"),
            gen_reason=x.get("gen_reason"),
        )


@dataclass(frozen=True)
class RankStatus:
    """One entry of ``status.ranks`` (§8.4)."""

    rank: int
    alive: bool = False
    pid: int = 0
    host: str = ""
    inflight: int = 0
    dispatched: int = 0
    acked_epoch: int = 0
    last_seen_ms: float = 0.0
    stats: Mapping[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "alive": self.alive,
            "pid": self.pid,
            "host": self.host,
            "inflight": self.inflight,
            "dispatched": self.dispatched,
            "acked_epoch": self.acked_epoch,
            "last_seen_ms": self.last_seen_ms,
            "stats": self.stats,
        }

    @classmethod
    def from_wire(cls, x: Mapping[str, Any]) -> "RankStatus":
        return cls(
            rank=x["rank"],
            alive=bool(x.get("alive")),
            pid=x.get("pid", 0),
            host=x.get("host", ""),
            inflight=x.get("inflight", 0),
            dispatched=x.get("dispatched", 0),
            acked_epoch=x.get("acked_epoch", 0),
            last_seen_ms=x.get("last_seen_ms", 0.0),
            stats=x.get("stats") or {},
        )


@dataclass(frozen=True)
class StatusReply(_Answer):
    """``status``'s reply (§8.4)."""

    state: BusState | None = None  # None: the reply did not say
    epoch: int = 0
    gen: int = 0
    cpu_gen: int | None = None
    gen_reason: str = ""
    weights: str | None = None  # the name the last clear without keep_cpu gave the weights (None: none)
    world: int = 0
    layout: CacheLayout | None = None  # None until a rank registered
    ranks: tuple[RankStatus, ...] = ()
    queued: int = 0
    inflight: int = 0
    max_inflight_per_rank: int = 0
    pending_op: ControlOp | None = None  # the control op in progress
    restate_failures: int = 0  # the broker's own resume: failures in a row
    restate_error: str | None = None
    restate_retry_in_s: float | None = None
    counters: Mapping[str, int] = field(default_factory=dict)

    OP = "status"

    @property
    def alive_ranks(self) -> list[int]:
        return [r.rank for r in self.ranks if r.alive]

    def wire_fields(self) -> dict[str, Any]:
        """Every field, absent ones as nil (§8.4: a status names them all)."""
        return {
            "state": self.state.value if self.state is not None else None,
            "epoch": self.epoch,
            "gen": self.gen,
            "cpu_gen": self.cpu_gen,
            "gen_reason": self.gen_reason,
            "weights": self.weights,
            "world": self.world,
            "layout": self.layout.to_wire() if self.layout else None,
            "ranks": [r.to_wire() for r in self.ranks],
            "queued": self.queued,
            "inflight": self.inflight,
            "max_inflight_per_rank": self.max_inflight_per_rank,
            "pending_op": self.pending_op.value if self.pending_op is not None else None,
            "restate_failures": self.restate_failures,
            "restate_error": self.restate_error,
            "restate_retry_in_s": self.restate_retry_in_s,
            "counters": dict(self.counters),
        }

    @classmethod
    def from_reply(cls, reply: Reply) -> "StatusReply":
        x = reply.extra
        layout, pending = x.get("layout"), x.get("pending_op")
        return cls(
            reply.req,
            x,
            state=_word(BusState, x.get("state"), "state"),
            epoch=x.get("epoch", 0),
            gen=x.get("gen", 0),
            cpu_gen=x.get("cpu_gen"),
            gen_reason=x.get("gen_reason") or "",
            weights=x.get("weights"),
            world=x.get("world", 0),
            layout=CacheLayout.from_wire(layout) if layout else None,
            ranks=tuple(RankStatus.from_wire(r) for r in x.get("ranks") or ()),
            queued=x.get("queued", 0),
            inflight=x.get("inflight", 0),
            max_inflight_per_rank=x.get("max_inflight_per_rank", 0),
            pending_op=_word(ControlOp, pending, "pending_op"),
            restate_failures=x.get("restate_failures", 0),
            restate_error=x.get("restate_error"),
            restate_retry_in_s=x.get("restate_retry_in_s"),
            counters=x.get("counters") or {},
        )


Answer = PingReply | CancelReply | ControlReply | StatusReply

_BY_OP: dict[str, Any] = {
    PingReply.OP: PingReply,
    CancelReply.OP: CancelReply,
    StatusReply.OP: StatusReply,
    **{op.value: ControlReply for op in (ControlOp.PAUSE, ControlOp.CLEAR, ControlOp.RESUME)},
}


def typed(reply: Reply) -> Answer:
    """The typed answer for ``reply``, by its ``op``."""
    cls = _BY_OP.get(reply.op)
    if cls is None:
        raise P.ProtocolError("bad_field", f"a reply of unknown op {P.shown(reply.op)}")
    return cls.from_reply(reply)
