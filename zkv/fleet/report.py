"""What a fleet operation tells its caller: per bus, its answer and when it
came, where the bus is left and whether a failed pause resumed it; for the
fleet, the outcome and how long it took.  ``FleetReport`` is what
``Fleet.last_report`` holds, what ``FleetError.report`` carries, and, as
``to_json()``, one line of a fleet record (docs/traces.md, "Fleet records")."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

from ..wire.errors import ZkvError
from ..wire.replies import ControlReply
from ..wire.vocab import ControlOp
from .decision import Answer, BusAnswer, FleetOp

RECORD_EV = "fleet"
_MISSING = "no answer before the fleet's deadline"


@dataclass(frozen=True)
class BusReport:
    name: str
    broker: str
    answer: BusAnswer
    state: str | None  # where the bus is left, as far as its answers tell; None: unknown
    needed_rollback: bool  # a failed pause had to resume it
    rollback: BusAnswer | None  # the resume that rollback sent, None when none was sent

    @property
    def resumed(self) -> bool:
        return self.rollback is not None and self.rollback.ok

    @property
    def not_resumable(self) -> bool:
        """A bus the failed pause had to resume and could not: the operator's to look at."""
        return self.needed_rollback and not self.resumed

    def describe(self, op: str) -> str:
        """One clause: what the bus answered and what became of it."""
        a = self.answer
        if a.answer is Answer.OK:
            text = f"{op} ok in {a.at_ms:.1f} ms"
        elif a.answer is Answer.NOOP:
            note = a.reply.note if isinstance(a.reply, ControlReply) else ""
            text = f"{note or 'noop'} ({a.at_ms:.1f} ms)"
        elif a.answer is Answer.ERROR:
            text = f"{a.code}: {a.reason}"
        else:
            text = f"{a.answer}: {a.reason}"
        if self.rollback is not None:
            r = self.rollback
            if r.ok:
                text += "; resumed again" + (" (it was running)" if r.answer is Answer.NOOP else "")
            else:
                text += f"; NOT RESUMED ({r.label}: {r.reason})"
        elif self.needed_rollback:
            text += "; NOT RESUMED (no time was left to send the resume)"
        if self.state is not None:
            text += f"; now {self.state}"
        elif a.answer is Answer.UNREACHABLE and self.rollback is None:
            text += "; nothing was sent to it"
        elif a.answer is Answer.NO_REPLY or self.not_resumable:
            text += "; its state is unknown"
        return text

    def to_json(self) -> dict[str, Any]:
        a = self.answer
        out: dict[str, Any] = {"bus": self.name, "broker": self.broker, "outcome": a.label, "ms": round(a.at_ms, 3)}
        if not a.ok:
            out["reason"] = a.reason
        if self.state is not None:
            out["state"] = self.state
        if self.needed_rollback:
            r = self.rollback
            out["rollback"] = "not_sent" if r is None else r.label
            if r is not None:
                out["rollback_ms"] = round(r.at_ms, 3)
                if not r.ok:
                    out["rollback_reason"] = r.reason
        reply = dict(a.reply.fields) if a.reply is not None else {}  # the op's fields, as the broker sent them
        if reply:
            out["reply"] = reply
        return out


@dataclass(frozen=True)
class FleetReport:
    op: str
    ok: bool
    duration_ms: float
    buses: tuple[BusReport, ...]
    on_failure: str = ControlOp.RESUME
    wall_time: float = 0.0  # time.time() when the operation began

    @classmethod
    def of(
        cls, fleet_op: FleetOp, brokers: Mapping[str, str], duration_ms: float, wall_time: float | None = None
    ) -> "FleetReport":
        """The report of ``fleet_op`` as it stands: a bus that never answered
        counts as ``no_reply``, a rollback never sent as not resumed."""
        buses = []
        for name in fleet_op.names:
            answer = fleet_op.answers.get(name) or BusAnswer(Answer.NO_REPLY, duration_ms, "no_reply", _MISSING)
            if name not in fleet_op.answers:
                needed = fleet_op.op == ControlOp.PAUSE and fleet_op.on_failure == ControlOp.RESUME
            else:
                needed = fleet_op.needs_rollback(name) and fleet_op.failed
            buses.append(
                BusReport(
                    name,
                    brokers.get(name, name),
                    answer,
                    fleet_op.state_after(name),
                    needed,
                    fleet_op.rollbacks.get(name),
                )
            )
        ok = all(b.answer.ok for b in buses)
        wall = time.time() - duration_ms / 1000 if wall_time is None else wall_time
        return cls(fleet_op.op, ok, round(duration_ms, 3), tuple(buses), fleet_op.on_failure, wall)

    def failed(self) -> list[BusReport]:
        return [b for b in self.buses if not b.answer.ok]

    def not_resumable(self) -> list[BusReport]:
        return [b for b in self.buses if b.not_resumable]

    def slowest(self) -> BusReport | None:
        """The bus that made the operation slow: the one whose answer came last,
        a bus that never answered (named at the deadline) included."""
        return max(self.buses, key=lambda b: b.answer.at_ms, default=None)

    def __getitem__(self, name: str) -> BusReport:
        for b in self.buses:
            if b.name == name:
                return b
        raise KeyError(name)

    def message(self) -> str:
        """Every bus and what happened to it, failures first."""
        n = len(self.buses)
        failed = f"failed on {len(self.failed())} of {n} bus" + ("" if n == 1 else "es")
        head = f"fleet {self.op} " + ("ok" if self.ok else failed)
        stuck = self.not_resumable()
        if stuck:
            head += f", {len(stuck)} left not running: {', '.join(b.name for b in stuck)}"
        order = sorted(self.buses, key=lambda b: (b.answer.ok, not b.not_resumable))
        return head + ": " + "; ".join(f"{b.name}: {b.describe(self.op)}" for b in order)

    def to_json(self) -> dict[str, Any]:
        """One fleet record (docs/traces.md, "Fleet records")."""
        slowest = self.slowest()
        return {
            "ev": RECORD_EV,
            "time": round(self.wall_time, 3),
            "op": self.op,
            "ok": self.ok,
            "ms": self.duration_ms,
            "slowest": slowest.name if slowest is not None else None,
            **({"on_failure": self.on_failure} if self.op == ControlOp.PAUSE else {}),
            "buses": [b.to_json() for b in self.buses],
        }


class FleetError(ZkvError):
    """A fleet pause, clear or resume that did not succeed on every bus;
    ``report`` names each bus and what became of it."""

    def __init__(self, report: FleetReport):
        super().__init__(f"fleet_{report.op}_failed", report.message())
        self.report = report
