"""The layout a rank on engine memory announces (docs/engines.md, "The layout a
rank announces"): derived from the memory when none is given, a given one
checked against it (block count, bytes per block, CPU rows) and refused naming
both values; what ``zkv status`` shows and the bytes a swap reports then agree
with the engine's tensors.  Real ``RankAgent`` / attached worker, real broker
and ZMQ sockets, real torch tensors (a manifest in shared memory)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading

import click
import pytest
import torch
import zmq
from click.testing import CliRunner
from test_engine_agent import LAYOUTS, make_engine
from test_operator_paths import cli

from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.cli.options import given_layout_fields, layout_options
from zkv.client.client import Client
from zkv.harness.bus.ipc_check import mapped
from zkv.net.endpoints import Endpoints
from zkv.rank import attach_rank
from zkv.rank.agent import RankAgent
from zkv.rank.errors import CacheError
from zkv.rank.memory import geometry, layouts
from zkv.rank.memory.manifest import ShmArena, export_manifest
from zkv.rank.memory.regions import EngineCache, TensorEntry
from zkv.rank.store import BlockStore
from zkv.wire.layout import CacheLayout

ROWS, PAGE = 8, 32768  # one uint8 tensor of 8 blocks of 32 KiB


def flat_entries() -> list[TensorEntry]:
    return [TensorEntry("kv", torch.zeros(ROWS, PAGE, dtype=torch.uint8))]


def descriptor_of(entries):
    return EngineCache.from_tensors(entries).descriptor


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_derived_layout_has_the_engines_block_count_and_bytes_per_block(layout):
    _, entries, _ = make_engine(layout)
    d = descriptor_of(entries)
    derived = geometry.derive(d, cpu_rows=10)
    assert (derived.gpu_blocks, derived.cpu_blocks, derived.block_bytes) == (d.num_blocks, 10, d.block_bytes)


def test_the_derived_dtype_is_the_engines_when_the_wire_names_it():
    fp16 = descriptor_of(make_engine("vllm_flash_attn")[1])
    assert geometry.derive(fp16, 4).dtype == "fp16"
    mixed = descriptor_of(make_engine("fastdeploy")[1])  # uint8 K/V and fp32 scales: counted in 2-byte elements
    assert geometry.derive(mixed, 4).dtype == "bf16"
    big = descriptor_of([TensorEntry("kv", torch.zeros(2, 2**20, dtype=torch.float32))])  # past head_dim's bound
    lay = geometry.derive(big, 4)
    assert lay.block_bytes == 2**22 and lay.head_dim <= 65536 and lay.dtype == "fp32"


def test_blocks_no_layout_can_describe_are_refused_naming_their_size():
    with pytest.raises(CacheError, match="3 bytes, not a multiple of 4") as err:
        geometry.derive(descriptor_of([TensorEntry("kv", torch.zeros(8, 3, dtype=torch.uint8))]), 4)
    assert err.value.code == "bad_layout"


WRONG = {
    "the default layout": (CacheLayout(gpu_blocks=ROWS, cpu_blocks=4), r"32768 bytes per block.*says 65536 bytes"),
    "another block count": (
        CacheLayout(gpu_blocks=256, cpu_blocks=4, head_dim=4096, layers=1, kv_heads=1, block_size=2),
        r"has 8 blocks, the layout says gpu_blocks=256",
    ),
    "another CPU tier": (
        CacheLayout(gpu_blocks=ROWS, cpu_blocks=512, head_dim=4096, layers=1, kv_heads=1, block_size=2),
        r"4 rows, the layout says cpu_blocks=512",
    ),
    "fields that do not multiply out": ({"layers": 2}, r"32768 bytes per block.*says 65536 bytes"),
    "an unknown field": ({"heads": 2}, r"unknown layout fields \['heads'\]"),
    "an out-of-range field": ({"head_dim": 0}, r"layout.head_dim must be an integer"),
}


@pytest.mark.parametrize("case", WRONG, ids=WRONG.keys())
def test_a_rank_agent_refuses_a_layout_its_memory_does_not_have_naming_both(tmp_path, case):
    given, reason = WRONG[case]
    ep = Endpoints.in_dir(tmp_path)
    with pytest.raises(CacheError, match=reason) as err:
        RankAgent(0, 1, ep.backend, ep.control, flat_entries(), 4, layout=given)
    assert err.value.code == "bad_layout"


def test_given_fields_that_agree_are_announced_with_the_engines_block_counts(tmp_path):
    ep = Endpoints.in_dir(tmp_path)
    model = {"layers": 4, "block_size": 16, "kv_heads": 4, "head_dim": 16, "dtype": "fp32"}
    agent = RankAgent(0, 1, ep.backend, ep.control, flat_entries(), 4, layout=model)
    assert agent.layout == CacheLayout(gpu_blocks=ROWS, cpu_blocks=4, **model)
    agent.stop(timeout=5)
    whole = CacheLayout(gpu_blocks=ROWS, cpu_blocks=4, **model)
    assert RankAgent(0, 1, ep.backend, ep.control, flat_entries(), 4, layout=whole).layout == whole


class BrokerThread:
    def __init__(self, tmp_path, world: int = 1):
        self.endpoints = Endpoints.in_dir(tmp_path)
        self.broker = Broker(self.endpoints, BrokerConfig(world=world, heartbeat_ms=100))
        self.thread = threading.Thread(target=self.broker.serve, daemon=True)

    def __enter__(self) -> "BrokerThread":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.broker.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


def test_status_and_swap_bytes_report_the_engines_blocks_not_zkvs_defaults(tmp_path):
    with BrokerThread(tmp_path) as b, Client(b.endpoints.frontend) as c:
        agent = RankAgent(0, 1, b.endpoints.backend, b.endpoints.control, flat_entries(), 4)
        agent.start(timeout=30)
        try:
            shown = c.status(timeout=10).layout
            assert (shown.gpu_blocks, shown.cpu_blocks, shown.block_bytes) == (ROWS, 4, PAGE)
            out = c.run("swap_out", [1, 2], [0, 1], timeout=30)
            assert out.ok and out.bytes == 2 * shown.block_bytes == 2 * PAGE
        finally:
            agent.stop(timeout=10)


@pytest.fixture
def manifest(tmp_path):
    """An engine's cache exported to a manifest: 16 blocks of 2 x 2 x 4 x 2 x 8 x 2 bytes (bf16)."""
    arena = ShmArena()
    ks = [arena.tensor(f"k{i}", (16, 2, 4, 8), torch.bfloat16) for i in range(2)]
    vs = [arena.tensor(f"v{i}", (16, 2, 4, 8), torch.bfloat16) for i in range(2)]
    path = str(tmp_path / "rank0.manifest")
    export_manifest(path, layouts.zkv_native(ks, vs), generation=1, arena=arena)
    yield path, arena
    del ks, vs
    arena.close()


