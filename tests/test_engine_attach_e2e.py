"""Cross-process attach on CPU: two "engine" processes own the KV tensors (in
shared memory), two ``zkv worker --attach MANIFEST`` processes serve them
through a real broker.  After a clear no worker maps engine memory
(``/proc/PID/maps``); a resume maps the engines' new tensors (another block
count); a missing, stale or bad manifest fails the resume naming the rank
and the reason, and every process keeps serving."""

from __future__ import annotations

import os

import pytest
from profiles import long_e2e

from zkv.client.client import ZkvError
from zkv.harness.bus.attached_cluster import AttachedCluster
from zkv.harness.bus.ipc_check import mapped
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=16, cpu_blocks=8, block_size=4, kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One attached cluster for the tests that leave it serving (each ends on
    a completed resume), so its five processes start once."""
    c = AttachedCluster(2, LAYOUT, directory=tmp_path_factory.mktemp("attach") / "z", quiet=True)
    c.start(timeout=120)
    yield c
    codes = c.stop().codes
    assert all(code == 0 for name, code in codes.items() if name.startswith("engine")), codes


def maps(cluster: AttachedCluster) -> list[int]:
    """How many mappings of its engine's current files each worker holds."""
    return [mapped(cluster.engines[r].tag, cluster.workers[r].pid) for r in range(cluster.ranks)]


def round_trip(cluster: AttachedCluster, c, src, rows, dst, seed: int) -> None:
    before = [cluster.engines[r].digest(src) for r in range(cluster.ranks)]
    out = c.run("swap_out", src, rows, timeout=30)
    assert out.ok, out.reason
    for engine in cluster.engines.values():
        assert engine.ask(f"scribble {seed}") == "ok"
    back = c.run("swap_in", rows, dst, timeout=30)
    assert back.ok, back.reason
    assert [cluster.engines[r].digest(dst) for r in range(cluster.ranks)] == before


def test_workers_serve_tensors_engine_processes_own_and_unmap_them_on_clear(cluster):
    with cluster.client() as c:
        assert all(n > 0 for n in maps(cluster))
        round_trip(cluster, c, [3, 4, 5, 15], [0, 1, 2, 7], [12, 13, 14, 0], seed=2)
        c.pause(timeout=30)
        c.clear(timeout=30)
        assert maps(cluster) == [0, 0], "a worker still maps engine memory after the clear reply"
        cluster.reallocate(blocks=24)  # the engines free and reallocate, with more blocks
        c.resume(layout={"gpu_blocks": 24}, timeout=30)
        assert all(n > 0 for n in maps(cluster))
        round_trip(cluster, c, [20, 21, 23], [5, 6, 7], [0, 1, 22], seed=3)


def test_a_bad_stale_or_missing_manifest_fails_the_resume_naming_the_rank(cluster):
    """A failed resume leaves the bus cleared again (every rank detaches), so
    each retry starts with the engines exporting a newer generation."""
    path = cluster.manifest(1)

    def retry_with(rank1_manifest: bytes | None) -> None:
        cluster.generation += 1
        cluster.engines[0].realloc(cluster.generation)  # rank 0's engine always does it right
        if rank1_manifest is None:
            os.unlink(path)
        else:
            with open(path, "wb") as f:
                f.write(rank1_manifest)

    with cluster.client() as c:
        c.pause(timeout=30)
        c.clear(keep_cpu=True, timeout=30)
        with pytest.raises(ZkvError, match=r"rank \d.*stale_manifest.*not newer"):  # the engines did not re-export
            c.resume(timeout=30)
        good = open(path, "rb").read()  # what rank 1 attached last
        for manifest, reason in (
            (b"\x81\xa3not a manifest", "bad_manifest"),
            (None, "missing_file"),
            (good, "stale_manifest"),
        ):
            retry_with(manifest)
            with pytest.raises(ZkvError, match=rf"rank 1 .*{reason}"):
                c.resume(timeout=30)
            assert all(p.poll() is None for p in list(cluster.workers.values()) + [cluster.broker]), "nothing crashed"
        cluster.reallocate()
        c.resume(timeout=30)
        round_trip(cluster, c, [1, 2], [3, 4], [5, 6], seed=4)


@long_e2e(
    "the whole demo on attached engine processes, 20-40 s",
    "test_workers_serve_tensors_engine_processes_own_and_unmap_them_on_clear",
)
def test_the_demo_runs_on_ranks_attached_to_engine_processes(tmp_path):
    """``zkv up --demo --attach``'s workload: the cycle's clear unmaps, the
    engines reallocate, the resume maps their next generation."""
    from zkv.harness.prefix.demo import run_demo

    layout = CacheLayout(layers=2, gpu_blocks=32, cpu_blocks=64, block_size=16, kv_heads=2, head_dim=32)
    cluster = AttachedCluster(2, layout, directory=tmp_path / "d", quiet=True)
    cluster.start(timeout=120)
    try:
        lines: list[str] = []
        ok = run_demo(cluster.endpoints.frontend, layout, 40, echo=lines.append, update=cluster.reallocate)
        assert ok, "\n".join(lines)
        assert cluster.generation == 2 and all(n > 0 for n in maps(cluster)), "the resume mapped the new generation"
        assert "pause/clear/resume" in "\n".join(lines)
    finally:
        cluster.stop()


def test_a_worker_whose_manifest_is_missing_exits_saying_why(tmp_path):
    import subprocess
    import sys

    ep = tmp_path / "s"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zkv",
            "worker",
            "--rank",
            "1",
            "--backend",
            f"ipc://{ep}-b",
            "--control",
            f"ipc://{ep}-c",
            "--attach",
            str(tmp_path / "nope.manifest"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
    )
    assert out.returncode != 0
    assert "rank 1 cannot attach" in out.stderr and "missing_file" in out.stderr, out.stderr
