"""Moved to ``zkv.cycle.prefix`` (the cycle lives in ``zkv/cycle/``,
docs/architecture.md): each name read here warns, and this module goes in
zkv 0.3 (docs/versions.md)."""

from __future__ import annotations

import warnings
from typing import Any

_NAMES = ("drain_and_clear", "resume", "pause_clear_resume")


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from ..cycle import prefix

    warnings.warn(
        f"zkv.prefix.cycle.{name} moved to zkv.cycle.prefix.{name}; the old name goes in zkv 0.3",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(prefix, name)
