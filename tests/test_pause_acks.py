"""``zkv pause`` says how many ranks of the world acknowledged it, and a pause
that not every rank acknowledged (a rank dead, or never started) is not a
silent success: exit 1 naming the missing ranks, unless ``--allow-partial``
(docs/operations.md, "Pause, clear, resume"; docs/deploy.md §4)."""

from __future__ import annotations

import json

from test_operator_paths import cli

from zkv.harness.bus.cluster import LocalCluster
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=1, gpu_blocks=16, cpu_blocks=16, block_size=4, kv_heads=2, head_dim=8)


def test_a_pause_without_every_rank_exits_1_naming_them_and_one_with_all_of_them_exits_0():
    cluster = LocalCluster(2, LAYOUT, worker_args=["--tier-dir", "none"], quiet=True)
    try:
        cluster.start_broker()
        cluster.wait_ready(ranks=0)
        b = ["--broker", cluster.endpoints.frontend]
        res = cli("pause", *b)
        assert res.returncode == 1, res.stdout + res.stderr
        assert "paused: epoch 1, 0 of 2 ranks acked" in res.stdout and "ranks [0, 1] did not" in res.stdout
        assert "only 0 of 2 ranks acknowledged the pause" in res.stderr and "--allow-partial" in res.stderr
        again = cli("pause", *b)  # already paused: still not every rank holds it
        assert again.returncode == 1 and "0 of 2 ranks hold it" in again.stdout, again.stdout
        said = cli("pause", "--json", *b)
        assert said.returncode == 1 and "only 0 of 2 ranks hold the pause" in said.stderr, said.stderr
        reply = json.loads(said.stdout)
        assert (reply["ranks_acked"], reply["world"], reply["ranks_missing"], reply["noop"]) == (0, 2, [0, 1], True)
        assert cli("pause", "--allow-partial", *b).returncode == 0

        cluster.start_worker(0)
        cluster.wait_ready(ranks=1)
        res = cli("pause", *b)
        assert res.returncode == 1 and "1 of 2 ranks hold it" in res.stdout and "ranks [1]" in res.stdout, res.stdout

        cluster.start_worker(1)
        cluster.wait_ready(ranks=2)
        assert cli("resume", *b).returncode == 0
        res = cli("pause", *b)
        assert res.returncode == 0 and "2 of 2 ranks acked" in res.stdout and "did not" not in res.stdout, res
        assert cli("resume", *b).returncode == 0

        cluster.kill_worker(1)  # dead, not yet declared so: the pause waits for it, then completes without it
        res = cli("pause", "--timeout", "20", *b)
        assert res.returncode == 1, res.stdout + res.stderr
    finally:
        cluster.stop()
