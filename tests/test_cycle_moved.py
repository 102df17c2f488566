"""The names the RL cycle had before it moved to ``zkv.cycle`` still work until
zkv 0.3, each read warning and naming where it went (docs/versions.md); and
the cycle's command and package start without torch."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings

import pytest

import zkv.cycle
import zkv.cycle.http
import zkv.cycle.prefix
import zkv.cycle.servers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MOVED = [
    ("zkv.engines.vllm.server_cycle", "ServerFleet", zkv.cycle.servers.ServerFleet),
    ("zkv.engines.vllm.server_cycle", "ServerSpec", zkv.cycle.servers.ServerSpec),
    ("zkv.engines.vllm.server_cycle", "ReloadWeights", zkv.cycle.ReloadWeights),
    ("zkv.engines.vllm.server_cycle", "CycleBusy", zkv.cycle.CycleBusy),
    ("zkv.engines.vllm.server_cycle", "CycleReport", zkv.cycle.CycleReport),
    ("zkv.engines.vllm.server_cycle", "reset_prefix_cache", zkv.cycle.servers.reset_prefix_cache),
    ("zkv.engines.vllm.server", "VllmServer", zkv.cycle.http.VllmServer),
    ("zkv.engines.vllm.server", "ServerError", zkv.cycle.http.ServerError),
    ("zkv.engines.vllm.rl", "update_weights", zkv.cycle.update_weights),
    ("zkv.engines.vllm.rl", "weights_digest", zkv.cycle.weights_digest),
    ("zkv.engines.vllm.rl", "CycleReport", zkv.cycle.CycleReport),
    ("zkv.prefix.cycle", "drain_and_clear", zkv.cycle.prefix.drain_and_clear),
    ("zkv.prefix.cycle", "resume", zkv.cycle.prefix.resume),
    ("zkv.prefix.cycle", "pause_clear_resume", zkv.cycle.prefix.pause_clear_resume),
    ("zkv.prefix", "drain_and_clear", zkv.cycle.prefix.drain_and_clear),
    ("zkv.prefix", "pause_clear_resume", zkv.cycle.prefix.pause_clear_resume),
]


@pytest.mark.parametrize("module,name,new", MOVED, ids=[f"{m}.{n}" for m, n, _ in MOVED])
def test_a_moved_name_still_works_and_warns_where_it_went(module, name, new):
    old = importlib.import_module(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert getattr(old, name) is new
    said = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert said and "0.3" in said[0] and "zkv.cycle" in said[0], said


def test_the_old_label_parser_reads_the_new_record():
    from zkv.cycle.label import CycleRecord, encode
    from zkv.cycle.terms import Phase

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from zkv.engines.vllm.server_cycle import parse_label
    text = encode(CycleRecord("step-1", Phase.UPDATING, "w0", None, "host", 42, 100))
    assert parse_label(text) == ("step-1", "updating", "w0")
    assert parse_label("w0") is None


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError):
        importlib.import_module("zkv.engines.vllm.rl").nothing_here  # noqa: B018


@pytest.mark.parametrize(
    "code",
    [
        "import zkv.cycle",
        "from zkv.cli.commands import main\n"
        "from click.testing import CliRunner\n"
        "r = CliRunner().invoke(main, ['cycle', 'x', '--server', 'a', 'http://127.0.0.1:9', 'ipc:///nowhere'])\n"
        "assert r.exit_code == 2 and 'name the new weights' in r.output, r.output",
    ],
    ids=["the package", "a usage error of zkv cycle"],
)
def test_the_cycle_starts_without_torch(code):
    """Measured in a fresh interpreter: a control command for servers never loads torch."""
    probe = code + "\nimport sys\nprint('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"], out.stdout