ENGINE = CacheLayout(layers=2, gpu_blocks=16, cpu_blocks=8, block_size=4, kv_heads=2, head_dim=8)


def test_an_attached_worker_without_layout_options_announces_the_engines_memory(tmp_path, manifest):
    """What ``zkv worker --attach M`` passes when only --cpu-blocks (or nothing) is given."""
    path, _ = manifest
    ctx = zmq.Context()
    with BrokerThread(tmp_path) as b, Client(b.endpoints.frontend) as c:
        worker = attach_rank(path, 0, 1, b.endpoints.backend, b.endpoints.control, {"cpu_blocks": 8}, ctx=ctx)
        thread = threading.Thread(target=worker.serve, daemon=True)
        thread.start()
        try:
            shown = c.status(timeout=10, wait_ranks=1).layout
            assert (shown.gpu_blocks, shown.cpu_blocks, shown.block_bytes) == (16, 8, ENGINE.block_bytes)
            assert c.run("swap_out", [15], [7], timeout=30).bytes == ENGINE.block_bytes
        finally:
            worker.stop()
            thread.join(timeout=10)
            worker.cache.close()
            ctx.destroy(linger=0)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    "given,reason",
    [
        ({"cpu_blocks": 8, "gpu_blocks": 256}, "has 16 blocks, the layout says gpu_blocks=256"),
        ({"cpu_blocks": 8, "head_dim": 64, "layers": 4, "block_size": 16, "kv_heads": 4, "dtype": "bf16"}, "512 bytes"),
    ],
)
def test_an_attached_worker_refuses_options_its_engine_lacks_and_maps_nothing(tmp_path, manifest, given, reason):
    path, arena = manifest
    ep = Endpoints.in_dir(tmp_path)
    before = mapped(arena.tag)
    with pytest.raises(CacheError, match=reason) as err:
        attach_rank(path, 0, 1, ep.backend, ep.control, given)
    assert err.value.code == "bad_layout"
    gc.collect()
    assert mapped(arena.tag) == before, "a refused attach leaves nothing mapped"
    store = BlockStore.from_manifest(path, ENGINE)
    assert store.layout == ENGINE, "the layout the engine has is taken"
    store.close()


