"""The address a client's result PULL binds and advertises (zkv/net/reply_address.py):
reachable from the ranks' hosts by default, overridable for other networks.
Across real hosts this is proven in test_multihost.py."""

import pytest

from zkv import Client
from zkv.net.reply_address import advertised, default_bind, route_source, split_tcp


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
