"""An engine's zkv bus as a cycle drives it: pause (acked once no copy is in
flight), clear (keeping the CPU tier or not), resume, each one bounded
request through the fleet's ``BusLink`` (``fleet/driver.py``: a broker that
is not there is known at once, a client that got no answer is dropped with
whatever it still had queued).  A failure raises ``StepFailed``: the bus
refused (its error), did not answer, or was never reached (nothing sent)."""

from __future__ import annotations

import time
from typing import Any

from ..fleet.decision import Answer, BusAnswer
from ..fleet.driver import BusLink
from ..fleet.spec import BusSpec, fleet_of
from ..wire.replies import StatusReply
from ..wire.vocab import ControlOp
from .engine import StepFailed
from .terms import Reach, Tiers


class LinkedBus:
    """The bus at ``spec`` (an address, a ``BusSpec`` or its map), used from one thread at a time."""

    def __init__(self, name: str, spec: BusSpec | str | dict[str, Any]):
        if isinstance(spec, BusSpec):
            self.spec = spec
        else:
            self.spec = fleet_of([spec if not isinstance(spec, str) else {"name": name, "broker": spec}])[0]
        self._link = BusLink(self.spec)

    def _ask(self, op: str, fields: dict[str, Any], timeout: float) -> BusAnswer:
        t0 = time.monotonic()
        answer = self._link.ask(op, fields, t0 + max(0.0, timeout), t0)
        if answer.ok:
            return answer
        sent = answer.answer is not Answer.UNREACHABLE
        why = f"bus {self.spec.broker}: {answer.label}: {answer.reason}"
        raise StepFailed(why, Reach.BUS, sent=sent)

    def pause(self, timeout: float) -> None:
        self._ask(ControlOp.PAUSE, {}, timeout)

    def clear(self, keep_cpu: bool, timeout: float, weights: str | None = None) -> Tiers:
        fields: dict[str, Any] = {"keep_cpu": bool(keep_cpu)}
        if weights is not None and not keep_cpu:
            fields["weights"] = weights
        self._ask(ControlOp.CLEAR, fields, timeout)
        return Tiers.KEPT if keep_cpu else Tiers.DROPPED

    def resume(self, timeout: float) -> None:
        self._ask(ControlOp.RESUME, {}, timeout)

    def status(self, timeout: float) -> StatusReply:
        reply = self._ask("status", {}, timeout).reply
        assert isinstance(reply, StatusReply), reply
        return reply

    def close(self) -> None:
        self._link.close()


class WithBus:
    """The bus steps of an engine driver whose bus is a ``LinkedBus`` (None: an engine without
    zkv, its bus steps nothing): what the vLLM drivers share."""

    bus: LinkedBus | None

    def pause_bus(self, timeout: float) -> None:
        if self.bus is not None:
            self.bus.pause(timeout)

    def clear_bus(self, keep_cpu: bool, timeout: float, weights: str | None = None) -> Tiers:
        if self.bus is None:
            return Tiers.UNTOUCHED
        return self.bus.clear(keep_cpu, timeout, weights)

    def resume_bus(self, timeout: float) -> None:
        if self.bus is not None:
            self.bus.resume(timeout)

    def close(self) -> None:
        if self.bus is not None:
            self.bus.close()
