"""The CUDA control flow of the copy engine, on a machine without a GPU.

CUDA cannot run here, so torch.cuda's stream, event and cache calls are
replaced by recording fakes (the only mocks in the suite) while the copies
themselves run on real CPU tensors.  On a GPU machine the same code runs for
real: ``zkv bench copy`` there exercises it end to end.
"""

import pytest
import torch

from zkv.rank.cache.owned import KVCache
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=16, cpu_blocks=32, block_size=2, kv_heads=1, head_dim=4)


class Recorder:
    def __init__(self):
        self.calls = []


@pytest.fixture
def fake_cuda(monkeypatch):
    rec = Recorder()

    class FakeStream:
        def __init__(self, device=None):
            rec.calls.append(("stream", str(device)))

        def wait_stream(self, other):
            rec.calls.append(("wait_stream",))

    class FakeEvent:
        def record(self, stream):
            rec.calls.append(("event.record",))

        def synchronize(self):
            rec.calls.append(("event.synchronize",))

    class StreamContext:
        def __init__(self, stream):
            pass

        def __enter__(self):
            rec.calls.append(("enter_stream",))

        def __exit__(self, *exc):
            rec.calls.append(("exit_stream",))

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: rec.calls.append(("synchronize",)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: rec.calls.append(("empty_cache",)))
    return rec


def cuda_like_cache(rec) -> KVCache:
    cache = KVCache(LAYOUT, "cpu")
    cache.cuda = True
    cache.copy_stream = torch.cuda.Stream(device="cuda:0")
    rec.calls.clear()
    return cache


@pytest.mark.parametrize("src,dst", [([0, 1, 2], [5, 6, 7]), ([3, 9, 1], [0, 30, 12])])
def test_swaps_run_on_the_copy_stream_after_the_compute_stream_and_wait_on_an_event(fake_cuda, src, dst):
    cache = cuda_like_cache(fake_cuda)
    cache.fill("gpu", src, seed=5)
    before = cache.checksum("gpu", src)
    fake_cuda.calls.clear()
    cache.swap("swap_out", src, dst)
    assert fake_cuda.calls == [("wait_stream",), ("enter_stream",), ("event.record",), ("exit_stream",), ("event.synchronize",)]
    assert cache.checksum("cpu", dst) == before
    cache.fill("gpu", src, seed=6)
    cache.swap("swap_in", dst, src)
    assert cache.checksum("gpu", src) == before


def test_free_returns_memory_to_the_driver(fake_cuda):
    cache = cuda_like_cache(fake_cuda)
    freed = cache.free(keep_cpu=False)
    assert freed.nbytes > 0 and ("empty_cache",) in fake_cuda.calls
    assert fake_cuda.calls.index(("synchronize",)) < fake_cuda.calls.index(("empty_cache",)), "no free while copies run"
