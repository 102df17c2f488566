"""CurveZMQ with ZAP enforced, over tcp://127.0.0.1: authorized parties
work end to end; an unknown key and a plaintext peer get nothing."""

import os
import shutil
import socket
import stat

import pytest
from waits import wait_for

from zkv import Client, ZkvError
from zkv.harness.bus.cluster import LocalCluster
from zkv.net.curve import Curve, generate_keypair
from zkv.net.endpoints import Endpoints, check_bind_address
from zkv.wire.layout import CacheLayout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    d = tmp_path_factory.mktemp("curve")
    keys, authorized, clients = d / "keys", d / "ranks", d / "clients"
    for name in ("broker", "rank", "client", "intruder"):
        generate_keypair(keys, name)
    authorized.mkdir()
    clients.mkdir()
    shutil.copy(keys / "rank.key", authorized)
    shutil.copy(keys / "client.key", clients)
    ep = Endpoints(*(f"tcp://127.0.0.1:{free_port()}" for _ in range(3)))
    cluster = LocalCluster(
        2,
        CacheLayout(layers=1, gpu_blocks=16, cpu_blocks=16),
        quiet=True,
        endpoints=ep,
        broker_args=[
            "--curve-secret",
            str(keys / "broker.key_secret"),
            "--curve-ranks",
            str(authorized),
            "--curve-clients",
            str(clients),
        ],
        worker_args=["--curve-secret", str(keys / "rank.key_secret"), "--curve-server", str(keys / "broker.key")],
    )
    cluster.start_broker()
    for r in (0, 1):
        cluster.start_worker(r)
    me = Curve(str(keys / "client.key_secret"), str(keys / "broker.key"), str(authorized))
    with Client(ep.frontend, curve=me) as c:
        c.status(timeout=60, wait_ranks=2)
    yield cluster, keys, authorized, me, clients
    cluster.stop()


def test_secret_keys_are_private_files(secured):
    _, keys, _, _, _ = secured
    assert stat.S_IMODE(os.stat(keys / "client.key_secret").st_mode) == 0o600


def test_authorized_client_and_ranks_swap_over_curve(secured):
    cluster, _, _, me, _ = secured
    with Client(cluster.endpoints.frontend, curve=me) as c:
        out = c.run("swap_out", [0, 1], [2, 3], timeout=10)
        assert out.ok and set(out.per_rank) == {0, 1}
        assert c.pause().state == "paused" and c.resume().state == "running"


def test_unknown_key_gets_no_service(secured):
    cluster, keys, authorized, _, _ = secured
    intruder = Curve(str(keys / "intruder.key_secret"), str(keys / "broker.key"), str(authorized))
    with Client(cluster.endpoints.frontend, curve=intruder, request_timeout=1.0) as c:
        with pytest.raises(ZkvError) as err:
            c.status()
        # the handshake is refused: either the send finds no accepted connection
        # or it is queued and never answered
        assert err.value.code in ("no_reply", "unreachable")


def test_plaintext_client_gets_no_service(secured):
    cluster, *_ = secured
    with Client(cluster.endpoints.frontend, request_timeout=1.0) as c:
        with pytest.raises(ZkvError):
            c.ping()


def test_non_loopback_bind_needs_curve_or_an_explicit_flag():
    with pytest.raises(ValueError, match="CurveZMQ"):
        check_bind_address("tcp://0.0.0.0:5555", allow_remote=False)
    check_bind_address("tcp://0.0.0.0:5555", allow_remote=False, secure=True)
    check_bind_address("tcp://127.0.0.1:5555", allow_remote=False)
    check_bind_address("ipc:///tmp/x", allow_remote=False)


def test_replay_against_a_curve_broker(secured):
    import io

    from zkv.replay import replay
    from zkv.trace import dump_records, generate, parse_trace

    cluster, _, _, me, _ = secured
    buf = io.StringIO()
    dump_records(generate("steady", 10, seed=1, world=2, layout=cluster.layout, max_blocks=4), buf)
    report = replay(
        parse_trace(buf.getvalue().splitlines()), cluster.endpoints.frontend, curve=me, speed=None, task_timeout=10
    )
    assert report.ok, report.to_json()
    assert report.to_json()["outcomes"] == {"ok": 10}


def _retry_bind(bind, within: float = 10.0):
    """Call ``bind`` until the address's previous owner has released it
    (a closed socket frees its port asynchronously)."""
    import time

    import zmq

    deadline = time.monotonic() + within
    while True:
        try:
            return bind()
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _bind_when_free(sock, address: str) -> None:
    _retry_bind(lambda: sock.bind(address))


def _keyed_client_when_free(frontend: str, curve, address: str) -> Client:
    return _retry_bind(lambda: Client(frontend, curve=curve, reply_to=address))