def test_the_worker_checks_only_the_layout_options_it_was_given():
    seen: list[list[str]] = []

    @click.command()
    @layout_options
    def probe(**kw):
        seen.append(given_layout_fields(click.get_current_context()))

    runner = CliRunner()
    assert runner.invoke(probe, [], env={"ZKV_KV_HEADS": None}).exit_code == 0
    assert runner.invoke(probe, ["--head-dim", "64", "--cpu-blocks", "9"]).exit_code == 0
    assert runner.invoke(probe, [], env={"ZKV_KV_HEADS": "2"}).exit_code == 0
    assert seen == [[], ["head_dim"], ["kv_heads"]], "defaults are derived, --cpu-blocks only sizes the tier"


def test_zkv_worker_attach_with_mismatched_options_exits_naming_both(tmp_path, manifest):
    path, _ = manifest
    ep = tmp_path / "s"
    out = subprocess.run(
        [sys.executable, "-m", "zkv", "worker", "--rank", "0", "--world-size", "1"]
        + ["--backend", f"ipc://{ep}-b", "--control", f"ipc://{ep}-c", "--attach", path, "--head-dim", "64"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
    )
    assert out.returncode != 0
    assert "rank 0 cannot attach" in out.stderr and "bad_layout" in out.stderr, out.stderr
    assert "has 512 bytes per block, the layout says 256 bytes per block" in out.stderr, out.stderr


def _zkv(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    return subprocess.run(
        [sys.executable, "-m", "zkv", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_an_attached_worker_refused_for_another_layout_names_the_resume_that_brings_the_bus_to_it(tmp_path, manifest):
    path, _ = manifest
    with BrokerThread(tmp_path) as b, Client(b.endpoints.frontend) as c:
        # The bus served another engine before: its layout is that engine's (PAGE-byte blocks).
        agent = RankAgent(0, 1, b.endpoints.backend, b.endpoints.control, flat_entries(), 4)
        agent.start(timeout=30)
        agent.stop(timeout=10)
        ep = b.endpoints
        worker = ["worker", "--rank", "0", "--world-size", "1", "--backend", ep.backend, "--control", ep.control]
        worker += ["--attach", path, "--cpu-blocks", "8", "--tier-dir", "none"]
        refused = _zkv(*worker)
        assert refused.returncode == 1, refused.stderr
        assert f"blocks of {ENGINE.block_bytes} bytes; the bus's: {PAGE}" in refused.stderr, refused.stderr
        assert "the fields below are zkv's way to write it, not the model's" in refused.stderr
        command = next(x for x in refused.stderr.splitlines() if x.strip().startswith("zkv pause; zkv clear; "))
        flags = command.split("zkv resume ", 1)[1].split()
        adopting = _zkv(*worker, "--adopt-layout")
        assert adopting.returncode == 2 and "cannot apply with --attach" in adopting.stderr, adopting.stderr

        front = ["--broker", ep.frontend, "--timeout", "10"]
        cli("pause", *front)  # the rank is not registered: a partial pause, still a pause
        assert cli("clear", *front).returncode == 0
        resumed = cli("resume", *flags, *front)
        assert resumed.returncode == 0, resumed.stderr
        proc = subprocess.Popen(
            [sys.executable, "-m", "zkv", *worker],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))},
        )
        try:
            shown = c.status(timeout=60, wait_ranks=1).layout
            assert (shown.gpu_blocks, shown.block_bytes) == (ENGINE.gpu_blocks, ENGINE.block_bytes)
            assert c.run("swap_out", [15], [7], timeout=30).bytes == ENGINE.block_bytes, "the engine's rank serves"
        finally:
            proc.terminate()
            proc.wait(timeout=30)
