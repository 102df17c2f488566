"""zkv's connector against vLLM 0.34's own offload classes, without an engine
(no CUDA here): vLLM's ``OffloadingConnector`` constructor builds ``ZkvSpec``
through its spec factory, its connector worker resolves device pointers of
host tensors and calls zkv's worker, whose rank copies through a real zkv bus
(the broker the scheduler side embeds).  Bytes are checked block by block.

When vLLM moves an interface again, ``test_the_interfaces_zkv_relies_on``
fails first, naming it."""

from __future__ import annotations

import inspect
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.timeout(300)

from groups_fixture import tiny_llama  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadingWorker,
)

from zkv.client.client import Client  # noqa: E402
from zkv.engines.vllm import api  # noqa: E402
from zkv.engines.vllm.connector import ZkvConnector, ZkvWorkerMetadata  # noqa: E402
from zkv.engines.vllm.manager import ZkvOffloadManager  # noqa: E402
from zkv.engines.vllm.rows import ZkvRows  # noqa: E402
from zkv.engines.vllm.worker import ZkvOffloadWorker  # noqa: E402
from zkv.net.endpoints import Endpoints  # noqa: E402
from zkv.wire.vocab import BusState, Tier  # noqa: E402

BLOCK, BLOCKS = 16, 12
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def test_the_interfaces_zkv_relies_on_are_where_it_expects_them():
    def params(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)

    assert api.INTERFACE == "0.34" and api.NATIVE_FAILURES
    assert params(OffloadingWorker.submit_store)[:4] == ["self", "job_id", "device_ptrs", "dst_spec"], (
        "OffloadingWorker.submit_store moved"
    )
    assert params(OffloadingWorker.submit_load)[:5] == ["self", "job_id", "src_spec", "device_ptrs", "expedited"], (
        "OffloadingWorker.submit_load moved"
    )
    missing = OffloadingManager.__abstractmethods__ - set(vars(ZkvOffloadManager))
    assert not missing, f"OffloadingManager asks for {sorted(missing)}, which ZkvOffloadManager lacks"
    assert {"completed_jobs", "failed_jobs", "transfer_stats"} <= set(OffloadingWorkerMetadata.__dataclass_fields__), (
        "OffloadingWorkerMetadata's fields moved"
    )
    assert "success" in params(OffloadingWorkerMetadata.mark_completed), "the failure channel moved"
    for hook in ("unregister_kv_caches", "restore_kv_caches", "kv_cache_access", "get_block_ids_with_load_errors"):
        assert hasattr(KVConnectorBase_V1, hook), f"KVConnectorBase_V1.{hook} is gone"
    assert "transfer_result.success" in inspect.getsource(OffloadingConnectorWorker.get_finished)
    assert ZkvConnector.kv_cache_access(None) == api.KVCacheAccess.IN_PROCESS
    # The members of vLLM's own objects zkv reads (nothing private): the worker its jobs run on,
    # and the manager its scheduler side asks.
    assigns = r"self\.{}(: [^=]+)? = "
    assert re.search(assigns.format("worker"), inspect.getsource(OffloadingConnectorWorker)), (
        "the worker's worker moved"
    )
    assert re.search(assigns.format("manager"), inspect.getsource(OffloadingConnectorScheduler)), "the manager moved"
    assert "success=not job_status.failed" in inspect.getsource(OffloadingConnectorScheduler), (
        "a failed store no longer reaches complete_store(success=False)"
    )


@pytest.fixture
def rig(tmp_path):
    model = tiny_llama(tmp_path / "tiny", dtype="float16", max_positions=1024)
    extra = {"bus_dir": str(tmp_path / "bus"), "cpu_blocks": 8, "tier_dir": None, "status_interval_s": 0.0}
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float16", max_model_len=512),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ZkvConnector",
            kv_connector_module_path="zkv.engines.vllm.connector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        ),
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.float16)
    page = spec.page_size_bytes * 2  # both layers' pages of one block: vLLM's canonical row
    kv_config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=page * BLOCKS, layers=LAYERS, layer_stride=spec.page_size_bytes, block_stride=page)
        ],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )
    scheduler = ZkvConnector(config, KVConnectorRole.SCHEDULER, kv_config)  # embeds the bus's broker
    worker = ZkvConnector(config, KVConnectorRole.WORKER, kv_config)
    gpu = torch.randint(-128, 127, (BLOCKS, page), dtype=torch.int8)
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(gpu, page)], [[CanonicalKVCacheRef(0, page)]])
    worker.connector_worker._init_worker(caches)
    frontend = Endpoints.in_dir(str(tmp_path / "bus")).frontend
    with Client(frontend, request_timeout=30) as c:
        c.status(timeout=30, wait_ranks=1)
    try:
        yield scheduler, worker, gpu, frontend
    finally:
        worker.shutdown()
        scheduler.shutdown()


