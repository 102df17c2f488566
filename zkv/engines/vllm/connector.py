"""zkv as vLLM's KV offload backend, turned on with one ``--kv-transfer-config``
(docs/engine-vllm.md)::

    {"kv_connector": "ZkvConnector",
     "kv_connector_module_path": "zkv.engines.vllm.connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"bus_dir": "/run/zkv/engine-0", "cpu_blocks": 4096,
                                   "disk_dir": "/var/cache/zkv", "disk_blocks": 65536}}

``ZkvConnector`` is vLLM's ``OffloadingConnector`` (its scheduler decides
what to store and load), built by vLLM's own constructor on ``ZkvSpec`` (the
spec factory finds it by name), with one thing the stock connector needs
help with: a job that failed is a recompute, never an assert that takes the
engine down.  vLLM 0.34 carries a failed job itself (a failed store is never
indexed); a failed load's keys, and on 0.32 every failure, travel to the
scheduler side in the worker metadata (``api.FAILED_STORES_NATIVE`` says
which), so that the manager never offers a failed load again; on 0.32 a
failed load's GPU blocks go back to vLLM through
``get_block_ids_with_load_errors``.  The connector leaves the user's
``kv_transfer_config`` alone: its own keys go to vLLM's constructor in a copy;
the one field vLLM's scheduler reads itself after building the connector,
``kv_load_failure_policy``, must be ``"recompute"`` (the documented config
says so; a config that does not is set so, and the engine's log says it).

Sleep (vLLM 0.34 tells connectors): before vLLM unmaps the KV memory, the
worker of rank 0 pauses the engine's bus (acked once no copy is in flight,
and nothing is dispatched while paused), and resumes it once the memory is
back: no copy ever touches KV memory that is not there.

The engine's bus: with ``broker: embedded`` (the default) the scheduler
process runs a zkv broker on a thread, on ipc sockets in ``bus_dir``; every
worker process hosts one rank on its own KV tensors (``worker.py``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgspec
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.outputs import KVConnectorOutput

from ...broker.core import BrokerConfig
from ...broker.loop import Broker
from . import api
from .groups import block_recompute_exact, check_rows, describe
from .identity import EngineIdentity, identity_of
from .manager import ZkvOffloadManager
from .settings import METRICS_URL_FILE, ZkvSettings
from .worker import ZkvOffloadWorker

log = logging.getLogger("zkv.vllm")

SPEC_NAME = "ZkvSpec"
SPEC_MODULE = __name__
IDENTITY_KEY = "zkv_identity"  # the scheduler's EngineIdentity, handed to ZkvSpec in the extra config
GROUPS_KEY = "zkv_groups"  # the KV cache groups vLLM offloads (groups.describe), handed to ZkvSpec


class EmbeddedBroker:
    """The engine's bus broker on a thread of the scheduler process."""

    def __init__(self, settings: ZkvSettings, world: int, engine_id: str):
        state = settings.make_bus_dir() / f"state-{engine_id[:12]}.json"  # a new engine starts running
        self.recorder = None
        if settings.trace_path is not None:
            from ...trace import TraceRecorder

            self.recorder = TraceRecorder(settings.trace_path, world=world)
        self.broker = Broker(settings.endpoints, BrokerConfig(world=world), state_file=state, recorder=self.recorder)
        self.metrics = None
        self.registry: Any = None  # the /metrics registry, where the manager adds its own counts
        self.url_file: Path | None = None
        if settings.metrics_port is not None:
            from ...obs.prometheus import make_registry, start_metrics_server

            self.registry = make_registry(self.broker.core)
            self.metrics = start_metrics_server(settings.metrics_port, self.registry, "127.0.0.1")
            # Where a port of 0 landed, for whoever has the bus's directory (its log says so too).
            self.url_file = settings.make_bus_dir() / METRICS_URL_FILE
            self.url_file.write_text(self.metrics.url + "\n")
            log.warning("zkv: bus %s metrics at %s", settings.bus_dir, self.metrics.url)
        self.thread = threading.Thread(target=self.broker.serve, name="zkv-vllm-broker", daemon=True)
        self.thread.start()
        log.warning("zkv: bus of this engine at ipc://%s/frontend.sock", settings.bus_dir)

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            if self.url_file is not None:
                self.url_file.unlink(missing_ok=True)
        self.broker.stop()
        self.thread.join(timeout=10)
        if self.recorder is not None:
            self.recorder.close()