def test_a_plaintext_peer_on_a_fixed_result_address_does_not_poison_it(secured):
    """A client run once without its Curve keys on the fixed result address
    makes the ranks' PUSH fail a handshake there; the keyed client that comes
    back on that address still gets every result."""

    import zmq
    from zmq.utils.monitor import recv_monitor_message

    cluster, *_, me, _ = secured
    result_addr = f"tcp://127.0.0.1:{free_port()}"
    with Client(cluster.endpoints.frontend, curve=me, reply_to=result_addr) as c:
        assert c.run("swap_out", [4], [4], timeout=10).ok  # both ranks now hold a PUSH to result_addr

    ctx = zmq.Context.instance()
    plain = ctx.socket(zmq.PULL)
    plain.setsockopt(zmq.LINGER, 0)
    monitor = plain.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    try:
        _bind_when_free(plain, result_addr)
        for _ in range(2):  # the ranks' PUSH sockets reconnect here and fail the handshake
            assert monitor.poll(10_000), "no rank's result socket reconnected to the plaintext peer"
            recv_monitor_message(monitor)
    finally:
        plain.disable_monitor()
        monitor.close(linger=0)
        plain.close(linger=0)

    c = _keyed_client_when_free(cluster.endpoints.frontend, me, result_addr)
    try:
        out = c.run("swap_out", [5], [5], timeout=10)
        assert out.ok and set(out.per_rank) == {0, 1}, out
        # the ranks say what they rebuilt (stats travel with the next heartbeat)
        reconnects = lambda st: sum(r.stats.get("result_reconnects", 0) for r in st.ranks)  # noqa: E731
        wait_for(c, lambda st: reconnects(st) >= 1, "a rank counting the rebuilt result connection", 10)
    finally:
        c.close()


def test_a_client_whose_result_bind_fails_keeps_no_hold_on_the_context_s_key_check(secured, tmp_path):
    """A Client that cannot bind its result address raises and releases what it
    took: another Curve client of this process, with rank keys from another
    directory, is served afterwards (a leaked hold would refuse it)."""
    import zmq

    cluster, keys, authorized, me, _ = secured
    taken = f"tcp://127.0.0.1:{free_port()}"
    squatter = zmq.Context.instance().socket(zmq.PULL)
    squatter.setsockopt(zmq.LINGER, 0)
    try:
        squatter.bind(taken)
        with pytest.raises(zmq.ZMQError):
            Client(cluster.endpoints.frontend, curve=me, reply_to=taken)
    finally:
        squatter.close(linger=0)
    elsewhere = tmp_path / "ranks"
    shutil.copytree(authorized, elsewhere)
    other = Curve(str(keys / "client.key_secret"), str(keys / "broker.key"), str(elsewhere))
    with Client(cluster.endpoints.frontend, curve=other) as c:
        assert c.status(timeout=10).state == "running"


def test_a_client_without_keys_is_told_the_broker_speaks_curve_not_to_start_one(secured):
    import subprocess
    import sys

    cluster, keys, *_ = secured
    out = subprocess.run(
        [sys.executable, "-m", "zkv", "status", "--broker", cluster.endpoints.frontend, "--timeout", "30"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("ZKV_CURVE")},
    )
    assert out.returncode == 1, out.stderr
    assert "refused this client's handshake: the broker speaks CurveZMQ and this client has no keys" in out.stderr
    assert out.stderr.count("this client has no keys") == 1, "said once"
    assert "--curve-secret" in out.stderr and "start one" not in out.stderr, out.stderr
    assert "within 30 s" not in out.stderr, "told at the handshake, not after the timeout"


def test_a_client_whose_security_differs_is_told_at_its_first_request_not_after_its_timeout(secured):
    """The handshake's mechanism mismatch is known at once: a request not answered within moments checks it
    (a probe socket of its own) and raises then, not after its timeout."""
    import time

    from zkv.broker.core import BrokerConfig
    from zkv.broker.loop import Broker

    cluster, _, _, me, _ = secured
    with Client(cluster.endpoints.frontend, request_timeout=60) as bare:
        started = time.monotonic()
        with pytest.raises(ZkvError) as err:
            bare.status()
        assert time.monotonic() - started < 30, "not the 60 s timeout"
    assert err.value.code == "unreachable"
    assert "refused this client's handshake: the broker speaks CurveZMQ and this client has no keys" in str(err.value)
    plain = Endpoints(*(f"tcp://127.0.0.1:{free_port()}" for _ in range(3)))
    broker = Broker(plain, BrokerConfig(world=1))
    import threading

    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    try:
        with Client(plain.frontend, request_timeout=60, curve=me) as keyed:
            with pytest.raises(ZkvError, match="the broker does not speak CurveZMQ and this client does"):
                keyed.ping()
        with Client(plain.frontend, request_timeout=60) as fine:
            assert fine.ping() is not None, "the same security on both ends: served"
            assert fine.status().state == "running", "a client once answered never probes again"
    finally:
        broker.stop()
        thread.join(timeout=10)


def test_a_client_with_keys_against_a_plain_broker_is_told_to_drop_them(secured, tmp_path):
    from zkv.broker.core import BrokerConfig
    from zkv.cli.reach import hint
    from zkv.net.curve import security_mismatch

    _, _, _, me, _ = secured
    plain = f"tcp://127.0.0.1:{free_port()}"
    import threading

    from zkv.broker.loop import Broker

    ep = Endpoints(plain, f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
    broker = Broker(ep, BrokerConfig(world=1))
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    try:
        assert security_mismatch(plain, me) == "the broker does not speak CurveZMQ and this client does"
        assert "drop the --curve-* options" in hint("no_reply", plain, me)
        assert security_mismatch(plain, None) is None, "a plain client of a plain broker: no mismatch"
    finally:
        broker.stop()
        thread.join(timeout=10)