def _step(worker, meta: OffloadingConnectorMetadata, wait: set[int] = frozenset()):
    """One engine step of the worker side, as vLLM's model runner drives it."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    if wait:
        ours = worker.connector_worker.worker
        assert isinstance(ours, ZkvOffloadWorker)
        ours.wait(set(wait))  # bounded by each task's deadline
    results = worker.get_transfer_results(set())
    worker.clear_connector_metadata()
    return results


def _run(worker, load_jobs=None, store_jobs=None) -> tuple:
    """The jobs handed over in one step (vLLM sends stores out the step after), waited for,
    reported: (the transfer results of both steps, the worker metadata)."""
    first = _step(worker, OffloadingConnectorMetadata(load_jobs or {}, store_jobs or {}))
    second = _step(worker, OffloadingConnectorMetadata({}, {}), set(load_jobs or {}) | set(store_jobs or {}))
    for name in ("finished_recving", "failed_recving"):
        getattr(second, name).update(getattr(first, name))
    return second, worker.build_connector_worker_meta()


def gpu_spec(ids: list[int]) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0])


def test_a_store_then_a_load_move_each_blocks_bytes_through_the_bus(rig):
    _, worker, gpu, _ = rig
    before = gpu.clone()
    _, meta = _run(worker, store_jobs={1: TransferJob("req-A", gpu_spec([3, 7]), ZkvRows([0, 5]))})
    assert meta is not None and meta.completed_jobs == {1: 1} and not meta.failed_jobs
    results, meta = _run(worker, load_jobs={2: TransferJob("req-B", ZkvRows([5, 0]), gpu_spec([9, 10]))})
    assert results.finished_recving == {"req-B"} and not results.failed_recving
    assert torch.equal(gpu[9], before[7]) and torch.equal(gpu[10], before[3])
    assert torch.equal(gpu[:9], before[:9]), "no other block was written"


def test_the_users_transfer_config_is_left_as_it_was(tmp_path):
    extra = {"bus_dir": str(tmp_path / "bus"), "cpu_blocks": 8}
    transfer = KVTransferConfig(
        kv_connector="ZkvConnector",
        kv_connector_module_path="zkv.engines.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config=dict(extra),
        kv_load_failure_policy="recompute",
    )
    seen = api.with_extra(SimpleNamespace(kv_transfer_config=transfer, model_config=None), {**extra, "x": 1})
    assert seen.kv_transfer_config.kv_connector_extra_config == {**extra, "x": 1}
    assert transfer.kv_connector_extra_config == extra, "the user's map was rewritten"


def test_a_failed_store_goes_through_vllms_own_channel_alone(rig):
    _, worker, gpu, _ = rig
    # CPU row 99 is no row of a tier of 8: every rank refuses the store, vLLM drops its chunks.
    _, meta = _run(worker, store_jobs={5: TransferJob("req-D", gpu_spec([1]), ZkvRows([99]))})
    assert meta is not None and meta.failed_jobs == {5}
    assert not getattr(meta, "zkv_failed", {}), "a failed store is vLLM's to carry: one channel, not two"


def test_a_failed_load_goes_through_vllms_own_channel_with_its_rows(rig):
    _, worker, gpu, _ = rig
    # CPU row 6 was never written: the rank reports it lost, vLLM recomputes the request.
    results, meta = _run(worker, load_jobs={4: TransferJob("req-C", ZkvRows([6]), gpu_spec([2]))})
    assert results.failed_recving == {"req-C"}
    assert isinstance(meta, ZkvWorkerMetadata) and meta.failed_jobs == {4}
    assert meta.zkv_failed == {4: (False, [6])}, "the manager is told which rows failed"
    assert worker.get_block_ids_with_load_errors() == set(), "one failure channel, not two"


def test_vllms_sleep_pauses_the_bus_until_the_kv_memory_is_back(rig):
    _, worker, _, frontend = rig
    with Client(frontend, request_timeout=30) as c:
        worker.unregister_kv_caches()
        assert c.status(timeout=30).state == BusState.PAUSED, "no copy while the KV memory is away"
        worker.unregister_kv_caches()  # idempotent
        worker.restore_kv_caches()
        assert c.status(timeout=30).state == BusState.RUNNING
        c.pause(timeout=30)  # paused by someone else: sleep and wake leave it theirs
        worker.unregister_kv_caches()
        worker.restore_kv_caches()
        assert c.status(timeout=30).state == BusState.PAUSED
        c.resume(timeout=30)


def test_the_scheduler_side_is_zkvs_manager_with_vllms_sync_loads_off(rig):
    scheduler, _, _, _ = rig
    manager = scheduler.manager
    assert isinstance(manager, ZkvOffloadManager) and manager.identity is not None
    assert manager.identity.layout["block_size"] == BLOCK
    assert scheduler.connector_scheduler.config is not None
    extra = scheduler._vllm_config.kv_transfer_config.kv_connector_extra_config
    assert extra["sync_load_budget_bytes"] == 0
    manager.bus.refresh(time.monotonic(), force=True)  # the rank registered before the fixture returned
    assert manager._serving(), "the manager sees its bus serving"
    assert Path(manager.settings.bus_dir).is_dir()


def test_a_reset_holds_the_rows_vllms_jobs_still_touch_until_vllm_says_they_are_flushed(rig):
    from vllm.v1.kv_offload.base import ReqContext

    scheduler, _, _, _ = rig
    manager = scheduler.manager
    manager.bus.refresh(time.monotonic(), force=True)
    planned = manager.prepare_store([b"k0", b"k1"], ReqContext("r"))  # a store vLLM has in flight
    assert planned is not None and len(planned.keys_to_store) == 2
    manager.reset_cache()
    assert manager.index.book.held()[Tier.CPU] == 2, "the rows the store still writes are out of reach"
    manager.on_reset_flushed()
    assert manager.index.book.held()[Tier.CPU] == 0 and manager.index.used(Tier.CPU) == 0
    # Through vLLM's own connector: with no job of vLLM's in flight, it says flushed at once.
    manager.prepare_store([b"k2"], ReqContext("r"))
    assert scheduler.reset_cache()
    assert manager.index.book.held()[Tier.CPU] == 0 and manager.counts["resets"] == 2


def _stored(manager, keys: list[bytes]) -> None:
    """Keys vLLM stored through zkv's manager (the store job's bytes are not the point here)."""
    from vllm.v1.kv_offload.base import ReqContext

    manager.bus.refresh(time.monotonic(), force=True)
    assert manager.prepare_store(keys, ReqContext("r")) is not None
    manager.complete_store(keys, ReqContext("r"))


def _found(manager, key: bytes) -> bool:
    from vllm.v1.kv_offload.base import ReqContext

    manager.bus.refresh(time.monotonic(), force=True)
    return manager.lookup(key, ReqContext("r")) is not LookupResult.MISS


def test_a_sleep_that_keeps_the_connector_serves_no_row_of_weights_nobody_measured(rig):
    # vLLM's sleep(reset_connector=False) never calls reset_cache: zkv's tiers survive it, and
    # while the KV memory was away the weights may have been updated.
    scheduler, worker, _, frontend = rig
    manager = scheduler.manager
    _stored(manager, [b"a0", b"a1"])
    assert _found(manager, b"a0")
    before = manager.identity
    worker.unregister_kv_caches()
    worker.restore_kv_caches()
    with Client(frontend, request_timeout=30) as c:
        assert c.status(timeout=30).state == BusState.RUNNING
    assert not _found(manager, b"a0") and not _found(manager, b"a1"), "rows of unmeasured weights"
    assert manager.identity is not None and manager.identity.differs(before) == ["weights"], (
        "stored from now on: new weights"
    )


def test_a_sleep_inside_a_cycle_that_measured_the_weights_keeps_the_rows(rig):
    # A cycle (zkv.cycle / zkv cycle) pauses the bus first, measures the weights
    # before and after, and clears keeping the CPU tier only when they did not move.
    scheduler, worker, _, frontend = rig
    manager = scheduler.manager
    _stored(manager, [b"b0"])
    with Client(frontend, request_timeout=30) as c:
        c.pause(timeout=30)
        worker.unregister_kv_caches()
        c.clear(keep_cpu=True, timeout=30)
        worker.restore_kv_caches()
        assert c.status(timeout=30).state == BusState.CLEARED, "the cycle's pause stays the cycle's"
        c.resume(timeout=30)
    assert _found(manager, b"b0"), "a keep the weights' measure allowed is served"