class ZkvSpec(OffloadingSpec):
    """vLLM's offloading spec for zkv: the manager in the scheduler, a rank in each worker."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        if self.blocks_per_chunk != 1:
            raise ValueError("zkv offloads one vLLM block per CPU row: leave blocks_per_chunk / block_size unset")
        par = config.parallel
        if par.world_size != par.tp_size:
            raise ValueError(
                f"zkv serves tensor-parallel engines (world {par.world_size}, tp {par.tp_size}): "
                "pipeline / context parallel are not supported (docs/engine-vllm.md, Limits)"
            )
        self.settings = ZkvSettings.from_extra(self.extra_config, config.engine_id)
        self.world = par.world_size
        self.rank = par.rank
        said = self.extra_config.get(IDENTITY_KEY)  # ZkvConnector's scheduler side: whose KV the tiers hold
        self.identity = msgspec.convert(said, EngineIdentity) if said is not None else None
        if self.identity is not None and self.settings.weights_version is not None:
            self.identity = self.identity.with_weights(self.settings.weights_version)
        self.groups: list[dict[str, Any]] | None = self.extra_config.get(GROUPS_KEY)
        self.manager: ZkvOffloadManager | None = None
        self.worker: ZkvOffloadWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self.manager is None:
            broker = None
            if self.settings.broker == "embedded":
                broker = EmbeddedBroker(self.settings, self.world, self.config.engine_id)
            self.manager = ZkvOffloadManager(
                self.settings,
                self.world,
                identity=self.identity,
                groups=self.groups,
                emit_events=self.kv_events_config.enable_kv_cache_events,
                broker=broker,
            )
        return self.manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.worker is None:
            # A row is a block's page of every canonical tensor: refused at start where
            # copying it would touch another block (docs/engine-vllm.md, "Models with several
            # KV cache groups").
            check_rows(kv_caches.tensors, kv_caches.group_data_refs)
            self.worker = ZkvOffloadWorker(self.settings, self.rank, self.world, kv_caches, self.groups)
        return self.worker


@dataclass
class ZkvWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's completed-jobs metadata plus the jobs whose zkv task failed that vLLM does not
    carry itself: job id -> (is_store, its CPU rows) (any worker's failure fails the job)."""

    zkv_failed: dict[int, tuple[bool, list[int]]] = field(default_factory=dict)

    @classmethod
    def of(cls, meta: OffloadingWorkerMetadata | None, failed: dict[int, tuple[bool, list[int]]]) -> ZkvWorkerMetadata:
        base = meta if meta is not None else OffloadingWorkerMetadata()
        theirs = {f.name: getattr(base, f.name) for f in fields(OffloadingWorkerMetadata)}
        return cls(**theirs, zkv_failed=dict(failed))

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        failed = dict(self.zkv_failed)
        failed.update(getattr(other, "zkv_failed", {}))
        return ZkvWorkerMetadata.of(merged, failed)


