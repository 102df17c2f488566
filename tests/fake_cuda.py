"""Recording fakes for torch.cuda (there is no GPU here) that also model stream order.

The copies themselves run on real CPU tensors; only torch.cuda's streams,
events and stream contexts are fakes (the only mocks in the suite).  The
fakes keep, per stream, the set of ops it is ordered after (its own, and
those of streams and events it waited on) and whether it is ordered after
the engine (it waited on the compute stream, the engine's stream or an event
the engine passed: anything that is not one of our fake streams).  Every
tensor op issued inside a stream context is recorded with its stream, so a
test can ask: did every op on engine or tier memory run on a stream ordered
after the engine; did the event synchronized last cover every op; how many
transfers touched the pinned tier; how many pinned allocations happened.

Use the ``fake_cuda`` fixture (``from fake_cuda import fake_cuda_fixture  # noqa: F401``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


@dataclass
class Op:
    id: int
    kind: str  # copy_, index_copy_, index_select
    stream: str | None  # None: issued on no fake stream (host side)
    after_engine: bool
    dst: str  # the watched memory it writes ("tier", "engine", ...) or "other"
    src: str
    contiguous: bool  # both sides dense: one cudaMemcpyAsync on a real GPU
    non_blocking: bool
    writes: tuple[int, int]  # byte spans [lo, hi) of the destination and the source
    reads: tuple[int, int]
    after: frozenset[int]  # the ops this one is ordered after (on a GPU: would have completed first)


def span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` can touch, as one interval (a strided view covers its gaps too: conservative)."""
    if t.numel() == 0:
        return (0, 0)
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size())


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


