"""Strangers: no well-formed or malformed message from a peer can
stop, wedge or hijack the bus.  A real broker and real rank processes; the
stranger is a raw pyzmq socket.  One test per rule of docs/architecture.md, "Strangers"."""

import itertools
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
from profiles import long_e2e

from zkv import Client, ZkvError
from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.harness.bus.cluster import LocalCluster, layout_args
from zkv.net.endpoints import Endpoints
from zkv.rank.worker import RankWorker
from zkv.wire import bounds
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout
from zkv.wire.messages import Message

LAYOUT = CacheLayout(layers=1, gpu_blocks=16, cpu_blocks=16, block_size=1, kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=["--heartbeat-ms", "100"]).start(timeout=90)
    yield c
    c.stop()


@pytest.fixture
def client(cluster):
    with cluster.client(request_timeout=20) as c:
        yield c


def raw(endpoint: str, identity: bytes | None = None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


def recv(sock: zmq.Socket, timeout_ms: int = 10_000) -> dict:
    """The next reply, which must pass the bounds a peer's decoder checks
    (docs/protocol.md §2.1 applies to what the bus sends too)."""
    assert sock.poll(timeout_ms), "no reply in time"
    frames = sock.recv_multipart()
    for frame in frames:
        P.decode(frame)
    return msgpack.unpackb(frames[0], raw=False)


def assert_serving(cluster, client):
    for rank, proc in cluster.workers.items():
        assert proc.poll() is None, f"rank {rank} exited with {proc.returncode}"
    assert cluster.broker.poll() is None
    out = client.run("swap_out", [0, 1], [2, 3], timeout=20)
    assert out.ok, out


def counters(client) -> dict:
    return client.status().counters


# --- 1. result addresses --------------------------------------------------------------


BAD_REPLY_TO = [
    "inproc://zkv-stop-rank-0-0",
    "inproc://zkv-stop-broker-0",
    "inproc://zeromq.zap.01",
    "tcp://",
    "udp://127.0.0.1:5",
    "tcp://127.0.0.1:1" + "1" * 600,
    "ipc://a\x00b",
    "tcp://no-such-host.invalid:5555",
    "tcp://127.0.0.1:*",
    "tcp://lo;127.0.0.1:5555",
    "tcp://::1:5555",  # IPv6 only in brackets
    "tcp://0.0.0.0:5555",
    "tcp://[::]:5555",
    "tcp://127.0.0.1:05555",
    "tcp://[fe80::1%lo]:5555",
    "ipc://",
]


def test_a_client_cannot_name_an_address_inside_a_zkv_process(cluster, client):
    sock = raw(cluster.endpoints.frontend)
    try:
        for task, reply_to in enumerate(BAD_REPLY_TO, 1):
            sock.send_multipart([P.encode("submit", task=task, reply_to=reply_to), P.encode_body("swap_out", [0], [1])])
            msg = recv(sock)
            assert (msg["kind"], msg["task"], msg["outcome"]) == ("outcome", task, "rejected"), msg
            assert "ipc://PATH or tcp://IP:PORT" in msg["reason"]
    finally:
        sock.close()
    assert_serving(cluster, client)


def _ipv6_loopback() -> bool:
    try:
        sock = zmq.Context.instance().socket(zmq.PULL)
    except zmq.ZMQError:
        return False
    try:
        sock.setsockopt(zmq.IPV6, 1)
        sock.bind("tcp://[::1]:*")
        return True
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=0)


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) on this host")
def test_results_reach_a_pull_on_an_ipv6_address(cluster, client):
    """A PULL bound on tcp://[::1]:* gets every rank's result: the rank sets
    ZMQ_IPV6 on its PUSH (without it libzmq connects and never delivers)."""
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.IPV6, 1)
    pull.bind("tcp://[::1]:*")
    reply_to = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    sock = raw(cluster.endpoints.frontend)
    before = sum(r.stats.get("undeliverable", 0) for r in client.status().ranks)
    try:
        assert reply_to.startswith("tcp://[::1]:") and P.is_result_address(reply_to)
        sock.send_multipart([P.encode("submit", task=7, reply_to=reply_to), P.encode_body("swap_out", [0], [1])])
        results = []
        while len(results) < 2:
            assert pull.poll(20_000), f"only {len(results)} of 2 results on {reply_to}"
            results.append(P.decode(pull.recv()))
        assert sorted((r.task, r.rank, r.outcome) for r in results) == [(7, 0, "ok"), (7, 1, "ok")]
        port = reply_to.rsplit(":", 1)[1]
        sock.send_multipart(
            [P.encode("submit", task=8, reply_to=f"tcp://::1:{port}"), P.encode_body("swap_out", [0], [1])]
        )
        msg = recv(sock)
        assert (msg["kind"], msg["task"], msg["outcome"]) == ("outcome", 8, "rejected"), msg
    finally:
        sock.close()
        pull.close()
    after = sum(r.stats.get("undeliverable", 0) for r in client.status().ranks)
    assert after == before
    assert_serving(cluster, client)


