"""A broker stopped with tasks on the ranks books their outcomes before it
exits (bounded), so a recording has exactly one outcome per task."""

import random
import signal

from zkv.harness.bus.cluster import LocalCluster
from zkv.trace import check_recording, load_trace
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=2, gpu_blocks=128, cpu_blocks=256, block_size=16, kv_heads=4, head_dim=64)


def test_sigterm_waits_for_the_done_of_tasks_in_flight(tmp_path):
    rec = tmp_path / "rec.jsonl"
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=["--record", str(rec)], directory=tmp_path / "sock")
    c.start(timeout=60)
    try:
        rng = random.Random(5)
        with c.client() as client:
            tasks = [
                client.submit("swap_out", rng.sample(range(128), 64), rng.sample(range(256), 64)) for _ in range(30)
            ]
            client.ping()  # every submit reached the broker before the stop
            c.broker.send_signal(signal.SIGTERM)
            assert c.broker.wait(timeout=10) == 0
            outs = [client.wait(t, timeout=10) for t in tasks]
        assert all(o.ok for o in outs)
        trace = load_trace(str(rec))
        assert len(trace.tasks) == 30
        assert check_recording(trace) == [], "every task's outcome was recorded before the broker exited"
    finally:
        c.stop()
