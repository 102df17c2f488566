"""The bounds on every value a peer sends (docs/protocol.md §2.1 lists the
same), one table for every party: the codec checks each value against them
where it enters, so nothing stored, incremented or echoed later can leave the
safe range or fail to encode."""

from __future__ import annotations

MAX_SAFE_INT = 2**53 - 1
MAX_FRAME_BYTES = 16 * 1024 * 1024  # application cap, answered with too_large
MAX_IDS = 1 << 20
# Under load the broker sends a rank the tasks of one wakeup as one message
# (header/body pairs) and a rank returns the ``done`` frames of one wakeup as
# one message (docs/protocol.md §3, §10.3): at most this many per message.
MAX_BATCH = 64

MAX_COUNTER = 2**40 - 1  # gen, epoch: +1 per op, so 2^40 keeps +1 safe for ever
MAX_WORLD = 256  # world, wait_ranks (and rank < world)
MAX_TIMEOUT_MS = 3_600_000  # timeout_ms, heartbeat_ms: one hour
MAX_BYTES = 2**44 - 1  # bytes, freed per rank: a sum over MAX_WORLD ranks stays < 2^53
MAX_PID = 2**32 - 1
MAX_CHECKSUM_IDS = 1 << 19  # 2^19 digests of 18 bytes fit a result frame under MAX_FRAME_BYTES
DIGEST_BYTES = 16  # one checksum digest (a bin of 16 bytes, 18 with its header)
MAX_STR = 4096  # any str field, in characters
MAX_ADDRESS = 512  # reply_to
MAX_NEST_DEPTH = 4  # levels inside a map / list field (stats, layout)
MAX_NEST_ITEMS = 256  # entries of a map / list field, nested ones counted too
MAX_STATS_BYTES = 16384  # encoded size of one rank's stats (status echoes world of them)
# layout fields (§4.8): block ids are int32; the rest far beyond any model
LAYOUT_MAX: dict[str, int] = {
    "layers": 4096,
    "gpu_blocks": 2**31 - 1,
    "cpu_blocks": 2**31 - 1,
    "block_size": 65536,
    "kv_heads": 65536,
    "head_dim": 65536,
}
RESULT_SCHEMES = ("tcp://", "ipc://")  # reply_to: never inproc:// (it would reach our own sockets)
Z85_KEY_LEN = 40

# uint fields whose maximum is not MAX_SAFE_INT (inclusive; minimum is 0 unless listed)
UINT_MAX: dict[str, int] = {
    "world": MAX_WORLD,
    "rank": MAX_WORLD - 1,
    "wait_ranks": MAX_WORLD,
    "timeout_ms": MAX_TIMEOUT_MS,
    "heartbeat_ms": MAX_TIMEOUT_MS,
    "bytes": MAX_BYTES,
    "freed": MAX_BYTES,
    "pid": MAX_PID,
}
UINT_MIN: dict[str, int] = {"world": 1, "heartbeat_ms": 1}
# Counters a broker may adopt from a rank: below MAX_COUNTER, so that the +1 per
# op the broker then adds (and sends in control / welcome / task, which take
# up to MAX_SAFE_INT) stays safe for 2^52 more ops.
ADOPTED_MAX: dict[tuple[str, str], int] = {
    ("ready", "gen"): MAX_COUNTER,
    ("ack", "gen"): MAX_COUNTER,
    ("ack", "epoch"): MAX_COUNTER,
    ("done", "gen"): MAX_COUNTER,
    ("ready", "cpu_gen"): MAX_COUNTER,
}


def uint_bounds(kind: str, name: str) -> tuple[int, int]:
    """The inclusive range of uint field ``name`` in a ``kind`` message."""
    return UINT_MIN.get(name, 0), ADOPTED_MAX.get((kind, name), UINT_MAX.get(name, MAX_SAFE_INT))


# list fields: most entries
LIST_MAX: dict[str, int] = {"upto": MAX_WORLD, "digests": MAX_CHECKSUM_IDS}
