"""Rows an engine keeps for itself (docs/engines.md, "Reserved rows"):
declared on the ``TensorEntry`` (transformers' adapter declares its scratch
rows), carried in the descriptor and the manifest, and refused by the rank:
a swap or a device-tier fill naming one fails naming the block, a checksum
may read it.  Real tensors, a real broker and a real ``RankAgent``."""

from __future__ import annotations

import gc
import threading

import msgpack
import pytest
import torch

from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.client.client import Client
from zkv.engines.transformers import layout as transformers_layout
from zkv.harness.bus.ipc_check import mapped
from zkv.net.endpoints import Endpoints
from zkv.rank.agent import RankAgent
from zkv.rank.copies.copier import CopyEngine
from zkv.rank.errors import CacheError
from zkv.rank.memory import layouts
from zkv.rank.memory.manifest import ShmArena, attach, export_manifest
from zkv.rank.memory.regions import EngineCache, TensorEntry
from zkv.rank.store import BlockStore
from zkv.rank.tiers.cpu_tier import CpuTier
from zkv.wire.protocol import TaskBody

NB = 8


def entries(reserved=(0, 1)) -> list[TensorEntry]:
    k = torch.zeros((NB, 2, 4, 8), dtype=torch.bfloat16)
    v = torch.zeros((NB, 2, 4, 8), dtype=torch.bfloat16)
    return [TensorEntry("k", k, reserved_blocks=reserved), TensorEntry("v", v)]


def test_reserved_ids_of_any_entry_are_the_caches_and_are_checked():
    k, v = torch.zeros(NB, 16), torch.zeros(NB, 16)
    cache = EngineCache.from_tensors([TensorEntry("k", k, reserved_blocks=(3, 0)), TensorEntry("v", v, 0, 1, (0, 1))])
    assert cache.descriptor.reserved == (0, 1, 3)
    for bad in ((NB,), (-1,), (True,)):
        with pytest.raises(CacheError, match="reserved block id") as err:
            EngineCache.from_tensors([TensorEntry("k", k, reserved_blocks=bad)])
        assert err.value.code == "bad_layout"


def test_the_transformers_adapter_declares_its_scratch_rows():
    flat = torch.zeros(NB * 2 * 2 * 4 * 2 * 8 * 2, dtype=torch.uint8)
    (entry,) = transformers_layout.regions(flat, 2, 4, 2, 8, torch.bfloat16, scratch_blocks=2)
    assert EngineCache.from_tensors([entry]).descriptor.reserved == (0, 1)
    with pytest.raises(CacheError, match="8 scratch rows leave no block"):
        transformers_layout.regions(flat, 2, 4, 2, 8, torch.bfloat16, scratch_blocks=NB)


REFUSED = [
    (TaskBody("swap_in", [0], [1]), "dst block id 1 is reserved by the engine"),
    (TaskBody("swap_in", [0, 1], [5, 0]), "dst block id 0 is reserved"),
    (TaskBody("swap_out", [2, 1], [0, 1]), "src block id 1 is reserved"),
    (TaskBody("fill", [], [0], "gpu"), "dst block id 0 is reserved"),
]


@pytest.mark.parametrize("body,reason", REFUSED, ids=[b.op + str(b.dst) for b, _ in REFUSED])
def test_a_store_refuses_swaps_and_fills_of_reserved_rows(body, reason):
    store = BlockStore.attached(EngineCache.from_tensors(entries()), cpu_rows=4)
    with pytest.raises(CacheError, match=reason) as err:
        store.validate(body)
    assert err.value.code == "bad_block_id" and "[0, 1]" in str(err.value)


def test_a_checksum_of_a_reserved_row_and_tier_rows_of_the_same_ids_are_allowed():
    store = BlockStore.attached(EngineCache.from_tensors(entries()), cpu_rows=4)
    for body in (TaskBody("checksum", [0, 1], [], "gpu"), TaskBody("fill", [], [0, 1], "cpu")):
        store.validate(body)
    store.validate(TaskBody("swap_in", [0, 1], [2, 7]))


def test_the_copy_engine_alone_refuses_reserved_rows_too():
    cache = EngineCache.from_tensors(entries())
    copier = CopyEngine(cache, CpuTier.for_cache(cache.descriptor, 4))
    with pytest.raises(CacheError, match="dst block id 1 is reserved"):
        copier.swap_in([0], [1])
    with pytest.raises(CacheError, match="src block id 0 is reserved"):
        copier.swap_out([0], [0])
    assert copier.swap_out([2], [0]) > 0


@pytest.fixture
def arena():
    a = ShmArena()
    yield a
    a.close()


def test_reserved_rows_travel_in_the_manifest_and_only_when_there_are_some(tmp_path, arena):
    k = arena.tensor("k", (NB, 2, 4, 8), torch.bfloat16)
    path = str(tmp_path / "m")
    plain = export_manifest(path, layouts.per_layer({"k": k}), generation=1, arena=arena)
    assert "reserved" not in plain["descriptor"], "a manifest without reserved rows is the same as before"
    m = export_manifest(path, [TensorEntry("k", k, reserved_blocks=(0, 1))], generation=2, arena=arena)
    assert m["descriptor"]["reserved"] == [0, 1]
    cache = attach(path)
    assert cache.descriptor.reserved == (0, 1)
    cache.release()


@pytest.mark.parametrize("reserved", [[1, 0], [0, 0], [NB], [-1], [True], "0-1", list(range(NB + 1))])
def test_bad_reserved_rows_in_a_manifest_are_refused_and_map_nothing(tmp_path, arena, reserved):
    k = arena.tensor("k", (NB, 2, 4, 8), torch.bfloat16)
    path = tmp_path / "m"
    m = export_manifest(str(path), [TensorEntry("k", k, reserved_blocks=(0,))], generation=1, arena=arena)
    m["descriptor"]["reserved"] = reserved
    path.write_bytes(msgpack.packb(m, use_bin_type=True))
    with pytest.raises(CacheError, match="reserved") as err:
        attach(str(path))
    assert err.value.code == "bad_manifest"
    gc.collect()
    assert mapped(arena.tag) == 1, "only the engine's own mapping"


def test_a_rank_on_the_bus_fails_tasks_naming_a_reserved_block_and_serves_on(tmp_path):
    ep = Endpoints.in_dir(tmp_path)
    broker = Broker(ep, BrokerConfig(world=1, heartbeat_ms=100))
    thread = threading.Thread(target=broker.serve, daemon=True)
    thread.start()
    agent = RankAgent(0, 1, ep.backend, ep.control, entries(), 4)
    try:
        agent.start(timeout=30)
        with Client(ep.frontend) as c:
            for op, src, dst, tier, block in (
                ("swap_in", [0], [1], None, 1),
                ("swap_out", [0], [0], None, 0),
                ("fill", None, [1], "gpu", 1),
            ):
                out = c.run(op, src, dst, timeout=30, tier=tier)
                assert out.outcome == "failed" and f"block id {block} is reserved by the engine" in out.reason, out
            assert c.run("checksum", [0, 1], tier="gpu", timeout=30).ok, "reading a reserved row is allowed"
            assert c.run("fill", None, [2], tier="gpu", seed=1, timeout=30).ok
            assert c.run("swap_out", [2], [0], timeout=30).ok and c.run("swap_in", [0], [7], timeout=30).ok
    finally:
        agent.stop(timeout=10)
        broker.stop()
        thread.join(timeout=10)
