"""Numbers an operator gives ``zkv`` are checked where they enter: every numeric
option (and so its environment variable) has a range, and a value outside it
is a one-line usage error naming the command, exit 2, before anything starts
(docs/operations.md, "Environment variables")."""

from __future__ import annotations

import os
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from zkv.cli import main


def commands(group: click.Group, ctx: click.Context, path: str = "zkv"):
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        if isinstance(cmd, click.Group):
            yield from commands(cmd, ctx, f"{path} {name}")
        elif cmd is not None:
            yield f"{path} {name}", cmd


def test_every_numeric_option_of_every_command_has_a_range():
    ctx = click.Context(main)
    unbounded = [
        f"{path} {param.opts[0]}"
        for path, cmd in commands(main, ctx)
        for param in cmd.params
        if isinstance(param.type, (click.types.IntParamType, click.types.FloatParamType))
        and not isinstance(param.type, click.types._NumberRangeBase)
    ]
    assert not unbounded, unbounded


@pytest.mark.parametrize(
    "args, env, said",
    [
        (["up", "--ranks", "0"], {}, "zkv up: error: Invalid value for '--ranks'"),
        (["up", "--ranks", "-1"], {}, "-1 is not in the range 1<=x<=256"),
        (["up"], {"ZKV_RANKS": "0"}, "(env var: 'ZKV_RANKS'): 0 is not in the range"),
        (["broker"], {"ZKV_MAX_INFLIGHT": "-5"}, "zkv broker: error: Invalid value for '--max-inflight'"),
        (["worker", "--rank", "2", "--world-size", "300"], {}, "'--world-size'"),
        (["worker", "--rank", "-1"], {}, "'--rank'"),
        (["pause", "--timeout", "0"], {}, "zkv pause: error: Invalid value for '--timeout'"),
        (["resume", "--gpu-blocks", "0"], {}, "'--gpu-blocks'"),
        (["submit", "fill", "--dst", "1", "--seed", "-3"], {}, "'--seed'"),
        (["up", "--gpu-blocks", "0"], {}, "'--gpu-blocks'"),
    ],
)
def test_a_number_out_of_range_is_a_one_line_usage_error(args, env, said):
    res = CliRunner().invoke(main, args, env=env, prog_name="zkv")
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "--help)" in lines[0], res.stderr


def test_zkv_up_with_a_broker_value_out_of_range_stops_at_once_with_exit_2(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "zkv", "up", "--runtime-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ZKV_MAX_INFLIGHT": "-5"},
    )
    assert res.returncode == 2, res.stderr
    assert "zkv broker: error: Invalid value for '--max-inflight' (env var: 'ZKV_MAX_INFLIGHT')" in res.stderr
    assert "ready" not in res.stdout and "the bus did not start: broker exited with 2" in res.stderr
