"""RankAgent: ranks inside the engine's process, on the engine's own tensors,
through a real broker (a thread) and real ZMQ sockets.

For every layout the test writes known bytes into the engine's tensors
directly (no ``fill``), swaps them out through the bus on 2 ranks,
overwrites the engine's memory, swaps back into other block ids, and
compares the bytes as the engine itself indexes them."""

from __future__ import annotations

import signal
import threading
import warnings

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.client.client import Client, ZkvError
from zkv.engines import fastdeploy, sglang, vllm
from zkv.engines.transformers import layout as transformers_layout
from zkv.net.endpoints import Endpoints
from zkv.rank.agent import RankAgent
from zkv.rank.memory import layouts
from zkv.rank.registration import RankRefused

NB, BS, H, D, L, P = 12, 4, 2, 8, 2, 4
CPU_ROWS = 10


def _random_(t: torch.Tensor, gen: torch.Generator) -> None:
    flat = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def make_engine(layout: str, nb: int = NB):
    """(tensors, entries, block(b) -> the engine's own slices of block b); the vLLM
    layouts without their null block, so every id is the layouts' to swap
    (the null block: tests/test_prefix_allocator.py)."""
    bf = torch.bfloat16
    if layout == "zkv_native":
        ks = [torch.zeros((nb, H, BS, D), dtype=bf) for _ in range(L)]
        vs = [torch.zeros((nb, H, BS, D), dtype=bf) for _ in range(L)]
        return ks + vs, layouts.zkv_native(ks, vs), lambda b: [t[b] for t in ks + vs]
    if layout == "fastdeploy":
        ks = [torch.zeros((nb, H, BS, D), dtype=torch.uint8) for _ in range(L)]
        vs = [torch.zeros((nb, H, BS, D), dtype=torch.uint8) for _ in range(L)]
        sk = [torch.zeros((nb, H, BS), dtype=torch.float32) for _ in range(L)]
        sv = [torch.zeros((nb, H, BS), dtype=torch.float32) for _ in range(L)]
        ts = ks + vs + sk + sv
        return ts, fastdeploy.regions(ks, vs, sk, sv), lambda b: [t[b] for t in ts]
    if layout == "vllm_flash_attn":
        kv = {f"layers.{i}.attn": torch.zeros((2, nb, BS, H, D), dtype=torch.float16) for i in range(L)}
        return list(kv.values()), vllm.flash_attn(kv, null_block=None), lambda b: [t[:, b] for t in kv.values()]
    if layout == "vllm_flash_attn_hnd":  # physical order (2, blocks, heads, block_size, dim), logical NHD shape
        kv = {f"layers.{i}.attn": torch.zeros((2, nb, H, BS, D), dtype=bf).transpose(2, 3) for i in range(L)}
        return list(kv.values()), vllm.flash_attn(kv, null_block=None), lambda b: [t[:, b] for t in kv.values()]
    if layout == "flashinfer":
        kv = {f"layers.{i}.attn": torch.zeros((nb, 2, BS, H, D), dtype=bf) for i in range(L)}
        return list(kv.values()), vllm.flashinfer(kv, null_block=None), lambda b: [t[b] for t in kv.values()]
    if layout == "transformers_cb":
        flat = torch.zeros(nb * L * 2 * BS * H * D * 2, dtype=torch.uint8)
        typed = flat.view(bf).view(nb, L, 2, BS, H, D)
        return [flat], transformers_layout.regions(flat, L, BS, H, D, bf), lambda b: [typed[b]]
    if layout == "sglang_mha":
        kb = [torch.zeros((nb * P + P, H, D), dtype=bf) for _ in range(L)]  # SGLang pads one page
        vb = [torch.zeros((nb * P + P, H, D), dtype=bf) for _ in range(L)]
        return kb + vb, sglang.mha(kb, vb, P), lambda b: [t[b * P : (b + 1) * P] for t in kb + vb]
    if layout == "mla":
        kv = {f"layers.{i}.attn": torch.zeros((nb, BS, 576), dtype=bf) for i in range(L)}
        return list(kv.values()), layouts.per_layer(kv), lambda b: [t[b] for t in kv.values()]
    raise AssertionError(layout)


