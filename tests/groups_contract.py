"""zkv's connector on the KV cache configs of real engines with several KV cache
groups (``groups_fixture``: Gemma 3, gpt-oss, Mistral-SWA, Qwen3-Next, a
dense DeepSeek-V2 with MLA), through the installed vLLM's own offloading
connector classes, without an engine: its constructor builds ``ZkvSpec``, its
scheduler side asks zkv's manager for every group, its worker side resolves
the jobs (device pointers on 0.34, block ids on 0.32) for zkv's worker, whose
rank copies through a real zkv bus.  Run under vLLM 0.34
(tests/vllm034/test_groups_contract.py) and 0.32
(tests/vllm_engine/test_groups_connector.py): the same tests, each
interface's own path (``zkv.engines.vllm.api``)."""

from __future__ import annotations

import copy
import logging
import time

import groups_fixture as gf
import pytest
import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata, TransferJob
from vllm.sampling_params import SamplingParams
from vllm.v1.kv_offload.base import GPULoadStoreSpec, ReqContext, make_offload_key
from vllm.v1.request import Request

from zkv.client.client import Client
from zkv.engines.vllm import api
from zkv.engines.vllm.connector import ZkvConnector
from zkv.engines.vllm.rows import ZkvRows
from zkv.net.endpoints import Endpoints

CPU_ROWS = 16


