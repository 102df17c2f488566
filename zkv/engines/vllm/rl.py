"""Moved to ``zkv.cycle`` (the control plane lives in ``zkv/cycle/``,
docs/architecture.md): ``update_weights`` and ``weights_digest`` are
``zkv.cycle.update_weights`` and ``zkv.cycle.weights_digest``, and the report
is the one ``zkv.cycle.CycleReport``.  Each name read here warns, and this
module goes in zkv 0.3 (docs/versions.md)."""

from __future__ import annotations

import warnings
from typing import Any

_NAMES = ("update_weights", "weights_digest", "CycleReport")


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ... import cycle

    warnings.warn(
        f"zkv.engines.vllm.rl.{name} moved to zkv.cycle.{name}; the old name goes in zkv 0.3",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(cycle, name)
