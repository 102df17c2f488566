"""Moved to ``zkv.cycle`` (the control plane lives in ``zkv/cycle/``,
docs/architecture.md): each name read here warns, and this module goes in
zkv 0.3 (docs/versions.md).  ``parse_label`` reads the cycle's record
(``zkv.cycle.label.decode``) as the (id, phase, old label) it used to split."""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = {
    "ServerFleet": "servers",
    "ServerSpec": "servers",
    "ReloadWeights": "servers",
    "CycleBusy": "servers",
    "reset_prefix_cache": "servers",
    "CycleReport": "report",
    "EngineReport": "report",
    "WeightUpdate": "engine",
}


def _parse_label(text: str | None) -> tuple[str, str, str] | None:
    from ...cycle import label

    record = label.decode(text)
    return None if record is None else (record.cycle, str(record.phase), record.old or "")


def __getattr__(name: str) -> Any:
    from ...cycle import engine, report, servers

    modules = {"servers": servers, "report": report, "engine": engine}
    if name == "parse_label":
        value: Any = _parse_label
        new = "zkv.cycle.label.decode"
    elif name in _MOVED:
        value = getattr(modules[_MOVED[name]], "WeightSource" if name == "WeightUpdate" else name)
        new = f"zkv.cycle.{'WeightSource' if name == 'WeightUpdate' else name}"
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"zkv.engines.vllm.server_cycle.{name} moved to {new}; the old name goes in zkv 0.3",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
