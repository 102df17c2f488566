"""A bounded, seeded fuzz of the broker's frontend and backend:
mutations of the golden valid vectors, sent by strangers on raw sockets, with
a genuine client served after every batch.  No process may exit, nothing may
hang.  ``ZKV_LONG_FUZZ=1`` runs the long profile (``ZKV_FUZZ_MESSAGES``
overrides the count of either).

Mutations that would be *authorized* acts rather than bad input are filtered
out: a valid pause / clear / resume (any client may pause the bus) and a
valid ``ready`` for this world (without Curve any backend peer may register).
"""

import os
import random
import time

import msgpack
import pytest
import zmq
from test_protocol import VALID as VECTORS  # the golden vectors, decoded
from test_protocol import from_json as _from_json

from zkv.harness.bus.cluster import LocalCluster
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=1, gpu_blocks=16, cpu_blocks=16, block_size=1, kv_heads=1, head_dim=8)
LONG = os.environ.get("ZKV_LONG_FUZZ") == "1"
MESSAGES = int(os.environ.get("ZKV_FUZZ_MESSAGES", 400_000 if LONG else 20_000))
BATCH = 2_000
SEED = 20261201


FRONT = [_from_json(v["decoded"]) for v in VECTORS if v["socket"] == "frontend" and v["direction"] == "client->broker"]
BACK = [_from_json(v["decoded"]) for v in VECTORS if v["socket"] == "backend" and v["direction"] == "rank->broker"]
BODIES = [bytes.fromhex(v["hex"]) for v in VECTORS if v["socket"] == "body"]


def _deep(n):
    v: dict = {}
    for _ in range(n):
        v = {"a": v}
    return v


NASTY = [
    2**53 - 1,
    2**53,
    2**64 - 1,
    -1,
    -(2**63),
    2**40,
    2**40 - 1,
    4097,
    0,
    True,
    False,
    1.0,
    float("nan"),
    None,
    "",
    "x" * 5000,
    b"bin",
    [],
    {},
    _deep(600),
    list(range(300)),
    {f"k{i}": i for i in range(300)},
    "inproc://zkv-stop-rank-0-0",
    "tcp://127.0.0.1:1",
    "tcp://::1:5555",
    "tcp://[::1]:5555",
    "ipc:///tmp/zkv-fuzz-nobody.sock",
    "pause",
    "ready",
    "run",
]
FIELDS = [
    "v",
    "kind",
    "req",
    "task",
    "reply_to",
    "reply_key",
    "timeout_ms",
    "wait_ranks",
    "keep_cpu",
    "layout",
    "rank",
    "world",
    "session",
    "gen",
    "pid",
    "epoch",
    "op",
    "upto",
    "seq",
    "n",
    "outcome",
    "bytes",
    "freed",
    "stats",
    "inflight",
    "probe",
]


def mutate(rng: random.Random, msg: dict) -> list[bytes]:
    """One mutated message (a list of frames)."""
    msg = dict(msg)
    roll = rng.random()
    if roll < 0.55:
        for _ in range(rng.randint(1, 3)):
            msg[rng.choice(list(msg) + FIELDS)] = rng.choice(NASTY)
    elif roll < 0.65 and msg:
        del msg[rng.choice(list(msg))]
    elif roll < 0.75 and isinstance(msg.get("layout"), dict):
        msg["layout"] = dict(msg["layout"], **{rng.choice(list(msg["layout"]) + ["extra"]): rng.choice(NASTY)})
    frame = msgpack.packb(msg, use_bin_type=True)
    if 0.75 <= roll < 0.95 and frame:  # byte-level damage
        b = bytearray(frame)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            i = rng.randrange(len(b)) if b else 0
            if op < 0.5 and b:
                b[i] = rng.randrange(256)
            elif op < 0.7:
                del b[i:]
            elif op < 0.85:
                b.insert(i, rng.randrange(256))
            else:
                b += bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        frame = bytes(b)
    frames = [frame]
    if msg.get("kind") == "submit" or rng.random() < 0.1:
        body = rng.choice(BODIES)
        if rng.random() < 0.5:
            body = bytes(x ^ (rng.randrange(256) if rng.random() < 0.1 else 0) for x in body)
        frames.append(body)
    if rng.random() < 0.03:
        frames.extend([b""] * rng.randint(1, 3))
    return frames


