"""Pictures: a real recording of a real bus (threads, ipc://) plotted as a
latency timeline, and a benchmark report beside its baselines."""

from __future__ import annotations

import struct

import pytest

pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402
import numpy as np  # noqa: E402
from inproc_bus import LAYOUT, InProcessBus  # noqa: E402

from zkv.client.client import Client  # noqa: E402
from zkv.harness.bus.bench import bench_copy  # noqa: E402
from zkv.obs.plots import OP_COLOURS, OUTCOME_COLOURS, plot_bench, plot_trace, read_timeline  # noqa: E402
from zkv.trace import TraceRecorder, load_trace  # noqa: E402


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def has_colour(image: np.ndarray, hex_colour: str, tol: float = 0.02) -> bool:
    rgb = np.array([int(hex_colour[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return bool((np.abs(image[..., :3] - rgb).max(axis=-1) < tol).any())


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    d = tmp_path_factory.mktemp("rec")
    path = d / "run.jsonl"
    recorder = TraceRecorder(str(path), world=2, layout=LAYOUT)
    with InProcessBus(d, recorder=recorder) as bus, Client(bus.endpoints.frontend) as client:
        for i in range(20):
            assert client.run("swap_out", [i], [i], timeout=30).ok
        tasks = [client.submit("swap_in", [i], [i]) for i in range(8)]
        client.pause(timeout=30)
        held = [client.submit("swap_out", [i], [i]) for i in range(3)]  # queued while paused
        client.ping()  # the broker has them before the clear
        client.clear(timeout=30)  # they end cancelled
        late = client.submit("swap_out", [0], [0])  # rejected: cleared
        client.resume(timeout=30)
        for t in tasks + held + [late]:
            client.wait(t, timeout=30)
        for i in range(5):
            assert client.run("fill", None, [i], timeout=30, tier="gpu", seed=1).ok
        client.pause(
            timeout=30
        )  # results reach the client before the ranks' done reach the broker: drain them into the recording
    recorder.close()
    return path


def test_trace_plot_of_a_real_recording(recording, tmp_path):
    trace = load_trace(str(recording))  # a valid trace
    tl = read_timeline(str(recording))
    outcomes = {o for _, _, o in tl.tasks}
    assert {"ok", "cancelled", "rejected"} <= outcomes
    assert len(tl.tasks) == len(trace.tasks) == 20 + 8 + 3 + 1 + 5
    assert {op for op, *_ in tl.ops} == {"pause", "clear", "resume"}
    assert all(start <= end for _, start, end, _ in tl.ops)
    out = tmp_path / "trace.png"
    assert plot_trace(str(recording), str(out)) == str(out)
    assert out.stat().st_size > 20_000
    assert png_size(out) == (1100, 480)
    image = matplotlib.image.imread(str(out))
    assert image.shape[:2] == (480, 1100)
    for colour in (
        OUTCOME_COLOURS["ok"],
        OUTCOME_COLOURS["cancelled"],
        OUTCOME_COLOURS["rejected"],
        OP_COLOURS["pause"],
    ):
        assert has_colour(image, colour), colour


def test_trace_without_outcomes_is_refused_with_a_hint(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text(
        '{"zkv_trace": 1, "world": 2, "layout": null}\n'
        '{"t": 0, "ev": "submit", "op": "swap_out", "src": [1], "dst": [1]}\n'
    )
    with pytest.raises(ValueError, match="no outcome records.*--record"):
        plot_trace(str(path), str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_bench_plot_beside_baselines(tmp_path):
    from zkv.wire.layout import CacheLayout

    copy = bench_copy(CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=64, block_size=4, kv_heads=2, head_dim=16), 16, 3)
    pct = lambda p50, p99: {"p50": p50, "p99": p99, "mean": p50, "n": 100}  # noqa: E731
    results = {
        "bus_1_blocks": {
            "raw_pyzmq_relay": {"rtt_us": pct(260, 460), "tasks_per_s": 39000},
            "zkv": {"rtt_us": pct(700, 1500), "tasks_per_s": 9000},
        },
        "bus_256_blocks": {
            "raw_pyzmq_relay": {"rtt_us": pct(300, 500), "tasks_per_s": 35000},
            "zkv": {"rtt_us": pct(900, 2000), "tasks_per_s": 4000},
        },
        "copy_256_blocks": copy,
        "pause": {
            "idle_pause_ms": pct(0.8, 2),
            "idle_resume_ms": pct(0.7, 1.5),
            "busy_pause_ms": pct(5, 9),
            "busy_drain_ms": pct(4, 8),
            "busy_overhead_beyond_drain_ms": pct(0.5, 1),
            "inflight_tasks": 32,
        },
    }
    out = tmp_path / "bench.png"
    plot_bench(results, str(out))
    w, h = png_size(out)
    assert (w, h) == (1260, 680) and out.stat().st_size > 20_000
    image = matplotlib.image.imread(str(out))
    assert has_colour(image, "#2b7bba") and has_colour(image, "#aaaaaa")  # zkv bars and baseline bars
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_bench({}, str(tmp_path / "none.png"))
    cost = tmp_path / "cost.png"  # zkv bench bus --metrics-cost: with metrics beside the no-op books
    plot_bench({"metrics_cost": {"bus": {"median_metered": 2300.0, "median_plain": 2350.0}}}, str(cost))
    assert png_size(cost) == (420, 340)
    image = matplotlib.image.imread(str(cost))
    assert has_colour(image, "#2b7bba") and has_colour(image, "#aaaaaa")
