"""Any language can speak zkv: a C and a JavaScript client, written from
docs/protocol.md alone, run against a real broker and two rank processes.

The toolchains are installed by ``bash tests/interop/setup.sh`` (CI runs it
before pytest).  Here the script runs with ``--check``: it installs nothing,
builds the C client if it is out of date, and says what is missing.  A missing
toolchain fails the test under CI (``CI`` set) and skips it elsewhere.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from zkv.harness.bus.cluster import LocalCluster
from zkv.wire.layout import CacheLayout

HERE = Path(__file__).parent / "interop"
SETUP = HERE / "setup.sh"
C_CLIENT = HERE / "build" / "zkv_client"
JS_CLIENT = HERE / "js" / "zkv_client.mjs"
LAYOUT = CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=128)
WORLD = 2
CLIENT_TIMEOUT_S = 60  # the whole scenario; each wait inside a client is bounded at 15 s


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def _missing(reason: str):
    if _in_ci():
        pytest.fail(f"interop toolchain missing under CI: {reason}")
    hint = "" if "setup.sh" in reason else " (install with: bash tests/interop/setup.sh)"
    pytest.skip(reason + hint)


@pytest.fixture(scope="module")
def toolchains() -> None:
    if shutil.which("bash") is None:
        _missing("bash is not installed")
    try:
        proc = subprocess.run(["bash", str(SETUP), "--check"], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        _missing("tests/interop/setup.sh --check did not finish within 120 s")
    if proc.returncode != 0:
        _missing(
            proc.stderr.strip().splitlines()[-1]
            if proc.stderr.strip()
            else f"setup.sh --check exited {proc.returncode}"
        )


@pytest.fixture(scope="module")
def cluster(toolchains):
    cl = LocalCluster(WORLD, LAYOUT, quiet=True)
    try:
        cl.start(timeout=60)
        yield cl
    finally:
        cl.stop()


def _command(lang: str) -> list[str]:
    if lang == "c":
        return [str(C_CLIENT)]
    node = shutil.which("node")
    if node is None:
        _missing("node is not installed")
    return [node, str(JS_CLIENT)]


def _run(cmd: list[str]) -> tuple[dict[str, str], str]:
    env = dict(os.environ, ZKV_TIMEOUT_MS="15000")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S, env=env, cwd=HERE)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"{cmd[0]} did not finish within {CLIENT_TIMEOUT_S} s; output so far:\n{err.stdout}")
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{proc.stderr[-3000:]}"
    lines = {}
    for line in out.splitlines():
        step, _, rest = line.partition(" ")
        lines[step] = rest
    return lines, out


def _fields(text: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", text))


@pytest.mark.parametrize("pull", ["tcp", "ipc"])
@pytest.mark.parametrize("lang", ["c", "js"])
def test_client_speaks_zkv(cluster: LocalCluster, lang: str, pull: str) -> None:
    cmd = [*_command(lang), cluster.endpoints.frontend]
    if pull == "ipc":
        cmd.append(f"ipc://{cluster.directory}/results-{lang}.sock")
    with cluster.client() as py:
        before = py.status()
    lines, out = _run(cmd)
    where = f"\n--- {lang} client output ---\n{out}"

    assert lines["client"].startswith(lang), where
    reply_to = _fields(lines["client"])["reply_to"]
    assert reply_to == cmd[-1] if pull == "ipc" else re.fullmatch(r"tcp://127\.0\.0\.1:\d+", reply_to), where

    status = _fields(lines["status"])
    assert lines["status"].startswith("ok ") and status["state"] == "running", where
    assert status["world"] == str(WORLD) and status["alive"] == str(WORLD), where
    assert status["gen"] == str(before.gen), where
    assert lines["ping"] == "ok", where

    swap_bytes = 4 * LAYOUT.block_bytes * WORLD  # 4 blocks on each of 2 ranks
    for step in ("fill", "swap_out", "swap_in", "after_resume"):
        assert lines[step] == f"ok bytes={swap_bytes} ranks={WORLD}", where
    for step in ("checksum", "checksum_after"):
        assert lines[step] == f"ok bytes=0 ranks={WORLD}", where
    assert lines["roundtrip"] == "ok identical=true", where

    bad = lines["bad_ids"]
    assert bad.startswith(f"failed ranks={WORLD} reason=rank "), where
    assert "999 is out of range for the cpu tier" in bad, where

    pause, clear, resume = _fields(lines["pause"]), _fields(lines["clear"]), _fields(lines["resume"])
    epoch, gen = before.epoch, before.gen
    assert lines["pause"].startswith("ok ") and pause["state"] == "paused", where
    assert pause["epoch"] == str(epoch + 1) and pause["gen"] == str(gen), where
    assert float(pause["drain_ms"]) >= 0, where
    assert lines["clear"].startswith("ok ") and clear["state"] == "cleared", where
    assert clear["epoch"] == str(epoch + 2) and clear["gen"] == str(gen + 1), where
    assert clear["cancelled"] == "1", where
    per_rank = (LAYOUT.gpu_blocks + LAYOUT.cpu_blocks) * LAYOUT.block_bytes
    assert clear["freed"] == str(per_rank * WORLD), where
    assert lines["queued"] == "cancelled reason=caches were cleared while the task was queued", where
    assert lines["while_cleared"] == "rejected", where
    assert lines["resume"].startswith("ok ") and resume["state"] == "running", where
    assert resume["epoch"] == str(epoch + 3) and resume["gen"] == str(gen + 1), where

    # A controller on another connection paused, cleared and resumed: the task
    # queued at the clear is cancelled, the five submitted after the resume ran
    # at the new generation and end ok (docs/protocol.md §7.4).
    assert lines["foreign_queued"] == "cancelled", where
    assert _fields(lines["foreign_after"]) == {"ok": "5", "gen": str(gen + 2), "resumed_gen": str(gen + 2)}, where

    assert lines["malformed"] == "error code=malformed", where
    assert lines["bad_version"].startswith("error code=bad_version reason=protocol version 2"), where
    assert _fields(lines["done"]) == {"tasks": "15", "ignored": "0"}, where

    # The bus is healthy after a foreign client: running, both ranks alive, no deaths,
    # nothing left queued or in flight.  The client has its results from the ranks
    # before the broker hears their dones: a pause (acked only at zero in flight) waits for them.
    with cluster.client() as py:
        drained = py.pause(timeout=30)
        after = py.status()
        py.resume(timeout=30)
        assert py.status().state == "running"
    assert drained.state == "paused" and after.gen == gen + 2, after
    assert [r.alive for r in after.ranks] == [True] * WORLD, after
    assert after.counters.get("rank_deaths", 0) == 0, after.counters
    assert after.queued == 0 and after.inflight == 0, after