def authorized_act(frames: list[bytes], backend: bool) -> bool:
    """What any unauthenticated peer may do by design; not bad input."""
    try:
        msg = P.decode(frames[0])
    except P.ProtocolError:
        return False
    if backend:
        return msg.kind == "ready" and msg.world == 2
    return msg.kind in ("pause", "clear", "resume")


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=["--heartbeat-ms", "100"]).start(timeout=90)
    yield c
    c.stop()


def stranger(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.connect(endpoint)
    return sock


def await_reply(sock: zmq.Socket, match, replies: list[int], timeout: float = 60.0) -> None:
    """Read every reply up to the one ``match`` takes; each must pass the
    bounds a peer's decoder checks (docs/protocol.md §2.1 binds what the bus
    sends as much as what it accepts)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), "the broker did not get through the batch in time"
        frames = sock.recv_multipart()
        for frame in frames:
            try:
                P.decode(frame)
            except P.ProtocolError as err:
                pytest.fail(f"the broker sent a frame a peer refuses ({err.code}: {err.reason}): {frame[:200]!r}")
        replies[0] += 1
        if match(msgpack.unpackb(frames[-1], raw=False)):
            return


def test_strangers_fuzz_the_frontend_and_backend_and_a_genuine_client_is_served_after_every_batch(cluster):
    rng = random.Random(SEED)
    sent = {"frontend": 0, "backend": 0}
    replies = [0]
    start = time.monotonic()
    with cluster.client(request_timeout=30) as genuine:
        bad_before = genuine.status().counters
        while sum(sent.values()) < MESSAGES:
            front, back = stranger(cluster.endpoints.frontend), stranger(cluster.endpoints.backend)
            try:
                for _ in range(BATCH):
                    backend = rng.random() < 0.5
                    frames = mutate(rng, rng.choice(BACK if backend else FRONT))
                    if authorized_act(frames, backend):
                        continue
                    (back if backend else front).send_multipart(frames)
                    sent["backend" if backend else "frontend"] += 1
                # One connection keeps its order: once the broker answered a marker
                # sent last, it has read (and answered) all of this batch.
                mark = sum(sent.values())
                front.send(P.encode("ping", req=mark))
                await_reply(front, lambda m, mark=mark: m.get("kind") == "reply" and m.get("req") == mark, replies)
                back.send(msgpack.packb({"v": 1, "kind": f"fuzz-mark-{mark}"}))
                await_reply(
                    back,
                    lambda m, mark=mark: m.get("kind") == "error" and f"fuzz-mark-{mark}" in m.get("reason", ""),
                    replies,
                )
            finally:
                front.close()
                back.close()
            for rank, proc in cluster.workers.items():
                assert proc.poll() is None, f"rank {rank} exited with {proc.returncode} after {sent}"
            assert cluster.broker.poll() is None, f"broker exited after {sent}"
            genuine.ping()
            out = genuine.run("swap_out", [0, 1], [2, 3], timeout=30)
            if not out.ok:
                st = genuine.status()
                pytest.fail(
                    f"genuine task failed after {sent}: {out}; broker counters {st.counters}; "
                    f"ranks {[(r.rank, r.alive, r.last_seen_ms, r.stats) for r in st.ranks]}"
                )
        st = genuine.status()
    elapsed = time.monotonic() - start
    assert st.state == "running" and [r.alive for r in st.ranks] == [True, True]
    refused = (
        st.counters.get("bad_requests", 0)
        - bad_before.get("bad_requests", 0)
        + st.counters.get("bad_rank_msgs", 0)
        - bad_before.get("bad_rank_msgs", 0)
    )
    assert refused > 0.6 * sum(sent.values()), (refused, sent)
    assert replies[0] > 0.6 * sum(sent.values()), (replies, sent)  # each read and decoded under the bounds
    # Every message was handled by the codec, none by the last-resort exception handler.
    assert st.counters.get("internal_errors", 0) == 0, st.counters
    assert all(r.stats.get("internal_errors", 0) == 0 for r in st.ranks), [r.stats for r in st.ranks]
    print(
        f"\nfuzz: {sum(sent.values())} messages ({sent}) in {elapsed:.1f} s, {refused} refused, "
        f"{replies[0]} replies in bounds, seed {SEED}"
    )
