"""What the vLLM scheduler knows of its zkv bus (zkv/engines/vllm/bus_view.py),
against a real broker and ranks: serving only while running with every rank
alive, generations moved by a clear, and a bus that does not answer costs the
scheduler's thread a short, rare wait."""

from __future__ import annotations

import time

import pytest

from zkv.client.client import Client
from zkv.engines.vllm.bus_view import BusView
from zkv.harness.bus.cluster import LocalCluster
from zkv.wire.layout import CacheLayout

pytestmark = pytest.mark.timeout(120)


def test_serving_follows_the_bus_and_a_clear_moves_the_generations(tmp_path):
    layout = CacheLayout(layers=1, gpu_blocks=8, cpu_blocks=8, block_size=4, kv_heads=1, head_dim=8)
    with LocalCluster(2, layout, directory=tmp_path) as cluster, Client(cluster.endpoints.frontend) as ctl:
        ctl.status(timeout=30, wait_ranks=2)
        view = BusView(Client(cluster.endpoints.frontend, request_timeout=0.25), world=2, interval=0.0)
        try:
            view.refresh(time.monotonic())
            assert view.serving
            ctl.pause()
            assert view.refresh(time.monotonic()) is False and not view.serving
            ctl.clear()
            assert view.refresh(time.monotonic()) is True, "a clear moves the generations"
            ctl.resume()
            view.refresh(time.monotonic())
            assert view.serving
        finally:
            view.client.close()


def test_a_bus_that_does_not_answer_costs_a_short_wait_then_none_for_the_backoff(tmp_path):
    view = BusView(Client(f"ipc://{tmp_path}/none.sock", request_timeout=0.25), world=1, interval=0.0, backoff=5.0)
    try:
        start = time.monotonic()
        assert view.refresh(start) is False and not view.serving
        first = time.monotonic() - start
        assert first < 1.0, first
        start = time.monotonic()
        for _ in range(100):
            view.refresh(time.monotonic())
        assert time.monotonic() - start < 0.1, "no new question within the backoff"
    finally:
        view.client.close()