class Rig:
    """Both sides of a ``ZkvConnector`` on one captured config, and the bus between them."""

    def __init__(self, tmp_path, data: dict):
        model = gf.tiny_llama(tmp_path / "tiny")
        self.data = data
        self.block = gf.block_size(data)
        extra = {"bus_dir": str(tmp_path / "bus"), "cpu_blocks": CPU_ROWS, "tier_dir": None, "status_interval_s": 0.0}
        config = VllmConfig(
            model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024),
            cache_config=CacheConfig(block_size=self.block, enable_prefix_caching=True),
            device_config=DeviceConfig(device="cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="ZkvConnector",
                kv_connector_module_path="zkv.engines.vllm.connector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            ),
        )
        self.kv_config = gf.kv_cache_config(data)
        self.scheduler = ZkvConnector(config, KVConnectorRole.SCHEDULER, self.kv_config)
        self.worker = ZkvConnector(config, KVConnectorRole.WORKER, copy.deepcopy(self.kv_config))
        self.frontend = Endpoints.in_dir(str(tmp_path / "bus")).frontend

    def start_worker(self, caches) -> None:
        self.caches = caches
        self.worker.connector_worker._init_worker(caches)
        with Client(self.frontend, request_timeout=30) as c:
            c.status(timeout=30, wait_ranks=1)

    @property
    def manager(self):
        manager = self.scheduler.manager
        assert manager is not None
        manager.bus.refresh(time.monotonic(), force=True)
        return manager

    def close(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def rig_of(tmp_path):
    made: list[Rig] = []

    def make(family: str, data: dict | None = None, caches=True) -> Rig:
        rig = Rig(tmp_path / family, data or gf.load(family))
        made.append(rig)
        if caches:
            rig.start_worker(gf.canonical(rig.data)[0])
        return rig

    yield make
    for rig in made:
        rig.close()


def _step(worker, meta: OffloadingConnectorMetadata, wait=frozenset()):
    """One engine step of the worker side, as vLLM's model runner drives it."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    if wait:
        worker.connector_worker.worker.wait(set(wait))  # bounded by each task's deadline
    results = worker.get_transfer_results(set())
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return results, errors


def run_jobs(worker, load_jobs=None, store_jobs=None):
    """The jobs handed over in one step (stores go out the step after), waited for:
    (finished receives, failed receives, block ids of load errors) over both steps."""
    first, e1 = _step(worker, OffloadingConnectorMetadata(load_jobs or {}, store_jobs or {}))
    jobs = set(load_jobs or {}) | set(store_jobs or {})
    second, e2 = _step(worker, OffloadingConnectorMetadata({}, {}), jobs)
    return first.finished_recving | second.finished_recving, first.failed_recving | second.failed_recving, e1 | e2


def gpu_spec(groups: list[list[int]]) -> GPULoadStoreSpec:
    """A job's GPU side: each group's block ids, group by group."""
    ids = [b for g in groups for b in g]
    return GPULoadStoreSpec(ids, group_sizes=[len(g) for g in groups], block_indices=[0] * len(groups))


def _spec_names(data: dict) -> list[str]:
    return [g["spec"] for g in data["kv_cache_groups"]]


@pytest.mark.parametrize("family", gf.FAMILIES)
def test_every_group_of_a_real_engine_is_served_and_named_in_the_identity(rig_of, family):
    rig = rig_of(family)
    manager = rig.manager
    assert not manager.refused, manager.refused
    assert [g["spec"] for g in manager.groups] == _spec_names(rig.data)
    said = manager.identity.layout["groups"]
    assert [g["spec"] for g in said] == _spec_names(rig.data)
    for g, captured in zip(said, rig.data["kv_cache_groups"]):
        assert g["fields"]["block_size"] == captured["fields"]["block_size"]
        if g["spec"] == "SlidingWindowSpec":
            assert g["fields"]["sliding_window"] == 64
        if g["spec"] == "MambaSpec":
            assert g["fields"]["mamba_cache_mode"] == "align"
            assert g["fields"]["shapes"] == captured["fields"]["shapes"]
    assert manager._serving(), "the bus serves this engine"


def test_another_window_or_state_shape_is_another_identity(rig_of):
    from zkv.engines.vllm.identity import identity_of

    rig = rig_of("gemma3", caches=False)
    config = rig.scheduler._vllm_config
    first = identity_of(config, rig.kv_config)
    assert first == rig.manager.identity
    wide = gf.load("gemma3")
    wide["kv_cache_groups"][0]["fields"]["sliding_window"] = 128
    assert first.differs(identity_of(config, gf.kv_cache_config(wide))) == ["layout"]
    qwen = gf.load("qwen3-next")
    bigger = copy.deepcopy(qwen)
    bigger["kv_cache_groups"][0]["fields"]["shapes"][1] = [2, 64, 128]
    before = identity_of(config, gf.kv_cache_config(qwen))
    assert before.differs(identity_of(config, gf.kv_cache_config(bigger))) == ["layout"]
    assert before.digest() != identity_of(config, gf.kv_cache_config(bigger)).digest()


@pytest.mark.parametrize("family", ["gemma3", "qwen3-next"])
def test_a_job_moves_every_groups_blocks_whole_and_only_them(rig_of, family):
    rig = rig_of(family)
    gpu = [t.tensor for t in rig.caches.tensors]
    before = [t.clone() for t in gpu]
    groups = len(rig.data["kv_cache_groups"])
    stored = [[3 + 2 * g, 4 + 2 * g] for g in range(groups)]  # two blocks of each group
    rows = list(range(2 * groups))
    run_jobs(rig.worker, store_jobs={1: TransferJob("req-A", gpu_spec(stored), ZkvRows(rows))})
    into = [[40 + 2 * g, 41 + 2 * g] for g in range(groups)]
    done, failed, _ = run_jobs(rig.worker, load_jobs={2: TransferJob("req-B", ZkvRows(rows), gpu_spec(into))})
    assert done == {"req-B"} and not failed
    src = [b for g in stored for b in g]
    dst = [b for g in into for b in g]
    for t, old in zip(gpu, before):
        for s, d in zip(src, dst):
            assert torch.equal(t[d], old[s]), f"block {d} is not block {s}'s row"
        untouched = [b for b in range(t.shape[0]) if b not in dst]
        assert torch.equal(t[untouched], old[untouched]), "a block no job named was written"


def _request(rig: Rig, tokens: int) -> Request:
    hashes = [bytes([i % 256, i // 256]) * 16 for i in range(tokens // rig.block)]
    return Request(
        "req-hit",
        list(range(1, tokens + 1)),
        SamplingParams(max_tokens=4),
        None,
        block_hasher=lambda req: hashes[len(req.block_hashes) :],
    )


def _store(manager, keys: list[bytes]) -> None:
    ctx = ReqContext("stored")
    planned = manager.prepare_store(keys, ctx)
    assert planned is not None and len(planned.keys_to_store) == len(keys)
    manager.complete_store(keys, ctx)


def _matched(rig: Rig, request: Request) -> int:
    rig.scheduler.on_new_request(request)
    hit, _ = rig.scheduler.get_num_new_matched_tokens(request, 0)
    return hit or 0


def test_a_hit_needs_every_group_the_request_needs(rig_of):
    """Gemma 3 through vLLM's own scheduler: the full-attention group's whole prefix alone is
    no hit, the sliding window's last blocks must be there too, and nothing before them."""
    rig = rig_of("gemma3")
    manager = rig.manager
    request = _request(rig, 10 * rig.block + 1)  # 10 full blocks, the last token recomputed
    keys = {g: [make_offload_key(h, g) for h in request.block_hashes] for g in (0, 1)}
    _store(manager, keys[1])  # every full-attention block, no sliding-window block
    assert _matched(rig, request) == 0, "a hit without the sliding window's blocks"
    _store(manager, keys[0][7:10])  # the window before the hit (64 tokens: 2-3 blocks), and no earlier
    other = _request(rig, 10 * rig.block + 1)
    other.request_id = "req-hit-2"
    assert _matched(rig, other) == 10 * rig.block


def test_a_hit_of_a_hybrid_model_needs_the_state_at_its_boundary(rig_of):
    """Qwen3-Next through vLLM's own scheduler: attention blocks of the whole prefix and, of
    each linear-attention group, the one state at the boundary (``align``)."""
    rig = rig_of("qwen3-next")
    manager = rig.manager
    request = _request(rig, 6 * rig.block + 1)
    keys = {g: [make_offload_key(h, g) for h in request.block_hashes] for g in range(4)}
    _store(manager, keys[3])
    _store(manager, keys[0][5:] + keys[1][5:])  # two of the three states
    assert _matched(rig, request) == 0, "a hit without every layer's state"
    _store(manager, keys[2][5:])
    other = _request(rig, 6 * rig.block + 1)
    other.request_id = "req-hit-2"
    assert _matched(rig, other) == 6 * rig.block


def test_a_group_zkv_cannot_serve_exactly_is_refused_at_start_and_nothing_is_served(rig_of, caplog):
    caplog.set_level(logging.WARNING, logger="zkv.vllm")
    rig = rig_of("qwen3-next-none", data=gf.with_mamba_mode(gf.load("qwen3-next"), "none"))
    manager = rig.manager
    assert sorted(manager.refused) == [0, 1, 2], manager.refused
    assert "mamba_cache_mode 'none'" in manager.refused[0]
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "group 0 (MambaSpec, 1 layers) is refused" in said and "serves no request" in said
    key = make_offload_key(b"h" * 32, 3)
    assert manager.prepare_store([key], ReqContext("r")) is None, "a store of a refused engine"
    assert manager.counts["stores_refused"] == 1
    request = _request(rig, 4 * rig.block + 1)
    assert _matched(rig, request) == 0


def test_canonical_tensors_that_share_bytes_are_refused_at_start(rig_of):
    data = gf.load("gemma3")
    tensors = data["canonical"]["tensors"]
    tensors[1]["offset"] = tensors[0]["offset"] + tensors[0]["row_bytes"] // 2  # rows astride two blocks
    rig = rig_of("gemma3-overlap", data=data, caches=False)
    with pytest.raises(ValueError, match="share bytes"):
        rig.worker.connector_worker._init_worker(gf.canonical(data)[0])


def test_a_failed_load_of_a_two_group_model_is_recomputed_from_its_first_token(rig_of):
    """vLLM recomputes a failed load from the first failed block when it is told block ids,
    which is exact only for one full-attention group: the window before a sliding group's
    first loaded block was never loaded (and 0.32 refuses block ids for several groups).  So
    the request is reported failed, and vLLM recomputes it whole."""
    rig = rig_of("gemma3")
    # CPU rows 6 and 7 were never written: the rank reports them lost.
    done, failed, errors = run_jobs(
        rig.worker, load_jobs={4: TransferJob("req-C", ZkvRows([6, 7]), gpu_spec([[5], [9]]))}
    )
    assert failed == {"req-C"} and "req-C" in done
    assert errors == set(), "no block ids: vLLM would recompute from the window only"


def test_a_failed_load_of_one_full_attention_group_names_its_blocks_on_0_32(rig_of):
    rig = rig_of("deepseek-mla")
    done, failed, errors = run_jobs(rig.worker, load_jobs={4: TransferJob("req-D", ZkvRows([6]), gpu_spec([[9]]))})
    assert "req-D" in done
    if api.NATIVE_FAILURES:
        assert failed == {"req-D"} and errors == set(), "0.34 carries it itself"
    else:
        assert errors == {9} and not failed, "0.32: only the failed block is recomputed"
