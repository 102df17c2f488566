"""The cycle's driver for a vLLM ``LLM`` in this process and its zkv bus
(docs/engine-vllm.md, "The RL cycle"): the engine stops scheduling with
``sleep(level=0)`` and starts again with ``wake_up(["scheduling"])``; its
label is vLLM's weight version (``llm_engine.set_weight_version``); its
weights are measured with vLLM's own checksums.  The ``LLM`` is driven
duck-typed: this module imports neither vLLM nor torch.

``update_weights`` runs the one cycle over such engines, with the deadline,
rollback and resumable id every cycle has."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any, Callable, Sequence

from ..fleet.spec import BusSpec
from ..wire.errors import ZkvError
from .bus import LinkedBus, WithBus
from .engine import Look
from .engines import EngineFleet
from .report import CycleReport
from .terms import Outcome, PauseMode


def weights_digest(llm: Any) -> str:
    """An engine's weights, measured: one digest over vLLM's own checksum of every
    weight on every worker (``compute_weight_checksums``, SHA-256 of each tensor's bytes)."""
    digest = hashlib.blake2b(digest_size=16)
    for checksums in llm.collective_rpc("compute_weight_checksums"):
        for name in sorted(checksums):
            digest.update(f"{name}={checksums[name]};".encode())
    return digest.hexdigest()


class LlmEngine(WithBus):
    """A vLLM ``LLM`` of this process (``llm``) with its bus at ``bus``.  Its calls cannot
    be interrupted: the cycle's runner gives up one past its bound, and the report calls
    the engine hung."""

    clears_before_update = False  # vLLM owns its KV memory

    def __init__(self, name: str, llm: Any, bus: BusSpec | str | dict[str, Any] | None):
        self.name = name
        self.llm = llm
        self.bus = LinkedBus(name, bus) if bus is not None else None
        self._label: str | None = None  # where vLLM has no weight version of its own

    def _engine(self) -> Any:
        return getattr(self.llm, "llm_engine", None)

    def look(self, sleep: bool, timeout: float) -> Look:
        engine = self._engine()
        asleep = bool(engine.is_sleeping()) if engine is not None and hasattr(engine, "is_sleeping") else False
        if engine is not None and hasattr(engine, "get_weight_version"):
            return Look(asleep, engine.get_weight_version())
        return Look(asleep, self._label)

    def model_path(self, timeout: float) -> str | None:
        engine = self._engine()
        config = getattr(engine, "model_config", None) or getattr(
            getattr(engine, "vllm_config", None), "model_config", None
        )
        return str(config.model) if config is not None else None

    def set_label(self, label: str, timeout: float) -> None:
        engine = self._engine()
        if engine is not None and hasattr(engine, "set_weight_version"):
            engine.set_weight_version(label)
        else:
            self._label = label

    def stop(self, mode: PauseMode, sleep: bool, timeout: float) -> None:
        self.llm.sleep(level=0, mode=str(mode))

    def start(self, sleep: bool, timeout: float) -> None:
        self.llm.wake_up(["scheduling"])

    def reload_weights(self, path: str, timeout: float) -> None:
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})

    def weights(self, timeout: float) -> str:
        return weights_digest(self.llm)

    def reset(self, running: bool, external: bool, timeout: float) -> bool:
        return bool(self.llm.reset_prefix_cache(reset_running_requests=running, reset_connector=external))


def update_weights(
    engines: Sequence[Any],
    buses: Sequence[BusSpec | str | dict[str, Any]] | Any,
    update: Callable[[Any], None] | Any,
    *,
    weights_changed: bool = True,
    rollback: Callable[[Any], None] | Any = None,
    cycle_id: str | None = None,
    **knobs: Any,
) -> CycleReport:
    """One cycle over ``engines`` (vLLM ``LLM`` s), each with its bus in ``buses`` (their
    addresses, ``BusSpec`` s, or a ``zkv.Fleet`` of them, in the same order).  ``update(llm)``
    loads the new weights (or a weight source), ``rollback(llm)`` the old ones.  Returns
    the report, or raises ``CycleError`` (with it) unless the cycle committed; the cycle id
    (``cycle_id``, or a new one) finishes it when run again."""
    specs = list(getattr(buses, "buses", buses))
    if len(specs) != len(engines):
        raise ValueError(f"{len(engines)} engines and {len(specs)} buses")
    drivers = [LlmEngine(f"engine-{i}", llm, bus) for i, (llm, bus) in enumerate(zip(engines, specs))]
    cid = cycle_id or f"rl-{uuid.uuid4().hex[:12]}"
    knobs.setdefault("sleep", True)  # an LLM stops scheduling by sleep(level=0): the report says so

    def plain(fn: Any) -> Any:
        if fn is None or (hasattr(fn, "apply") and hasattr(fn, "stage")):
            return fn
        return lambda llm, timeout: fn(llm)

    with EngineFleet(drivers, unwrap=lambda e: e.llm) as fleet:
        report = fleet.cycle(cid, plain(update), rollback=plain(rollback), weights_changed=weights_changed, **knobs)
    if report.outcome is not Outcome.COMMITTED:
        raise CycleError(report)
    return report


class CycleError(ZkvError):
    """A cycle that did not commit; ``report`` says where each engine is and how to finish it."""

    def __init__(self, report: CycleReport):
        super().__init__(f"cycle_{report.outcome}", report.describe())
        self.report = report