def test_a_rank_refuses_an_inproc_result_address_from_its_broker(tmp_path):
    """The rank's own check, for a broker that lets one through: the named
    socket (the rank's own stop signal) is never connected, the rank serves on."""
    ctx = zmq.Context.instance()
    ep = Endpoints.in_dir(tmp_path)
    router, pub, pull = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    for s in (router, pub, pull):
        s.setsockopt(zmq.LINGER, 0)
    router.bind(ep.backend)
    pub.bind(ep.control)
    pull.bind(f"ipc://{tmp_path}/results.sock")
    worker = RankWorker(0, 1, ep.backend, ep.control, LAYOUT, device="cpu", liveness_ms=10_000)
    thread = threading.Thread(target=worker.serve, daemon=True)
    thread.start()
    try:
        assert router.poll(20_000)
        ident, frame = router.recv_multipart()
        ready = P.decode(frame)
        assert ready.kind == "ready" and ident != b"rank-0", "a rank's identity must not be guessable"
        router.send_multipart(
            [
                ident,
                P.encode(
                    "welcome",
                    epoch=0,
                    op="run",
                    gen=0,
                    upto=0,
                    layout=LAYOUT.to_wire(),
                    heartbeat_ms=1000,
                    session=ready.session,
                ),
            ]
        )
        body = P.encode_body("fill", dst=[0], tier="gpu", seed=1)
        for n, reply_to in enumerate([worker._stopper.address, worker._report_address, "inproc://zeromq.zap.01"], 1):
            router.send_multipart(
                [ident, P.encode("task", seq=n, n=n, task=n, reply_to=reply_to, gen=0, session=ready.session), body]
            )
            done = next_kind(router, "done")
            assert (done.seq, done.outcome) == (n, "failed")
        assert thread.is_alive(), "a named inproc address stopped the rank"
        router.send_multipart(
            [
                ident,
                P.encode(
                    "task",
                    seq=9,
                    n=4,
                    task=9,
                    reply_to=f"ipc://{tmp_path}/results.sock",
                    gen=0,
                    session=ready.session,
                ),
                body,
            ]
        )
        assert pull.poll(10_000)
        result = P.decode(pull.recv())
        assert (result.task, result.outcome) == (9, "ok")
    finally:
        worker.stop()
        thread.join(timeout=10)
        for s in (router, pub, pull):
            s.close()


def next_kind(sock: zmq.Socket, kind: str) -> Message:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000)))
        msg = P.decode(sock.recv_multipart()[-1])
        if msg.kind == kind:
            return msg
    raise AssertionError(f"no {kind} in time")


# --- 2. integers from a peer ------------------------------------------------------------


def ready(**fields):
    base = {"rank": 0, "world": 2, "session": 7, "layout": LAYOUT.to_wire(), "gen": 0}
    base.update(fields)
    return P.encode("ready", **base)


def test_a_stranger_ready_cannot_poison_the_generation(cluster, client):
    before = client.status()
    sock = raw(cluster.endpoints.backend)
    try:
        for gen in (2**53, 2**64 - 1):  # beyond any uint (a ready in range registers: see below)
            sock.send(msgpack.packb(msgpack.unpackb(ready()) | {"gen": gen}))
            msg = recv(sock)
            assert (msg["kind"], msg["code"]) == ("error", "bad_field"), msg
        sock.send(ready(world=3, rank=1))
        assert recv(sock)["kind"] == "refused"
    finally:
        sock.close()
    after = client.status()
    assert after.gen == before.gen
    assert after.counters.get("registrations") == before.counters.get("registrations")
    client.pause()
    assert client.clear().gen == before.gen + 1
    assert client.resume().state == "running"
    assert_serving(cluster, client)


