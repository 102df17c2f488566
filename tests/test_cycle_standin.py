"""The RL cycle over stand-in vLLM servers (zkv/harness/cycle/standin.py: the
same HTTP routes on 127.0.0.1, each with a bus answering the zkv protocol on a
real ZMQ socket, faults on demand), and over real zkv buses where the bus
matters (docs/engine-vllm.md, "A fleet of vLLM servers").  What the real
vLLM servers must show themselves is in tests/vllm_engine/test_server_fleet.py."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from click.testing import CliRunner

from zkv import Client
from zkv.cli.commands import main
from zkv.cycle import InFlight, Outcome, PauseMode, ReloadWeights, ServerFleet, ServerSpec, Serves, State, Tiers
from zkv.cycle.version import FleetVersion
from zkv.harness.cycle.standin import StandinFleet, weights_digest, write_weights
from zkv.harness.fleet.rig import FleetRig

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def weights(tmp_path):
    return [write_weights(tmp_path / f"w{i}", seed=i) for i in range(2)]


@pytest.fixture
def standins(tmp_path, weights):
    with StandinFleet(3, tmp_path / "servers", weights[0], apply_ms=50) as fleet:
        yield fleet


def fleet_of(standins: StandinFleet, **kw) -> ServerFleet:
    return ServerFleet([ServerSpec(*s) for s in standins.specs()], **kw)


def paused_calls(standins: StandinFleet) -> int:
    return sum(s.calls.get("/pause", 0) + s.calls.get("/sleep", 0) for s in standins.servers)


def test_a_cycle_moves_every_stand_in_and_says_it_in_a_steps_by_engines_table(standins, weights):
    w0, w1 = weights
    with fleet_of(standins) as fleet:
        report = fleet.cycle("to-w1", ReloadWeights(w1), rollback=ReloadWeights(w0), new_label="w1")
    assert report.outcome is Outcome.COMMITTED, report.describe()
    assert all(s.weights == w1 and s.label == "w1" and not s.paused for s in standins.servers)
    assert {e.serves for e in report.engines.values()} == {Serves.NEW}
    assert {e.tiers for e in report.engines.values()} == {Tiers.DROPPED}
    assert all(e.staged == weights_digest(w1) for e in report.engines.values()), "staged: its digest known"
    text = report.describe().splitlines()
    assert text[1].split() == ["step", "engine-0", "engine-1", "engine-2"], text
    assert any(line.split()[:1] == ["update"] for line in text) and "to finish it" not in report.describe()
    assert 0 < report.pause_window_s < report.seconds


def test_one_hung_server_never_spends_the_others_rollback(standins, weights):
    """Stopped during its update: every other engine rolls back and serves again in its own time, long
    before the deadline; every state is what that engine answers; the hung one serves unknown weights."""
    w0, w1 = weights
    standins.servers[1].set(apply_ms=400)
    hang = threading.Timer(0.2, standins.hang, args=(1,))  # while engine-1 is in its update
    hang.start()
    with fleet_of(standins, call_timeout=3.0) as fleet:
        report = fleet.cycle("hang", ReloadWeights(w1), rollback=ReloadWeights(w0), deadline_s=20)
    hang.join()
    try:
        assert report.outcome is Outcome.INCOMPLETE and report.finish, report.describe()
        hung = report.engines["engine-1"]
        assert hung.state is State.HUNG and hung.serves is Serves.UNKNOWN and hung.failed_step == "update"
        for name in ("engine-0", "engine-2"):
            e = report.engines[name]
            assert e.state is State.SERVING and not e.paused and e.serves is Serves.OLD, report.describe()
            assert e.paused_s is not None and e.paused_s < 3.0 + 1.0, "back serving within its own call's bound"
        assert [s.paused for s in standins.servers] == [False, True, False], "what each answers"
        assert standins.servers[0].weights == w0 and standins.servers[2].weights == w0
    finally:
        standins.unhang(1)
    with fleet_of(standins) as fleet:  # the same cycle, run again once it answers, finishes it
        again = fleet.cycle("hang", ReloadWeights(w1), rollback=ReloadWeights(w0))
    assert again.outcome is Outcome.COMMITTED, again.describe()
    assert all(s.weights == w1 and not s.paused for s in standins.servers)


def test_a_bad_checkpoint_on_one_server_never_pauses_the_fleet(standins, weights, tmp_path):
    w0, w1 = weights
    truncated = tmp_path / "truncated"
    write_weights(truncated, seed=1)
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(100)
    other = write_weights(tmp_path / "other-model", seed=1, tensors=3)  # not the model's tensors
    for bad, complaint in ((str(truncated), "header of"), (other, "not the model's tensors")):
        paths = {"engine-0": ReloadWeights(w1), "engine-1": ReloadWeights(bad), "engine-2": ReloadWeights(w1)}
        with fleet_of(standins) as fleet:
            report = fleet.cycle(f"bad-{len(complaint)}", paths)
        assert report.outcome is Outcome.REFUSED and complaint in report.why, report.describe()
        assert paused_calls(standins) == 0 and all(s.weights == w0 for s in standins.servers)
        assert "to finish it" not in report.describe() and not report.finish


@pytest.mark.parametrize("mode", list(PauseMode))
def test_the_in_flight_policy_each_pause_mode_declares_is_what_the_requests_got(standins, weights, mode):
    w0, w1 = weights
    server = standins.servers[0]
    server.set(token_ms=20)
    answer: dict = {}

    def ask() -> None:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 25}).encode()
        req = urllib.request.Request(server.url + "/v1/completions", data=body, method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer.update(json.loads(resp.read())["choices"][0])

    asker = threading.Thread(target=ask)
    asker.start()
    while server.inflight == 0:  # bounded by the request's own timeout: it starts at once
        asker.join(0.005)
        assert asker.is_alive() or answer, "the request ended before the cycle began"
    with fleet_of(standins) as fleet:
        report = fleet.cycle(f"in-flight-{mode}", ReloadWeights(w1), rollback=ReloadWeights(w0), pause_mode=mode)
    asker.join(60)
    assert report.outcome is Outcome.COMMITTED, report.describe()
    declared = report.engines["engine-0"].in_flight
    assert declared is InFlight.of(mode)
    if declared is InFlight.ABORTED:
        assert answer["finish_reason"] == "abort" and len(answer["token_ids"]) < 25
    elif declared is InFlight.ANSWERED_OLD:
        assert answer["finish_reason"] == "length" and answer["weights"] == w0
    else:
        assert answer["finish_reason"] == "length" and answer["weights"] == w1, "recomputed on the new weights"


def test_a_server_killed_after_the_commit_comes_back_behind_and_a_cycle_brings_it_forward(standins, weights, tmp_path):
    w0, w1 = weights
    record = str(tmp_path / "fleet-version.json")
    with fleet_of(standins, record=record) as fleet:
        report = fleet.cycle("step-1", ReloadWeights(w1), rollback=ReloadWeights(w0), new_label="w1")
        assert report.outcome is Outcome.COMMITTED, report.describe()
        version = FleetVersion.load(record)
        assert version is not None and version.label == "w1" and version.checkpoint == weights_digest(w1)
        standins.kill(2)
        standins.restart(2)  # from its command line: its checkpoint, the old weights
        view = fleet.look()
        assert view.behind == ["engine-2"] and view.mixed, view.describe()
        assert not version.admits(view.servers[2].label, view.servers[2].weights), "kept off shared tiers"
        assert version.admits(view.servers[0].label), "the others are the fleet's version"
        said = CliRunner().invoke(main, ["cycle", "--show", "--record", record, *_servers(standins), "--metrics"])
        assert said.exit_code == 0, said.output
        assert 'zkv_fleet_server_behind{server="engine-2"} 1' in said.output and "zkv_fleet_mixed 1" in said.output
        again = fleet.cycle("step-1", ReloadWeights(w1), rollback=ReloadWeights(w0), new_label="w1")
        assert again.outcome is Outcome.COMMITTED, again.describe()
        assert again.engines["engine-2"].behind and not again.engines["engine-0"].behind
        assert fleet.look().behind == [] and not fleet.look().mixed
    assert all(s.weights == w1 and s.label == "w1" for s in standins.servers)


def _servers(standins: StandinFleet) -> list[str]:
    return [a for spec in standins.specs() for a in ("--server", *spec)]


def test_the_finish_command_of_a_cycle_started_from_the_command_line_finishes_it(standins, weights):
    w0, w1 = weights
    args = ["cycle", "cli-1", *_servers(standins), "--reload", w1, "--rollback", w0, "--deadline", "20"]
    standins.servers[2].set(reset_false=10**6)  # its prefix cache never resets: it stays paused
    said = CliRunner().invoke(main, [*args, "--json"])
    assert said.exit_code == 2, said.output
    report = json.loads(said.output)
    assert report["outcome"] == "incomplete" and report["engines"]["engine-2"]["paused"] is True
    argv = report["finish_argv"]
    assert argv[:3] == ["zkv", "cycle", "cli-1"] and report["finish"].startswith("zkv cycle cli-1 --server")
    standins.servers[2].set(reset_false=0)
    again = CliRunner().invoke(main, argv[1:])
    assert again.exit_code == 0, again.output
    assert all(s.weights == w1 and not s.paused for s in standins.servers)


@pytest.mark.parametrize(
    "args,complaint",
    [
        (["cycle", "x", "--show"], "--show takes no CYCLE_ID"),
        (["cycle", "x"], "name the new weights"),
        (["cycle"], "name the cycle"),
        (["cycle", "bad id", "--reload", "/w"], "a cycle id is"),
        (["cycle", "x", "--reload", "/w", "--budget-on", "nobody", "3"], "--budget-on names 'nobody'"),
        (["cycle", "x", "--reload", "/w", "--metrics"], "go with --show"),
    ],
)
def test_a_usage_error_names_what_is_wrong_and_touches_nothing(standins, args, complaint):
    said = CliRunner().invoke(main, [*args, *_servers(standins)])
    assert said.exit_code == 2 and complaint in said.output, said.output
    assert paused_calls(standins) == 0


@pytest.fixture(scope="module")
def buses():
    with FleetRig(2, ranks=1) as rig:
        yield rig


def test_over_real_buses_a_cycle_drops_the_cpu_tier_unless_measured_unchanged(buses, tmp_path, weights):
    w0, w1 = weights
    with StandinFleet(2, tmp_path / "servers", w0, apply_ms=20) as standins:
        specs = [ServerSpec(s.name, s.url, bus) for s, bus in zip(standins.servers, buses.frontends)]
        with ServerFleet(specs) as fleet:
            cpu = [_cpu_gen(b) for b in buses.frontends]
            changed = fleet.cycle("real-1", ReloadWeights(w1), rollback=ReloadWeights(w0))
            assert changed.outcome is Outcome.COMMITTED, changed.describe()
            assert [_cpu_gen(b) for b in buses.frontends] == [g + 1 for g in cpu], "the CPU tier dropped"
            kept = fleet.cycle("real-2", ReloadWeights(w1), weights_changed=False)
            assert kept.outcome is Outcome.COMMITTED and kept.kept, kept.describe()
            assert [_cpu_gen(b) for b in buses.frontends] == [g + 1 for g in cpu], "measured unchanged: kept"
            buses.clusters[1].broker.kill()
            buses.clusters[1].broker.wait(10)
            try:
                down = fleet.cycle("real-3", ReloadWeights(w0), rollback=ReloadWeights(w1), deadline_s=20)
                assert down.outcome is Outcome.ROLLED_BACK, down.describe()
                assert down.engines["engine-1"].failed_step == "pause_buses"
                assert all(s.weights == w1 and not s.paused for s in standins.servers), "nothing was loaded"
            finally:
                buses.clusters[1].start_broker()
                buses.clusters[1].wait_ready(60)


def _cpu_gen(bus: str) -> int:
    with Client(bus, request_timeout=10) as c:
        gen = c.status(timeout=10).cpu_gen
    assert gen is not None
    return gen
