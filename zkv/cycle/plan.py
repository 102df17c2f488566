"""A cycle as data (docs/engine-vllm.md, "A fleet of vLLM servers": per
server, its own checkpoint and budget): its id, the weights each engine gets
and the ones a rollback loads back, the pause mode, one deadline for the
whole (rollback included) and each engine's budget under it.  Everything is
checked here, before any engine is asked."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from . import label as L
from .engine import WeightSource
from .terms import PauseMode

MAX_DEADLINE_S = 24 * 3600.0


def _seconds(value: float, what: str, low: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= low:
        raise ValueError(f"{what} {value!r}: a number of seconds above {low:g}")
    if value > MAX_DEADLINE_S:
        raise ValueError(f"{what} {value!r}: at most {MAX_DEADLINE_S:.0f} s")
    return float(value)


@dataclass(frozen=True)
class CyclePlan:
    """One cycle over named engines.

    ``sources[name]`` loads an engine's new weights, ``rollbacks[name]`` its old ones
    (missing: a failure after its update leaves its weights unknown, and it stays
    paused).  ``weights_changed=False`` is measured, never taken on the caller's word.
    ``deadline_s`` bounds the whole cycle; the forward steps stop ``rollback_s`` before
    it (a third of it by default), and ``budgets[name]`` bounds one engine's forward
    steps (the forward window by default): an engine past its budget fails the cycle,
    and every other engine rolls back in its own time.  ``call_timeout`` bounds each
    call, ``reset_tries_s`` the retries of a prefix cache reset, ``look_s`` the survey
    and the last look at each engine (what the report says it answers)."""

    cycle_id: str
    sources: Mapping[str, WeightSource]
    rollbacks: Mapping[str, WeightSource | None] = field(default_factory=dict)
    weights_changed: bool = True
    pause_mode: PauseMode = PauseMode.WAIT
    sleep: bool = False
    deadline_s: float = 120.0
    rollback_s: float | None = None
    budgets: Mapping[str, float] = field(default_factory=dict)
    new_label: str | None = None
    call_timeout: float = 30.0
    reset_tries_s: float = 10.0
    look_s: float = 5.0
    stage: bool = True
    keep_cpu_first: bool = True  # a clear before the update keeps the CPU tier (engines that clear first)

    def __post_init__(self) -> None:
        if not isinstance(self.cycle_id, str) or not L.ID.match(self.cycle_id):
            raise ValueError(f"a cycle id is 1-64 of [A-Za-z0-9._-], got {self.cycle_id!r}")
        object.__setattr__(self, "pause_mode", PauseMode(self.pause_mode))
        _seconds(self.deadline_s, "deadline_s")
        if self.rollback_s is not None:
            _seconds(self.rollback_s, "rollback_s")
        for name, budget in self.budgets.items():
            _seconds(budget, f"the budget of {name}")
        _seconds(self.call_timeout, "call_timeout")
        _seconds(self.reset_tries_s, "reset_tries_s")
        _seconds(self.look_s, "look_s")
        if self.new_label is not None and (
            not self.new_label or len(self.new_label) > L.MAX_LABEL or not self.new_label.isprintable()
        ):
            raise ValueError(f"the new label: 1-{L.MAX_LABEL} printable characters, got {self.new_label!r}")
        if L.is_record(self.new_label):
            raise ValueError(f"the new label may not start with {L.PREFIX!r}: that is a cycle's record")

    @property
    def target_label(self) -> str:
        """The label every engine carries once the cycle committed."""
        return self.new_label or self.cycle_id

    @property
    def rollback_window_s(self) -> float:
        """What the rollback keeps of the deadline (the forward steps stop this much before it)."""
        back = self.rollback_s if self.rollback_s is not None else max(5.0, self.deadline_s / 3)
        return min(back, self.deadline_s / 2)

    def check_engines(self, names: list[str]) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a cycle needs engines with distinct names, got {names}")
        for what, table in (("sources", self.sources), ("rollbacks", self.rollbacks), ("budgets", self.budgets)):
            unknown = sorted(set(table) - set(names))
            if unknown:
                raise ValueError(f"{what} names engines the cycle does not have: {unknown}")
        missing = sorted(set(names) - set(self.sources))
        if missing:
            raise ValueError(f"no weights named for {missing}")
