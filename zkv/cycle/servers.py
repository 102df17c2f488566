"""One RL cycle over a fleet of vLLM servers, each with its own zkv bus, as
one transaction (docs/engine-vllm.md, "A fleet of vLLM servers"):

    fleet = ServerFleet([ServerSpec("a", "http://10.0.0.1:8000", "tcp://10.0.0.1:5555"), ...])
    report = fleet.cycle("step-42", ReloadWeights("/ckpt/step-42"), rollback=ReloadWeights("/ckpt/step-41"))

The steps, the rollback and the report are the one cycle's (``table.py``,
``core.py``, ``report.py``); this module names the servers, and the
``zkv cycle`` command line that finishes a cycle left incomplete."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

from .engines import EngineFleet
from .http import ServerError, VllmServer
from .report import CycleReport
from .runner import CycleBusy
from .sources import ReloadWeights
from .version import FleetVersion, FleetView, look
from .vllm_http import ServerEngine

__all__ = ["CycleBusy", "ReloadWeights", "ServerFleet", "ServerSpec", "cycle_argv", "reset_prefix_cache"]


@dataclass(frozen=True)
class ServerSpec:
    """One engine: its ``name``, its server's ``url`` and its zkv bus's frontend ``bus``."""

    name: str
    url: str
    bus: str


def _paths(given: Any, names: list[str]) -> dict[str, str] | None:
    """Per-server checkpoint paths of a ``ReloadWeights`` (or a map of them); None for anything else."""
    if given is None:
        return {}
    if isinstance(given, ReloadWeights):
        return dict.fromkeys(names, given.path)
    if isinstance(given, Mapping) and all(isinstance(v, ReloadWeights) for v in given.values()):
        return {n: v.path for n, v in given.items()}
    return None


def cycle_argv(
    cycle_id: str,
    servers: list[ServerSpec],
    reload: Mapping[str, str],
    rollback: Mapping[str, str],
    *,
    unchanged: bool = False,
    mode: str = "wait",
    sleep: bool = False,
    deadline: float = 120.0,
    budgets: Mapping[str, float] | None = None,
    label: str | None = None,
    stage: bool = True,
    record: str | None = None,
) -> list[str]:
    """The ``zkv cycle`` command line of a cycle (what a report names to finish it)."""
    argv = ["zkv", "cycle", cycle_id]
    for s in servers:
        argv += ["--server", s.name, s.url, s.bus]
    for flag, paths in (("--reload", reload), ("--rollback", rollback)):
        if len(set(paths.values())) == 1 and set(paths) == {s.name for s in servers}:
            argv += [flag, next(iter(paths.values()))]
        else:
            for name, path in paths.items():
                argv += [f"{flag}-on", name, path]
    argv += ["--unchanged"] if unchanged else []
    argv += ["--mode", str(mode)] if str(mode) != "wait" else []
    argv += ["--sleep"] if sleep else []
    argv += ["--deadline", f"{deadline:g}"]
    for name, budget in (budgets or {}).items():
        argv += ["--budget-on", name, f"{budget:g}"]
    argv += ["--label", label] if label is not None else []
    argv += ["--no-stage"] if not stage else []
    argv += ["--record", record] if record is not None else []
    return argv


def committed(report: CycleReport, label: str) -> FleetVersion:
    """The version a committed cycle leaves: its label, and the weights every engine measured and
    staged (when they all agree)."""
    staged = {e.staged for e in report.engines.values()}
    return FleetVersion(
        report.cycle_id,
        label,
        weights=report.weights_after,
        checkpoint=staged.pop() if len(staged) == 1 else None,
        servers=tuple(report.engines),
        committed_at=time.time(),
    )


def reset_prefix_cache(server: VllmServer, tries_s: float, call_timeout: float = 30.0, running: bool = False) -> None:
    """A prefix cache reset retried while vLLM answers ``success: false`` (held blocks),
    backing off from 5 ms to 0.2 s apart, for at most ``tries_s``; then ``ServerError``."""
    end = time.monotonic() + tries_s
    wait = 0.005
    while True:
        if server.reset_prefix_cache(running, timeout=max(0.1, min(call_timeout, end - time.monotonic()))):
            return
        if time.monotonic() + wait > end:
            raise ServerError(server.url, "/reset_prefix_cache", f"still success: false after {tries_s:.1f} s")
        time.sleep(wait)
        wait = min(0.2, wait * 2)


class ServerFleet:
    """vLLM servers, each with its own bus, driven through RL cycles.

    ``call_timeout`` bounds each HTTP call; ``reset_tries_s`` how long a prefix
    cache reset is retried while vLLM answers ``success: false``."""

    def __init__(
        self,
        servers: list[ServerSpec],
        *,
        call_timeout: float = 30.0,
        reset_tries_s: float = 10.0,
        finish_hint: str = "",
        record: str | None = None,
    ):
        names = [s.name for s in servers]
        if not servers or len(set(names)) != len(names):
            raise ValueError(f"a server fleet needs engines with distinct names, got {names}")
        self.specs = list(servers)
        self.engines = [ServerEngine(s.name, s.url, s.bus, call_timeout) for s in servers]
        self.servers = {e.name: e.server for e in self.engines}
        self.call_timeout = call_timeout
        self.reset_tries_s = reset_tries_s
        self.finish_hint = finish_hint
        self.record = record  # where a commit writes the fleet's version (version.py)
        self._fleet = EngineFleet(self.engines, unwrap=lambda e: e.server)

    def close(self) -> None:
        self._fleet.close()

    def __enter__(self) -> "ServerFleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def cycle(
        self,
        cycle_id: str,
        update: Any,
        *,
        rollback: Any = None,
        weights_changed: bool = True,
        pause_mode: str = "wait",
        sleep: bool = False,
        deadline_s: float = 120.0,
        rollback_s: float | None = None,
        budgets: Mapping[str, float] | None = None,
        new_label: str | None = None,
        stage: bool = True,
        finish_argv: list[str] | None = None,
    ) -> CycleReport:
        """Run (or finish) cycle ``cycle_id``: ``update`` loads an engine's new weights
        (a ``ReloadWeights``, a function ``(server, timeout)``, or a map name -> either),
        ``rollback`` its old ones.  ``finish_argv``: the command line that started it, when
        one did (``zkv cycle``), else one is written when ``update`` is a checkpoint."""
        names = [s.name for s in self.specs]
        reload, back = _paths(update, names), _paths(rollback, names)
        if finish_argv is None and reload is not None and back is not None:
            finish_argv = cycle_argv(
                cycle_id, self.specs, reload, back, unchanged=not weights_changed, mode=pause_mode, sleep=sleep,
                deadline=deadline_s, budgets=budgets, label=new_label, stage=stage, record=self.record,
            )  # fmt: skip
        argv = finish_argv

        def finish(cid: str) -> tuple[str, list[str] | None]:
            if self.finish_hint:
                return self.finish_hint.format(cycle=cid), argv
            if argv is not None:
                import shlex

                return shlex.join(argv), argv
            return f"run cycle {cid!r} again (the same call, with the same cycle id)", None

        self._fleet.finish = finish
        plan = self._fleet.plan(
            cycle_id, update, rollback=rollback, weights_changed=weights_changed, pause_mode=pause_mode,
            sleep=sleep, deadline_s=deadline_s, rollback_s=rollback_s, budgets=dict(budgets or {}),
            new_label=new_label, call_timeout=self.call_timeout, reset_tries_s=self.reset_tries_s, stage=stage,
        )  # fmt: skip
        known = FleetVersion.load(self.record) if self.record is not None else None
        report = self._fleet.run(plan, fleet_label=known.label if known is not None else None)
        if self.record is not None and report.committed:
            committed(report, plan.target_label).save(self.record)
        return report

    def look(self, *, checksums: bool = True, timeout: float = 30.0) -> FleetView:
        """Which weights each server serves now, and whether the fleet is on one version
        (measured against the version this fleet's ``record`` holds, when it has one)."""
        known = FleetVersion.load(self.record) if self.record is not None else None
        return look(self.engines, committed=known, checksums=checksums, timeout=timeout)

    def _reset(self, server: VllmServer, timeout: float, running: bool = False) -> None:
        reset_prefix_cache(server, min(timeout, self.reset_tries_s), self.call_timeout, running)

    def finish_command(self, cycle_id: str) -> str:
        return self.finish_hint.format(cycle=cycle_id) if self.finish_hint else f"run cycle {cycle_id!r} again"

    def states(self, timeout: float = 5.0) -> dict[str, dict[str, Any]]:
        """Each engine's label, pause state and reachability, as it reports them now."""
        out: dict[str, dict[str, Any]] = {}
        for name, s in self.servers.items():
            try:
                out[name] = {"label": s.weight_version(timeout), "paused": s.is_paused(timeout)}
            except ServerError as err:
                out[name] = {"error": err.why, "down": err.down, "hung": err.hung}
        return out
