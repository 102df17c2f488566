"""The rank's two small policies, sans-IO: which task the I/O thread runs
itself (``InlinePolicy``) and when held dones go to the broker
(``DoneBatcher``).  Both take ``now`` (seconds, any monotonic clock) from
their caller: the worker passes ``time.perf_counter()``, a test a number.

Why inline (rank/runner.py): handing a 1-block copy to the executor cost two
thread wake-ups, a report and the GIL's hand-overs, several times the copy;
so while nothing is queued on the executor a small task runs on the I/O
thread, in FIFO order with the rest.  Why batch: the dones of one wakeup go
to the broker as one message (docs/protocol.md §10.3), but a long run of
small inline tasks must not hold every credit until its end (the broker
would book them all at once, on the way to a pause's ack): a done waits for
company at most ``hold_s``."""

from __future__ import annotations

from ..wire import bounds
from ..wire.layout import CacheLayout

INLINE_MAX_BYTES = 8 << 20  # a task the I/O thread may copy itself (about a millisecond on a CPU)
INLINE_MAX_BODY = 4096
_SPILL, _LOAD, _DISK = b"\xa5spill", b"\xa4load", b"\xa4disk"  # msgpack fixstrs: a task that waits on the disk tier
_PUT, _GET = b"\xa3put", b"\xa3get"  # a task that waits on the keyed store
DONES_HOLD_S = 0.0005


class DoneBatcher:
    """Done frames held for one message to the broker.

    ``add(frame, now)`` holds a frame and says whether to flush now (the batch
    is full, or its first frame waited ``hold_s``); ``due(now)`` says whether
    held frames waited long enough to go before a copy starts; ``take()``
    empties the batch (the loop flushes at the end of every wakeup too)."""

    __slots__ = ("hold_s", "limit", "frames", "since")

    def __init__(self, hold_s: float = DONES_HOLD_S, limit: int = bounds.MAX_BATCH):
        self.hold_s = hold_s
        self.limit = limit
        self.frames: list[bytes] = []
        self.since = 0.0  # when the first held frame came

    def add(self, frame: bytes, now: float) -> bool:
        frames = self.frames
        if not frames:
            self.since = now
        frames.append(frame)
        return len(frames) >= self.limit or now - self.since >= self.hold_s

    def due(self, now: float) -> bool:
        return bool(self.frames) and now - self.since >= self.hold_s

    def take(self) -> list[bytes]:
        frames, self.frames = self.frames, []
        return frames


class InlinePolicy:
    """Whether the I/O thread runs a task itself: only while nothing is queued
    on the executor (``queued``: work handed over and not yet reported), and
    only a task small enough, estimated from the body's size before decoding
    it: zkv's encoder packs ids as int32, 8 bytes per (src, dst) pair; other
    encodings are at most ~4x denser, and a body over 4 KiB always goes to the
    executor, where a long copy delays no heartbeat."""

    __slots__ = ("queued", "_layout", "_blocks")

    def __init__(self) -> None:
        self.queued = 0
        self._layout: object = None
        self._blocks = 0

    def inline(self, body: bytes, layout: CacheLayout) -> bool:
        if self.queued:
            return False
        size = len(body)
        if size > INLINE_MAX_BODY:
            return False
        if layout is not self._layout:  # the layout changes only on an allocation: work its bound out once
            self._layout = layout
            self._blocks = max(1, INLINE_MAX_BYTES // max(1, layout.block_bytes))
        if (size - 24) // 8 > self._blocks:  # src and dst: 8 bytes per block pair
            return False
        # disk I/O stays off the I/O thread (a false match queues); three tests, no generator
        return not (_SPILL in body or _LOAD in body or _DISK in body)


def is_keyed(body: bytes) -> bool:
    """Whether a task body is a ``put`` or a ``get`` (the store lane's), read off its bytes
    as ``InlinePolicy`` reads them: its op's msgpack string.  Only an id list of int32s
    (packed as bytes) could hold those 4 bytes too, and only with an id over 1.6e9, which
    no tier has: such a task fails its checks on whichever lane it lands."""
    return _PUT in body or _GET in body
