"""Engines driven through RL cycles, whatever their kind (docs/engine-vllm.md,
"The RL cycle"): ``EngineFleet`` holds one driver per engine (``engine.py``)
and a thread per engine for its life, and runs each cycle's plan over them.

    fleet = EngineFleet([ServerEngine("a", "http://10.0.0.1:8000", "tcp://10.0.0.1:5555"), ...])
    report = fleet.cycle("step-42", ReloadWeights("/ckpt/step-42"), rollback=ReloadWeights("/ckpt/step-41"))
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from . import sources
from .engine import Engine
from .plan import CyclePlan
from .report import CycleReport
from .runner import Workers, run

#: (text, argv) of the command that finishes cycle ``id`` (argv None: no command line started it).
FinishHint = Callable[[str], "tuple[str, list[str] | None]"]


class EngineFleet:
    """Engines, each with its bus, driven through cycles one at a time (from one thread)."""

    def __init__(
        self, engines: Sequence[Engine], *, finish: FinishHint | None = None, unwrap: Callable[[Any], Any] | None = None
    ):
        names = [e.name for e in engines]
        if not engines or len(set(names)) != len(names):
            raise ValueError(f"a fleet needs engines with distinct names, got {names}")
        self.engines = {e.name: e for e in engines}
        self.finish = finish
        self._unwrap = unwrap or (lambda e: e)
        self._workers = Workers()

    def plan(
        self,
        cycle_id: str,
        update: Any,
        *,
        rollback: Any = None,
        **knobs: Any,
    ) -> CyclePlan:
        """A plan for every engine: ``update`` and ``rollback`` are a weight source, a function
        (called with the engine as its driver exposes it, and a timeout), or a map name -> one."""
        return CyclePlan(cycle_id, self._each(update), self._each(rollback), **knobs)

    def _each(self, given: Any) -> dict[str, Any]:
        if given is None:
            return {}
        if isinstance(given, Mapping):
            return {n: sources.of(u, self._unwrap) for n, u in given.items() if u is not None}
        source = sources.of(given, self._unwrap)
        return dict.fromkeys(self.engines, source)

    def cycle(self, cycle_id: str, update: Any, *, rollback: Any = None, **knobs: Any) -> CycleReport:
        """Run (or finish) cycle ``cycle_id`` (``CyclePlan`` names the knobs)."""
        return self.run(self.plan(cycle_id, update, rollback=rollback, **knobs))

    def run(self, plan: CyclePlan, fleet_label: str | None = None) -> CycleReport:
        """``fleet_label``: the label the fleet last committed (an engine without it is behind)."""
        finish = self.finish(plan.cycle_id) if self.finish is not None else None
        return run(plan, self.engines, self._workers, finish=finish, fleet_label=fleet_label)

    def close(self) -> None:
        self._workers.close()
        for e in self.engines.values():
            e.close()

    def __enter__(self) -> "EngineFleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
