"""The codec's cost per hot message: ``protocol``'s validating codec beside
the decoder of the socket that receives it (``wire/fast.py``,
``wire/sockets.py``) and the typed encoders (``wire/messages.py``) on the
same frames, in the same run.  ``python -m zkv.harness.bus.codec_bench``
prints them.

Each figure is the best of ``repeats`` timings of ``number`` calls, old and
new in turns, in microseconds per call (the best: the other processes on the
machine only ever add time).  Compare within one run only.
"""

from __future__ import annotations

import json
import timeit
from typing import Any, Callable

from ...wire import fast as F
from ...wire import protocol as P
from ...wire import sockets as S
from ...wire.messages import MESSAGES

_REPLY_TO = "ipc:///run/user/1000/zkv/client-12345-0123abcd.sock"  # as Client makes them

#: the frames of a 1-block swap task on a 2-rank bus, and the two a broker and a
#: rank send most beside them (a broker's own outcome, a rank's heartbeat)
CASES: dict[str, dict[str, Any]] = {
    "submit": {"task": 1 << 40, "reply_to": _REPLY_TO},
    "task": {"seq": 123_456, "n": 61_728, "task": 1 << 40, "reply_to": _REPLY_TO, "gen": 3, "session": 987_654_321},
    "done": {"seq": 123_456, "n": 61_728, "outcome": "ok", "gen": 3, "bytes": 65_536},
    "result": {
        "task": 1 << 40,
        "rank": 1,
        "world": 2,
        "outcome": "ok",
        "reason": "",
        "gen": 3,
        "bytes": 65_536,
        "elapsed_us": 87,
    },
    "outcome": {"task": 1 << 40, "outcome": "cancelled", "reason": "cancelled by its client", "gen": 3, "ran": False},
    "hb": {"inflight": 2, "stats": {}},
    "ack": {"epoch": 7, "op": "pause", "upto": 61_728, "stats": {"tasks_ok": 61_728, "copy_seconds": 0.25}},
    "control": {"epoch": 7, "op": "pause", "gen": 3, "upto": [61_728, 61_728]},
}
#: kind -> the socket whose decoder reads it, and what a frame of its message narrows that to
_SOCKETS: dict[str, tuple[tuple[str, ...], tuple[str, ...] | None]] = {
    "submit": (S.BROKER_FRONTEND, None),
    "task": (S.RANK_DEALER, S.TASK_HEADER),
    "done": (S.BROKER_BACKEND, None),
    "result": (S.CLIENT_PULL, None),
    "outcome": (S.CLIENT_DEALER, None),
    "hb": (S.BROKER_BACKEND, None),
    "ack": (S.BROKER_BACKEND, None),
    "control": (S.RANK_SUB, None),
}


def bench_codec(number: int = 20_000, repeats: int = 5) -> dict[str, dict[str, dict[str, float]]]:
    """``{kind: {"decode" | "encode": {"protocol_us", "fast_us", "speedup"}}}``:
    decoding by ``protocol.decode`` beside its socket's decoder, encoding by
    ``protocol.encode`` (a map of keyword fields) beside what zkv sends, its
    typed message built and ``to_wire()``-d (``messages.py``)."""
    body = P.encode_body("swap_out", [7], [3])
    report: dict[str, dict[str, dict[str, float]]] = {}
    for kind, fields in CASES.items():
        cls = MESSAGES[kind]

        def old_encode(kind: str = kind, fields: dict[str, Any] = fields) -> bytes:
            return P.encode(kind, **fields)

        def new_encode(cls: Any = cls, fields: dict[str, Any] = fields) -> bytes:
            return cls(**fields).to_wire()

        assert new_encode() == old_encode()
        report[kind] = {"encode": _pair(old_encode, new_encode, number, repeats)}
        report[kind]["decode"] = _decoding(old_encode(), *_SOCKETS[kind], number, repeats)
    assert F.decode_body(body) == P.decode_body(body)
    report["body"] = {"decode": _pair(lambda: P.decode_body(body), lambda: F.decode_body(body), number, repeats)}
    return report


def _decoding(
    frame: bytes, kinds: tuple[str, ...], only: tuple[str, ...] | None, number: int, repeats: int
) -> dict[str, float]:
    fast, narrow = F.decoder(kinds), kinds if only is None else only
    assert fast(frame, only) == P.decode(frame, narrow)
    return _pair(lambda: P.decode(frame, narrow), lambda: fast(frame, only), number, repeats)


def _pair(old: Callable[[], Any], new: Callable[[], Any], number: int, repeats: int) -> dict[str, float]:
    """Old and new timed in turns, so a burst of load hits both alike."""
    old_s, new_s = [], []
    for _ in range(repeats):
        old_s.append(timeit.timeit(old, number=number))
        new_s.append(timeit.timeit(new, number=number))
    old_us, new_us = round(min(old_s) / number * 1e6, 3), round(min(new_s) / number * 1e6, 3)
    return {"protocol_us": old_us, "fast_us": new_us, "speedup": round(old_us / new_us, 2)}


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(bench_codec(), indent=1))
