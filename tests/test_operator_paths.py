"""The paths an operator walks through README.md and docs/operations.md, run
as the operator runs them: ``python -m zkv ...`` processes against real
brokers and ranks (``zkv up``), or no broker at all.

What each test holds: a restored state file is announced and never silently
overrides ``zkv up``'s flags; a client command with no broker fails at once,
naming the broker, with a hint that fits the address; a start that fails
says so in one line and leaves no socket file; the smaller promises of the
CLI (env vars, digests, versions, missing extras) are kept.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

import zkv as zkv_package
from zkv.broker.state_file import StateFile
from zkv.cli import main
from zkv.harness.prefix.demo import Progress
from zkv.net.curve import generate_keypair
from zkv.net.endpoints import Endpoints

LAYOUT = ["--layers", "2", "--block-size", "4", "--kv-heads", "2", "--head-dim", "8", "--cpu-blocks", "64"]
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 2  # layers x (K, V) x block_size x kv_heads x head_dim x bf16
PLOT_MISSING = "plots need matplotlib: pip install -e '.[plot]' in the zkv checkout (the README's install)"
FAST = 10.0  # seconds: far below the 30 s timeout a command used to wait out


def zkv(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zkv", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, env: dict | None = None) -> Ran:
    """A client command run in this process (click's runner) against whatever
    bus is there: what ``zkv ARGS`` prints and exits with, without paying an
    interpreter start per command."""
    res = CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
    return Ran(res.exit_code, res.stdout, res.stderr)


def timed(*args: str, env: dict | None = None, run=None) -> tuple[Ran, float]:
    t0 = time.monotonic()
    res = (run or cli)(*args, env=env)
    return res, time.monotonic() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sockets_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.sock"))


class Up:
    """``zkv up`` in the background: its output read line by line, Ctrl-C to stop."""

    def __init__(self, directory: Path, *args: str, env: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zkv", "up", "--runtime-dir", str(directory), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.broker = Endpoints.in_dir(directory).frontend
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append("")  # end of output
            self.changed.notify_all()

    def output(self) -> str:
        with self.changed:
            return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 120) -> str:
        """Every line up to the first that holds ``text``."""
        with self.changed:
            found = self.changed.wait_for(lambda: any(text in line for line in self.lines) or "" in self.lines, timeout)
            assert found and any(text in line for line in self.lines), f"no {text!r} in: {''.join(self.lines)}"
            return "".join(self.lines)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert self.proc.wait(timeout=60) == 0, self.output()
        self.reader.join(timeout=10)
        return self.output()


def test_up_pause_clear_resume_restart_restores_what_was_set_and_never_overrides_flags(tmp_path):
    stale = {"state": "paused", "epoch": 3, "gen": 2, "gen_used": True, "keep_cpu": False, "world": 2}
    stale.update(gen_reason="", layout=None)
    writer = StateFile(tmp_path / "broker-state.json")
    writer.save(stale)  # the broker's own writer: two padded slots, as a bus that ran here left them
    writer.close()
    rec = tmp_path / "rec.jsonl"
    bus = Up(tmp_path, "--ranks", "1", "--fresh", "--gpu-blocks", "32", *LAYOUT, "--record", str(rec))
    try:
        said = bus.wait_for("Ctrl-C to stop.")
        assert "--fresh: moved" in said and (tmp_path / "broker-state.json.old").exists()
        assert "zkv up: broker + 1 rank ready" in said
        b = ["--broker", bus.broker]
        ignored = cli("resume", "--gpu-blocks", "64", *b)
        assert ignored.returncode == 1
        assert "the bus is running" in ignored.stderr and "(--gpu-blocks 64 was not applied)" in ignored.stderr
        assert "run zkv pause and zkv clear first, then zkv resume --gpu-blocks 64" in ignored.stderr
        assert ignored.stderr.count("zkv pause") == 1, "the way out is said once"
        refused = cli("clear", *b)
        assert refused.returncode == 1 and refused.stderr.count("zkv pause") == 1, refused.stderr

        filled = cli("submit", "fill", "--dst", "0-1", "--tier", "gpu", "--seed", "5", *b)
        assert filled.returncode == 0 and "KiB moved" in filled.stdout, filled.stdout + filled.stderr
        text = cli("submit", "checksum", "--src", "0-1", "--tier", "gpu", *b)
        as_json = json.loads(cli("submit", "checksum", "--src", "0-1", "--tier", "gpu", "--json", *b).stdout)
        assert f"rank 0 digests: {' '.join(as_json['ranks']['0']['digests'])}" in text.stdout

        for step in (["pause"], ["clear"], ["resume", "--gpu-blocks", "48"], ["pause"]):
            res = cli(*step, *b)
            assert res.returncode == 0, res.stderr
            assert step != ["clear"] or "KiB freed" in res.stdout, res.stdout
    finally:
        bus.stop()  # Ctrl-C
    assert sockets_in(tmp_path) == []
    recorded = [json.loads(line).get("ev") for line in rec.read_text().splitlines()]  # the header has none
    ops = [ev for ev in recorded if ev in ("pause", "clear", "resume")]
    assert ops == ["resume", "clear", "pause", "clear", "resume", "pause"]  # the refused clear included

    state_file = tmp_path / "broker-state.json"
    shown = cli("state", "--state-file", str(state_file))
    assert shown.returncode == 0, shown.stderr
    assert "state       paused" in shown.stdout and "48 GPU / 64 CPU blocks" in shown.stdout
    snapshot = json.loads(cli("state", "--json", "--state-file", str(state_file)).stdout)["snapshot"]
    assert snapshot["state"] == "paused" and snapshot["layout"]["gpu_blocks"] == 48 and snapshot["gen"] == 1

    refused, took = timed("up", "--runtime-dir", str(tmp_path), "--gpu-blocks", "64", "--layers", "2", run=zkv)
    assert refused.returncode == 1 and took < FAST, refused.stderr
    assert "--gpu-blocks 64 (restored: 48)" in refused.stderr and "--fresh" in refused.stderr
    assert "--layers" not in refused.stderr.split("disagree")[1]  # it agrees
    assert sockets_in(tmp_path) == [] and "zkv broker:" not in refused.stderr

    bus = Up(tmp_path)  # no layout flags: the restored bus, world 1, 48 blocks, still paused
    try:
        said = bus.wait_for("Ctrl-C to stop.")
        st = json.loads(cli("status", "--json", "--broker", bus.broker).stdout)
        assert st["state"] == "paused" and st["layout"]["gpu_blocks"] == 48 and st["world"] == 1
        assert f"restoring the bus of {state_file}: paused at epoch" in said and "generation 1" in said
        assert "48 GPU" in said and "PAUSED, as it was restored" in said and "zkv resume" in said
        held = cli("submit", "swap-out", "--src", "0", "--dst", "0", "--timeout", "1", "--broker", bus.broker)
        assert held.returncode == 1
        assert (
            "the bus is paused" in held.stderr
            and "the broker dropped it: it never ran (the bus is paused" in held.stdout
        )
        assert cli("resume", "--broker", bus.broker).returncode == 0
        ranks = json.loads(cli("status", "--json", "--broker", bus.broker).stdout)["ranks"]
        assert ranks[0]["stats"]["cache_bytes_gpu"] == 48 * BLOCK_BYTES  # the rank holds the restored layout
    finally:
        bus.stop()


def test_client_commands_without_a_broker_fail_at_once(tmp_path):
    missing = f"ipc://{tmp_path}/frontend.sock"
    for args in (["status"], ["pause"], ["submit", "swap-out", "--src", "0", "--dst", "0"]):
        res, took = timed(*args, "--broker", missing, "--timeout", "30")
        assert res.returncode == 1 and took < FAST, (args, took, res.stderr)
        assert f"no broker answers at {missing}: no socket file" in res.stderr
        assert f"zkv up --runtime-dir {tmp_path}" in res.stderr and "no rank answered" not in res.stdout + res.stderr
        assert len(res.stderr.strip().splitlines()) == 1

    runtime = tmp_path / "rt"
    default = cli("status", env={"ZKV_RUNTIME_DIR": str(runtime)})
    assert default.returncode == 1 and "start one with: zkv up," in default.stderr

    stale = tmp_path / "stale.sock"  # a socket file nobody listens on (a broker killed -9)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))
    res, took = timed("status", "--broker", f"ipc://{stale}")
    assert res.returncode == 1 and took < FAST and "connection refused" in res.stderr

    port = free_port()
    res, took = timed("pause", "--broker", f"tcp://127.0.0.1:{port}")
    assert res.returncode == 1 and took < FAST and "connection refused" in res.stderr
    assert f"zkv broker --frontend tcp://127.0.0.1:{port}" in res.stderr and "zkv up" not in res.stderr

    for bad in ("localhost:5555", "tcp://localhost", "frontend.sock"):
        res = cli("status", "--broker", bad)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.strip().splitlines() == [
            f"zkv: error: --broker {bad!r} is not a broker address: use ipc://PATH or tcp://HOST:PORT"
        ]

    trace = tmp_path / "t.jsonl"
    assert cli("trace", "gen", "steady", "--tasks", "2", "-o", str(trace)).returncode == 0
    for name in ("ZKV_BROKER", "ZKV_REPLAY_BROKER"):  # the documented name, and the older one
        res, took = timed("replay", str(trace), env={name: missing})
        assert res.returncode == 1 and took < FAST and f"no broker answers at {missing}" in res.stderr


def test_a_silent_tcp_peer_gets_hints_that_fit_the_curve_settings(tmp_path):
    with socket.socket() as silent:  # accepts connections (the backlog) and never speaks ZMTP
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        plain = cli("status", "--broker", address, "--timeout", "1")
        assert plain.returncode == 1 and address in plain.stderr
        assert f"zkv broker --frontend {address}" in plain.stderr and "curve" not in plain.stderr.lower()
        keys = tmp_path / "keys"
        for name in ("broker", "me"):
            generate_keypair(keys, name)
        curve = ["--curve-secret", str(keys / "me.key_secret"), "--curve-server", str(keys / "broker.key")]
        secured = cli("status", "--broker", address, "--timeout", "1", *curve, "--curve-ranks", str(keys))
    assert secured.returncode == 1 and "--curve-server is the broker's broker.key" in secured.stderr
    assert "--curve-clients" in secured.stderr


def test_a_start_that_fails_says_so_at_once_and_leaves_no_socket(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res, took = timed("up", "--runtime-dir", str(tmp_path), "--ranks", "1", "--metrics-port", str(port), run=zkv)
    assert res.returncode == 1 and took < FAST and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        f"zkv: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use "
        "(pick another --metrics-port, or 0 for a free one)"
    ]
    assert sockets_in(tmp_path) == []

    # A broker that exits at start for a reason zkv up cannot see beforehand
    # (here an option it reads from the environment) ends the wait at once.
    res, took = timed("up", "--runtime-dir", str(tmp_path), "--ranks", "1", env={"ZKV_MAX_INFLIGHT": "many"}, run=zkv)
    assert res.returncode == 2 and took < 60, "the broker's usage error is zkv up's too"
    assert "Traceback" not in res.stdout + res.stderr
    assert "zkv: error: the bus did not start: broker exited with 2" in res.stderr
    assert sockets_in(tmp_path) == []


@pytest.fixture
def without(monkeypatch):
    """Importing the named packages fails, as where their extra is not installed."""

    def block(*packages: str) -> None:
        for name in packages:
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                monkeypatch.setitem(sys.modules, loaded, None)
            monkeypatch.setitem(sys.modules, name, None)

    return block


def test_missing_extras_are_one_line_before_any_work(tmp_path, without):
    without("matplotlib", "transformers")
    res, took = timed("bench", "pause", "--quick", "--plot", str(tmp_path / "b.png"))
    assert res.returncode == 2 and took < FAST, res.stderr
    assert res.stderr.strip().splitlines() == [
        "zkv: error: plots need matplotlib: pip install -e '.[plot]' in the zkv checkout (the README's install)"
    ]
    res = cli("trace", "plot", str(tmp_path / "rec.jsonl"), "-o", str(tmp_path / "t.png"))
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [f"zkv: error: {PLOT_MISSING}"]
    res = cli("up", "--demo", "--engine", "transformers")
    assert res.returncode == 1 and res.stderr.strip().splitlines() == [
        "zkv: error: --engine transformers needs the transformers extra (pip install -e '.[transformers]')"
    ]


def test_every_option_of_the_operator_commands_has_an_environment_variable():
    for name in ("submit", "status", "up", "replay", "bench", "state"):
        command = main.commands[name]
        for param in command.params:
            if param.param_type_name == "option" and param.name != "help":
                assert param.envvar, f"zkv {name} {param.opts[0]} has no environment variable"
    runner = CliRunner()
    assert runner.invoke(main, ["--version"]).output.strip() == f"zkv {zkv_package.__version__}"
    helped = " ".join(runner.invoke(main, ["submit", "--help"]).output.split())
    assert "fill these blocks of --tier" in helped and "spill these disk blocks" in helped
    assert "ZKV_SUBMIT_DST" in helped
    backwards = runner.invoke(main, ["submit", "checksum", "--src", "5-2"])
    assert backwards.exit_code == 2 and "5-2: the end is before the start" in backwards.output
    doc = (Path(__file__).parent.parent / "docs" / "operations.md").read_text()
    for var in ("ZKV_BROKER", "ZKV_SUBMIT_SRC", "ZKV_STATUS_WATCH", "ZKV_UP_FRESH", "ZKV_RECORD", "ZKV_BENCH_PLOT"):
        assert var in doc, var


def test_demo_progress_says_something_every_few_seconds():
    now, lines = [100.0], []
    progress = Progress(200, lines.append, every=3.0, clock=lambda: now[0])
    for number in range(200):
        now[0] += 0.125  # 25 s in all
        progress(number)
    assert lines[0] == "  ... 24/200 requests served (3 s)" and len(lines) == 8


def test_json_commands_print_json_on_stdout_when_no_broker_answers(tmp_path):
    gone = f"ipc://{tmp_path}/frontend.sock"
    for args in (["status"], ["pause"], ["submit", "fill", "--dst", "1"]):
        res = cli(*args, "--json", "--broker", gone)
        assert res.returncode == 1, res
        out = json.loads(res.stdout)
        assert out["ok"] is False and out["code"] == "unreachable" and "no socket file" in out["reason"], out


@pytest.mark.parametrize("module, args", [("zmq", ["status"]), ("torch", ["worker", "--rank", "0"])])
def test_a_missing_dependency_is_one_line_not_a_traceback(module, args):
    """``bin/zkv`` runs ``python -m zkv`` from a checkout, where nothing may be installed yet."""
    code = f"import sys, runpy; sys.modules[{module!r}] = None; sys.argv = ['zkv', *{args!r}]; "
    code += "runpy.run_module('zkv', run_name='__main__')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines() == [
        f"zkv: error: a dependency is missing: {module} is not installed for {sys.executable} "
        "(install zkv with its dependencies: pip install -e . in the zkv checkout, as the README says)"
    ]
