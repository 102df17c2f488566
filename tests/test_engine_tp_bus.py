"""The ideal two-rank shape, opt-in because two torch processes are slow here
(ZKV_TP_TEST=1): transformers' tensor parallelism over 2 gloo processes,
a RankAgent in each on its half of the KV heads, the same SwapController
on both in lockstep, and one bus task (from TP rank 0) moving both shards.
By default, only TPBus itself over 2 gloo processes: a prefix cache manager
on each rank follows the same generation moves at the same call."""

import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from zkv.harness.bus.cluster import LocalCluster  # noqa: E402

WORKER = """
import json, os, sys
import torch, transformers
sys.path[:0] = [{root!r}]
torch.set_num_threads(1)
from zkv.client.client import Client
from zkv.engines.swap_controller import SwapController
from zkv.engines.tp_bus import TPBus
from zkv.engines.transformers import attach
from zkv.engines.transformers.build import build_manager
from zkv.engines.transformers.engine import TransformersCBEngine
from zkv.rank.store import block_digests
from zkv.testing.models import random_tokens
from zkv.net.endpoints import Endpoints

rank = int(os.environ["RANK"])
model = transformers.LlamaForCausalLM.from_pretrained({model!r}, attn_implementation="sdpa", tp_plan="auto").eval()
engine = TransformersCBEngine(build_manager(model, num_blocks=32, block_size=16, prefix_sharing=False))
endpoints = Endpoints({frontend!r}, {backend!r}, {control!r})
agent = attach.start_rank(engine, rank, 2, endpoints, 32)
client = Client(endpoints.frontend) if rank == 0 else None
ctrl = SwapController([engine], TPBus(client), 32)

def turn(first):
    if first:
        ctrl.submit("chat", random_tokens(1, 40), 12)
        how = "first"
    else:
        how = ctrl.continue_turn("chat", random_tokens(2, 12), 10)
    ctrl.run_until_idle()
    out = ctrl.result("chat")
    return how, (out.generated_tokens, out.logprobs)

turn(True)
_, expected = turn(False)  # no swap: the reference
ctrl.forget("chat")
turn(True)
old = engine.block_table("chat")
before = block_digests([engine.block_rows()], old)
swapped_out = ctrl.swap_out("chat")
rows = engine.block_rows()
rows[torch.tensor(old)] = 0  # the released blocks get other content
held = []
while set(old) - set(held):  # hold the old ids: the swap-in must land elsewhere
    held += engine.take_blocks(1)
engine.return_blocks([b for b in held if b not in old])
how = ctrl.continue_turn("chat", random_tokens(2, 12), 10)  # the swap-in
new = engine.block_table("chat")
after = block_digests([rows], new)  # before the turn writes its tokens into the last block
ctrl.run_until_idle()
out = ctrl.result("chat")
got = (out.generated_tokens, out.logprobs)
report = dict(kv_heads=engine.layout.kv_heads, old=old, new=new, swapped_out=swapped_out, how=how,
              bytes_equal=before == after, exact=got == expected, stats=ctrl.stats.swap_ins)
agent.stop()
if client is not None:
    client.close()
with open(os.path.join({out!r}, "rank%s.json" % rank), "w") as f:
    json.dump(report, f)
"""


@pytest.mark.skipif(os.environ.get("ZKV_TP_TEST") != "1", reason="two torch processes: 30-90 s here; set ZKV_TP_TEST=1")
def test_one_bus_task_moves_both_tensor_parallel_shards_and_generation_continues_bit_for_bit(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # tp_plan="auto" needs it
    from zkv.testing.models import random_llama

    random_llama(0).save_pretrained(tmp_path / "model")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = LocalCluster(2, quiet=True)
    cluster.start_broker()
    try:
        ep = cluster.endpoints
        script = tmp_path / "worker.py"
        script.write_text(
            WORKER.format(
                root=root,
                model=str(tmp_path / "model"),
                frontend=ep.frontend,
                backend=ep.backend,
                control=ep.control,
                out=str(tmp_path),
            )
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            str(script),
        ]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    finally:
        cluster.stop()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["kv_heads"] for r in ranks] == [2, 2]  # each rank's agent serves its own half of the heads
    assert ranks[0]["old"] == ranks[1]["old"] and ranks[0]["new"] == ranks[1]["new"]
    assert not set(ranks[0]["old"]) & set(ranks[0]["new"])
    for r in ranks:
        assert r["swapped_out"] and r["how"] == "swapped_in" and r["bytes_equal"] and r["exact"], r


LOCKSTEP = """
import json, os, sys
sys.path[:0] = [{root!r}]
import torch.distributed as dist
from zkv.engines.tp_bus import TPBus
from zkv.prefix import PrefixCacheManager
from zkv.wire.outcome import TaskOutcome

class Client:  # rank 0's bus client: every task ok; its GPU generation moves after the 2nd task
    gen, cpu_gen, tasks = 7, 3, 0
    def submit(self, op, src, dst, timeout=30.0):
        self.tasks += 1
        return self.tasks
    def wait(self, task, timeout=None):
        if task == 2:
            self.gen += 1  # a rank restarted with its CPU tier: cpu_gen stays
        return TaskOutcome(task, "ok", "", 1, 0.0, {{0: {{}}, 1: {{}}}})
    def settled(self, timeout=0.0):
        return []

dist.init_process_group("gloo")
rank = dist.get_rank()
bus = TPBus(Client() if rank == 0 else None)
manager = PrefixCacheManager(bus, 4, 8, 8)
seen = []
for seed in range(3):
    tokens = [seed * 100 + i for i in range(8)]
    fresh = manager.allocate(2)
    manager.insert(tokens, fresh.block_ids)
    manager.release(fresh)
    manager.evict(1)  # a swap_out task each: through rank 0, its outcome broadcast
    seen.append((bus.gen, bus.cpu_gen, manager.locate(tokens)))
manager.match([0, 1, 2, 3])
st = manager.stats()
with open(os.path.join({out!r}, "rank%d.json" % rank), "w") as f:
    json.dump(dict(seen=seen, drops=st["gpu_generation_drops"], resets=st["generation_resets"], epoch=st["epoch"]), f)
dist.destroy_process_group()
"""


def test_every_tp_rank_sees_the_same_generations_and_its_manager_follows_them_in_lockstep(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "lockstep.py"
    script.write_text(LOCKSTEP.format(root=root, out=str(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(r), "WORLD_SIZE": "2"},
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errors
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1], "the same generations, the same tree, on every rank"
    assert [tuple(s[:2]) for s in ranks[0]["seen"]] == [(7, 3), (8, 3), (8, 3)]
    assert (ranks[0]["drops"], ranks[0]["resets"]) == (1, 0), "the GPU generation moved alone"
