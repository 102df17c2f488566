"""A harness cluster (benchmarks, demos, tests) dies with the process that
started it: a ``LocalCluster`` owner killed with kill -9 leaves no broker or
rank behind to load the machine (``zkv/harness/bus/lifeline.py``)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys

from test_up_lifecycle import gone

_OWNER = """
import json, sys, time
from zkv.harness.bus.cluster import LocalCluster
from zkv.wire.layout import CacheLayout
cluster = LocalCluster(1, CacheLayout(layers=1, gpu_blocks=8, cpu_blocks=8, block_size=4, kv_heads=1, head_dim=8),
                       directory=sys.argv[1], quiet=True).start()
print(json.dumps([cluster.broker.pid, *(w.pid for w in cluster.workers.values())]), flush=True)
time.sleep(120)  # killed by the test long before
"""


def test_a_cluster_owner_killed_with_kill_9_leaves_no_bus_process(tmp_path):
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(tmp_path / "bus")],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    pids: list[int] = []
    try:
        ready, _, _ = select.select([owner.stdout], [], [], 90)  # the cluster's start is bounded at 60 s
        assert ready, "the owner said nothing in 90 s"
        line = owner.stdout.readline()
        assert line, f"the owner exited before its cluster was ready (rc {owner.wait(30)})"
        pids = json.loads(line)
        assert len(pids) == 2 and all(pid > 0 for pid in pids)
        owner.kill()
        owner.wait(timeout=30)
        assert all(gone(pid, 30) for pid in pids), "a broker or rank outlived the process that started it"
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=30)
        for pid in pids:  # what a failure left behind
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
