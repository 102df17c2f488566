"""Moved to ``zkv.cycle.http`` (the control plane lives in ``zkv/cycle/``,
docs/architecture.md): each name read here warns, and this module goes in
zkv 0.3 (docs/versions.md)."""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from ...cycle import http

    value = getattr(http, name)
    warnings.warn(
        f"zkv.engines.vllm.server.{name} moved to zkv.cycle.http.{name}; the old name goes in zkv 0.3",
        DeprecationWarning,
        stacklevel=2,
    )
    return value
