"""The one GPU script (``python -m zkv.harness.copies.gpu_check``) rehearses end to end on
CPU with small sizes, as CI runs it: every check and every figure is printed,
exit 0, and nothing is a PASS (no GPU was checked); without a CUDA device torch
sees, the default run is refused."""

import itertools
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from profiles import long_e2e

ROOT = pathlib.Path(__file__).resolve().parent.parent
IPC = long_e2e(
    "its ipc check starts two engine processes, 8-10 s",
    "tests/test_engine_manifest.py (the same zkv.harness.bus.ipc_check.check on both layouts)",
)


@pytest.mark.parametrize("ipc", [False, pytest.param(True, marks=IPC)], ids=["no-ipc", "ipc"])
def test_the_gpu_check_runs_on_cpu_and_prints_every_check_and_figure(tmp_path, ipc):
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, "-m", "zkv.harness.copies.gpu_check", "--device", "cpu", "--json", str(out)]
        + ([] if ipc else ["--no-ipc"]),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    for check in (
        "owned round trip",
        "attached round trip",
        "owned copy stream after the engine stream",
        "attached copy stream after the engine stream",
        *(["ipc attach (shared memory)"] if ipc else []),
    ):
        verdict = "n/a" if "engine stream" in check else "ok"  # ran on cpu: ok; needs CUDA streams: n/a
        assert re.search(rf"^  {verdict}  {re.escape(check)}", text, re.M), f"no {verdict} line for {check!r}:\n{text}"
    for engine, size, ids, op in itertools.product(
        ("owned", "attached"), ("16KiB", "2KiB"), ("contiguous", "scattered"), ("swap_out", "swap_in")
    ):
        line = rf"^  {engine} +{size} +\d+ +[\d.]+  {ids} +{op} +[\d.]+ +[\d.]+ +[\d.]+x  n/a$"
        assert re.search(line, text, re.M), f"no figure for {engine} {size} {ids} {op}:\n{text}"
    for family in ("gemma3", "gpt-oss", "mistral-swa", "qwen3-next", "deepseek-mla"):  # a check per family
        assert re.search(rf"^  n/a  vllm groups {family}: vLLM is not installed", text, re.M), text
    assert "CPU REHEARSAL ok" in text.splitlines()[-1] and "PASS " not in text and "ALL PASS" not in text
    report = json.loads(out.read_text())
    assert report["failed"] == [] and len(report["bandwidth"]) == 4
    for r in report["bandwidth"]:
        for ids, op in itertools.product(("contiguous", "scattered"), ("swap_out", "swap_in")):
            c = r[ids][op]
            assert c["gbps"] > 0 and c["pinned_copy_gbps"] > 0 and c["ratio"] > 0 and c["pass"] is None
            assert r[ids]["bytes_ok"] is True, "every configuration is checked byte for byte at full size"


@pytest.mark.parametrize("args", [[], ["--device", "cuda"]], ids=["default", "cuda"])
def test_the_gpu_check_refuses_cuda_where_there_is_none(args, monkeypatch, capsys):
    """Run in this process: a refusal needs no interpreter (and torch import) of its own."""
    import torch

    from zkv.harness.copies.gpu_check import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 2 and "--device cpu" in err and "nothing PASSes" in err
    assert "PASS " not in out + err.replace("nothing PASSes", "")