def test_the_largest_adoptable_generation_still_leaves_room_for_the_next_clear():
    """A rank may send gen up to 2^40-1; the broker's +1 after it must still be
    taken by every rank (control, welcome and task allow up to 2^53-1)."""
    from zkv.broker.core import BrokerCore, Publish

    core = BrokerCore(BrokerConfig(world=1))
    core.on_rank(b"r", [ready(world=1, gen=bounds.MAX_ADOPTED_GEN)], 1.0)
    core.on_client(b"c", [P.encode("pause", req=1)], 1.1)
    core.on_rank(b"r", [P.encode("ack", epoch=1, op="pause", upto=0, gen=bounds.MAX_ADOPTED_GEN)], 1.2)
    (pub,) = [a for a in core.on_client(b"c", [P.encode("clear", req=2)], 1.3) if isinstance(a, Publish)]
    assert P.decode(pub.frame, ("control",)).gen == bounds.MAX_ADOPTED_GEN + 1


def test_a_rank_above_the_adoption_bound_is_not_adopted_and_its_dones_return_credit():
    """A ready may carry any uint gen (a rank echoes what its broker sent), but
    the broker takes a rank's gen as its own only up to 2^40-1; a done at the
    gen of its task returns its credit however high (sans-IO: docs/protocol.md §10.1)."""
    from zkv.broker.core import BrokerCore

    core = BrokerCore(BrokerConfig(world=1))
    out = core.on_rank(b"r", [ready(world=1, gen=bounds.MAX_GEN)], 1.0)
    assert [P.decode(f).kind for a in out if hasattr(a, "frames") for f in a.frames] == ["welcome"]
    assert core.gen == 0 and core.counters.get("gen_adopted", 0) == 0


def test_a_clear_that_would_pass_the_largest_generation_is_refused():
    from zkv.broker.core import BrokerCore, ToClient

    core = BrokerCore(BrokerConfig(world=1))
    core.on_rank(b"r", [ready(world=1)], 1.0)
    core.gens.gen = bounds.MAX_GEN - 1  # as after 2^53 - 2 operations
    core.on_client(b"c", [P.encode("pause", req=1)], 1.1)
    core.on_rank(b"r", [P.encode("ack", epoch=1, op="pause", upto=0, gen=bounds.MAX_GEN - 1)], 1.2)
    (reply,) = [
        P.decode(a.frames[0]) for a in core.on_client(b"c", [P.encode("clear", req=2)], 1.3) if isinstance(a, ToClient)
    ]
    assert (reply.kind, reply.code, reply.req) == ("error", "gen_exhausted", 2) and str(bounds.MAX_GEN) in reply.reason
    assert core.state == "paused" and core.gen == bounds.MAX_GEN - 1


def test_a_stranger_cannot_wedge_the_bus_at_the_top_of_the_adoption_range(tmp_path):
    """A stranger registers first with the largest generation a broker adopts;
    the genuine rank then moves the bus one above it, and its tasks, dones and
    a pause still go through: nothing a task or done carries is out of range."""
    ep = Endpoints.in_dir(tmp_path)
    broker = Broker(ep, BrokerConfig(world=1, heartbeat_ms=100, liveness_ms=2000))
    threads = [threading.Thread(target=broker.serve, daemon=True)]
    threads[0].start()
    worker = None
    sock = raw(ep.backend)
    try:
        sock.send(ready(world=1, gen=bounds.MAX_ADOPTED_GEN, session=11))
        welcome = recv(sock)
        assert (welcome["kind"], welcome["gen"]) == ("welcome", bounds.MAX_ADOPTED_GEN), welcome
        sock.close()
        worker = RankWorker(0, 1, ep.backend, ep.control, LAYOUT, device="cpu", liveness_ms=2000)
        threads.append(threading.Thread(target=worker.serve, daemon=True))
        threads[1].start()
        with Client(ep.frontend, request_timeout=20) as c:
            c.status(wait_ranks=1, timeout=20)
            for _ in range(3):
                out = c.run("swap_out", [0], [1], timeout=20)
                if out.ok:
                    break
            assert out.ok, out
            assert c.gen == bounds.MAX_ADOPTED_GEN + 1
            assert c.pause(timeout=10).state == "paused"
            st = c.status()
            assert st.inflight == 0 and st.ranks[0].inflight == 0, st
            assert c.clear(timeout=10).gen == bounds.MAX_ADOPTED_GEN + 2
            assert c.resume(timeout=10).state == "running"
            assert c.run("swap_out", [0], [1], timeout=20).ok
    finally:
        if not sock.closed:
            sock.close()
        if worker is not None:
            worker.stop()
        broker.stop()
        for t in threads:
            t.join(timeout=10)