class ZkvConnector(OffloadingConnector):
    """``OffloadingConnector`` on ``ZkvSpec``, with failures that become recomputes."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra = dict(transfer.kv_connector_extra_config or {})
        extra.update(spec_name=SPEC_NAME, spec_module_path=SPEC_MODULE)
        # vLLM 0.34's sync (expedited) loads cannot fail without failing the step: zkv serves
        # none, so a hit it cannot serve in time is never promised.
        extra["sync_load_budget_bytes"] = 0
        group_ids = api.offloaded_group_ids(kv_cache_config)
        extra[GROUPS_KEY] = describe(kv_cache_config, group_ids)
        if role == KVConnectorRole.SCHEDULER:
            extra[IDENTITY_KEY] = msgspec.to_builtins(identity_of(vllm_config, kv_cache_config, group_ids))
        if transfer.kv_load_failure_policy != "recompute":
            # vLLM's scheduler reads this right after building its connector: a failed load is a
            # recompute, never a failed request.
            transfer.kv_load_failure_policy = "recompute"
            log.warning('zkv: kv_load_failure_policy set to "recompute" (put it in --kv-transfer-config)')
        super().__init__(api.with_extra(vllm_config, extra), role, kv_cache_config)
        self._failed: dict[int, tuple[bool, list[int]]] = {}  # this worker's failed jobs, not yet sent
        self._load_errors: set[int] = set()  # GPU blocks of failed loads, for vLLM to recompute (0.32)
        self._failed_requests: set[str] = set()  # requests of failed loads, recomputed whole (0.32)
        # 0.32: block ids of a failed load make vLLM recompute from the first of them, exact
        # for one full-attention group only; otherwise the whole request is recomputed.
        self._block_recompute = block_recompute_exact(extra[GROUPS_KEY])

    @property
    def manager(self) -> ZkvOffloadManager | None:
        part = self.connector_scheduler
        return part.manager if part is not None and isinstance(part.manager, ZkvOffloadManager) else None

    def _offload_worker(self) -> ZkvOffloadWorker | None:
        part = self.connector_worker
        worker = api.offloading_worker(part) if part is not None else None
        return worker if isinstance(worker, ZkvOffloadWorker) else None

    # --- failures: worker side ---------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        worker = self._offload_worker()
        loads = getattr(connector_metadata, "load_jobs", None)
        if worker is not None and loads and not api.NATIVE_FAILURES:
            worker.requests_of_loads({job_id: job.req_id for job_id, job in loads.items()})

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done = super().get_finished(finished_req_ids)  # vLLM 0.34 hears a failure here; 0.32 a job done
        worker = self._offload_worker()
        if worker is not None:
            failed, blocks = worker.take_failures()
            self._failed.update(
                {job: said for job, said in failed.items() if not (said[0] and api.FAILED_STORES_NATIVE)}
            )
            requests = worker.take_failed_requests()
            if self._block_recompute:
                self._load_errors |= blocks
            else:
                self._failed_requests |= requests
        return done

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's results, with (0.32, a model whose failed load cannot be recomputed from its
        first failed block) the requests of failed loads as failed receives: vLLM recomputes
        them from their first token.  0.34 says so itself."""
        results = super().get_transfer_results(finished_req_ids)
        if self._failed_requests:
            failed, self._failed_requests = self._failed_requests, set()
            results.failed_recving |= failed & results.finished_recving
            self._failed_requests = failed - results.finished_recving  # reported with their finish
        return results

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = super().build_connector_worker_meta()
        if not self._failed:
            return meta
        failed, self._failed = self._failed, {}
        return ZkvWorkerMetadata.of(meta, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- failures: scheduler side ------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        manager = self.manager
        if isinstance(meta, ZkvWorkerMetadata) and meta.zkv_failed and manager is not None:
            # vLLM completes the jobs in the call below: hand the failures over first.
            for is_store, rows in meta.zkv_failed.values():
                manager.rows_failed(rows, is_store)
        super().update_connector_output(connector_output)

    # --- sleep and wake (vLLM 0.34 calls these; 0.32 never does) ---------------------------

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: object) -> Any:
        """zkv's rank copies on the worker's own tensors, in the worker's process."""
        return api.KVCacheAccess.IN_PROCESS

    def unregister_kv_caches(self) -> None:
        worker = self._offload_worker()
        if worker is not None:
            worker.kv_memory_gone()

    def restore_kv_caches(self) -> None:
        worker = self._offload_worker()
        if worker is not None:
            worker.kv_memory_back()
