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

# Generations and epochs: every message may carry any uint (0..2^53-1), so a
# rank can always echo what its broker sent.  The broker *adopts* a rank's
# generation (takes it, then adds 1 per op) only up to MAX_ADOPTED_GEN, which
# leaves 2^53 - 2^40 moves of headroom below MAX_GEN; a move past MAX_GEN is
# refused (docs/protocol.md §2.1, §10.1), never sent.
MAX_GEN = MAX_SAFE_INT
MAX_ADOPTED_GEN = 2**40 - 1
MAX_WORLD = 256  # world, wait_ranks (and rank < world)
MAX_TIMEOUT_MS = 3_600_000  # timeout_ms, heartbeat_ms: one hour
MAX_BYTES = 2**44 - 1  # bytes, freed per rank: a sum over MAX_WORLD ranks stays < 2^53
MAX_PID = 2**32 - 1
MAX_CHECKSUM_IDS = 1 << 19  # 2^19 digests of 18 bytes fit a result frame under MAX_FRAME_BYTES
DIGEST_BYTES = 16  # one checksum digest (a bin of 16 bytes, 18 with its header)
MAX_KEY_BYTES = 255  # one key of a keyed move (a block hash: tens of bytes); it travels behind one length byte
MAX_NS = 64  # a keyed move's namespace: an identity's digest
MAX_STR = 4096  # any str field, in characters (what the bus sends too: error reasons are clamped to it)
STR_MAX = {"host": 255, "weights": 256}  # str fields bounded lower than MAX_STR (host: POSIX HOST_NAME_MAX)
#: str fields whose every character is checked: a name of the weights (clear's) is one line of text
STR_PATTERN = {"weights": r"\A[^\x00-\x1f\x7f]+\Z"}
MAX_ECHO = 64  # characters of a peer's value an error reason quotes, then an ellipsis
MAX_ADDRESS = 512  # reply_to
MAX_NEST_DEPTH = 4  # maps / lists enclosing any value of a map / list field, the field's own counted
MAX_NEST_ITEMS = 256  # entries of a map / list field, nested ones counted too
MAX_STATS_BYTES = 16384  # encoded size of one rank's stats (status echoes world of them)
# layout fields (§4.8): block ids are int32; the rest far beyond any model
MAX_LAYERS = 4096
# A rank's cache is regions of block pages: K and V per layer, and an fp8
# engine's two scales per layer (FastDeploy): every layout the broker accepts
# fits a rank (zkv/rank/memory/descriptor.py takes its limit from here).
REGIONS_PER_LAYER = 4
MAX_REGIONS = REGIONS_PER_LAYER * MAX_LAYERS
LAYOUT_MAX: dict[str, int] = {
    "layers": MAX_LAYERS,
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


def uint_bounds(kind: str, name: str) -> tuple[int, int]:
    """The inclusive range of uint field ``name`` in a ``kind`` message (the
    same in every kind: what one party sends, the next may echo)."""
    return UINT_MIN.get(name, 0), UINT_MAX.get(name, MAX_SAFE_INT)


def gen_room(gen: int, moves: int = 1) -> bool:
    """The broker may move generation ``gen`` on ``moves`` more times without passing MAX_GEN."""
    return gen + moves <= MAX_GEN


# list fields: most entries
LIST_MAX: dict[str, int] = {"upto": MAX_WORLD, "digests": MAX_CHECKSUM_IDS, "kept_tiers": MAX_NEST_ITEMS}
MAX_TIER_NAME = 16  # characters of one name in a ready's kept_tiers (at least 1)