@pytest.mark.parametrize(
    "field,value", [("timeout_ms", 2**53 - 1), ("timeout_ms", bounds.MAX_TIMEOUT_MS + 1), ("wait_ranks", 3)]
)
def test_out_of_range_request_integers_are_refused_with_their_req(cluster, client, field, value):
    sock = raw(cluster.endpoints.frontend)
    try:
        sock.send(P.encode("status", req=41, **{field: value}))
        msg = recv(sock)
        assert (msg["kind"], msg["code"], msg["req"]) == ("error", "bad_field", 41), msg
    finally:
        sock.close()


def test_any_layout_the_broker_accepts_a_rank_holds(cluster, client):
    """The largest layer count (§4.8) is 2 x 4096 regions on a rank: the rank's
    region limit comes from the same table (zkv/wire/bounds.py), so the resume
    completes instead of failing alloc_failed; and one layer more is refused."""
    widest = {"layers": bounds.MAX_LAYERS, "gpu_blocks": 2, "cpu_blocks": 2, "block_size": 1, "kv_heads": 1}
    widest.update(head_dim=1, dtype="fp16")
    client.pause()
    client.clear()
    try:
        with pytest.raises(ZkvError) as err:
            client.resume(layout=dict(widest, layers=bounds.MAX_LAYERS + 1))
        assert err.value.code == "bad_field"
        assert client.resume(layout=widest, timeout=60).layout.layers == bounds.MAX_LAYERS
        out = client.run("swap_out", [0, 1], [1, 0], timeout=60)
        assert out.ok and out.bytes == 2 * 2 * 2 * bounds.MAX_LAYERS * 2, out  # ranks x blocks x K,V x layers x fp16
    finally:
        client.pause()
        client.clear()
        client.resume(layout=LAYOUT.to_wire())
    assert_serving(cluster, client)


@pytest.mark.parametrize(
    "socket,frame",
    [
        ("frontend", {"v": 1, "kind": "k" * 5000, "req": 3}),
        ("frontend", {"v": 1, "kind": "body", "op": "o" * 5000}),
        ("backend", {"v": "v" * 5000, "kind": "hb"}),
        ("backend", {"v": 1, "kind": "done", "seq": 1, "n": 1, "gen": 0, "outcome": "o" * 4096}),
        (
            "backend",
            {"v": 1, "kind": "ready", "rank": 0, "world": 2, "session": 1, "gen": 0, "layout": {"dtype": "d" * 4096}},
        ),
    ],
    ids=["kind", "wrong_socket", "version", "enum", "ready_layout"],
)
def test_an_error_reply_quotes_a_peer_value_at_most_64_characters(cluster, client, socket, frame):
    """Everything the bus sends keeps the bounds it checks (§2.1): a reason
    quotes a peer's value cut to 64 characters with an ellipsis."""
    sock = raw(getattr(cluster.endpoints, socket))
    try:
        sock.send(msgpack.packb(frame))
        msg = recv(sock)  # decodes under the bounds a peer checks
        assert msg["kind"] in ("error", "refused") and len(msg["reason"]) <= 200, (len(msg["reason"]), msg)
    finally:
        sock.close()


# --- 3. nested structures ------------------------------------------------------------------


def deep(n):
    v = {}
    for _ in range(n):
        v = {"a": v}
    return v


