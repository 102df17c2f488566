"""Moved to ``zkv.cycle`` (the control plane lives in ``zkv/cycle/``,
docs/architecture.md): ``update_weights`` and ``weights_digest`` are
``zkv.cycle.update_weights`` and ``zkv.cycle.weights_digest``, and the report
is the one ``zkv.cycle.CycleReport``.  The first read of each name here warns
(``wire.moved.forward``), and this module goes in zkv 0.3 (docs/versions.md)."""

from __future__ import annotations

from ...wire.moved import forward

# each name kept its name in zkv.cycle
__getattr__ = forward(__name__, {n: f"zkv.cycle.{n}" for n in ("update_weights", "weights_digest", "CycleReport")})
