"""What the bus did, booked cheaply enough for the hot path (no Prometheus here).

The broker and the ranks record into plain Python accumulators: a histogram
observation is one ``bisect`` and two additions, a labelled count one dict
update.  No locks: the loop thread is the only writer, and the metrics
collector (``zkv.obs.prometheus``) copies the accumulators at scrape time, so the
cost of Prometheus (label sets, text formatting) is paid per scrape, never
per task.

Label values that come from peers (an op peeked from a task body, an error
code) are bounded: an unknown value is booked as ``other``, and a book keeps
at most ``MAX_SERIES`` series per metric.

A rank books its copy times and bytes per op in :class:`RankBook` and sends
``to_stats()`` in its heartbeat stats; the broker exports them (one scrape
target).
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Any, Iterable

from ..wire.moves import MOVES
from ..wire.vocab import Op, Outcome

# Bucket upper bounds (the +Inf bucket is implicit).  Round trips on this
# machine are ~0.3 ms at p50; a pause drains in ms to seconds.
RTT_BUCKETS_S = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
COPY_BUCKETS_S = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
CONTROL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BYTES_BUCKETS = tuple(float(4**k * 1024) for k in range(11))  # 1 KiB .. 1 GiB, x4

OPS = tuple(Op)
# the tier moves; spill / load: the disk tier's write / read latency
COPY_OPS = tuple(move.op for move in MOVES.values())
MAX_SERIES = 64
OTHER = "other"

_OP_BY_BYTES = {op.encode(): op for op in OPS}
_OP_KEY = b"\xa2op"  # msgpack fixstr "op"
_ZKV_HEAD = b"\xa1v\x01\xa4kind\xa4body\xa2op"  # what zkv's encode_body writes after the map header


def task_op(body: bytes, _get: Any = _OP_BY_BYTES.get) -> str:
    """The op of an encoded task body, read from its first bytes without
    decoding it (a broker that decodes every body was measured 2x slower).

    Fast path: zkv's own encoding (``v``, ``kind``, ``op`` first).  Otherwise
    the ``op`` key is looked for in the first 24 bytes; an encoder that puts
    it later, or an op zkv does not know, books as ``other``.
    """
    if body[1:17] == _ZKV_HEAD and len(body) > 17:
        return _get(body[18 : body[17] - 0x8E], OTHER)  # body[17] is the fixstr byte 0xa0 + n; op = body[18:18 + n]
    i = body.find(_OP_KEY, 0, 24)
    if i < 0 or len(body) < i + 4:
        return OTHER
    n = body[i + 3] - 0xA0
    if not 0 < n <= 8:
        return OTHER
    return _get(body[i + 4 : i + 4 + n], OTHER)


class Histogram:
    """Fixed buckets: ``counts[i]`` observations <= ``bounds[i]`` (not cumulative;
    the last slot is +Inf), and their ``total``."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> tuple[list[int], float]:
        """(per-bucket counts, sum): copies, so a scrape never sees a list mid-update."""
        return list(self.counts), self.total

    def to_stats(self) -> dict[str, Any]:
        counts, total = self.snapshot()
        return {"counts": counts, "sum": total}


def histogram_from_stats(value: Any, bounds: tuple[float, ...]) -> tuple[list[int], float] | None:
    """A peer's ``Histogram.to_stats()``, range-checked; None if it does not fit ``bounds``."""
    if not isinstance(value, dict):
        return None
    counts, total = value.get("counts"), value.get("sum")
    if not isinstance(counts, list) or len(counts) != len(bounds) + 1:
        return None
    if not all(type(c) is int and 0 <= c < 2**53 for c in counts):
        return None
    if not (type(total) is int or type(total) is float) or not math.isfinite(total) or total < 0:
        return None
    return counts, float(total)


class _Series(dict):
    """label tuple -> value, at most MAX_SERIES keys (then the ``other`` key)."""

    def key(self, labels: tuple) -> tuple:
        if labels in self or len(self) < MAX_SERIES:
            return labels
        return (OTHER,) * len(labels)