@pytest.mark.parametrize(
    "stats",
    [
        deep(1022),
        deep(P.MAX_NEST_DEPTH + 2),
        {f"k{i}": i for i in range(300)},
        {"x": "y" * 5000},
        {"big": [1] * 200, "more": [2] * 100},
    ],
)
def test_stats_that_would_not_encode_are_refused_on_arrival(cluster, client, stats):
    sock = raw(cluster.endpoints.backend)
    try:
        for kind, fields in (("hb", {"stats": stats}), ("ack", {"epoch": 1, "op": "pause", "stats": stats})):
            sock.send(msgpack.packb({"v": 1, "kind": kind, **fields}))
            msg = recv(sock)
            assert (msg["kind"], msg["code"]) == ("error", "bad_field"), msg
    finally:
        sock.close()
    st = client.status()  # still encodes, with the real ranks' stats
    assert [r.alive for r in st.ranks] == [True, True] and all(r.stats for r in st.ranks)


def test_a_value_enclosed_by_5_maps_is_refused_and_by_4_is_taken(cluster, client):
    """docs/protocol.md §2.1: the field's own map counts as the first of at most 4."""
    four, five = {"a": {"b": {"c": {"d": 1}}}}, {"a": {"b": {"c": {"d": {"e": 1}}}}}
    sock = raw(cluster.endpoints.backend)
    try:
        sock.send(P.encode("hb", stats=five))
        assert (recv(sock)["kind"], P.MAX_NEST_DEPTH) == ("error", 4)
        sock.send(P.encode("hb", stats=four))  # decodes: then it is a stranger's hb
        assert recv(sock)["kind"] == "reregister"
    finally:
        sock.close()


# --- 3b. what the spec settles at its edges (docs/protocol.md §2, §2.1, §3, §9, §10) ---------


def test_a_map_over_4096_entries_is_malformed_and_its_error_carries_no_req(cluster, client):
    sock = raw(cluster.endpoints.frontend)
    try:
        sock.send(msgpack.packb({"v": 1, "kind": "ping", "req": 5, **{f"k{i}": 0 for i in range(4094)}}))
        msg = recv(sock)
        assert (msg["kind"], msg["code"], "req" in msg) == ("error", "malformed", False), msg
        sock.send(msgpack.packb({"v": 1, "kind": "ping", "req": 6, **{f"k{i}": 0 for i in range(4093)}}))
        assert recv(sock) == {"v": 1, "kind": "reply", "req": 6, "op": "ping"}  # 4096 entries: read
    finally:
        sock.close()


def test_a_nil_inside_a_layout_is_invalid(cluster, client):
    sock = raw(cluster.endpoints.backend)
    try:
        sock.send(ready(layout=dict(LAYOUT.to_wire(), layers=None)))
        msg = recv(sock)
        assert msg["kind"] == "refused" and "layers" in msg["reason"], msg
    finally:
        sock.close()
    assert_serving(cluster, client)


def test_a_header_only_submit_is_an_error_when_its_header_is_bad_and_rejected_when_not(cluster, client):
    sock = raw(cluster.endpoints.frontend)
    try:
        sock.send(msgpack.packb({"v": 1, "kind": "submit", "task": 4, "reply_to": 5}))
        msg = recv(sock)
        assert (msg["kind"], msg["code"], msg["task"]) == ("error", "bad_field", 4), msg
        sock.send(P.encode("submit", task=5, reply_to="ipc:///tmp/zkv-nobody.sock"))
        msg = recv(sock)
        assert (msg["kind"], msg["task"], msg["outcome"]) == ("outcome", 5, "rejected"), msg
    finally:
        sock.close()


def test_a_done_batch_from_a_stranger_gets_one_reregister_per_frame(cluster, client):
    sock = raw(cluster.endpoints.backend)
    try:
        sock.send_multipart([P.encode("done", seq=n, n=n, outcome="ok", gen=0) for n in (1, 2, 3)])
        assert [recv(sock)["kind"] for _ in range(3)] == ["reregister"] * 3
        assert not sock.poll(200)
    finally:
        sock.close()


def test_an_ack_whose_layout_breaks_the_layout_rules_is_a_bad_field_from_anyone(cluster, client):
    """A layout is typed where it enters: one that breaks a bound is a malformed frame,
    answered ``bad_field`` before the sender is looked at, as any other bound is."""
    sock = raw(cluster.endpoints.backend)
    try:
        sock.send(P.encode("ack", epoch=1, op="resume", gen=0, layout=dict(LAYOUT.to_wire(), layers=0)))
        msg = recv(sock)
        assert (msg["kind"], msg["code"]) == ("error", "bad_field") and "layers" in msg["reason"], msg
    finally:
        sock.close()
    assert_serving(cluster, client)


