"""Generate the zkv golden vectors: ``valid.json`` and ``invalid.json``.

Deterministic: running it twice gives byte-identical files, and
``tests/test_protocol.py`` checks that the committed files are what this script
makes.  Regenerate with ``python tests/vectors/make_vectors.py``.

JSON conventions (also described in docs/protocol.md, "Golden vectors"):
- ``hex``: the frame, lowercase hex.
- ``decoded``: the msgpack map as JSON; a msgpack bin value is written
  ``{"$bin": "<hex>"}`` (no zkv message has a field named ``$bin``).
- ``fields`` (valid, not body): the keyword fields passed to
  ``zkv.wire.protocol.encode(kind, **fields)``, which must reproduce ``hex``
  exactly; for bodies, ``encode_body`` holds ``op``/``src``/``dst``/``extra``
  for ``zkv.wire.protocol.encode_body`` when the vector is what it emits.
- ``body`` (valid bodies): what ``decode_body`` must return, ids as lists.
- ``decoder`` (invalid): ``decode``, ``decode_body`` or ``layout`` (decodes, but
  its ``layout`` map fails the layout checks); ``expect_kinds``: the
  kinds the receiving socket accepts (null: any kind); ``code``: the error code.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import msgpack

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from zkv.wire import protocol as P  # noqa: E402

LAYOUT = {
    "layers": 2,
    "gpu_blocks": 64,
    "cpu_blocks": 128,
    "block_size": 16,
    "kv_heads": 4,
    "head_dim": 64,
    "dtype": "bf16",
}
REPLY_TO = "tcp://127.0.0.1:5555"
REPLY_TO_V6 = "tcp://[::1]:5555"
LAYOUT_MAX = {
    "layers": 4096,
    "gpu_blocks": 2**31 - 1,
    "cpu_blocks": 2**31 - 1,
    "block_size": 65536,
    "kv_heads": 65536,
    "head_dim": 65536,
    "dtype": "fp32",
}
DIGEST0 = bytes(range(16))
DIGEST1 = bytes(range(16, 32))


def to_json(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return {"$bin": bytes(value).hex()}
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def packed(ids: list[int]) -> bytes:
    return struct.pack(f"<{len(ids)}i", *ids)


def _deep(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def _refusal(msg: dict) -> str:
    """The reason the codec gives for ``msg`` (the bytes of an error the broker sends)."""
    try:
        P.decode(msgpack.packb(msg, use_bin_type=True))
    except P.ProtocolError as err:
        return err.reason
    raise AssertionError(f"{msg} decodes")


# (name, socket, direction, kind, fields, note)
MESSAGES: list[tuple[str, str, str, str, dict[str, Any], str]] = [
    # client -> broker (frontend ROUTER)
    (
        "submit",
        "frontend",
        "client->broker",
        "submit",
        {"task": 1, "reply_to": REPLY_TO},
        "header frame of a 2-frame submit (the worked example)",
    ),
    (
        "submit_timeout",
        "frontend",
        "client->broker",
        "submit",
        {"task": 9007199254740991, "reply_to": "ipc:///tmp/zkv-c.sock", "timeout_ms": 5000},
        "largest task id (2^53-1); timeout_ms: still queued 5 s after the broker took it, it ends timeout "
        "(ran: false) and never runs",
    ),
    (
        "submit_batch_results",
        "frontend",
        "client->broker",
        "submit",
        {"task": 2, "reply_to": REPLY_TO, "batch_results": True},
        "batch_results: this client reads several result frames in one message; the broker copies it into the "
        "task header (docs/protocol.md §10.3)",
    ),
    ("pause", "frontend", "client->broker", "pause", {"req": 1, "timeout_ms": 10000}, ""),
    ("clear", "frontend", "client->broker", "clear", {"req": 2, "timeout_ms": 10000, "keep_cpu": False}, ""),
    ("resume", "frontend", "client->broker", "resume", {"req": 3, "timeout_ms": 10000}, ""),
    (
        "resume_layout",
        "frontend",
        "client->broker",
        "resume",
        {"req": 4, "layout": {"gpu_blocks": 32}},
        "partial layout: merged over the current one; needs a cleared bus",
    ),
    ("status", "frontend", "client->broker", "status", {"req": 5}, ""),
    ("status_wait", "frontend", "client->broker", "status", {"req": 6, "wait_ranks": 2, "timeout_ms": 60000}, ""),
    ("ping", "frontend", "client->broker", "ping", {"req": 7}, ""),
    (
        "cancel",
        "frontend",
        "client->broker",
        "cancel",
        {"req": 8, "task": 9},
        "end task 9 of this connection if it is still queued (§7.6)",
    ),
    # broker -> client (frontend ROUTER)
    ("reply_ping", "frontend", "broker->client", "reply", {"req": 7, "op": "ping"}, ""),
    (
        "reply_cancel_queued",
        "frontend",
        "broker->client",
        "reply",
        {"req": 8, "op": "cancel", "task": 9, "cancelled": True, "state": "queued"},
        "in time: outcome{cancelled, ran: false} came just before this reply",
    ),
    (
        "reply_cancel_dispatched",
        "frontend",
        "broker->client",
        "reply",
        {"req": 8, "op": "cancel", "task": 9, "cancelled": False, "state": "dispatched"},
        "too late: the ranks have it; it ends with its own outcome",
    ),
    (
        "reply_pause",
        "frontend",
        "broker->client",
        "reply",
        {"req": 1, "op": "pause", "epoch": 1, "gen": 0, "drain_ms": 1.25, "state": "paused", "ranks": 2},
        "drain_ms is a float64",
    ),
    (
        "reply_pause_noop",
        "frontend",
        "broker->client",
        "reply",
        {
            "req": 1,
            "op": "pause",
            "noop": True,
            "state": "paused",
            "epoch": 1,
            "gen": 0,
            "drain_ms": 0.0,
            "note": "already paused",
        },
        "",
    ),
    (
        "reply_clear",
        "frontend",
        "broker->client",
        "reply",
        {
            "req": 2,
            "op": "clear",
            "epoch": 2,
            "gen": 1,
            "clear_ms": 3.5,
            "cancelled": 0,
            "freed": 2097152,
            "state": "cleared",
            "ranks": 2,
        },
        "",
    ),
    (
        "reply_resume",
        "frontend",
        "broker->client",
        "reply",
        {"req": 3, "op": "resume", "epoch": 3, "gen": 1, "resume_ms": 2.0, "state": "running", "ranks": 2},
        "",
    ),
    (
        "reply_status",
        "frontend",
        "broker->client",
        "reply",
        {
            "req": 5,
            "op": "status",
            "state": "running",
            "epoch": 0,
            "gen": 0,
            "world": 1,
            "layout": LAYOUT,
            "ranks": [
                {
                    "rank": 0,
                    "alive": True,
                    "pid": 4242,
                    "inflight": 0,
                    "dispatched": 3,
                    "acked_epoch": 0,
                    "last_seen_ms": 12.5,
                    "stats": {},
                }
            ],
            "queued": 0,
            "inflight": 0,
            "max_inflight_per_rank": 64,
            "pending_op": None,
            "counters": {"client_msgs": 4},
        },
        "pending_op and layout may be nil",
    ),
    (
        "error_req",
        "frontend",
        "broker->client",
        "error",
        {"code": "not_paused", "reason": "clear needs a paused bus: run zkv pause first", "req": 2},
        "",
    ),
    (
        "error_task",
        "frontend",
        "broker->client",
        "error",
        {"code": "duplicate_task", "reason": "task 1 is still open", "task": 1},
        "",
    ),
    (
        "error_bare",
        "frontend",
        "broker->client",
        "error",
        {"code": "malformed", "reason": "not a msgpack frame (ExtraData)"},
        "no req: the request could not be decoded",
    ),
    (
        "outcome_rejected",
        "frontend",
        "broker->client",
        "outcome",
        {"task": 1, "outcome": "rejected", "reason": "caches are cleared; resume the bus first (zkv resume)"},
        "",
    ),
    (
        "outcome_cancelled",
        "frontend",
        "broker->client",
        "outcome",
        {"task": 2, "outcome": "cancelled", "reason": "caches were cleared while the task was queued"},
        "",
    ),
    (
        "outcome_cancelled_gen",
        "frontend",
        "broker->client",
        "outcome",
        {"task": 2, "outcome": "cancelled", "reason": "caches were cleared while the task was queued", "gen": 0},
        "gen: the task's own generation (queued at 0; the clear moved the bus to 1)",
    ),
    (
        "outcome_cancelled_by_client",
        "frontend",
        "broker->client",
        "outcome",
        {
            "task": 9,
            "outcome": "cancelled",
            "reason": "cancelled by its client before it was dispatched",
            "gen": 0,
            "ran": False,
        },
        "answer to a cancel in time: no rank ran it",
    ),
    (
        "outcome_timeout_never_ran",
        "frontend",
        "broker->client",
        "outcome",
        {
            "task": 3,
            "outcome": "timeout",
            "reason": "the task's timeout_ms passed while it was queued: it was never dispatched and never ran",
            "gen": 0,
            "ran": False,
        },
        "the submit's timeout_ms passed while it was queued",
    ),
    (
        "submit_ipv6",
        "frontend",
        "client->broker",
        "submit",
        {"task": 2, "reply_to": REPLY_TO_V6},
        "an IPv6 result address is bracketed (tcp://[::1]:5555); ranks set ZMQ_IPV6 to connect to it",
    ),
    (
        "ping_unknown_fields_unbounded",
        "frontend",
        "client->broker",
        "ping",
        {"req": 8, "pad": "x" * 5000, "deep": _deep(10), "big": 2**60},
        "unknown fields are ignored, unchecked by the bounds of §2.1 (only the frame's size and map caps apply)",
    ),
    (
        "resume_layout_at_bounds",
        "frontend",
        "client->broker",
        "resume",
        {"req": 9, "layout": LAYOUT_MAX},
        "every layout field at its largest (§4.8): a rank holds 2 x 4096 regions",
    ),
    (
        "error_echo_cut",
        "frontend",
        "broker->client",
        "error",
        {"code": "unknown_kind", "reason": _refusal({"v": 1, "kind": "k" * 5000, "req": 3}), "req": 3},
        "a peer's value is quoted cut to 64 characters with an ellipsis (U+2026)",
    ),
    (
        "error_gen_exhausted",
        "frontend",
        "broker->client",
        "error",
        {
            "code": "gen_exhausted",
            "reason": f"cache generation {2**53 - 2} is at its maximum {2**53 - 1}: no clear follows",
            "req": 2,
        },
        "a clear that would move the generation past 2^53-1",
    ),
    (
        "outcome_rejected_reply_to",
        "frontend",
        "broker->client",
        "outcome",
        {
            "task": 3,
            "outcome": "rejected",
            "reason": "reply_to 'tcp://::1:5555' is not an ipc://PATH or tcp://IP:PORT address "
            "(numeric IP, at most 512 characters)",
        },
        "a reply_to that §2.1 refuses ends the task rejected",
    ),
    # rank -> broker (backend ROUTER)
    (
        "ready",
        "backend",
        "rank->broker",
        "ready",
        {"rank": 0, "world": 2, "session": 4503599627370495, "layout": LAYOUT, "gen": 0, "pid": 4242},
        "",
    ),
    (
        "ready_with_host",
        "backend",
        "rank->broker",
        "ready",
        {"rank": 1, "world": 2, "session": 7, "layout": LAYOUT, "gen": 0, "pid": 4243, "host": "gpu-node-3"},
        "",
    ),
    (
        "ready_cpu_kept",
        "backend",
        "rank->broker",
        "ready",
        {
            "rank": 0,
            "world": 2,
            "session": 9,
            "layout": LAYOUT,
            "gen": 0,
            "pid": 4244,
            "fresh": True,
            "kept_tiers": ["cpu"],
            "cpu_gen": 3,
        },
        "a restarted rank that mapped its CPU tier again: its GPU memory is fresh, its CPU blocks of CPU "
        "generation 3 survived (docs/protocol.md §10.1)",
    ),
    (
        "ready_cpu_and_disk_kept",
        "backend",
        "rank->broker",
        "ready",
        {
            "rank": 1,
            "world": 2,
            "session": 10,
            "layout": LAYOUT,
            "gen": 0,
            "pid": 4245,
            "fresh": True,
            "kept_tiers": ["cpu", "disk"],
            "cpu_gen": 3,
        },
        "a restarted rank that mapped its CPU tier again and reopened its disk file: both hold blocks of CPU "
        "generation 3 (docs/protocol.md §6.3, §10.1)",
    ),
    ("hb_rank", "backend", "rank->broker", "hb", {"inflight": 0, "stats": {"tasks_ok": 3}}, ""),
    ("done", "backend", "rank->broker", "done", {"seq": 1, "n": 1, "outcome": "ok", "gen": 0, "bytes": 131072}, ""),
    ("ack_pause", "backend", "rank->broker", "ack", {"epoch": 1, "op": "pause", "gen": 0, "upto": 3}, ""),
    (
        "ready_gen_2_40",
        "backend",
        "rank->broker",
        "ready",
        {"rank": 0, "world": 2, "session": 1, "layout": LAYOUT, "gen": 2**40},
        "any uint gen may be announced; the broker adopts one only up to 2^40-1 (§10.1)",
    ),
    (
        "done_gen_2_40",
        "backend",
        "rank->broker",
        "done",
        {"seq": 9, "n": 2, "outcome": "ok", "gen": 2**40},
        "a done echoes its task's gen, whatever the broker sent",
    ),
    (
        "ack_epoch_2_40",
        "backend",
        "rank->broker",
        "ack",
        {"epoch": 2**40, "op": "pause", "gen": 2**53 - 1, "upto": 0},
        "an ack echoes the broker's epoch and gen, up to 2^53-1",
    ),
    (
        "hb_stats_4_deep",
        "backend",
        "rank->broker",
        "hb",
        {"stats": {"a": {"b": {"c": {"d": 1}}}}},
        "every value of a map field is enclosed by at most 4 maps / lists, the field's own counted",
    ),
    ("ack_clear", "backend", "rank->broker", "ack", {"epoch": 2, "op": "clear", "gen": 1, "freed": 1048576}, ""),
    ("ack_resume", "backend", "rank->broker", "ack", {"epoch": 3, "op": "resume", "gen": 1, "layout": LAYOUT}, ""),
    # broker -> rank (backend ROUTER)
    (
        "welcome",
        "backend",
        "broker->rank",
        "welcome",
        {"epoch": 0, "op": "run", "gen": 0, "upto": 0, "layout": LAYOUT, "heartbeat_ms": 500},
        "",
    ),
    (
        "welcome_cleared",
        "backend",
        "broker->rank",
        "welcome",
        {"epoch": 2, "op": "clear", "gen": 1, "upto": 0, "layout": LAYOUT, "heartbeat_ms": 500, "keep_cpu": True},
        "",
    ),
    (
        "welcome_session",  # what the broker sends: the session of the ready it answers (docs/protocol.md §10.2)
        "backend",
        "broker->rank",
        "welcome",
        {
            "epoch": 3,
            "op": "resume",
            "gen": 1,
            "upto": 2,
            "layout": LAYOUT,
            "heartbeat_ms": 500,
            "session": 4503599627370495,
        },
        "",
    ),
    (
        "refused",
        "backend",
        "broker->rank",
        "refused",
        {"reason": "rank 2 of world 2 does not fit this broker's world size 2"},
        "",
    ),
    ("reregister", "backend", "broker->rank", "reregister", {}, ""),
    ("hb_broker", "backend", "broker->rank", "hb", {}, ""),
    (
        "task",
        "backend",
        "broker->rank",
        "task",
        {"seq": 1, "n": 1, "task": 1, "reply_to": REPLY_TO, "gen": 0},
        "header frame of a 2-frame task; the body frame is the client's, byte for byte",
    ),
    (
        "task_ipv6_gen_2_40",
        "backend",
        "broker->rank",
        "task",
        {"seq": 2, "n": 2, "task": 2, "reply_to": REPLY_TO_V6, "gen": 2**40},
        "",
    ),
    (
        "task_cpu_gen",
        "backend",
        "broker->rank",
        "task",
        {"seq": 2, "n": 2, "task": 2, "reply_to": REPLY_TO, "gen": 4, "cpu_gen": 3},
        "cpu_gen: the bus's CPU generation at dispatch; the rank echoes it in the result (docs/protocol.md §8.2)",
    ),
    (
        "task_batch_results",
        "backend",
        "broker->rank",
        "task",
        {"seq": 3, "n": 3, "task": 2, "reply_to": REPLY_TO, "gen": 0, "batch_results": True},
        "batch_results: copied from the submit; the rank may send this task's result in one message with other "
        "results for the same reply_to (docs/protocol.md §10.3)",
    ),
    # broker -> ranks (PUB)
    ("control_pause", "control", "broker->ranks", "control", {"epoch": 1, "op": "pause", "gen": 0, "upto": [3, 3]}, ""),
    (
        "control_clear",
        "control",
        "broker->ranks",
        "control",
        {"epoch": 2, "op": "clear", "gen": 1, "upto": [3, 3], "keep_cpu": False},
        "",
    ),
    (
        "control_clear_gen_2_40",
        "control",
        "broker->ranks",
        "control",
        {"epoch": 7, "op": "clear", "gen": 2**40, "upto": [0, 0]},
        "a broker that adopted a rank's largest allowed gen (2^40-1) and then cleared: ranks must take it",
    ),
    (
        "control_resume",
        "control",
        "broker->ranks",
        "control",
        {"epoch": 3, "op": "resume", "gen": 1, "upto": [3, 3], "layout": dict(LAYOUT, gpu_blocks=32)},
        "",
    ),
    # rank -> client (PUSH -> PULL)
    (
        "result_ok",
        "results",
        "rank->client",
        "result",
        {"task": 1, "rank": 0, "world": 2, "outcome": "ok", "reason": "", "gen": 0, "bytes": 65536, "elapsed_us": 180},
        "",
    ),
    (
        "result_failed",
        "results",
        "rank->client",
        "result",
        {
            "task": 3,
            "rank": 1,
            "world": 2,
            "outcome": "failed",
            "reason": "dst block id 999 is out of range for the gpu tier (0..63)",
            "gen": 0,
            "bytes": 0,
            "elapsed_us": 40,
        },
        "",
    ),
    (
        "result_checksum",
        "results",
        "rank->client",
        "result",
        {
            "task": 4,
            "rank": 0,
            "world": 2,
            "outcome": "ok",
            "reason": "",
            "gen": 0,
            "bytes": 0,
            "elapsed_us": 95,
            "digests": [DIGEST0, DIGEST1],
        },
        "digests: one 16-byte bin per block, in src order",
    ),
    (
        "result_new_gen",
        "results",
        "rank->client",
        "result",
        {"task": 5, "rank": 0, "world": 2, "outcome": "ok", "reason": "", "gen": 1, "bytes": 65536, "elapsed_us": 150},
        "gen: the generation the task ran at; newer than the client's, it ends the open tasks that ran at an older "
        "one, not this task (docs/protocol.md §7.4)",
    ),
    (
        "result_cpu_kept",
        "results",
        "rank->client",
        "result",
        {"task": 6, "rank": 0, "world": 2, "outcome": "ok", "reason": "", "gen": 4, "bytes": 65536, "cpu_gen": 3},
        "gen moved (GPU blocks gone) but cpu_gen did not: the client keeps its CPU entries (docs/protocol.md §8.2)",
    ),
    (
        "result_lost_block",
        "results",
        "rank->client",
        "result",
        {
            "task": 7,
            "rank": 1,
            "world": 2,
            "outcome": "failed",
            "reason": "lost_block: CPU block(s) [6] lost: header or digest does not check (a torn write or corruption)",
            "gen": 4,
            "cpu_gen": 3,
        },
        "a swap_in from a CPU block whose header or digest does not check fails naming the block",
    ),
]

# (name, op, src, dst, extra, packed?, note)
BODIES: list[tuple[str, str, list[int] | None, list[int] | None, dict[str, Any], bool, str]] = [
    (
        "body_swap_out_packed",
        "swap_out",
        [3, 4],
        [10, 11],
        {},
        True,
        "the worked example; what the Python client sends",
    ),
    ("body_swap_in_packed", "swap_in", [10, 11, 12], [5, 6, 7], {}, True, ""),
    (
        "body_swap_out_array",
        "swap_out",
        [0, 1, 2, 3],
        [100, 101, 102, 103],
        {},
        False,
        "ids as a msgpack array of ints: also accepted",
    ),
    ("body_swap_in_array", "swap_in", [127], [63], {}, False, ""),
    ("body_fill", "fill", None, [0, 1, 2, 3], {"tier": "gpu", "seed": 7}, True, ""),
    ("body_fill_cpu_array", "fill", None, [5], {"tier": "cpu", "seed": 0}, False, ""),
    ("body_checksum", "checksum", [0, 1], None, {"tier": "gpu"}, True, ""),
    ("body_checksum_default_tier", "checksum", [9], None, {}, True, "tier omitted: gpu"),
    ("body_spill", "spill", [3, 4], [1000, 1001], {}, True, "CPU rows 3, 4 to disk blocks 1000, 1001"),
    ("body_load", "load", [1000, 7], [0, 1], {}, True, "disk blocks 1000, 7 to CPU rows 0, 1"),
    ("body_spill_array", "spill", [0], [2], {}, False, ""),
    ("body_checksum_disk", "checksum", [1000, 1001], None, {"tier": "disk"}, True, "read back, digest checked"),
]


def valid_vectors() -> list[dict[str, Any]]:
    out = []
    for name, socket, direction, kind, fields, note in MESSAGES:
        frame = P.encode(kind, **dict(fields))
        out.append(
            {
                "name": name,
                "kind": kind,
                "socket": socket,
                "direction": direction,
                "note": note,
                "fields": to_json(fields),
                "hex": frame.hex(),
                "decoded": to_json(msgpack.unpackb(frame, raw=False)),
            }
        )
    for name, op, src, dst, extra, is_packed, note in BODIES:
        if is_packed:
            frame = P.encode_body(op, src, dst, **extra)
            enc = {"op": op, "src": src, "dst": dst, "extra": extra}
        else:
            body: dict[str, Any] = {"v": P.VERSION, "kind": "body", "op": op}
            if src is not None:
                body["src"] = src
            if dst is not None:
                body["dst"] = dst
            body.update(extra)
            frame = msgpack.packb(body, use_bin_type=True)
            enc = None
        expect = {
            "op": op,
            "src": src or [],
            "dst": dst or [],
            "tier": extra.get("tier", "gpu"),
            "seed": extra.get("seed", 0),
        }
        out.append(
            {
                "name": name,
                "kind": "body",
                "socket": "body",
                "direction": "client->ranks (via broker)",
                "note": note,
                "encode_body": enc,
                "hex": frame.hex(),
                "decoded": to_json(msgpack.unpackb(frame, raw=False)),
                "body": expect,
            }
        )
    return out


def m(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


LAYOUT_NIL = {**LAYOUT, "layers": None}
FRONTEND = ["submit", "pause", "clear", "resume", "status", "ping", "cancel"]
SWAP = {"v": 1, "kind": "body", "op": "swap_out"}

# (name, frame, decoder, expect_kinds, code, why)
INVALID: list[tuple[str, bytes, str, list[str] | None, str, str]] = [
    (
        "empty_frame",
        b"",
        "decode",
        None,
        "malformed",
        "an empty frame (e.g. a REQ-style empty delimiter) is not msgpack",
    ),
    ("not_msgpack", b"\xc1", "decode", None, "malformed", "0xc1 is never used in msgpack"),
    (
        "not_msgpack_text",
        b"hello, zkv",
        "decode",
        None,
        "malformed",
        "plain text: the first byte is a fixint, then trailing data",
    ),
    ("truncated", m({"v": 1, "kind": "ping", "req": 1})[:-1], "decode", None, "malformed", "the map ends early"),
    (
        "trailing_bytes",
        m({"v": 1, "kind": "ping", "req": 1}) + b"\x00",
        "decode",
        None,
        "malformed",
        "one frame is exactly one msgpack object",
    ),
    (
        "bad_utf8",
        b"\x83\xa1v\x01\xa4kind\xa4p\xffng\xa3req\x01",
        "decode",
        None,
        "malformed",
        "msgpack str must be valid UTF-8 (kind is 'p\\xffng')",
    ),
    ("not_a_map_array", m([1, "ping", 1]), "decode", None, "malformed", "a frame must be a map"),
    ("not_a_map_int", m(1), "decode", None, "malformed", "a frame must be a map"),
    ("not_a_map_str", m("ping"), "decode", None, "malformed", "a frame must be a map"),
    ("version_missing", m({"kind": "ping", "req": 1}), "decode", None, "bad_version", "v is required"),
    ("version_2", m({"v": 2, "kind": "ping", "req": 1}), "decode", None, "bad_version", "this peer speaks v1 only"),
    ("version_0", m({"v": 0, "kind": "ping", "req": 1}), "decode", None, "bad_version", ""),
    ("version_str", m({"v": "1", "kind": "ping", "req": 1}), "decode", None, "bad_version", "v must be the integer 1"),
    ("kind_missing", m({"v": 1, "req": 1}), "decode", None, "unknown_kind", ""),
    ("kind_unknown", m({"v": 1, "kind": "launch", "req": 1}), "decode", None, "unknown_kind", ""),
    (
        "kind_bin",
        m({"v": 1, "kind": b"ping", "req": 1}),
        "decode",
        None,
        "unknown_kind",
        "kind must be a msgpack str, not bin",
    ),
    (
        "kind_wrong_socket",
        m({"v": 1, "kind": "result", "task": 1, "rank": 0, "world": 1, "outcome": "ok", "reason": "", "gen": 0}),
        "decode",
        FRONTEND,
        "unknown_kind",
        "a valid kind that this socket does not take",
    ),
    (
        "body_on_frontend",
        m({"v": 1, "kind": "body", "op": "swap_out"}),
        "decode",
        FRONTEND,
        "unknown_kind",
        "a body is only valid as the second frame",
    ),
    ("req_missing", m({"v": 1, "kind": "ping"}), "decode", None, "bad_field", ""),
    ("cancel_task_missing", m({"v": 1, "kind": "cancel", "req": 1}), "decode", None, "bad_field", ""),
    (
        "cancel_task_negative",
        m({"v": 1, "kind": "cancel", "req": 1, "task": -1}),
        "decode",
        None,
        "bad_field",
        "task ids are uint, like submit's",
    ),
    (
        "outcome_ran_not_bool",
        m({"v": 1, "kind": "outcome", "task": 1, "outcome": "timeout", "reason": "", "ran": 0}),
        "decode",
        None,
        "bad_field",
        "ran is a bool",
    ),
    ("submit_reply_to_missing", m({"v": 1, "kind": "submit", "task": 1}), "decode", None, "bad_field", ""),
    ("req_negative", m({"v": 1, "kind": "ping", "req": -1}), "decode", None, "bad_field", "uint fields are 0..2^53-1"),
    (
        "req_2_53",
        m({"v": 1, "kind": "ping", "req": 2**53}),
        "decode",
        None,
        "bad_field",
        "2^53 is one past the largest allowed integer",
    ),
    ("req_uint64_max", m({"v": 1, "kind": "ping", "req": 2**64 - 1}), "decode", None, "bad_field", ""),
    (
        "req_float",
        m({"v": 1, "kind": "ping", "req": 1.0}),
        "decode",
        None,
        "bad_field",
        "a float is not an integer, even 1.0",
    ),
    ("req_bool", m({"v": 1, "kind": "ping", "req": True}), "decode", None, "bad_field", "true is not an integer"),
    ("req_str", m({"v": 1, "kind": "ping", "req": "1"}), "decode", None, "bad_field", ""),
    (
        "req_nil",
        m({"v": 1, "kind": "ping", "req": None}),
        "decode",
        None,
        "bad_field",
        "a required field may not be nil",
    ),
    ("task_negative", m({"v": 1, "kind": "submit", "task": -5, "reply_to": REPLY_TO}), "decode", None, "bad_field", ""),
    (
        "task_too_big",
        m({"v": 1, "kind": "submit", "task": 2**60, "reply_to": REPLY_TO}),
        "decode",
        None,
        "bad_field",
        "",
    ),
    (
        "reply_to_bin",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": REPLY_TO.encode()}),
        "decode",
        None,
        "bad_field",
        "strings must be msgpack str, not bin",
    ),
    (
        "timeout_ms_negative",
        m({"v": 1, "kind": "pause", "req": 1, "timeout_ms": -1}),
        "decode",
        None,
        "bad_field",
        "optional fields are checked when present and not nil",
    ),
    (
        "keep_cpu_int",
        m({"v": 1, "kind": "clear", "req": 1, "keep_cpu": 1}),
        "decode",
        None,
        "bad_field",
        "bool fields take true/false only",
    ),
    ("resume_layout_not_map", m({"v": 1, "kind": "resume", "req": 1, "layout": [32]}), "decode", None, "bad_field", ""),
    (
        "control_upto_not_array",
        m({"v": 1, "kind": "control", "epoch": 1, "op": "pause", "gen": 0, "upto": 3}),
        "decode",
        None,
        "bad_field",
        "",
    ),
    (
        "body_ids_packed_not_multiple_of_4",
        m({**SWAP, "src": b"\x01\x00\x00\x00\x02", "dst": packed([1])}),
        "decode_body",
        None,
        "bad_field",
        "packed int32 ids: length must be a multiple of 4",
    ),
    (
        "body_ids_str",
        m({**SWAP, "src": "1,2", "dst": packed([1, 2])}),
        "decode_body",
        None,
        "bad_field",
        "ids are an array or bin, never str",
    ),
    ("body_ids_array_of_str", m({**SWAP, "src": ["1"], "dst": [1]}), "decode_body", None, "bad_field", ""),
    ("body_ids_array_of_bool", m({**SWAP, "src": [True], "dst": [1]}), "decode_body", None, "bad_field", ""),
    (
        "body_swap_length_mismatch",
        m({**SWAP, "src": packed([1, 2, 3]), "dst": packed([4, 5])}),
        "decode_body",
        None,
        "bad_field",
        "src and dst pair up one to one",
    ),
    (
        "body_swap_length_mismatch_array",
        m({"v": 1, "kind": "body", "op": "swap_in", "src": [1], "dst": [4, 5]}),
        "decode_body",
        None,
        "bad_field",
        "",
    ),
    (
        "body_swap_empty",
        m({**SWAP, "src": b"", "dst": b""}),
        "decode_body",
        None,
        "bad_field",
        "a swap needs at least one block",
    ),
    ("body_swap_no_ids", m(SWAP), "decode_body", None, "bad_field", ""),
    (
        "body_fill_no_dst",
        m({"v": 1, "kind": "body", "op": "fill", "tier": "gpu", "seed": 1}),
        "decode_body",
        None,
        "bad_field",
        "",
    ),
    (
        "body_checksum_no_src",
        m({"v": 1, "kind": "body", "op": "checksum", "tier": "gpu"}),
        "decode_body",
        None,
        "bad_field",
        "",
    ),
    (
        "body_unknown_op",
        m({"v": 1, "kind": "body", "op": "swap_sideways", "src": packed([1]), "dst": packed([2])}),
        "decode_body",
        None,
        "bad_field",
        "",
    ),
    (
        "body_op_missing",
        m({"v": 1, "kind": "body", "src": packed([1]), "dst": packed([2])}),
        "decode_body",
        None,
        "bad_field",
        "",
    ),
    (
        "body_bad_tier",
        m({"v": 1, "kind": "body", "op": "fill", "dst": packed([1]), "tier": "nvme", "seed": 1}),
        "decode_body",
        None,
        "bad_field",
        "tier is gpu, cpu or disk",
    ),
    (
        "body_spill_length_mismatch",
        m({"v": 1, "kind": "body", "op": "spill", "src": packed([1, 2]), "dst": packed([3])}),
        "decode_body",
        None,
        "bad_field",
        "",
    ),
    (
        "body_load_empty",
        m({"v": 1, "kind": "body", "op": "load", "src": b"", "dst": b""}),
        "decode_body",
        None,
        "bad_field",
        "a load needs at least one block",
    ),
    ("body_spill_no_ids", m({"v": 1, "kind": "body", "op": "spill"}), "decode_body", None, "bad_field", ""),
    (
        "body_seed_negative",
        m({"v": 1, "kind": "body", "op": "fill", "dst": packed([1]), "tier": "gpu", "seed": -1}),
        "decode_body",
        None,
        "bad_field",
        "",
    ),
    (
        "body_wrong_kind",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": REPLY_TO}),
        "decode_body",
        None,
        "unknown_kind",
        "the second frame must be kind body",
    ),
    (
        "body_wrong_version",
        m({"v": 2, "kind": "body", "op": "swap_out", "src": packed([1]), "dst": packed([2])}),
        "decode_body",
        None,
        "bad_version",
        "",
    ),
    ("body_not_msgpack", b"\xc1\xc1", "decode_body", None, "malformed", ""),
    # --- strangers: well-formed values outside the documented bounds (§2.1)
    (
        "version_true",
        m({"v": True, "kind": "ping", "req": 1}),
        "decode",
        None,
        "bad_version",
        "true is not the integer 1",
    ),
    (
        "version_float",
        m({"v": 1.0, "kind": "ping", "req": 1}),
        "decode",
        None,
        "bad_version",
        "1.0 is not the integer 1",
    ),
    (
        "body_version_true",
        m({"v": True, "kind": "body", "op": "swap_out", "src": packed([1]), "dst": packed([2])}),
        "decode_body",
        None,
        "bad_version",
        "",
    ),
    (
        "submit_reply_to_too_long",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://" + "a" * 5000}),
        "decode",
        None,
        "bad_field",
        "str fields are at most 4096 characters",
    ),
    (
        "submit_reply_key_not_z85",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": REPLY_TO, "reply_key": "x" * 39}),
        "decode",
        None,
        "bad_field",
        "reply_key is a 40-character Z85 key",
    ),
    (
        "submit_timeout_over_max",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": REPLY_TO, "timeout_ms": 3_600_001}),
        "decode",
        None,
        "bad_field",
        "timeout_ms is at most 3600000",
    ),
    (
        "status_timeout_2_53",
        m({"v": 1, "kind": "status", "req": 1, "wait_ranks": 3, "timeout_ms": 2**53 - 1}),
        "decode",
        None,
        "bad_field",
        "timeout_ms is at most 3600000",
    ),
    (
        "status_wait_ranks_over_max",
        m({"v": 1, "kind": "status", "req": 1, "wait_ranks": 257}),
        "decode",
        None,
        "bad_field",
        "wait_ranks is at most 256",
    ),
    (
        "ready_gen_2_53",
        m({"v": 1, "kind": "ready", "rank": 0, "world": 2, "session": 1, "layout": LAYOUT, "gen": 2**53}),
        "decode",
        None,
        "bad_field",
        "gen is a uint: at most 2^53-1 (the broker adopts only up to 2^40-1, §10.1)",
    ),
    (
        "ready_kept_tiers_not_names",
        m(
            {
                "v": 1,
                "kind": "ready",
                "rank": 0,
                "world": 2,
                "session": 1,
                "layout": LAYOUT,
                "gen": 0,
                "kept_tiers": [1],
            }
        ),
        "decode",
        None,
        "bad_field",
        "kept_tiers is a list of tier names",
    ),
    (
        "done_gen_2_53",
        m({"v": 1, "kind": "done", "seq": 1, "n": 1, "outcome": "ok", "gen": 2**53}),
        "decode",
        None,
        "bad_field",
        "",
    ),
    (
        "ready_world_zero",
        m({"v": 1, "kind": "ready", "rank": 0, "world": 0, "session": 1, "layout": LAYOUT, "gen": 0}),
        "decode",
        None,
        "bad_field",
        "world is 1..256",
    ),
    (
        "ready_world_over_max",
        m({"v": 1, "kind": "ready", "rank": 0, "world": 257, "session": 1, "layout": LAYOUT, "gen": 0}),
        "decode",
        None,
        "bad_field",
        "world is 1..256",
    ),
    (
        "ready_pid_over_max",
        m({"v": 1, "kind": "ready", "rank": 0, "world": 2, "session": 1, "layout": LAYOUT, "gen": 0, "pid": 2**32}),
        "decode",
        None,
        "bad_field",
        "pid is at most 2^32-1",
    ),
    (
        "ack_epoch_2_53",
        m({"v": 1, "kind": "ack", "epoch": 2**53, "op": "pause", "upto": 0}),
        "decode",
        None,
        "bad_field",
        "epoch is a uint: at most 2^53-1",
    ),
    (
        "ack_op_unknown",
        m({"v": 1, "kind": "ack", "epoch": 1, "op": "explode"}),
        "decode",
        None,
        "bad_field",
        "ack.op is pause, clear or resume",
    ),
    (
        "ack_freed_over_max",
        m({"v": 1, "kind": "ack", "epoch": 1, "op": "clear", "freed": 2**44}),
        "decode",
        None,
        "bad_field",
        "bytes / freed are at most 2^44-1 per rank",
    ),
    (
        "done_outcome_unknown",
        m({"v": 1, "kind": "done", "seq": 1, "n": 1, "outcome": "great", "gen": 0}),
        "decode",
        None,
        "bad_field",
        "a rank reports ok or failed",
    ),
    (
        "hb_stats_deep",
        m({"v": 1, "kind": "hb", "stats": _deep(1022)}),
        "decode",
        None,
        "bad_field",
        "nested structures are at most 4 levels deep",
    ),
    (
        "hb_stats_too_many_entries",
        m({"v": 1, "kind": "hb", "stats": {f"k{i}": i for i in range(300)}}),
        "decode",
        None,
        "bad_field",
        "a map / list field has at most 256 entries",
    ),
    (
        "hb_stats_too_large",
        m({"v": 1, "kind": "hb", "stats": {f"k{i}": "x" * 4000 for i in range(5)}}),
        "decode",
        None,
        "bad_field",
        "stats encode to at most 16384 bytes",
    ),
    ("hb_stats_int_key", m({"v": 1, "kind": "hb", "stats": {1: 2}}), "decode", None, "bad_field", "map keys are str"),
    (
        "welcome_heartbeat_zero",
        m(
            {
                "v": 1,
                "kind": "welcome",
                "epoch": 0,
                "op": "run",
                "gen": 0,
                "upto": 0,
                "layout": LAYOUT,
                "heartbeat_ms": 0,
            }
        ),
        "decode",
        None,
        "bad_field",
        "heartbeat_ms is 1..3600000",
    ),
    (
        "control_upto_not_uints",
        m({"v": 1, "kind": "control", "epoch": 1, "op": "pause", "gen": 0, "upto": [1, -1]}),
        "decode",
        None,
        "bad_field",
        "",
    ),
    (
        "result_digest_not_16_bytes",
        m(
            {
                "v": 1,
                "kind": "result",
                "task": 1,
                "rank": 0,
                "world": 1,
                "outcome": "ok",
                "reason": "",
                "gen": 0,
                "digests": [b"x"],
            }
        ),
        "decode",
        None,
        "bad_field",
        "",
    ),
    (
        "ready_layout_blocks_beyond_int32",
        m(
            {
                "v": 1,
                "kind": "ready",
                "rank": 0,
                "world": 2,
                "session": 1,
                "layout": dict(LAYOUT, gpu_blocks=2**31),
                "gen": 0,
            }
        ),
        "layout",
        None,
        "bad_field",
        "block ids are int32: at most 2^31-1 blocks per tier",
    ),
    (
        "resume_layout_bool",
        m({"v": 1, "kind": "resume", "req": 1, "layout": dict(LAYOUT, layers=True)}),
        "layout",
        None,
        "bad_field",
        "a layout integer is never a bool",
    ),
    (
        "body_tier_empty",
        m({"v": 1, "kind": "body", "op": "fill", "dst": packed([1]), "tier": "", "seed": 1}),
        "decode_body",
        None,
        "bad_field",
        "an empty tier is not gpu: only an absent or nil tier defaults",
    ),
    (
        "hb_stats_value_5_deep",
        m({"v": 1, "kind": "hb", "stats": {"a": {"b": {"c": {"d": {"e": 1}}}}}}),
        "decode",
        None,
        "bad_field",
        "a value enclosed by 5 maps, the stats map counted: one more than 4",
    ),
    (
        "ping_map_4097_entries",
        m({"v": 1, "kind": "ping", "req": 1, **{f"k{i}": 0 for i in range(4094)}}),
        "decode",
        None,
        "malformed",
        "a map over 4096 entries is not parsed at all: the error carries no req",
    ),
    (
        "error_reason_too_long",
        m({"v": 1, "kind": "error", "code": "unknown_kind", "reason": "r" * 4097}),
        "decode",
        None,
        "bad_field",
        "what the bus sends keeps the bounds it checks: a reason is at most 4096 characters",
    ),
    (
        "ready_layout_nil_field",
        m(
            {
                "v": 1,
                "kind": "ready",
                "rank": 0,
                "world": 2,
                "session": 1,
                "gen": 0,
                "layout": {**LAYOUT, "layers": None},
            }
        ),
        "layout",
        None,
        "bad_field",
        "a nil inside a layout is not an absent field: the layout is invalid",
    ),
    (
        "resume_layout_layers_4097",
        m({"v": 1, "kind": "resume", "req": 1, "layout": {"layers": 4097}}),
        "layout",
        None,
        "bad_field",
        "layers is at most 4096 (a rank holds 4 regions per layer, 16384 in all)",
    ),
    (
        "reply_to_ipv6_unbracketed",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://::1:5555"}),
        "reply_to",
        None,
        "rejected",
        "IPv6 only in brackets: ::1:5555 is also the address ::1:5555 with no port",
    ),
    (
        "reply_to_ipv6_no_port",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://[::1]"}),
        "reply_to",
        None,
        "rejected",
        "",
    ),
    (
        "reply_to_ipv4_wildcard",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://0.0.0.0:5555"}),
        "reply_to",
        None,
        "rejected",
        "a wildcard is where to bind, never where to connect",
    ),
    (
        "reply_to_ipv6_wildcard",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://[::]:5555"}),
        "reply_to",
        None,
        "rejected",
        "",
    ),
    (
        "reply_to_ipv4_multicast",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://224.0.0.1:5555"}),
        "reply_to",
        None,
        "rejected",
        "no tcp peer listens on a multicast address",
    ),
    (
        "reply_to_ipv6_zone",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://[fe80::1%eth0]:5555"}),
        "reply_to",
        None,
        "rejected",
        "an interface name is a lookup too",
    ),
    (
        "reply_to_port_leading_zero",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://127.0.0.1:05555"}),
        "reply_to",
        None,
        "rejected",
        "one spelling per address: the one ZMQ_LAST_ENDPOINT gives",
    ),
    (
        "reply_to_ipv4_leading_zero",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://127.000.0.1:5555"}),
        "reply_to",
        None,
        "rejected",
        "",
    ),
    (
        "reply_to_port_zero",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://127.0.0.1:0"}),
        "reply_to",
        None,
        "rejected",
        "",
    ),
    (
        "reply_to_port_too_big",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://127.0.0.1:65536"}),
        "reply_to",
        None,
        "rejected",
        "",
    ),
    (
        "reply_to_port_wildcard",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://127.0.0.1:*"}),
        "reply_to",
        None,
        "rejected",
        "the concrete port goes in reply_to",
    ),
    (
        "reply_to_host_name",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "tcp://localhost:5555"}),
        "reply_to",
        None,
        "rejected",
        "a host name would make the rank run a name lookup",
    ),
    (
        "reply_to_ipc_empty",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "ipc://"}),
        "reply_to",
        None,
        "rejected",
        "an ipc address names a path",
    ),
    (
        "reply_to_inproc",
        m({"v": 1, "kind": "submit", "task": 1, "reply_to": "inproc://zkv-stop-rank-0-0"}),
        "reply_to",
        None,
        "rejected",
        "would resolve inside the rank's own process",
    ),
    (
        "body_ids_array_beyond_int32",
        m({**SWAP, "src": [2**31], "dst": [1]}),
        "decode_body",
        None,
        "bad_field",
        "array ids have the int32 range of packed ids",
    ),
]


def invalid_vectors() -> list[dict[str, Any]]:
    out = []
    for name, frame, decoder, kinds, code, why in INVALID:
        out.append(
            {"name": name, "hex": frame.hex(), "decoder": decoder, "expect_kinds": kinds, "code": code, "why": why}
        )
    return out


def render(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=False, ensure_ascii=True) + "\n"


def build() -> dict[str, str]:
    header = {
        "protocol": "zkv",
        "version": P.VERSION,
        "generator": "tests/vectors/make_vectors.py",
        "spec": "docs/protocol.md",
        "bin_convention": 'a msgpack bin value is written {"$bin": "<hex>"}',
    }
    return {
        "valid.json": render({**header, "vectors": valid_vectors()}),
        "invalid.json": render({**header, "vectors": invalid_vectors()}),
    }


def main() -> None:
    for name, text in build().items():
        (HERE / name).write_text(text)
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main()
