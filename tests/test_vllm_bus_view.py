"""What the vLLM scheduler knows of its zkv bus (zkv/engines/vllm/bus_view.py),
against a real broker and ranks: pauses, clears and resumes heard from the
bus's broadcasts, the background status that heals what a broadcast missed,
serving only while running with every rank alive, and a bus that does not
answer makes the scheduler wait only at its first look (bounded), then
never: a status not answered in time stops serving."""

from __future__ import annotations

import time

import pytest

from zkv.client.client import Client
from zkv.engines.vllm.bus_view import BusView
from zkv.harness.bus.cluster import LocalCluster
from zkv.wire.layout import CacheLayout

pytestmark = pytest.mark.timeout(120)
LAYOUT = CacheLayout(layers=1, gpu_blocks=8, cpu_blocks=8, block_size=4, kv_heads=1, head_dim=8)


def hear(view: BusView, broadcasts: int, timeout: float = 10.0) -> bool:
    """Refresh until ``broadcasts`` more control broadcasts were heard (bounded); the last refresh's result."""
    want, deadline, moved = view.heard + broadcasts, time.monotonic() + timeout, False
    while view.heard < want:
        assert time.monotonic() < deadline, f"heard {view.heard} broadcasts, waited for {want}"
        view.sub.poll(100)
        moved = view.refresh(time.monotonic()) or moved
    return moved


def test_pauses_clears_and_resumes_are_heard_from_the_broadcasts(tmp_path):
    with LocalCluster(2, LAYOUT, directory=tmp_path) as cluster, Client(cluster.endpoints.frontend) as ctl:
        ctl.status(timeout=30, wait_ranks=2)
        client = Client(cluster.endpoints.frontend, request_timeout=0.25)
        # A background status every minute: all the view learns below comes from the broadcasts.
        view = BusView(client, world=2, interval=60.0, control=cluster.endpoints.control)
        try:
            view.refresh(time.monotonic(), force=True)
            assert view.serving
            ctl.pause()
            assert hear(view, 1) is False and not view.serving, "a pause stops serving with no round trip"
            ctl.clear(weights="step-2")
            assert hear(view, 1) is False and not view.serving
            before = (view.gen, view.cpu_gen)
            assert view.weights is None
            ctl.resume()
            assert hear(view, 1) is True and view.serving, "a resume is checked: the clear moved the generations"
            assert (view.gen, view.cpu_gen) != before
            assert view.weights == "step-2", "with the name the clear gave the weights"
        finally:
            view.close()
            client.close()


def test_the_background_status_heals_a_lost_broadcast_and_is_never_waited_for(tmp_path):
    with LocalCluster(2, LAYOUT, directory=tmp_path) as cluster, Client(cluster.endpoints.frontend) as ctl:
        ctl.status(timeout=30, wait_ranks=2)
        client = Client(cluster.endpoints.frontend, request_timeout=0.25)
        view = BusView(client, world=2, interval=0.0)  # hears no broadcast at all
        try:
            view.refresh(time.monotonic(), force=True)
            assert view.serving
            ctl.pause()
            deadline = time.monotonic() + 10
            while view.serving:  # each refresh sends a status or reads one that came
                assert time.monotonic() < deadline, "the background status never saw the pause"
                client.poll(0.02)  # a bounded wait for traffic
                view.refresh(time.monotonic())
            ctl.resume()
        finally:
            view.close()
            client.close()


def test_a_bus_that_does_not_answer_is_waited_for_once_then_asked_in_the_background(tmp_path):
    client = Client(f"ipc://{tmp_path}/none.sock", request_timeout=0.25)
    view = BusView(client, world=1, interval=0.0, timeout=0.25, backoff=5.0)
    try:
        # Never heard from: the first look asks and waits (bounded), then none for the backoff.
        assert view.refresh(500.0) is False and not view.serving and view._pending is None
        assert view.next_check == 505.0
        view.gen, view.serving = 3, True  # a bus it knew, serving until now
        t = 1000.0  # the view's own clock: what it does at each moment, without waiting for any of them
        assert view.refresh(t) is False and view.serving, "a status asked, not waited for"
        assert view._pending is not None
        view.refresh(t + 0.1)
        assert view.serving and view._pending is not None, "still within the timeout"
        view.refresh(t + 0.3)
        assert not view.serving and view._pending is None, "no answer within the timeout: offload off"
        for dt in (0.4, 2.0, 5.2):
            view.refresh(t + dt)
            assert view._pending is None, "nothing asked within the backoff"
        view.refresh(t + 5.4)
        assert view._pending is not None, "asked again after the backoff"
    finally:
        view.close()
        client.close()


def test_one_unanswered_status_turns_offload_off_for_the_backoff_not_the_poll_interval(tmp_path):
    client = Client(f"ipc://{tmp_path}/none.sock", request_timeout=0.25)
    view = BusView(client, world=1, interval=60.0, timeout=0.25, backoff=2.0)
    try:
        assert view.refresh(100.0) is False and not view.serving, "the first look is not answered"
        assert view.next_check == 102.0, "asked again after the backoff (2 s), not the interval (60 s)"
    finally:
        view.close()
        client.close()


def test_a_status_asked_before_a_pause_does_not_turn_serving_back_on(tmp_path):
    """The background status is asked at one step and read at a later one: one the bus
    answered ``running`` just before a pause must not outvote the pause's broadcast (a
    lookup would hit on a paused bus, and its load fail)."""
    with LocalCluster(2, LAYOUT, directory=tmp_path) as cluster, Client(cluster.endpoints.frontend) as ctl:
        ctl.status(timeout=30, wait_ranks=2)
        client = Client(cluster.endpoints.frontend, request_timeout=0.25)
        view = BusView(client, world=2, interval=0.0, control=cluster.endpoints.control)
        try:
            view.refresh(time.monotonic(), force=True)
            view.refresh(time.monotonic())  # asks a status in the background
            assert view._pending is not None
            req = view._pending[0]
            deadline = time.monotonic() + 10
            while req not in client.replies:  # answered (running), not read yet
                assert time.monotonic() < deadline, "no status reply"
                client.poll(0.02)  # files the reply, waits a bounded while for traffic
            ctl.pause()
            hear(view, 1)
            assert not view.serving, "the pause's broadcast stops serving"
            for _ in range(3):
                view.refresh(time.monotonic())
                assert not view.serving, "an answer from before the pause turned serving back on"
            ctl.resume()
        finally:
            view.close()
            client.close()
