"""The CUDA control flow of the engine-cache copy engine, without a GPU.

torch.cuda's stream, event and stream-context calls are recording fakes (the
only mocks here); the copies run on real CPU tensors, so the bytes are still
checked.  On a GPU machine the same code runs for real."""

from __future__ import annotations

import pytest
import torch

from zkv.rank.cache import layouts
from zkv.rank.cache.copier import CopyEngine
from zkv.rank.cache.regions import EngineCache
from zkv.rank.cache.tier import CpuTier


@pytest.fixture
def calls(monkeypatch):
    rec: list[tuple] = []

    class FakeStream:
        def __init__(self, device=None):
            rec.append(("stream", str(device)))

        def wait_stream(self, other):
            rec.append(("wait_stream", other))

        def wait_event(self, event):
            rec.append(("wait_event", event))

    class FakeEvent:
        def __init__(self, blocking=False):
            rec.append(("event", blocking))

        def record(self, stream):
            rec.append(("event.record", type(stream).__name__))

        def synchronize(self):
            rec.append(("event.synchronize",))

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            rec.append(("enter_stream", type(self.stream).__name__))

        def __exit__(self, *exc):
            rec.append(("exit_stream",))

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    return rec


def cuda_like(rec, **kw):
    k = torch.arange(8 * 64, dtype=torch.float32).view(8, 2, 4, 8)
    cache = EngineCache.from_tensors(layouts.per_layer({"k": k}))
    copier = CopyEngine(cache, CpuTier.for_cache(cache.descriptor, rows=8, pin=False), **kw)
    copier.cuda = True
    copier.copy_stream = torch.cuda.Stream(device="cuda:0")
    rec.clear()
    return k, copier


def test_a_swap_waits_for_the_compute_stream_copies_on_the_copy_stream_and_waits_on_an_event(calls):
    k, copier = cuda_like(calls)
    want = k[[1, 4]].clone()
    copier.swap_out([1, 4], [0, 1])
    assert calls == [("wait_stream", "compute"), ("enter_stream", "FakeStream"), ("event", True), ("event.record", "FakeStream"),
                     ("exit_stream",), ("event.synchronize",)]
    k.zero_()
    calls.clear()
    copier.swap_in([0, 1], [6, 7])
    assert calls[-1] == ("event.synchronize",), "a swap-in returns (reports ok) only after its copy completed"
    assert torch.equal(k[6:8], want)


def test_an_event_passed_with_the_task_replaces_the_stream_wait(calls):
    _, copier = cuda_like(calls)
    copier.swap_out([0], [0], wait_event="engine-event")
    assert calls[0] == ("wait_event", "engine-event") and ("wait_stream", "compute") not in calls


def test_the_engine_can_name_its_compute_stream(calls):
    _, copier = cuda_like(calls, compute_stream="engine-stream")
    copier.swap_in([0], [0])
    assert calls[0] == ("wait_stream", "engine-stream")


@pytest.mark.parametrize("staging_rows", [1, 3, 64])
def test_multi_region_runs_go_through_a_staging_buffer_in_tier_row_layout(calls, staging_rows):
    ks = [torch.randint(0, 1000, (12, 2, 4, 8), dtype=torch.int32) for _ in range(3)]
    cache = EngineCache.from_tensors(layouts.zkv_native(ks[:2], ks[1:]))  # layer1.k is layer0.v: kept once
    tier = CpuTier.for_cache(cache.descriptor, rows=16, pin=False)
    copier = CopyEngine(cache, tier, staging_bytes=staging_rows * tier.row_bytes)
    copier.cuda, copier.copy_stream = True, torch.cuda.Stream(device="cuda:0")
    src, rows, dst = [0, 1, 2, 3, 4, 9], [5, 6, 7, 8, 9, 0], [6, 7, 8, 9, 10, 11]
    want = [k[src].clone() for k in ks]
    copier.swap_out(src, rows)
    assert copier._staging is not None and copier._staging.shape == (staging_rows, tier.row_bytes)
    for k in ks:
        k.zero_()
    copier.swap_in(rows, dst)
    assert all(torch.equal(k[dst], w) for k, w in zip(ks, want))
    assert [c[0] for c in calls].count("event.synchronize") == 2
    copier.close()
    assert copier._staging is None


def test_the_tier_is_pinned_when_cuda_exists(monkeypatch):
    seen = []
    real_zeros = torch.zeros

    def zeros(*args, pin_memory=False, **kw):
        seen.append(pin_memory)
        return real_zeros(*args, **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch, "zeros", zeros)
    tier = CpuTier([("k", 64)], rows=2)
    assert tier.pinned and seen == [True]


def test_the_rank_backend_waits_for_the_stream_the_engine_passed(calls):
    """RankAgent(compute_stream=s) -> EngineBackend -> AttachedCache -> CopyEngine: copies wait for s."""
    from zkv.rank.cache.engine_backend import EngineBackend

    k = torch.arange(8 * 64, dtype=torch.float32).view(8, 2, 4, 8)
    backend = EngineBackend(EngineCache.from_tensors(layouts.per_layer({"k": k})), 8, compute_stream="engine-stream", pin=False)
    copier = backend.attached.copier
    copier.cuda = True
    copier.copy_stream = torch.cuda.Stream(device="cuda:0")
    calls.clear()
    backend.swap("swap_out", [2, 3], [0, 1])
    assert calls[0] == ("wait_stream", "engine-stream") and calls[-1] == ("event.synchronize",)
