"""The ideal two-rank shape, opt-in because two torch processes are slow here
(ZKV_TP_TEST=1): transformers' tensor parallelism over 2 gloo processes,
a RankAgent in each on its half of the KV heads, the same SwapController
on both in lockstep, and one bus task (from TP rank 0) moving both shards."""

import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from zkv.harness.cluster import LocalCluster  # noqa: E402
from zkv.testing.models import random_llama  # noqa: E402

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
from zkv.rank.cache.store import block_digests
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
    pytest.importorskip("accelerate")  # tp_plan="auto" needs it
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