class TaskSeries:
    """One (op, outcome): round-trip histogram, and for ``ok`` the task-size histogram."""

    __slots__ = ("rtt", "size")

    def __init__(self, outcome: str):
        self.rtt = Histogram(RTT_BUCKETS_S)
        self.size = Histogram(BYTES_BUCKETS) if outcome == Outcome.OK else None


class BusBook:
    """What the broker books: the one book of a broker process.

    Call sites (each once per event, on the broker's loop thread):
    ``task_finished`` where a task ends exactly once (the only per-task
    call), ``control_finished`` where a pause / clear / resume completes or
    fails or is answered at once, ``bad_request`` where a frontend message is
    refused as bad input.  Every other event the broker counts by name in
    ``events``; ``counters()`` is what status reports of them all.  Bytes per
    rank and op come from the ranks' stats.
    """

    def __init__(self) -> None:
        self.events: collections.Counter[str] = collections.Counter()  # event name -> count
        self.tasks: _Series = _Series()  # (op, outcome) -> TaskSeries
        self.controls: _Series = _Series()  # (op, result) -> int
        self.control_seconds: _Series = _Series()  # (op,) -> Histogram, completed ops only
        self.bad_requests: _Series = _Series()  # (code,) -> int

    def task_finished(
        self,
        op: str,
        outcome: str,
        rtt_s: float,
        nbytes: int,
        _rtt: tuple = RTT_BUCKETS_S,
        _size: tuple = BYTES_BUCKETS,
        _bisect: Any = bisect.bisect_left,
    ) -> None:
        series = self.tasks.get((op, outcome))
        if series is None:
            key = self.tasks.key((op, outcome))
            series = self.tasks.get(key) or self.tasks.setdefault(key, TaskSeries(key[1]))
        h = series.rtt  # Histogram.observe, inlined: this runs once per task
        h.counts[_bisect(_rtt, rtt_s)] += 1
        h.total += rtt_s
        h = series.size
        if h is not None:
            h.counts[_bisect(_size, nbytes)] += 1
            h.total += nbytes

    def control_finished(self, op: str, result: str, seconds: float | None = None) -> None:
        """``result``: ``ok``, ``noop``, or the error code it was answered with;
        ``seconds`` (pause drain, clear, resume time) for completed ops."""
        key = self.controls.key((op, result))
        self.controls[key] = self.controls.get(key, 0) + 1
        if result == Outcome.OK and seconds is not None:
            key = self.control_seconds.key((op,))
            h = self.control_seconds.get(key)
            if h is None:
                h = self.control_seconds[key] = Histogram(CONTROL_BUCKETS_S)
            h.observe(seconds)

    def bad_request(self, code: str) -> None:
        key = self.bad_requests.key((code,))
        self.bad_requests[key] = self.bad_requests.get(key, 0) + 1

    def counters(self) -> collections.Counter[str]:
        """The event counts status reports (``counters``): ``events``, with the
        bad requests as ``bad_requests`` and a submit of a task still open as
        ``duplicate_tasks`` (its code), both read off ``bad_requests``."""
        counts = collections.Counter(self.events)
        duplicate = self.bad_requests.get(("duplicate_task",), 0)
        bad = sum(self.bad_requests.values()) - duplicate
        if bad:
            counts["bad_requests"] = bad
        if duplicate:
            counts["duplicate_tasks"] = duplicate
        return counts


class RankBook:
    """A rank's copy durations and bytes per op, sent in its heartbeat stats
    (``copy_seconds``, ``bytes_by_op``); booked on the executor thread."""

    def __init__(self) -> None:
        self.copy: dict[str, Histogram] = {op: Histogram(COPY_BUCKETS_S) for op in COPY_OPS}
        self.bytes_by_op: dict[str, int] = dict.fromkeys(OPS, 0)

    def task_done(self, op: str, seconds: float, nbytes: int) -> None:
        h = self.copy.get(op)
        if h is not None:
            h.observe(seconds)
        if op in self.bytes_by_op:
            self.bytes_by_op[op] += nbytes

    def to_stats(self) -> dict[str, Any]:
        return {
            "copy_seconds": {op: h.to_stats() for op, h in self.copy.items()},
            "bytes_by_op": dict(self.bytes_by_op),
        }
