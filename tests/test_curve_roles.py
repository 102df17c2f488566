"""Curve roles: ranks and clients are authorized
separately, so a rank key cannot submit and a client key cannot register; the
README's recipe works as written, through the CLI."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
import zmq
from test_worker_paths import Lines

from zkv import Client, ZkvError
from zkv.harness.bus.cluster import LocalCluster, layout_args
from zkv.net.curve import Curve, generate_keypair, load_keypair, load_public
from zkv.net.endpoints import Endpoints
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=1, gpu_blocks=16, cpu_blocks=16, block_size=1, kv_heads=1, head_dim=8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    d = tmp_path_factory.mktemp("roles")
    keys, ranks, clients = d / "keys", d / "ranks", d / "clients"
    for name in ("broker", "rank0", "client"):
        generate_keypair(keys, name)
    ranks.mkdir()
    clients.mkdir()
    shutil.copy(keys / "rank0.key", ranks)
    shutil.copy(keys / "client.key", clients)
    ep = Endpoints(*(f"tcp://127.0.0.1:{free_port()}" for _ in range(3)))
    # The README's recipe, option for option.
    cluster = LocalCluster(
        1,
        LAYOUT,
        quiet=True,
        endpoints=ep,
        broker_args=[
            "--curve-secret",
            str(keys / "broker.key_secret"),
            "--curve-ranks",
            str(ranks),
            "--curve-clients",
            str(clients),
        ],
        worker_args=["--curve-secret", str(keys / "rank0.key_secret"), "--curve-server", str(keys / "broker.key")],
    )
    cluster.start_broker()
    cluster.start_worker(0)
    me = Curve(str(keys / "client.key_secret"), str(keys / "broker.key"), str(ranks))
    with Client(ep.frontend, curve=me) as c:
        c.status(timeout=60, wait_ranks=1)
    yield cluster, keys, ranks, me
    cluster.stop()


def zkv(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "zkv", *args], capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
    )


def test_the_readme_client_recipe_works_as_written(roles):
    cluster, keys, ranks, _ = roles
    curve = [
        "--curve-secret",
        str(keys / "client.key_secret"),
        "--curve-server",
        str(keys / "broker.key"),
        "--curve-ranks",
        str(ranks),
    ]
    res = zkv(
        "submit", "swap-out", "--src", "0", "--dst", "1", "--broker", cluster.endpoints.frontend, *curve, "--json"
    )
    assert res.returncode == 0, res.stderr + res.stdout
    res = zkv("status", "--broker", cluster.endpoints.frontend, *curve, "--json")
    assert res.returncode == 0, res.stderr
    res = zkv("status", "--broker", cluster.endpoints.frontend, *curve[:4], "--json")  # no --curve-ranks
    assert res.returncode != 0 and "--curve-ranks" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_broker_needs_both_role_directories(roles):
    _, keys, ranks, _ = roles
    res = zkv(
        "broker",
        "--frontend",
        f"tcp://127.0.0.1:{free_port()}",
        "--backend",
        f"tcp://127.0.0.1:{free_port()}",
        "--control",
        f"tcp://127.0.0.1:{free_port()}",
        "--curve-secret",
        str(keys / "broker.key_secret"),
        "--curve-ranks",
        str(ranks),
    )
    assert res.returncode != 0 and "--curve-clients" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_rank_key_cannot_submit(roles):
    cluster, keys, ranks, me = roles
    as_rank = Curve(str(keys / "rank0.key_secret"), str(keys / "broker.key"), str(ranks))
    with Client(cluster.endpoints.frontend, curve=as_rank, request_timeout=1.0) as c:
        with pytest.raises(ZkvError) as err:
            c.ping()
        assert err.value.code in ("no_reply", "unreachable")
    with Client(cluster.endpoints.frontend, curve=me) as c:  # the client key still can
        assert c.run("swap_out", [0], [1], timeout=20).ok


def test_a_client_key_cannot_register_or_listen_to_control(roles):
    cluster, keys, _, me = roles
    public, secret = load_keypair(keys / "client.key_secret")
    ctx = zmq.Context.instance()
    dealer, sub = ctx.socket(zmq.DEALER), ctx.socket(zmq.SUB)
    for s in (dealer, sub):
        s.setsockopt(zmq.LINGER, 0)
        s.curve_publickey, s.curve_secretkey = public, secret
        s.curve_serverkey = load_public(keys / "broker.key")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        dealer.connect(cluster.endpoints.backend)
        sub.connect(cluster.endpoints.control)
        dealer.send(P.encode("ready", rank=0, world=1, session=5, layout=LAYOUT.to_wire(), gen=0), zmq.NOBLOCK)
        assert not dealer.poll(2000), "a client key got an answer on the backend"
        with Client(cluster.endpoints.frontend, curve=me) as c:
            c.pause()  # publishes control messages the client key must not hear
            assert not sub.poll(1000), "a client key heard the control socket"
            c.resume()
            st = c.status()
        assert st.counters.get("registrations") == 1 and [r.alive for r in st.ranks] == [True]
    finally:
        dealer.close()
        sub.close()


def test_a_worker_whose_key_the_broker_refuses_says_so_while_it_waits(roles):
    """docs/deploy.md §4: a refused Curve handshake is never answered; the worker names it."""
    cluster, keys, _ranks, _me = roles
    ep = cluster.endpoints
    proc = subprocess.Popen(
        [sys.executable, "-m", "zkv", "worker", "--rank", "0", "--world-size", "1", "--tier-dir", "none"]
        + ["--backend", ep.backend, "--control", ep.control, *layout_args(LAYOUT)]
        + ["--curve-secret", str(keys / "client.key_secret"), "--curve-server", str(keys / "broker.key")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        said = Lines(proc).wait_for("waiting for the broker at", timeout=30)
        assert "refused the Curve handshake (HANDSHAKE_FAILED" in said and "--curve-ranks" in said, said
    finally:
        proc.kill()
        proc.wait(timeout=10)
