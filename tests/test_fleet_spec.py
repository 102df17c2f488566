"""The buses of a fleet and the fleet file (zkv/fleet/spec.py): what
docs/deploy.md shows is read as written, and every fault is named before
any bus is asked."""

from __future__ import annotations

import json

import pytest
from doc_blocks import all_blocks

from zkv import Fleet
from zkv.fleet import BusSpec, load_fleet_file
from zkv.fleet.spec import fleet_of
from zkv.net.curve import generate_keypair


def keys(tmp_path):
    generate_keypair(tmp_path / "keys", "client-trainer")
    for i in (0, 1):
        generate_keypair(tmp_path / "keys", f"broker-{i}")
    generate_keypair(tmp_path / "ranks", "rank-a")


def test_the_fleet_file_of_docs_deploy_is_read_with_its_paths_from_the_file_s_directory(tmp_path):
    (doc,) = [b for b in all_blocks() if b.doc == "docs/deploy.md" and b.lang == "json" and "zkv_fleet" in b.text]
    keys(tmp_path)
    path = tmp_path / "fleet.json"
    path.write_text(doc.text)
    buses = load_fleet_file(path)
    assert [(b.name, b.broker) for b in buses] == [
        ("engine-0", "tcp://10.0.0.10:5555"),
        ("engine-1", "tcp://10.0.1.10:5555"),
    ]
    assert buses[1].curve_server == str(tmp_path / "keys/broker-1.key")
    assert buses[0].curve_secret == str(tmp_path / "keys/client-trainer.key_secret")  # the top-level default
    assert buses[0].curve_ranks == str(tmp_path / "ranks")
    curve = buses[0].curve()
    assert curve is not None and curve.server_public_file == buses[0].curve_server


@pytest.mark.parametrize(
    "doc,complaint",
    [
        ([], "must be an object"),
        ({"buses": []}, "at least one bus"),
        ({"buses": "ipc:///x"}, "must be a list"),
        ({"zkv_fleet": 2, "buses": ["ipc:///x"]}, "zkv_fleet 2"),
        ({"zkv_fleet": True, "buses": ["ipc:///x"]}, "zkv_fleet True"),
        ({"buses": ["ipc:///x"], "bus": []}, "unknown fields ['bus']"),
        ({"buses": [{"name": "a"}]}, "no broker address"),
        ({"buses": [{"broker": "ipc:///x", "curve_key": "k"}]}, "unknown fields ['curve_key']"),
        ({"buses": [{"name": "a", "broker": "localhost:5555"}]}, "bus a: broker 'localhost:5555' is not a broker"),
        ({"buses": [{"name": "a", "broker": "ipc:///x"}, {"name": "a", "broker": "ipc:///y"}]}, "the name 'a'"),
        ({"buses": ["ipc:///x", {"name": "b", "broker": "ipc:///x"}]}, "the broker 'ipc:///x'"),
        ({"buses": [{"name": "", "broker": "ipc:///x"}]}, "printable string"),
        ({"buses": [{"broker": "ipc:///x", "curve_server": "k.key"}]}, "curve_server without curve_secret"),
        ({"buses": [{"broker": "tcp://h:1", "curve_secret": "s", "curve_server": "k"}]}, "needs curve_ranks too"),
        (
            {"buses": [{"broker": "tcp://h:1", "curve_secret": "s", "curve_server": "k", "curve_ranks": "r"}]},
            "does not exist",
        ),
        ({"buses": [{"broker": "tcp://h:1", "curve_secret": 7}]}, "must be a path string"),
    ],
)
def test_a_fleet_file_fault_is_named_with_the_file(tmp_path, doc, complaint):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="fleet file .*fleet.json") as caught:
        load_fleet_file(path)
    assert complaint in str(caught.value)


def test_a_file_that_is_not_json_or_not_there_is_named(tmp_path):
    (tmp_path / "f.json").write_text("{buses: [")
    with pytest.raises(ValueError, match="is not JSON"):
        load_fleet_file(tmp_path / "f.json")
    with pytest.raises(ValueError, match="cannot read fleet file"):
        load_fleet_file(tmp_path / "none.json")


def test_buses_as_addresses_specs_or_maps_and_the_command_line_s_keys_as_defaults(tmp_path):
    keys(tmp_path)
    cli = {"curve_secret": str(tmp_path / "keys/client-trainer.key_secret"), "curve_ranks": str(tmp_path / "ranks")}
    server = str(tmp_path / "keys/broker-0.key")
    buses = fleet_of(
        ["tcp://127.0.0.1:5555", {"name": "e1", "broker": "tcp://127.0.0.1:5556"}], {**cli, "curve_server": server}
    )
    assert [b.name for b in buses] == ["tcp://127.0.0.1:5555", "e1"] and all(b.curve_server == server for b in buses)
    path = tmp_path / "fleet.json"
    path.write_text(
        json.dumps({"buses": [{"name": "e0", "broker": "tcp://127.0.0.1:5555", "curve_server": "keys/broker-1.key"}]})
    )
    (bus,) = load_fleet_file(path, cli)  # the file's own key wins, the command line fills the rest
    assert bus.curve_server == str(tmp_path / "keys/broker-1.key") and bus.curve_secret == cli["curve_secret"]
    assert fleet_of([BusSpec("x", "ipc:///tmp/x.sock")])[0].curve() is None


@pytest.mark.parametrize(
    "kwargs,complaint",
    [({"timeout": 0}, "timeout 0"), ({"timeout": float("nan")}, "timeout nan"), ({"rollback_timeout": -1}, "rollback")],
)
def test_a_fleet_refuses_a_bad_bound(kwargs, complaint):
    with pytest.raises(ValueError, match=complaint):
        Fleet(["ipc:///tmp/x.sock"], **kwargs)
    with Fleet(["ipc:///tmp/x.sock"]) as fleet:
        with pytest.raises(ValueError, match="on_failure"):
            fleet.pause(on_failure="ignore")
        with pytest.raises(ValueError, match="wait_ranks"):
            fleet.status(wait_ranks=-1)