class FakeCuda:
    def __init__(self):
        self.calls: list[tuple] = []
        self.ops: list[Op] = []
        self.pinned_allocations = 0
        self.synced: set[int] | None = None
        self.stack: list[FakeStream] = []
        self.watched: list[tuple[str, int, int]] = []
        self.streams = 0
        self.host_ops: set[int] = set()
        self.next_id = 0  # op ids never restart: streams remember ids across clear()

    def watch(self, name: str, *tensors: torch.Tensor) -> None:
        """Name the memory of ``tensors`` (their whole storages) for the op records."""
        for t in tensors:
            storage = t.untyped_storage()
            self.watched.append((name, storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

    def where(self, t: torch.Tensor) -> str:
        p = t.data_ptr()
        return next((name for name, lo, hi in self.watched if lo <= p < hi), "other")

    def clear(self) -> None:
        self.calls.clear()
        self.ops.clear()
        self.host_ops.clear()
        self.synced = None

    # --- questions a test asks -----------------------------------------------------

    def on(self, memory: str) -> list[Op]:
        """Ops that write or read ``memory``."""
        return [op for op in self.ops if memory in (op.dst, op.src)]

    def unordered(self) -> list[Op]:
        """Ops on engine or tier memory not ordered after the engine (must be none)."""
        return [op for op in self.on("engine") + self.on("tier") if op.stream is None or not op.after_engine]

    def unsynced(self) -> list[Op]:
        """Stream ops the last synchronized event did not cover (must be none when a swap returns)."""
        return [op for op in self.ops if op.stream is not None and (self.synced is None or op.id not in self.synced)]

    def races(self) -> list[tuple[Op, Op]]:
        """Pairs of ops on overlapping bytes (one of them writing) where the later one is not
        ordered after the earlier: on a GPU they could run in either order."""
        found = []
        for i, b in enumerate(self.ops):
            for a in self.ops[:i]:
                conflict = overlap(a.writes, b.reads) or overlap(a.writes, b.writes) or overlap(a.reads, b.writes)
                if conflict and a.id not in b.after:
                    found.append((a, b))
        return found

    def record(self, kind: str, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        stream = self.stack[-1] if self.stack else None
        oid, self.next_id = self.next_id, self.next_id + 1
        if stream is not None:
            stream.covered |= self.host_ops  # host work issued before a stream op is done when it runs
            after = frozenset(stream.covered)
            stream.covered.add(oid)
        else:  # the host waits only on what it synchronized
            after = frozenset(self.host_ops | (self.synced or set()))
            self.host_ops.add(oid)
        self.ops.append(
            Op(
                oid,
                kind,
                stream.name if stream else None,
                bool(stream and stream.after_engine),
                self.where(dst),
                self.where(src),
                dst.is_contiguous() and src.is_contiguous(),
                non_blocking,
                span(dst),
                span(src),
                after,
            )
        )


class FakeStream:
    rec: FakeCuda

    def __init__(self, device=None, priority=0):
        self.rec.streams += 1
        self.name = f"stream{self.rec.streams}"
        self.covered: set[int] = set()
        self.after_engine = False
        self.rec.calls.append(("stream", self.name, str(device)))

    def _follow(self, what) -> None:
        if isinstance(what, (FakeStream, FakeEvent)):
            self.covered |= what.covered
            self.after_engine |= what.after_engine
        else:  # the compute stream, the engine's stream or the engine's event
            self.after_engine = True

    def wait_stream(self, other) -> None:
        self.rec.calls.append(("wait_stream", self.name, getattr(other, "name", other)))
        self._follow(other)

    def wait_event(self, event) -> None:
        self.rec.calls.append(("wait_event", self.name, getattr(event, "name", event)))
        self._follow(event)


class FakeEvent:
    rec: FakeCuda
    count = 0

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        FakeEvent.count += 1
        self.name = f"event{FakeEvent.count}"
        self.blocking = blocking
        self.covered: set[int] = set()
        self.after_engine = False

    def record(self, stream=None):
        stream = stream or (self.rec.stack[-1] if self.rec.stack else None)
        self.covered = set(stream.covered) if stream else set()
        self.after_engine = bool(stream and stream.after_engine)
        self.rec.calls.append(("event.record", self.name, getattr(stream, "name", None)))

    def synchronize(self):
        self.rec.calls.append(("event.synchronize", self.name, self.blocking))
        self.rec.synced = set(self.covered)


@pytest.fixture(name="fake_cuda")
def fake_cuda_fixture(monkeypatch):
    rec = FakeCuda()
    stream_type = type("FakeStream", (FakeStream,), {"rec": rec})
    event_type = type("FakeEvent", (FakeEvent,), {"rec": rec})

    class StreamContext:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            rec.stack.append(self.stream)
            rec.calls.append(("enter_stream", self.stream.name))

        def __exit__(self, *exc):
            rec.stack.pop()
            rec.calls.append(("exit_stream", self.stream.name))

    monkeypatch.setattr(torch.cuda, "Stream", stream_type)
    monkeypatch.setattr(torch.cuda, "Event", event_type)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: "compute")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: rec.calls.append(("synchronize",)))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: rec.calls.append(("empty_cache",)))

    def unpinned(real):
        def alloc(*args, pin_memory=False, **kw):
            rec.pinned_allocations += bool(pin_memory)
            return real(*args, **kw)

        return alloc

    def pin_memory(self, *args, **kw):
        rec.pinned_allocations += 1
        return self

    for name in ("empty", "zeros"):
        monkeypatch.setattr(torch, name, unpinned(getattr(torch, name)))
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)

    real_copy, real_index_copy, real_index_select = torch.Tensor.copy_, torch.Tensor.index_copy_, torch.index_select

    def copy_(self, src, non_blocking=False):
        rec.record("copy_", self, src, non_blocking)
        return real_copy(self, src, non_blocking)

    def index_copy_(self, dim, index, source):
        rec.record("index_copy_", self, source, False)
        return real_index_copy(self, dim, index, source)

    def index_select(input, dim, index, *, out=None):
        if out is None:
            return real_index_select(input, dim, index)
        rec.record("index_select", out, input, False)
        return real_index_select(input, dim, index, out=out)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.Tensor, "index_copy_", index_copy_)
    monkeypatch.setattr(torch, "index_select", index_select)
    return rec