def test_an_ack_whose_layout_breaks_the_layout_rules_is_not_counted_from_a_rank():
    from zkv.broker.core import BrokerCore, ToClient

    core = BrokerCore(BrokerConfig(world=1))
    core.on_rank(b"r", [ready(world=1)], 1.0)
    for req, op in enumerate(("pause", "clear"), 1):
        core.on_client(b"c", [P.encode(op, req=req)], 1.0 + req)
        core.on_rank(b"r", [P.encode("ack", epoch=req, op=op, gen=core.gen, upto=0, freed=0)], 1.0 + req)
    core.on_client(b"c", [P.encode("resume", req=3)], 4.0)
    bad = P.encode("ack", epoch=3, op="resume", gen=core.gen, layout=dict(LAYOUT.to_wire(), layers=0))
    assert not [a for a in core.on_rank(b"r", [bad], 4.1) if isinstance(a, ToClient)]
    assert core.state == "resuming"
    good = P.encode("ack", epoch=3, op="resume", gen=core.gen, layout=LAYOUT.to_wire())
    (reply,) = [P.decode(a.frames[0]) for a in core.on_rank(b"r", [good], 4.2) if isinstance(a, ToClient)]
    assert (reply.kind, reply.req, core.state) == ("reply", 3, "running")


def test_a_second_frame_on_a_request_other_than_submit_is_ignored(cluster, client):
    sock = raw(cluster.endpoints.frontend)
    try:
        sock.send_multipart([P.encode("ping", req=9), b"\xc1 anything"])
        assert recv(sock) == {"v": 1, "kind": "reply", "req": 9, "op": "ping"}
        sock.send_multipart([P.encode("ping", req=10), b"", b""])
        msg = recv(sock)
        assert (msg["code"], msg["req"]) == ("malformed", 10), msg  # three frames: too many
    finally:
        sock.close()


def test_unknown_fields_are_ignored_whatever_their_size(cluster, client):
    sock = raw(cluster.endpoints.frontend)
    try:
        sock.send(P.encode("ping", req=11, pad="x" * 5000, deep=deep(10), big=2**60, neg=-(2**63)))
        assert recv(sock) == {"v": 1, "kind": "reply", "req": 11, "op": "ping"}
    finally:
        sock.close()


# --- 4. per-client state ---------------------------------------------------------------------


@pytest.fixture
def lonely_broker(tmp_path):
    """A broker with no ranks, so every status{wait_ranks} is held."""
    ep = Endpoints.in_dir(tmp_path)
    b = Broker(ep, BrokerConfig(world=2, max_waiters_per_client=16, max_waiters=32, max_open_per_client=5))
    thread = threading.Thread(target=b.serve, daemon=True)
    thread.start()
    yield ep, b
    b.stop()
    thread.join(timeout=10)


def drain(sock, n, timeout_ms=10_000):
    out = []
    while len(out) < n:
        out.append(recv(sock, timeout_ms))
    return out


