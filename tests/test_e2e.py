"""End to end: a broker and 2 ranks as separate processes started through the
CLI, real ipc:// sockets, real torch tensors."""

import json
import os
import subprocess
import sys

import msgpack
import pytest
import zmq

from zkv import Client
from zkv.harness.bus.cluster import LocalCluster
from zkv.obs.status_view import human_bytes
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=128, block_size=16, kv_heads=2, head_dim=64)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=["--heartbeat-ms", "100"]).start(timeout=60)
    yield c
    codes = c.stop().codes
    assert codes == {"rank0": 0, "rank1": 0, "broker": 0}, f"processes must stop cleanly on SIGTERM: {codes}"


@pytest.fixture
def client(cluster):
    with cluster.client(request_timeout=10) as c:
        yield c


def zkv_cli(cluster, *args, timeout=60):
    env = dict(os.environ, ZKV_BROKER=cluster.endpoints.frontend)
    return subprocess.run(
        [sys.executable, "-m", "zkv", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def raw_dealer(cluster):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(cluster.endpoints.frontend)
    return sock


def assert_still_serving(client):
    out = client.run("swap_out", [0, 1], [0, 1], timeout=10)
    assert out.ok, out


def test_status_json_shows_both_ranks_ready(cluster):
    res = zkv_cli(cluster, "status", "--json")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["state"] == "running" and st["world"] == 2
    assert [(r["rank"], r["alive"]) for r in st["ranks"]] == [(0, True), (1, True)]
    assert st["layout"] == LAYOUT.to_wire()


def test_cli_submit_swap_out_and_in_print_ok_with_bytes(cluster):
    res = zkv_cli(cluster, "submit", "swap-out", "--src", "0-3", "--dst", "10-13")
    assert res.returncode == 0, res.stderr
    assert "ok" in res.stdout and f"{human_bytes(4 * LAYOUT.block_bytes * 2)} moved" in res.stdout
    res = zkv_cli(cluster, "submit", "swap-in", "--src", "10-13", "--dst", "4-7", "--json")
    out = json.loads(res.stdout)
    assert res.returncode == 0 and out["outcome"] == "ok" and out["bytes"] == 8 * LAYOUT.block_bytes
    assert set(out["ranks"]) == {"0", "1"}


def test_cli_failed_outcome_exits_non_zero_with_one_line_error(cluster):
    res = zkv_cli(cluster, "submit", "swap-out", "--src", "999", "--dst", "0")
    assert res.returncode == 1
    assert "failed" in res.stdout and "out of range" in res.stdout
    assert res.stderr.strip().startswith("zkv: error:") and len(res.stderr.strip().splitlines()) == 1


def test_cli_without_a_broker_says_what_to_do(tmp_path):
    env = dict(os.environ, ZKV_BROKER=f"ipc://{tmp_path}/nobody.sock")
    res = subprocess.run(
        [sys.executable, "-m", "zkv", "status", "--timeout", "0.5"], capture_output=True, text=True, timeout=60, env=env
    )
    assert res.returncode == 1 and "zkv up" in res.stderr


@pytest.mark.parametrize(
    "src,dst",
    [
        (list(range(16)), list(range(100, 116))),  # one coalesced run
        ([3, 17, 5, 60, 41, 8, 9, 10], [127, 0, 64, 2, 90, 30, 31, 32]),  # scattered + a short run
    ],
)
def test_swap_round_trip_is_bit_identical_on_every_rank(client, src, dst):
    assert client.run("fill", None, src, tier="gpu", seed=11).ok
    before = client.run("checksum", src, tier="gpu")
    assert before.ok and set(before.per_rank) == {0, 1}
    assert before.per_rank[0]["digests"] != before.per_rank[1]["digests"], "ranks hold different shards"
    out = client.run("swap_out", src, dst)
    assert out.ok and out.bytes == 2 * len(src) * LAYOUT.block_bytes
    assert client.run("fill", None, src, tier="gpu", seed=12).ok
    scribbled = client.run("checksum", src, tier="gpu")
    assert scribbled.per_rank[0]["digests"] != before.per_rank[0]["digests"]
    assert client.run("swap_in", dst, src).ok
    after = client.run("checksum", src, tier="gpu")
    for rank in (0, 1):
        assert after.per_rank[rank]["digests"] == before.per_rank[rank]["digests"]


@pytest.mark.parametrize(
    "frames,code",
    [
        ([b"\xc1not msgpack"], "malformed"),
        ([msgpack.packb({"v": 1, "kind": "explode", "req": 1})], "unknown_kind"),
        ([msgpack.packb({"v": 99, "kind": "status", "req": 1})], "bad_version"),
        ([msgpack.packb({"v": 1, "kind": "pause", "req": "one"})], "bad_field"),
        ([P.encode("ping", req=1)] * 4, "malformed"),
        ([b"\x00" * (P.MAX_FRAME_BYTES + 10)], "too_large"),
    ],
)
def test_bad_frontend_input_gets_a_clear_error_and_everything_keeps_serving(cluster, client, frames, code):
    sock = raw_dealer(cluster)
    try:
        sock.send_multipart(frames)
        reply = P.decode(sock.recv())
    finally:
        sock.close()
    assert reply.kind == "error" and reply.code == code and reply.reason
    assert_still_serving(client)


def test_frame_over_the_transport_limit_drops_that_peer_only(cluster, client):
    from zkv.net.endpoints import ZMQ_MAXMSGSIZE

    sock = raw_dealer(cluster)
    sock.setsockopt(zmq.RCVTIMEO, 300)
    try:
        sock.send(b"\x00" * (ZMQ_MAXMSGSIZE + 1))
        with pytest.raises(zmq.Again):
            sock.recv()  # libzmq disconnected us: no reply is possible
    finally:
        sock.close()
    assert_still_serving(client)


@pytest.mark.parametrize(
    "body,reason",
    [
        (P.encode_body("swap_out", [0, 64], [0, 1]), "out of range"),
        (P.encode_body("swap_in", [0, 1], [5, 5]), "duplicate"),
        (P.encode_body("swap_out", [0, 1, 2], [0, 1]), "src has 3 ids but dst has 2"),
        (msgpack.packb({"v": 1, "kind": "body", "op": "teleport"}), "unknown op"),
        (
            msgpack.packb({"v": 1, "kind": "body", "op": "swap_out", "src": b"\x00\x00\x00", "dst": [1]}),
            "multiple of 4",
        ),
        (b"\xc1", "not a msgpack frame"),
    ],
)
def test_bad_task_fails_on_every_rank_with_the_reason_and_ranks_keep_serving(client, body, reason):
    out = client.wait(client.submit_raw(body, timeout=10))
    assert out.outcome == "failed" and reason in out.reason
    assert {r["outcome"] for r in out.per_rank.values()} == {"failed"}
    assert_still_serving(client)


def test_bad_backend_input_gets_an_error_and_the_broker_keeps_serving(cluster, client):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.connect(cluster.endpoints.backend)
    try:
        sock.send(b"junk")
        assert P.decode(sock.recv()).code == "malformed"
        sock.send(P.encode("ready", rank=7, world=2, session=1, layout=LAYOUT.to_wire(), gen=0))
        assert P.decode(sock.recv()).kind == "refused"
    finally:
        sock.close()
    assert_still_serving(client)


def test_a_client_that_went_away_never_blocks_a_rank(cluster, client, tmp_path):
    ghost = Client(cluster.endpoints.frontend, reply_to=f"ipc://{tmp_path}/ghost.sock")
    tasks = [ghost.submit("swap_out", [i], [i]) for i in range(20)]
    ghost.close()  # gone before any result could be read
    assert len(tasks) == 20
    outs = [client.wait(client.submit("swap_out", [i], [64 + i])) for i in range(20)]
    assert all(o.ok for o in outs)
    # the ghost's own tasks (those that reached the broker) drain too
    import time

    deadline = time.monotonic() + 10
    st = client.status()
    while (st.inflight or st.queued) and time.monotonic() < deadline:
        client.poll(0.05)
        st = client.status()
    assert st.inflight == 0 and st.queued == 0


def test_many_pipelined_tasks_each_get_exactly_one_outcome(client):
    assert client.run("fill", dst=list(range(64)), tier="cpu", timeout=30).ok  # the rows the swap-ins read
    tasks = [
        client.submit("swap_out" if i % 2 else "swap_in", [i % 64], [i % 128] if i % 2 else [i % 64])
        for i in range(500)
    ]
    outcomes = [client.wait(t, timeout=30) for t in tasks]
    assert [o.task for o in outcomes] == tasks
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:3]
    assert client.poll(0.05) == [] and client.book.counters["duplicate_results"] == 0


def test_a_rank_that_reregisters_drops_the_tasks_the_broker_already_failed(cluster, client):
    """SIGSTOP a rank past its liveness window with tasks queued: the broker
    fails them; when the rank wakes and re-registers it must not run them."""
    import signal
    import time

    proc = cluster.workers[1]
    proc.send_signal(signal.SIGSTOP)
    try:
        tasks = [client.submit("swap_out", [i], [i], timeout=30) for i in range(5)]
        outs = [client.wait(t) for t in tasks]  # the broker fails them when rank 1 is declared dead
        assert all(o.outcome == "failed" and "rank 1" in o.reason for o in outs), outs
    finally:
        proc.send_signal(signal.SIGCONT)
    cluster.wait_ready(timeout=30)
    assert_still_serving(client)
    deadline = time.monotonic() + 10
    while True:  # rank 1's next heartbeats carry its stats
        stats = client.status().ranks[1].stats
        if stats.get("refused_stale_session", 0) >= 5 or time.monotonic() > deadline:
            break
        client.poll(0.1)
    assert stats.get("refused_stale_session") == 5 and stats.get("frozen") == 1, stats
    assert stats["tasks_failed"] >= 5 and stats["copies_after_ack"] == 0
