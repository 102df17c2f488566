"""``zkv.Fleet``: pause, clear, resume and status over every bus of an RL
trainer's fleet of engines at once, each a single operation with one
deadline, all or nothing (docs/engines.md, "A fleet of engines").

    with zkv.Fleet(["ipc:///run/zkv-0/frontend.sock", "ipc:///run/zkv-1/frontend.sock"]) as fleet:
        fleet.pause(timeout=30)     # FleetError (naming each bus) unless every bus drained; the rest resumed
        fleet.clear()
        ...                         # update the weights, hand the engines' new caches over
        fleet.resume()              # a retry of a failed resume repairs the fleet
        print(fleet.last_report.slowest().name)

Each call returns a ``FleetReport`` (also ``fleet.last_report``); with
``record=PATH`` it is appended there as one JSON line (docs/traces.md,
"Fleet records").  A ``Fleet`` is used from one thread at a time.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..wire.vocab import ControlOp
from . import driver
from .decision import ON_FAILURE, FleetOp
from .report import FleetError, FleetReport
from .spec import BusSpec, fleet_of, load_fleet_file

DEFAULT_TIMEOUT = 30.0
DEFAULT_ROLLBACK = 10.0


class Fleet:
    """Buses given as addresses, ``BusSpec`` s or maps (``spec.py``).

    ``timeout`` bounds each operation (the default of each call);
    ``rollback_timeout`` bounds the resume a failed pause sends each bus it
    may have paused, at most ``timeout`` itself: so a call returns within
    ``timeout``, and a failed pause within ``timeout + min(rollback_timeout,
    timeout)`` (docs/deploy.md §6)."""

    def __init__(
        self,
        buses: Iterable[BusSpec | str | Mapping[str, Any]],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        rollback_timeout: float = DEFAULT_ROLLBACK,
        record: str | Path | None = None,
    ):
        self.buses = fleet_of(buses)
        self.timeout = _seconds(timeout, "timeout")
        self.rollback_timeout = _seconds(rollback_timeout, "rollback_timeout")
        self.record = Path(record) if record is not None else None
        self._links = [driver.BusLink(spec) for spec in self.buses]
        self._busy = threading.Lock()
        self.last_report: FleetReport | None = None

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> "Fleet":
        """The buses of a fleet file (``spec.py``)."""
        return cls(load_fleet_file(path), **kwargs)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.buses]

    def __len__(self) -> int:
        return len(self.buses)

    # --- the operations ------------------------------------------------------------------

    def pause(
        self, timeout: float | None = None, *, on_failure: str = ControlOp.RESUME, rollback_timeout: float | None = None
    ) -> FleetReport:
        """Drain every bus.  Unless every bus paused (or already was paused),
        raise ``FleetError``; the buses this call paused are resumed first
        (``on_failure="stay"``: left paused)."""
        if on_failure not in ON_FAILURE:
            raise ValueError(f"on_failure {on_failure!r}: one of {', '.join(ON_FAILURE)}")
        return self._run(ControlOp.PAUSE, {}, timeout, on_failure, rollback_timeout)

    def clear(self, keep_cpu: bool = False, timeout: float | None = None, weights: str | None = None) -> FleetReport:
        """Free every bus's caches (each must be paused); ``FleetError`` names the
        buses that did not clear.  Run it again to finish: cleared buses answer noop.
        ``weights``: one name for the weights every bus serves after (``Client.clear``)."""
        fields: dict[str, Any] = {"keep_cpu": bool(keep_cpu)}
        if weights is not None:
            fields["weights"] = weights
        return self._run(ControlOp.CLEAR, fields, timeout)

    def resume(self, layout: Mapping[str, Any] | None = None, timeout: float | None = None) -> FleetReport:
        """Serve again on every bus (``layout``: changes for every bus, after a
        clear).  ``FleetError`` names the buses that did not resume; run it
        again to finish: running buses answer noop."""
        return self._run(ControlOp.RESUME, {"layout": dict(layout)} if layout else {}, timeout)

    def status(self, timeout: float | None = None, wait_ranks: int = 0) -> FleetReport:
        """Every bus's status reply (``report[name].answer.reply``); never raises
        for a bus that did not answer: its entry says why.  ``wait_ranks``:
        each bus answers once that many of its ranks are up (or at the deadline)."""
        if type(wait_ranks) is not int or wait_ranks < 0:
            raise ValueError(f"wait_ranks {wait_ranks!r}: a count of ranks")
        return self._run("status", {"wait_ranks": wait_ranks} if wait_ranks else {}, timeout, raise_error=False)

    # --- one operation -------------------------------------------------------------------

    def _run(
        self,
        op: str,
        fields: dict[str, Any],
        timeout: float | None,
        on_failure: str = ControlOp.RESUME,
        rollback_timeout: float | None = None,
        raise_error: bool = True,
    ) -> FleetReport:
        timeout = self.timeout if timeout is None else _seconds(timeout, "timeout")
        rollback = self.rollback_timeout if rollback_timeout is None else _seconds(rollback_timeout, "rollback_timeout")
        rollback = min(rollback, timeout)  # the rollback never takes longer than the operation may
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("a Fleet runs one operation at a time (use it from one thread)")
        try:
            wall, t0 = time.time(), time.monotonic()
            brokers = {b.name: b.broker for b in self.buses}
            report = driver.run(
                self._links,
                FleetOp(op, self.names, on_failure),
                fields,
                t0 + timeout,
                rollback,
                t0,
                lambda done: FleetReport.of(done, brokers, (time.monotonic() - t0) * 1000, wall),
            )
        finally:
            self._busy.release()
        self.last_report = report
        if self.record is not None and op != "status":  # a record of what changed the buses, not of looks
            self._append(report)
        if raise_error and not report.ok:
            raise FleetError(report)
        return report

    def _append(self, report: FleetReport) -> None:
        line = json.dumps(report.to_json(), separators=(",", ":"), default=str) + "\n"
        with open(self.record, "a", encoding="utf-8") as f:  # type: ignore[arg-type]
            f.write(line)

    def close(self) -> None:
        for link in self._links:
            link.close()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _seconds(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} {value!r}: a positive number of seconds")
    return float(value)