LAYOUTS = [
    "zkv_native",
    "fastdeploy",
    "vllm_flash_attn",
    "vllm_flash_attn_hnd",
    "flashinfer",
    "transformers_cb",
    "sglang_mha",
    "mla",
]


def block_bytes(block) -> list[torch.Tensor]:
    return [s.contiguous().view(torch.uint8).clone() for s in block]


class Bus:
    """A real broker on a thread and ``world`` RankAgents over their own engine tensors."""

    def __init__(self, tmp_path, layout: str, world: int = 2, nb: int = NB):
        self.endpoints = Endpoints.in_dir(tmp_path)
        self.broker = Broker(self.endpoints, BrokerConfig(world=world, heartbeat_ms=100))
        self.thread = threading.Thread(target=self.broker.serve, daemon=True)
        self.engines = [make_engine(layout, nb) for _ in range(world)]
        self.agents = [
            RankAgent(r, world, self.endpoints.backend, self.endpoints.control, self.engines[r][1], CPU_ROWS)
            for r in range(world)
        ]

    def __enter__(self) -> "Bus":
        self.thread.start()
        for agent in self.agents:
            agent.start(timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        for agent in self.agents:
            agent.stop(timeout=10)
        self.broker.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()

    def client(self) -> Client:
        return Client(self.endpoints.frontend)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_round_trips_the_engines_own_bytes_through_the_bus(tmp_path, layout):
    gen = torch.Generator().manual_seed(5)
    with Bus(tmp_path, layout) as bus, bus.client() as c:
        for tensors, _, _ in bus.engines:
            for t in tensors:
                _random_(t, gen)
        src, rows, dst = [1, 2, 3, 9], [7, 0, 1, 2], [4, 5, 10, 11]
        want = [[block_bytes(block(b)) for b in src] for _, _, block in bus.engines]
        out = c.run("swap_out", src, rows, timeout=30)
        assert out.ok, out.reason
        for tensors, _, _ in bus.engines:  # the engine overwrites its memory
            for t in tensors:
                _random_(t, gen)
        back = c.run("swap_in", rows, dst, timeout=30)
        assert back.ok, back.reason
        for r, (_, _, block) in enumerate(bus.engines):
            got = [block_bytes(block(b)) for b in dst]
            for w_pages, g_pages in zip(want[r], got):
                assert all(torch.equal(w, g) for w, g in zip(w_pages, g_pages)), f"rank {r}, layout {layout}"
        # fill and checksum work on the engine's memory too: a block and its tier row share a digest
        assert c.run("fill", None, [0, 6], tier="gpu", seed=3, timeout=30).ok
        assert c.run("swap_out", [0, 6], [8, 9], timeout=30).ok
        g = c.run("checksum", [0, 6], tier="gpu", timeout=30)
        k = c.run("checksum", [8, 9], tier="cpu", timeout=30)
        assert g.ok and k.ok and all(g.per_rank[r]["digests"] == k.per_rank[r]["digests"] for r in range(2))


def test_ids_are_checked_against_the_engines_block_count(tmp_path):
    with Bus(tmp_path, "flashinfer") as bus, bus.client() as c:
        bad = c.run("swap_in", [0], [NB], timeout=30)
        assert bad.outcome == "failed" and f"out of range for the gpu tier (0..{NB - 1})" in bad.reason
        bad = c.run("swap_out", [0], [CPU_ROWS], timeout=30)
        assert bad.outcome == "failed" and "cpu tier" in bad.reason
        assert c.run("swap_out", [NB - 1], [CPU_ROWS - 1], timeout=30).ok, "the rank still serves"


def test_clear_drops_every_reference_and_resume_attaches_new_tensors_of_another_block_count(tmp_path):
    bus = Bus(tmp_path, "vllm_flash_attn")
    with bus, bus.client() as c:
        assert c.run("swap_out", [1, 2], [0, 1], timeout=30).ok
        refs = [[StorageWeakRef(t.untyped_storage()) for t in tensors] for tensors, _, _ in bus.engines]
        keep = [[block_bytes(block(b)) for b in (1, 2)] for _, _, block in bus.engines]
        c.pause(timeout=30)
        cleared = c.clear(keep_cpu=True, timeout=30)
        assert cleared.freed > 0
        bus.engines = []  # the engine frees its cache once the clear reply arrived
        assert all(ref.expired() for per_rank in refs for ref in per_rank), "a rank still holds engine memory"
        with pytest.raises(ZkvError, match=r"rank \d .*no_cache"):  # the engine handed over nothing yet
            c.resume(timeout=30)
        bus.engines = [make_engine("vllm_flash_attn", 2 * NB) for _ in range(2)]
        for agent, (_, entries, _) in zip(bus.agents, bus.engines):
            agent.attach(entries)
        with pytest.raises(ZkvError, match=rf"rank \d .*{2 * NB} blocks.*gpu_blocks={NB}"):  # the bus layout says NB
            c.resume(timeout=30)
        c.pause(timeout=30)  # the way out the failure names; the caches handed over stay the next resume's
        c.clear(keep_cpu=True, timeout=30)
        c.resume(layout={"gpu_blocks": 2 * NB}, timeout=30)
        back = c.run("swap_in", [0, 1], [2 * NB - 2, 2 * NB - 1], timeout=30)
        assert back.ok, back.reason
        for r, (_, _, block) in enumerate(bus.engines):  # keep_cpu kept the tier's rows, bit for bit
            got = [block_bytes(block(b)) for b in (2 * NB - 2, 2 * NB - 1)]
            assert all(torch.equal(w, g) for wp, gp in zip(keep[r], got) for w, g in zip(wp, gp))


def test_start_and_stop_are_bounded_idempotent_and_leave_the_process_alone(tmp_path):
    ep = Endpoints.in_dir(tmp_path)
    _, entries, _ = make_engine("flashinfer")
    before = (
        torch.get_num_threads(),
        signal.getsignal(signal.SIGINT),
        signal.getsignal(signal.SIGTERM),
        list(warnings.filters),
    )
    agent = RankAgent(0, 1, ep.backend, ep.control, entries, CPU_ROWS)
    with pytest.raises(TimeoutError, match="not registered"):
        agent.start(timeout=0.5)  # no broker
    agent.stop(timeout=5)
    agent.stop(timeout=5)
    assert not agent.is_alive()
    broker = Broker(ep, BrokerConfig(world=2, heartbeat_ms=100))
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    try:
        wrong = RankAgent(0, 3, ep.backend, ep.control, make_engine("flashinfer")[1], CPU_ROWS)
        with pytest.raises(RankRefused, match="world size"):
            wrong.start(timeout=30)
        tensors, entries, block = make_engine("flashinfer")
        refs = [StorageWeakRef(t.untyped_storage()) for t in tensors]
        ok = RankAgent(1, 2, ep.backend, ep.control, entries, CPU_ROWS)
        del tensors, entries, block
        ok.start(timeout=30)
        ok.start(timeout=30)
        assert ok.is_alive() and ok.stats()["device"] == "cpu"
        assert not any(r.expired() for r in refs)
        ok.stop(timeout=10)
        ok.stop(timeout=10)
        assert not ok.is_alive()
        assert all(r.expired() for r in refs), "a stopped agent holds no engine memory"
    finally:
        broker.stop()
        thread.join(timeout=10)
    after = (
        torch.get_num_threads(),
        signal.getsignal(signal.SIGINT),
        signal.getsignal(signal.SIGTERM),
        list(warnings.filters),
    )
    assert before == after
