"""``zkv worker`` as an operator starts it, against a real broker (or none):
a worker whose layout options differ from the bus's is refused naming both
layouts, or with ``--adopt-layout`` takes the bus's and says so; a worker
that waits for a broker says what it waits for, after a bound and then at a
low rate (docs/deploy.md §4).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from zkv.harness.bus.cluster import LocalCluster
from zkv.net.curve import generate_keypair
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=1, gpu_blocks=64, cpu_blocks=32, block_size=4, kv_heads=2, head_dim=8)


def worker(cluster: LocalCluster, rank: int, *args: str) -> subprocess.Popen:
    ep = cluster.endpoints
    return subprocess.Popen(
        [sys.executable, "-m", "zkv", "worker", "--rank", str(rank), "--world-size", str(cluster.ranks)]
        + ["--backend", ep.backend, "--control", ep.control, "--tier-dir", "none", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


class Lines:
    """A process's stderr, read line by line on a thread; ``wait_for`` a line (bounded)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.changed = proc, [], threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.lines.append(None)  # the end
            self.changed.notify_all()

    def wait_for(self, text: str, timeout: float = 60) -> str:
        def seen() -> bool:
            return any(line is None or text in line for line in self.lines)

        with self.changed:
            assert self.changed.wait_for(seen, timeout), f"no {text!r} within {timeout} s: {self.text()}"
            assert any(line and text in line for line in self.lines), f"no {text!r} before the end: {self.text()}"
            return self.text()

    def text(self) -> str:
        return "".join(line for line in self.lines if line)


def test_a_worker_with_another_layout_is_refused_naming_both_or_adopts_the_bus_layout_when_told():
    with LocalCluster(2, LAYOUT, worker_args=["--tier-dir", "none"], quiet=True) as cluster:
        cluster.kill_worker(1)
        refused = worker(cluster, 1, "--gpu-blocks", "32", "--layers", "2", "--cpu-blocks", "32")
        out, err = refused.communicate(timeout=60)
        assert refused.returncode == 1, err
        assert "the broker refused rank 1" in err, err
        assert "gpu_blocks 32 (the bus: 64)" in err and "layers 2 (the bus: 1)" in err, err
        assert "--adopt-layout" in err and "Traceback" not in err, err
        assert cluster.broker.poll() is None and cluster.workers[0].poll() is None, "a refused ready changes nothing"

        adopted = worker(cluster, 1, "--gpu-blocks", "32", "--layers", "2", "--adopt-layout")
        cluster.workers[1] = adopted  # stopped with the cluster
        lines = Lines(adopted)
        said = lines.wait_for("adopts the bus's layout")
        assert "'gpu_blocks': 64" in said and "'gpu_blocks': 32" in said, said
        cluster.wait_ready(ranks=2)
        with cluster.client() as c:
            assert c.run("fill", dst=[63], tier="gpu", seed=1, timeout=30).ok, "block 63: the bus's layout, not 32"
            st = c.status()
        assert st.layout.gpu_blocks == 64 and all(r.alive for r in st.ranks)


def test_a_worker_without_a_broker_says_what_it_waits_for_after_a_bound(tmp_path):
    cluster = LocalCluster(1, LAYOUT, directory=tmp_path)  # its addresses only: no broker is started
    waiting = worker(cluster, 0, *LAYOUT_ARGS)
    try:
        lines = Lines(waiting)
        said = lines.wait_for("waiting for the broker at", timeout=30)
        assert cluster.endpoints.backend in said and "is zkv broker running" in said, said
        assert waiting.poll() is None, "it keeps waiting"
    finally:
        waiting.kill()
        waiting.wait(timeout=10)

    keys = tmp_path / "keys"
    generate_keypair(str(keys), "broker")
    generate_keypair(str(keys), "rank")
    curve = ["--curve-server", str(keys / "broker.key"), "--curve-secret", str(keys / "rank.key_secret")]
    waiting = worker(cluster, 0, *LAYOUT_ARGS, *curve)
    try:
        said = Lines(waiting).wait_for("waiting for the broker at", timeout=30)
        assert "--curve-ranks" in said and "broker's public key" in said, said
    finally:
        waiting.kill()
        waiting.wait(timeout=10)


LAYOUT_ARGS = ["--gpu-blocks", "64", "--layers", "1", "--cpu-blocks", "32", "--block-size", "4"]
LAYOUT_ARGS += ["--kv-heads", "2", "--head-dim", "8"]


def test_a_worker_of_a_rank_outside_its_world_is_refused_before_it_takes_any_memory():
    out = subprocess.run(
        [sys.executable, "-m", "zkv", "worker", "--rank", "5", "--world-size", "3", "--gpu-blocks", "4096"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "rank 5 does not exist in a world of 3 (ranks 0 to 2)" in out.stderr, out.stderr
