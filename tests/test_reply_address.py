"""The address a client's result PULL binds and advertises (zkv/net/reply_address.py):
reachable from the ranks' hosts by default, overridable for other networks.
Across real hosts this is proven in test_multihost.py."""

import pytest
import zmq

from zkv import Client
from zkv.net.reply_address import advertised, connect_result, default_bind, route_source, split_tcp
from zkv.wire.reply_to import is_result_address


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv("ZKV_RESULT_ADDR", raising=False)
    monkeypatch.delenv("ZKV_RESULT_ADVERTISE", raising=False)


def test_a_loopback_broker_keeps_a_loopback_pull():
    assert route_source("tcp://127.0.0.1:5555") == "127.0.0.1"
    assert default_bind("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:*"
    assert default_bind("ipc:///tmp/x/frontend.sock") is None  # the client picks a private ipc path


def test_the_env_sets_the_bind_address(monkeypatch):
    monkeypatch.setenv("ZKV_RESULT_ADDR", "tcp://0.0.0.0:7000")
    assert default_bind("tcp://127.0.0.1:5555") == "tcp://0.0.0.0:7000"


def test_a_wildcard_bind_advertises_the_routed_address_with_the_bound_port():
    assert advertised("tcp://0.0.0.0:41234", "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:41234"
    assert advertised("tcp://127.0.0.1:41234", "tcp://127.0.0.1:5555") == "tcp://127.0.0.1:41234"


def test_an_explicit_advertise_wins_and_takes_the_bound_port_for_star(monkeypatch):
    assert advertised("tcp://0.0.0.0:41234", "tcp://127.0.0.1:5555", "tcp://gw.example:*") == "tcp://gw.example:41234"
    assert advertised("tcp://0.0.0.0:41234", "tcp://127.0.0.1:5555", "tcp://10.1.2.3:9000") == "tcp://10.1.2.3:9000"
    monkeypatch.setenv("ZKV_RESULT_ADVERTISE", "tcp://[fd00::5]:*")
    assert advertised("tcp://[::]:41234", "tcp://127.0.0.1:5555") == "tcp://[fd00::5]:41234"


def test_no_route_falls_back_to_loopback_and_bad_addresses_are_named():
    assert route_source("tcp://no-such-host.invalid:5555") == "127.0.0.1"
    with pytest.raises(ValueError, match="not a tcp://HOST:PORT"):
        split_tcp("ipc:///tmp/x")


def test_client_uses_the_bind_and_advertise_it_is_given(monkeypatch):
    monkeypatch.setenv("ZKV_RESULT_ADDR", "tcp://0.0.0.0:*")
    with Client("tcp://127.0.0.1:1", request_timeout=0.2) as c:
        host, port = split_tcp(c.reply_to)
        assert host == "127.0.0.1" and port.isdigit()  # the wildcard is never advertised
        bound = c.pull.getsockopt_string(0x20)  # ZMQ_LAST_ENDPOINT
        assert bound == f"tcp://0.0.0.0:{port}"
    with Client(
        "tcp://127.0.0.1:1", reply_to="tcp://127.0.0.1:*", advertise="tcp://10.9.8.7:*", request_timeout=0.2
    ) as c:
        assert c.reply_to.startswith("tcp://10.9.8.7:") and c.reply_to != "tcp://10.9.8.7:*"


@pytest.mark.parametrize(
    "address,ok",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://10.1.2.3:1", True),
        ("tcp://127.0.0.1:65535", True),
        ("tcp://[::1]:5555", True),
        ("tcp://[fd00::5]:41234", True),
        ("tcp://[::ffff:127.0.0.1]:5555", True),
        ("ipc:///tmp/zkv/results.sock", True),
        ("ipc://relative.sock", True),
        ("tcp://::1:5555", False),  # IPv6 only in brackets: ::1:5555 is an address too
        ("tcp://[::1]", False),
        ("tcp://[127.0.0.1]:5555", False),
        ("tcp://0.0.0.0:5555", False),  # where to bind, never where to connect
        ("tcp://[::]:5555", False),
        ("tcp://224.0.0.1:5555", False),
        ("tcp://[ff02::1]:5555", False),
        ("tcp://[fe80::1%eth0]:5555", False),  # a zone names an interface
        ("tcp://127.0.0.1:05555", False),  # one spelling: the one ZMQ_LAST_ENDPOINT gives
        ("tcp://127.000.0.1:5555", False),
        ("tcp://127.0.0.1:0", False),
        ("tcp://127.0.0.1:65536", False),
        ("tcp://127.0.0.1:\u0665", False),  # a non-ASCII digit
        ("tcp://127.0.0.1:*", False),
        ("tcp://localhost:5555", False),
        ("ipc://", False),
        ("inproc://zkv-stop-rank-0-0", False),
        ("tcp://127.0.0.1:5555" + " " * 600, False),
        (5555, False),
    ],
)
def test_the_result_address_forms_of_the_spec(address, ok):
    """docs/protocol.md §2.1: the reply_to forms a broker takes and a rank connects to."""
    assert is_result_address(address) is ok


def test_an_ipv6_result_push_connects_with_zmq_ipv6():
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        for s in (pull, push):
            s.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.IPV6, 1)
        try:
            pull.bind("tcp://[::1]:*")
        except zmq.ZMQError as err:
            pytest.skip(f"no IPv6 loopback (::1) on this host: {err}")
        connect_result(push, pull.getsockopt_string(zmq.LAST_ENDPOINT))
        assert push.getsockopt(zmq.IPV6) == 1
        push.send(b"result")
        assert pull.poll(5000) and pull.recv() == b"result"
    finally:
        pull.close()
        push.close()


def test_a_client_removes_the_result_sockets_of_clients_killed_before_their_close(tmp_path, monkeypatch):
    """kill -9 leaves a client's ``client-<pid>-….sock`` behind; the next client in that runtime
    directory removes it (its pid is gone, nothing listens), and never a live client's."""
    import os
    import subprocess
    import sys

    monkeypatch.setenv("ZKV_RUNTIME_DIR", str(tmp_path))
    code = (
        "import sys; from zkv import Client; c = Client('ipc:///nonexistent/frontend.sock'); "
        "print(c.reply_to, flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "ZKV_RUNTIME_DIR": str(tmp_path)}
    killed = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    alive = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        stale = killed.stdout.readline().strip()[len("ipc://") :]
        live = alive.stdout.readline().strip()[len("ipc://") :]
        killed.kill()
        killed.wait(timeout=30)
        assert os.path.exists(stale), "kill -9 left its socket file"
        with Client("ipc:///nonexistent/frontend.sock") as c:
            mine = c.reply_to[len("ipc://") :]
            assert not os.path.exists(stale), "the dead client's socket file is gone"
            assert os.path.exists(live) and os.path.exists(mine), "live clients' files stay"
        assert not os.path.exists(mine), "a closed client removes its own"
    finally:
        for proc in (killed, alive):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
