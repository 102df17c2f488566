"""Which weights each server of a fleet serves, and whether the fleet is on
one version (docs/engine-vllm.md, "One weight version, fleet-wide"): each
server's label, the digest of vLLM's own checksums of its weights, its bus's
state and generations, and its identity (the model it serves, the weights it
measures); the fleet on one version, or which servers are mixed, and which
are behind the version a cycle last committed.

``FleetVersion`` is that commit, kept in a file (``zkv cycle --record``):
what a shared tier checks before it serves a server's rows (``admits``), and
what ``zkv cycle --show`` measures each server against.  A server restarted
from its command line after a commit loads its checkpoint, the old weights:
its label and its checksums are not the committed ones, so it is behind until
a cycle brings it forward."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import label as L
from .http import ServerError
from .vllm_http import ServerEngine, checksum_digest

FORMAT = 1


@dataclass(frozen=True)
class FleetVersion:
    """The weights a cycle committed fleet-wide: its ``label``, the digest of every server's
    measured weights (``weights``, None when not measured) and of its checkpoint (``checkpoint``)."""

    cycle: str
    label: str
    weights: str | None = None
    checkpoint: str | None = None
    servers: tuple[str, ...] = ()
    committed_at: float = 0.0

    def admits(self, label: str | None, weights: str | None = None) -> bool:
        """Whether a server that says ``label`` and measures ``weights`` serves this version: the hook
        a tier shared between servers checks before it serves or stores a server's rows."""
        if label != self.label:
            return False
        return self.weights is None or weights is None or weights == self.weights

    def save(self, path: str | os.PathLike[str]) -> None:
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps({"zkv_fleet_version": FORMAT, **asdict(self)}, indent=1) + "\n")
        os.replace(tmp, target)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "FleetVersion | None":
        """The version in ``path``; None when there is none yet; ``ValueError`` for a file that does not check."""
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            return None
        if not isinstance(raw, dict) or raw.get("zkv_fleet_version") != FORMAT:
            raise ValueError(f"{path}: not a zkv fleet version (format {FORMAT})")
        try:
            return cls(
                str(raw["cycle"]),
                str(raw["label"]),
                None if raw.get("weights") is None else str(raw["weights"]),
                None if raw.get("checkpoint") is None else str(raw["checkpoint"]),
                tuple(str(s) for s in raw.get("servers", ())),
                float(raw.get("committed_at", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: a fleet version that does not check ({err})") from None


@dataclass
class ServerView:
    """One server as it answers now (``error``: it did not)."""

    name: str
    url: str
    label: str | None = None
    in_cycle: str | None = None  # the cycle whose record its label holds
    paused: bool | None = None
    model: str | None = None
    weights: str | None = None  # the digest of vLLM's checksums of its weights
    bus_state: str | None = None
    gen: int | None = None
    cpu_gen: int | None = None
    error: str | None = None
    behind: bool = False

    @property
    def identity(self) -> str | None:
        """The model it serves and the weights it measures: what zkv keys its rows by."""
        if self.model is None or self.weights is None:
            return None
        return f"{self.model}@{self.weights[:16]}"


@dataclass
class FleetView:
    servers: list[ServerView]
    committed: FleetVersion | None = None
    version: str | None = None  # the weights most servers measure (the committed ones, when known)
    mixed: bool = False
    taken_at: float = field(default_factory=time.time)

    @property
    def behind(self) -> list[str]:
        return [s.name for s in self.servers if s.behind]

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "committed": asdict(self.committed) if self.committed else None,
            "mixed": self.mixed,
            "behind": self.behind,
            "servers": {
                s.name: {
                    "label": s.label,
                    "paused": s.paused,
                    "in_cycle": s.in_cycle,
                    "weights": s.weights,
                    "identity": s.identity,
                    "bus": {"state": s.bus_state, "gen": s.gen, "cpu_gen": s.cpu_gen},
                    "behind": s.behind,
                    **({"error": s.error} if s.error else {}),
                }
                for s in self.servers
            },
        }

    def describe(self) -> str:
        if self.mixed:
            head = "MIXED: the servers serve different weights"
        elif self.version is not None:
            head = f"one weight version: {self.version[:16]}"
        else:
            head = "weights not measured"
        if self.committed is not None:
            head += f"; the last commit: cycle {self.committed.cycle} (label {self.committed.label})"
        if self.behind:
            head += f"; BEHIND: {', '.join(self.behind)} (run a cycle to bring them forward)"
        lines = [head]
        for s in self.servers:
            if s.error:
                lines.append(f"  {s.name}: {s.error}")
                continue
            cycle = f", in cycle {s.in_cycle}" if s.in_cycle else ""
            weights = (s.weights or "-")[:16]
            bus = f"bus {s.bus_state} gen {s.gen} cpu_gen {s.cpu_gen}" if s.bus_state else "bus -"
            state = "paused" if s.paused else "serving"
            lines.append(
                f"  {s.name}: label {s.label}{cycle}, weights {weights}, {bus}, {state}"
                + (", BEHIND" if s.behind else "")
            )
        return "\n".join(lines)

    def metrics(self) -> str:
        """The same as Prometheus text (a node exporter's textfile, or a scrape through a pushgateway)."""

        def q(v: Any) -> str:
            return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

        out = [
            "# HELP zkv_fleet_server_info The weights a server serves (1 per server).",
            "# TYPE zkv_fleet_server_info gauge",
        ]
        for s in self.servers:
            out.append(
                f'zkv_fleet_server_info{{server="{q(s.name)}",label="{q(s.label)}",weights="{q(s.weights)}",'
                f'answers="{0 if s.error else 1}"}} 1'
            )
        out += ["# HELP zkv_fleet_server_behind 1 while a server is behind the fleet's committed weights.",
                "# TYPE zkv_fleet_server_behind gauge"]  # fmt: skip
        out += [f'zkv_fleet_server_behind{{server="{q(s.name)}"}} {int(s.behind)}' for s in self.servers]
        out += ["# HELP zkv_fleet_bus_cpu_generation A server's bus's CPU tier generation.",
                "# TYPE zkv_fleet_bus_cpu_generation gauge"]  # fmt: skip
        out += [f'zkv_fleet_bus_cpu_generation{{server="{q(s.name)}"}} {s.cpu_gen}' for s in self.servers if s.cpu_gen]
        out += [
            "# HELP zkv_fleet_mixed 1 while the servers serve different weights.",
            "# TYPE zkv_fleet_mixed gauge",
            f"zkv_fleet_mixed {int(self.mixed)}",
        ]
        return "\n".join(out) + "\n"


def _look(engine: ServerEngine, checksums: bool, timeout: float) -> ServerView:
    view = ServerView(engine.name, engine.url)
    s = engine.server
    try:
        view.label = s.weight_version(timeout)
        view.paused = s.is_paused(timeout)
        view.model = s.model_root(timeout)
        if checksums:
            view.weights = checksum_digest(s.weight_checksums(timeout))
    except ServerError as err:
        view.error = err.why
        return view
    try:
        record = L.decode(view.label)
        view.in_cycle = record.cycle if record is not None else None
    except L.LabelError as err:
        view.in_cycle = f"(unreadable: {err})"
    if engine.bus is not None:
        try:
            status = engine.bus.status(timeout)
            view.bus_state, view.gen, view.cpu_gen = str(status.state), status.gen, status.cpu_gen
        except Exception as err:  # noqa: BLE001 - the view says what the bus answered
            view.bus_state = f"no answer ({err})"
    return view


def look(
    engines: list[ServerEngine], *, committed: FleetVersion | None = None, checksums: bool = True, timeout: float = 30.0
) -> FleetView:
    """Every server at once, as it answers now, measured against ``committed`` (or, without one,
    against the weights most servers measure)."""
    with ThreadPoolExecutor(max_workers=max(1, min(32, len(engines)))) as pool:
        views = list(pool.map(lambda e: _look(e, checksums, timeout), engines))
    answered = [v for v in views if v.error is None]
    weights = Counter(v.weights for v in answered if v.weights is not None)
    view = FleetView(views, committed)
    view.mixed = len(weights) > 1
    if committed is not None and committed.weights is not None:
        view.version = committed.weights
    elif weights:
        view.version = weights.most_common(1)[0][0]
    for v in answered:
        if committed is not None and v.in_cycle is None:
            v.behind = not committed.admits(v.label, v.weights)
        elif view.version is not None and v.weights is not None:
            v.behind = v.weights != view.version
    return view
