"""Moved to ``zkv.cycle.prefix`` (the cycle lives in ``zkv/cycle/``,
docs/architecture.md): the first read of each name here warns
(``wire.moved.forward``), and this module goes in zkv 0.3 (docs/versions.md)."""

from __future__ import annotations

from ..wire.moved import forward

# each name kept its name in zkv.cycle.prefix
__getattr__ = forward(
    __name__, {n: f"zkv.cycle.prefix.{n}" for n in ("drain_and_clear", "resume", "pause_clear_resume")}
)