def ping_p50(c: Client, n: int = 100) -> float:
    lat = []
    for _ in range(n):
        t = time.perf_counter()
        c.ping()
        lat.append(time.perf_counter() - t)
    return sorted(lat)[n // 2]


def test_held_status_requests_are_bounded_per_client_and_in_all(lonely_broker):
    ep, broker = lonely_broker
    with Client(ep.frontend, request_timeout=10) as genuine:
        base = ping_p50(genuine)
        strangers = [raw(ep.frontend) for _ in range(3)]
        try:
            for s in strangers[:2]:  # each may hold 16: the other 24 are refused at once
                for req in range(40):
                    s.send(P.encode("status", req=req, wait_ranks=1, timeout_ms=bounds.MAX_TIMEOUT_MS))
                assert {e["code"] for e in drain(s, 24)} == {"over_limit"}
            assert len(broker.core.ready_waiters) == 32  # the global cap
            for req in range(40):  # a third connection gets room only up to a fair share
                strangers[2].send(P.encode("status", req=req, wait_ranks=1, timeout_ms=bounds.MAX_TIMEOUT_MS))
            replies = [recv(strangers[2])]
            while strangers[2].poll(500):
                replies.append(recv(strangers[2]))
            held = dict(broker.core.ready_waiters.count)
            assert len(broker.core.ready_waiters) == 32 and max(held.values()) - min(held.values()) <= 1, held
            assert len(replies) == 40 - min(held.values()) or len(replies) == 40 - max(held.values())
        finally:
            for s in strangers:
                s.close()  # gone without a word: their held requests expire, and do not crowd out others
        assert len(broker.core.ready_waiters) == 32
        # A genuine client that holds fewer gets room (a hog's oldest request is
        # dropped), and its request expires at its own deadline.
        with pytest.raises(ZkvError) as err:
            genuine.status(timeout=0.2, wait_ranks=1)
        assert err.value.code == "timeout"
        after = ping_p50(genuine)
    assert broker.core.counters["waiters_evicted"] >= 1
    assert after < 3 * base + 0.01, (base, after)  # was 1 ms -> 26-44 ms with 40,000 held requests


def test_open_tasks_are_bounded_per_client_and_queued_ones_expire(lonely_broker):
    ep, broker = lonely_broker
    sock = raw(ep.frontend)
    try:
        body = P.encode_body("swap_out", [0], [1])
        for task in range(1, 8):
            sock.send_multipart(
                [P.encode("submit", task=task, reply_to="ipc:///tmp/nobody.sock", timeout_ms=100), body]
            )
        rejected = drain(sock, 2)
        assert [(m["task"], m["outcome"]) for m in rejected] == [(6, "rejected"), (7, "rejected")]
        assert "open tasks" in rejected[0]["reason"]
    finally:
        sock.close()
    assert broker.core.tasks.open_per_client and max(broker.core.tasks.open_per_client.values()) == 5


def test_a_queued_task_past_its_timeout_never_runs():
    from zkv.broker.core import BrokerCore, SaveState, ToClient, ToRank

    core = BrokerCore(BrokerConfig(world=1))
    out = core.on_client(
        b"c",
        [P.encode("submit", task=1, reply_to="ipc:///tmp/c", timeout_ms=100), P.encode_body("swap_out", [0], [1])],
        0.0,
    )
    assert [a for a in out if not isinstance(a, SaveState)] == []  # queued: nothing sent
    out = core.on_rank(b"r0", [ready(world=1)], 1.0)
    assert not [a for a in out if isinstance(a, ToRank) and len(a.frames) == 2], "an expired task was dispatched"
    (msg,) = [P.decode(a.frames[0]) for a in out if isinstance(a, ToClient)]
    assert (msg.task, msg.outcome) == (1, "timeout")
    assert not core.tasks.open_per_client


# --- 5. identities -----------------------------------------------------------------------------


@long_e2e("a second worker process, 12-18 s", "test_rank_claims.py")
def test_a_misconfigured_rank_cannot_evict_the_live_one(cluster, client):
    deaths = counters(client).get("rank_deaths", 0)
    intruder = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zkv",
            "worker",
            "--rank",
            "1",
            "--world-size",
            "3",
            "--backend",
            cluster.endpoints.backend,
            "--control",
            cluster.endpoints.control,
            *layout_args(LAYOUT),
            "--tier-dir",
            "none",  # as from another host: on this one its CPU tier file is refused first
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while intruder.poll() is None:  # tasks keep running on the real rank 1 meanwhile
            out = client.run("swap_out", [0], [1], timeout=20)
            assert out.ok, out
        assert intruder.returncode != 0 and "refused" in intruder.stderr.read()
    finally:
        if intruder.poll() is None:
            intruder.kill()
        intruder.wait(timeout=10)
    # A stranger claiming the old guessable identity is no one's rank either.
    sock = raw(cluster.endpoints.backend, identity=b"rank-1")
    try:
        sock.send(ready(rank=1, world=3))
        assert recv(sock)["kind"] == "refused"
        sock.send(P.encode("hb", inflight=0))
        assert recv(sock)["kind"] == "reregister"
    finally:
        sock.close()
    assert counters(client).get("rank_deaths", 0) == deaths
    assert_serving(cluster, client)


# --- 7. spec and code agree ------------------------------------------------------------------------


@pytest.mark.parametrize("v", [True, 1.0])
def test_a_version_that_only_equals_1_is_bad_version(cluster, client, v):
    front, back = raw(cluster.endpoints.frontend), raw(cluster.endpoints.backend)
    try:
        front.send(msgpack.packb({"v": v, "kind": "ping", "req": 5}))
        msg = recv(front)
        assert (msg["code"], msg["req"]) == ("bad_version", 5)
        back.send(
            msgpack.packb(
                {"v": v, "kind": "ready", "rank": 0, "world": 2, "session": 9, "layout": LAYOUT.to_wire(), "gen": 0}
            )
        )
        assert recv(back)["code"] == "bad_version"
        front.send_multipart(
            [
                P.encode("submit", task=1, reply_to="ipc:///tmp/zkv-nobody.sock"),
                msgpack.packb({"v": v, "kind": "body", "op": "fill", "dst": [0]}),
            ]
        )
    finally:
        front.close()
        back.close()
    assert_serving(cluster, client)


def test_rank_failures_carry_the_error_code_and_tier_empty_is_refused(client):
    out = client.wait(
        client.submit_raw(msgpack.packb({"v": 1, "kind": "body", "op": "fill", "dst": P.pack_ids([0]), "tier": ""}), 20)
    )
    assert out.outcome == "failed" and codes(out) == {"bad_field"}, out
    out = client.wait(
        client.submit_raw(msgpack.packb({"v": True, "kind": "body", "op": "fill", "dst": P.pack_ids([0])}), 20)
    )
    assert out.outcome == "failed" and codes(out) == {"bad_version"}, out


def codes(out) -> set[str]:
    """The §9 code each rank's failure reason starts with."""
    return {r["reason"].split(":", 1)[0] for r in out.per_rank.values()}


def test_fill_takes_any_uint_seed(client):
    for seed in (2**44 + 1, P.MAX_SAFE_INT):
        out = client.run("fill", dst=[4], tier="gpu", seed=seed, timeout=20)
        assert out.ok, out


def test_a_checksum_of_the_documented_maximum_fits_one_result(client):
    out = client.run("checksum", src=[0] * P.MAX_CHECKSUM_IDS, tier="gpu", timeout=120)
    assert out.ok, out
    assert all(len(r["digests"]) == P.MAX_CHECKSUM_IDS for r in out.per_rank.values())
    out = client.run("checksum", src=[0] * (P.MAX_CHECKSUM_IDS + 1), tier="gpu", timeout=60)
    assert out.outcome == "failed" and codes(out) == {"too_large"}, out


def test_status_keeps_the_pid_after_a_rank_re_registers():
    from zkv.rank.core import RankCore

    core = RankCore(0, 2, LAYOUT, sessions=itertools.count(1).__next__)
    (first,) = core.start(1.0, pid=4242)
    core.on_broker(
        P.encode(
            "welcome",
            epoch=0,
            op="run",
            gen=0,
            upto=0,
            layout=LAYOUT.to_wire(),
            heartbeat_ms=500,
            session=P.decode(first.frame).session,
        ),
        1.0,
    )
    (again,) = core.on_broker(P.encode("reregister"), 2.0)
    assert P.decode(again.frame).pid == 4242


def test_a_rank_ignores_a_welcome_or_control_with_a_bad_layout():
    from zkv.rank.core import RankCore

    core = RankCore(0, 1, LAYOUT, sessions=itertools.count(1).__next__)
    (first,) = core.start(1.0, pid=1)
    session = P.decode(first.frame).session
    bad = dict(LAYOUT.to_wire(), gpu_blocks=2**31)
    assert (
        core.on_broker(
            P.encode("welcome", epoch=0, op="run", gen=0, upto=0, layout=bad, heartbeat_ms=500, session=session), 1.0
        )
        == []
    )
    assert not core.registered and core.counters["bad_broker_msgs"] == 1
    core.on_broker(
        P.encode(
            "welcome", epoch=0, op="run", gen=0, upto=0, layout=LAYOUT.to_wire(), heartbeat_ms=500, session=session
        ),
        1.0,
    )
    assert core.on_control(P.encode("control", epoch=1, op="resume", gen=0, upto=[0], layout=bad), 1.1) == []
    assert core.layout == LAYOUT and core.counters["bad_broker_msgs"] == 1 and core.counters["bad_control_msgs"] == 1
