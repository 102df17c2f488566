"""A fleet of CurveZMQ buses over tcp://127.0.0.1, read from a fleet file:
each bus with its own broker key and its own rank keys (so each needs a ZMQ
context of its own for its result socket's ZAP handler, zkv/fleet/driver.py),
and a client key a broker does not know gets nothing."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from test_curve import free_port

from zkv import Client, Fleet
from zkv.fleet import Answer, BusSpec, load_fleet_file
from zkv.harness.bus.cluster import LocalCluster
from zkv.net.curve import generate_keypair
from zkv.net.endpoints import Endpoints


@pytest.fixture(scope="module")
def buses(tmp_path_factory):
    """Two Curve brokers (processes, no ranks: a pause completes at once on a bus with no live rank)."""
    d = tmp_path_factory.mktemp("fleetcurve")
    keys = d / "keys"
    for name in ("broker-0", "broker-1", "trainer", "intruder", "rank-0", "rank-1"):
        generate_keypair(keys, name)
    (d / "clients").mkdir()
    shutil.copy(keys / "trainer.key", d / "clients")
    clusters = []
    for i in (0, 1):
        (d / f"ranks-{i}").mkdir()
        shutil.copy(keys / f"rank-{i}.key", d / f"ranks-{i}")
        ep = Endpoints(*(f"tcp://127.0.0.1:{free_port()}" for _ in range(3)))
        secret, ranks, clients = keys / f"broker-{i}.key_secret", d / f"ranks-{i}", d / "clients"
        args = ["--curve-secret", str(secret), "--curve-ranks", str(ranks), "--curve-clients", str(clients)]
        c = LocalCluster(1, quiet=True, endpoints=ep, broker_args=args)
        c.start_broker()
        clusters.append(c)
    fleet_file = d / "fleet.json"
    fleet_file.write_text(
        json.dumps(
            {
                "zkv_fleet": 1,
                "curve_secret": "keys/trainer.key_secret",
                "buses": [
                    {
                        "name": f"engine-{i}",
                        "broker": c.endpoints.frontend,
                        "curve_server": f"keys/broker-{i}.key",
                        "curve_ranks": f"ranks-{i}",
                    }
                    for i, c in enumerate(clusters)
                ],
            }
        )
    )
    for spec in load_fleet_file(fleet_file):  # each broker answers (a bounded wait while it binds)
        with Client(spec.broker, curve=spec.curve()) as c:
            c.status(timeout=60)
    yield fleet_file, clusters
    for c in clusters:
        c.stop()


def test_a_curve_fleet_from_a_fleet_file_pauses_and_resumes_every_bus(buses):
    fleet_file, _ = buses
    with Fleet.from_file(fleet_file, timeout=10) as fleet:
        assert fleet.pause().ok and fleet.status()["engine-1"].answer.reply.state == "paused"
        report = fleet.resume()
        assert report.ok and [b.answer.reply.state for b in report.buses] == ["running", "running"]


def test_a_client_key_the_broker_does_not_know_gets_no_answer_within_the_deadline(buses, tmp_path):
    fleet_file, clusters = buses
    keys = fleet_file.parent / "keys"
    good = json.loads(fleet_file.read_text())["buses"][0]
    intruder = BusSpec(
        "engine-0",
        clusters[0].endpoints.frontend,
        str(keys / "intruder.key_secret"),
        str(fleet_file.parent / good["curve_server"]),
        str(fleet_file.parent / good["curve_ranks"]),
    )
    with Fleet([intruder], timeout=1.0) as fleet:
        start = time.monotonic()
        report = fleet.status()
        assert time.monotonic() - start < 1.0 + 0.5
        assert report["engine-0"].answer.answer in (Answer.NO_REPLY, Answer.UNREACHABLE)
