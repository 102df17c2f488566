"""``zkv replay`` without ``--broker``: the trace played on a bus of its own,
a ``LocalCluster`` of the trace's world size and layout started for it and
stopped after (docs/architecture.md, "Modules")."""

from __future__ import annotations

import json
import os
from typing import Any

from ...replay import Replayer, Report, check
from ...trace import LAYOUT_ENV, Trace
from ...wire.layout import CacheLayout
from .cluster import LocalCluster


def replay_embedded(
    trace: Trace, *, record: str | None = None, heartbeat_ms: int = 100, start_timeout: float = 120.0, **kwargs: Any
) -> Report:
    """Start a LocalCluster with the trace's world size and layout, replay, stop it.
    The report's ``teardown`` says what the stop met (ranks it had to kill), '' when
    nothing: the stop is bounded and removes the cluster's tiers and directory.

    ``record`` passes ``--record`` to its broker (the layout goes into the
    recording's header through ``ZKV_TRACE_LAYOUT``: the broker does not know it).
    """
    layout = trace.layout or CacheLayout()
    args = ["--heartbeat-ms", str(heartbeat_ms)]
    if record:
        args += ["--record", record]
    cluster = LocalCluster(trace.world, layout, quiet=True, broker_args=args)
    old = os.environ.get(LAYOUT_ENV)
    os.environ[LAYOUT_ENV] = json.dumps(layout.to_wire())
    try:
        try:
            cluster.start(timeout=start_timeout)
        finally:
            if old is None:
                os.environ.pop(LAYOUT_ENV, None)
            else:
                os.environ[LAYOUT_ENV] = old
        obs = Replayer(trace, cluster.endpoints.frontend, **kwargs).run()
        obs.target = (
            f"an embedded cluster ({trace.world} ranks, {layout.gpu_blocks} GPU / {layout.cpu_blocks} CPU blocks)"
        )
    finally:
        end = cluster.stop()  # bounded, never raises; removes the tiers and the directory whatever happened
    if end.exited_before:  # a process that ended during the replay: part of what the replay saw
        ended = ", ".join(f"{name} (code {code})" for name, code in end.exited_before.items())
        obs.notes.append(f"the embedded cluster's {ended} exited during the replay")
    report = check(trace, obs)
    report.teardown = end.said()
    return report
