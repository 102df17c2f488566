"""What ``zkv up --demo --engine vllm`` and ``zkv bench vllm`` print, without vLLM
(the runs themselves are faked here; tests/vllm_engine/test_demo.py runs the real
demo): vLLM's own logging is quieted before anything imports vllm, unless the
user set it, and says how to see it; the results come last, as an aligned
table; ``--json`` prints the result unchanged."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from zkv.cli import main
from zkv.harness.vllm import bench as vllm_bench
from zkv.harness.vllm import demo as vllm_demo
from zkv.harness.vllm import rig as vllm_rig

UNSET = {"VLLM_LOGGING_LEVEL": None, "VLLM_CONFIGURE_LOGGING": None}

RESULT = {
    "model": {"layers": 4, "hidden": 256, "kv_heads": 8},
    "context_tokens": 1024,
    "conversations": 3,
    "gpu_blocks": 45,
    "block_bytes": 131072,
    "recompute": {"ttft_ms_p50": 829.4, "ttft_ms": [829.4]},
    "zkv": {"ttft_ms_p50": 50.2, "ttft_ms": [50.2]},
    "torch_copy_floor": {"ttft_ms_p50": 53.1, "ttft_ms": [53.1]},
    "zkv_restarted": {"ttft_ms_p50": 55.0, "ttft_ms": [55.0], "blocks_served": 108},
    "restart_vs_warm": 1.096,
    "zkv_vs_recompute": 0.061,
    "zkv_vs_floor": 0.945,
    "tokens_identical": True,
}


@pytest.fixture
def fake_bench(monkeypatch):
    """``bench_vllm`` replaced: it notes the logging level its engines would inherit and
    says something on the way, the way the real one does."""
    seen: dict[str, str | None] = {}

    def bench_vllm(quick: bool = False, say=print, log=None, **_):
        seen["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL")
        seen["log"] = log
        say("vllm bench: zkv ...")
        return json.loads(json.dumps(RESULT))

    monkeypatch.setattr(vllm_bench, "bench_vllm", bench_vllm)
    return seen


@pytest.fixture
def fake_demo(monkeypatch):
    seen: dict[str, str | None] = {}

    def run_vllm_demo(echo=print, log=None):
        seen["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL")
        seen["log"] = log
        echo("vLLM demo: all checks hold")
        return True

    monkeypatch.setattr(vllm_demo, "run_vllm_demo", run_vllm_demo)
    monkeypatch.setattr("zkv.cli.up._check_engine", lambda engine, demo: None)  # vLLM is not installed here
    return seen


def _table_rows(lines: list[str]) -> list[str]:
    """The rows of the aligned table at the end of ``lines`` (status_view.table: header, rule, rows)."""
    rules = [i for i, line in enumerate(lines) if set(line.strip()) <= {"-", " "} and "--" in line]
    assert rules, lines
    return lines[rules[-1] + 1 :]


def test_bench_vllm_quiets_vllm_and_prints_its_figures_last_as_a_table(fake_bench):
    res = CliRunner().invoke(main, ["bench", "vllm", "--quick"], env=UNSET, prog_name="zkv")
    assert res.exit_code == 0, res.output
    assert fake_bench["VLLM_LOGGING_LEVEL"] == "ERROR"  # set before the engines start: they inherit it
    assert fake_bench["log"].name == "bench-vllm.log" and str(fake_bench["log"]) in res.stderr
    assert "VLLM_LOGGING_LEVEL=INFO" in res.stderr  # the user is told how to see vLLM's logging
    out = res.stdout.rstrip("\n").splitlines()
    header = out[-6]
    assert "time to first token p50" in header and "target" in header, out
    rows = _table_rows(out)
    assert [r.split()[0] for r in rows] == ["zkv", "recompute", "in-process", "zkv"], rows
    # aligned: every row's figure starts in the header's column
    col = header.index("time to first token p50")
    assert all(r[col:].split()[0].isdigit() for r in rows), rows
    assert "829 ms" in rows[1] and "0.06x" in rows[1] and "<= 0.5x: ok" in rows[1], rows
    assert "55 ms" in rows[3] and "1.10x" in rows[3] and "<= 1.5x: ok" in rows[3], rows


def test_bench_vllm_json_is_the_result_unchanged(fake_bench):
    res = CliRunner().invoke(main, ["bench", "vllm", "--json"], env=UNSET, prog_name="zkv")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == RESULT  # nothing else on stdout, and every figure as it was


def test_a_vllm_logging_level_the_user_set_stands(fake_bench, fake_demo):
    for env in ({"VLLM_LOGGING_LEVEL": "INFO"}, {"VLLM_LOGGING_LEVEL": None, "VLLM_CONFIGURE_LOGGING": "0"}):
        res = CliRunner().invoke(main, ["bench", "vllm"], env=env, prog_name="zkv")
        assert res.exit_code == 0, res.output
        assert fake_bench["VLLM_LOGGING_LEVEL"] == env["VLLM_LOGGING_LEVEL"], env
        assert "VLLM_LOGGING_LEVEL" not in res.stderr
        res = CliRunner().invoke(main, ["up", "--demo", "--engine", "vllm"], env=env, prog_name="zkv")
        assert res.exit_code == 0, res.output
        assert fake_demo["VLLM_LOGGING_LEVEL"] == env["VLLM_LOGGING_LEVEL"], env
        assert fake_demo["log"] is None and fake_bench["log"] is None, "theirs: vLLM's output stays on the terminal"


def test_the_vllm_demo_quiets_vllm_and_says_how_to_see_its_logging(fake_demo):
    res = CliRunner().invoke(main, ["up", "--demo", "--engine", "vllm"], env=UNSET, prog_name="zkv")
    assert res.exit_code == 0, res.output
    assert fake_demo["VLLM_LOGGING_LEVEL"] == "ERROR"
    first = res.stdout.splitlines()[0]
    assert "VLLM_LOGGING_LEVEL=INFO" in first, res.stdout
    log = fake_demo["log"]
    assert log is not None and log.name == "vllm-demo.log" and f"the rest of its output goes to {log}" in first


def test_the_help_says_how_to_see_vllm_s_logging():
    for args in (["up", "--help"], ["bench", "--help"]):
        res = CliRunner().invoke(main, args, prog_name="zkv")
        assert "VLLM_LOGGING_LEVEL" in " ".join(res.stdout.split()), args


def test_quiet_vllm_logging_only_where_the_user_set_nothing():
    said: list[str] = []
    env: dict[str, str] = {}
    assert vllm_rig.quiet_vllm_logging(said.append, env) and env == {"VLLM_LOGGING_LEVEL": "ERROR"}
    assert len(said) == 1 and "VLLM_LOGGING_LEVEL=INFO" in said[0]
    for theirs in ({"VLLM_LOGGING_LEVEL": "DEBUG"}, {"VLLM_CONFIGURE_LOGGING": "0"}):
        env = dict(theirs)
        assert not vllm_rig.quiet_vllm_logging(said.append, env) and env == theirs
    assert len(said) == 1


def test_the_demo_says_why_zkv_is_not_faster_only_when_it_is_not():
    assert vllm_demo.why_not_faster(97.0, 292.0, 3072, 100, 262144) is None
    line = vllm_demo.why_not_faster(28.0, 20.0, 900, 30, 131072)
    assert line is not None and line.startswith("why zkv is not faster here:"), line
    assert "20 ms" in line and "30 blocks" in line and "zkv bench vllm" in line, line


def _fleet_result(ratio: float) -> dict:
    ms = {"p50": 2.0, "p99": 3.0, "mean": 2.1}
    return {
        "buses": 2, "ranks_per_bus": 2, "rounds": 8, "fleet_pause_ms": ms, "slowest_single_pause_ms": ms,
        "loop_of_single_pauses_ms": ms, "fleet_vs_slowest_single": ratio, "target": 1.5,
        "fleet_vs_slowest_single_per_round_p50": ratio, "fleet_vs_loop": 0.5, "cpu_ms_per_fleet_pause": 1.0,
        "cpu_ms_per_single_pause": 0.5, "cores": 2, "cpu_floor_ms": 0.5, "fleet_vs_cpu_floor": 4.0,
        "load_average_1min": 0.1, "cpu_ms_per_fleet_pause_by_thread": {"client": 0.5},
    }  # fmt: skip


def test_several_benchmarks_run_in_one_call_and_a_missed_target_is_said_with_advice(fake_bench, monkeypatch):
    from zkv.harness.fleet import bench as fleet_bench

    ratio = {"value": 3.0}  # the fleet pause misses its 1.5x target
    monkeypatch.setattr(fleet_bench, "bench_fleet", lambda buses, rounds, say: _fleet_result(ratio["value"]))
    res = CliRunner().invoke(main, ["bench", "fleet", "vllm", "--quick"], env=UNSET, prog_name="zkv")
    assert res.exit_code == 0, res.output  # a miss alone does not fail the command
    assert res.stdout.index("fleet pause of 2 buses") < res.stdout.index("time to first token p50"), "in turn"
    assert "1 target(s) MISSED" in res.stderr and "rerun on an idle machine" in res.stderr, res.stderr
    checked = CliRunner().invoke(main, ["bench", "fleet", "--check", "--json"], env=UNSET, prog_name="zkv")
    assert checked.exit_code == 1 and json.loads(checked.stdout)["fleet_vs_slowest_single"] == 3.0
    both = CliRunner().invoke(main, ["bench", "fleet", "vllm", "--json"], env=UNSET, prog_name="zkv")
    assert set(json.loads(both.stdout)) == {"fleet", "vllm"}, "one JSON document, by name"
    ratio["value"] = 1.0
    held = CliRunner().invoke(main, ["bench", "fleet", "--check"], env=UNSET, prog_name="zkv")
    assert held.exit_code == 0 and "MISSED" not in held.stderr, held.output


def test_vllm_s_output_goes_to_its_log_and_the_tool_s_own_lines_stay_on_the_terminal(tmp_path, capfd):
    """What vLLM's engine processes inherit (file descriptors 1 and 2) goes to the log, with what C code
    writes there; ``print`` and ``click.echo`` (``sys.stdout``, ``sys.stderr``) still reach the terminal."""
    import subprocess
    import sys

    from zkv.harness.vllm.output import tail, vllm_output_to

    log = tmp_path / "vllm.log"
    child = "import os; print('engine says INFO', flush=True); os.write(2, b'engine warns\\n')"
    with vllm_output_to(log):
        print("the demo's own line")
        subprocess.run([sys.executable, "-c", child], check=True)
        os.write(2, b"a C library warns\n")
        print("a note", file=sys.stderr)
    print("after")
    out, err = capfd.readouterr()
    assert out.splitlines() == ["the demo's own line", "after"], out
    assert err.splitlines() == ["a note"], err
    assert sorted(log.read_text().splitlines()) == ["a C library warns", "engine says INFO", "engine warns"]
    assert tail(log, 1) in ("a C library warns", "engine warns", "engine says INFO")
    with vllm_output_to(None):  # the user asked to see vLLM: nothing moves
        os.write(1, b"shown\n")
    assert capfd.readouterr().out == "shown\n"


def test_serve_vllm_needs_a_model_and_says_what_to_install_where_vllm_is_missing(monkeypatch):
    res = CliRunner().invoke(main, ["serve-vllm", "engine-0"], prog_name="zkv")
    assert res.exit_code == 2 and "--random-model" in res.output, res.output
    res = CliRunner().invoke(main, ["serve-vllm", "engine-0", "--model", "m", "--write-only"], prog_name="zkv")
    assert res.exit_code == 2 and "--write-only writes a --random-model" in res.output, res.output
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else object())
    res = CliRunner().invoke(main, ["serve-vllm", "engine-0", "--model", "m"], prog_name="zkv")
    assert res.exit_code == 1 and "needs vLLM" in res.stderr and "vllm_setup.sh" in res.stderr, res.output
