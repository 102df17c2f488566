"""zkv as vLLM's KV offload backend, turned on with one ``--kv-transfer-config``
(docs/engine-vllm.md)::

    {"kv_connector": "ZkvConnector",
     "kv_connector_module_path": "zkv.engines.vllm.connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {"bus_dir": "/run/zkv/engine-0", "cpu_blocks": 4096,
                                   "disk_dir": "/var/cache/zkv", "disk_blocks": 65536}}

``ZkvConnector`` is vLLM's ``OffloadingConnector`` (its scheduler decides
what to store and load) with ``ZkvSpec`` as the offloading spec and one thing
the stock connector cannot do: a job that failed is not an assert that takes
the engine down.  Its worker side reports a failed load's GPU blocks through
``get_block_ids_with_load_errors`` (vLLM recomputes exactly those, under
``kv_load_failure_policy="recompute"``, which the connector sets), and hands
every failed job over to the scheduler side in the worker metadata, so that
the manager never indexes a failed store nor offers a failed load again.

The engine's bus: with ``broker: embedded`` (the default) the scheduler
process runs a zkv broker on a thread, on ipc sockets in ``bus_dir``; every
worker process hosts one rank on its own KV tensors (``worker.py``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingManager, OffloadingSpec, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.outputs import KVConnectorOutput

from ...broker.core import BrokerConfig
from ...broker.loop import Broker
from .identity import EngineIdentity, identity_of
from .manager import ZkvOffloadManager
from .settings import ZkvSettings
from .worker import ZkvOffloadWorker

log = logging.getLogger("zkv.vllm")

SPEC_NAME = "ZkvSpec"
SPEC_MODULE = __name__


class EmbeddedBroker:
    """The engine's bus broker on a thread of the scheduler process."""

    def __init__(self, settings: ZkvSettings, world: int, engine_id: str):
        state = Path(settings.bus_dir) / f"state-{engine_id[:12]}.json"  # a new engine starts running
        self.recorder = None
        if settings.trace_path is not None:
            from ...trace import TraceRecorder

            self.recorder = TraceRecorder(settings.trace_path, world=world)
        self.broker = Broker(settings.endpoints, BrokerConfig(world=world), state_file=state, recorder=self.recorder)
        self.metrics = None
        if settings.metrics_port is not None:
            from ...obs.prometheus import make_registry, start_metrics_server

            self.metrics = start_metrics_server(settings.metrics_port, make_registry(self.broker.core), "127.0.0.1")
            log.warning("zkv: bus %s metrics at %s", settings.bus_dir, self.metrics.url)
        self.thread = threading.Thread(target=self.broker.serve, name="zkv-vllm-broker", daemon=True)
        self.thread.start()
        log.warning("zkv: bus of this engine at ipc://%s/frontend.sock", settings.bus_dir)

    def stop(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
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
        self.identity: EngineIdentity | None = None  # set by ZkvConnector: whose KV the tiers hold
        self.manager: ZkvOffloadManager | None = None
        self.worker: ZkvOffloadWorker | None = None
        self._broker: EmbeddedBroker | None = None

    def get_manager(self) -> OffloadingManager:
        if self.manager is None:
            if self.settings.broker == "embedded":
                self._broker = EmbeddedBroker(self.settings, self.world, self.config.engine_id)
            self.manager = ZkvOffloadManager(
                self.settings,
                self.world,
                identity=self.identity,
                emit_events=self.kv_events_config.enable_kv_cache_events,
            )
            self.manager.broker = self._broker  # stopped with the manager
        return self.manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self.worker is None:
            if len(kv_caches.group_data_refs) > 1:
                raise ValueError("zkv offloads one KV cache group (docs/engine-vllm.md, Limits)")
            self.worker = ZkvOffloadWorker(self.settings, self.rank, self.world, kv_caches)
        return self.worker


@dataclass
class ZkvWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's completed-jobs metadata plus the jobs whose zkv task failed:
    job id -> is_store (any worker's failure fails the job)."""

    failed_jobs: dict[int, bool] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)
        failed = dict(self.failed_jobs)
        failed.update(getattr(other, "failed_jobs", {}))
        return ZkvWorkerMetadata(merged.completed_jobs, merged.transfer_stats, failed)


class ZkvConnectorWorker(OffloadingConnectorWorker):
    """vLLM's worker side, with failed jobs reported instead of asserted."""

    def __init__(self, spec: OffloadingSpec, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig):
        super().__init__(spec, vllm_config, kv_cache_config)
        self._connector_worker_meta = ZkvWorkerMetadata()
        self.load_errors: set[int] = set()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done = super().get_finished(finished_req_ids)  # our worker reports success=True for every job
        worker = self.worker
        assert isinstance(worker, ZkvOffloadWorker)
        failed, blocks = worker.take_failures()
        meta = self._connector_worker_meta
        assert isinstance(meta, ZkvWorkerMetadata)
        meta.failed_jobs.update(failed)
        self.load_errors |= blocks
        return done

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        meta = self._connector_worker_meta
        if not meta.completed_jobs:
            return None
        self._connector_worker_meta = ZkvWorkerMetadata()
        return meta

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors


class ZkvConnector(OffloadingConnector):
    """``OffloadingConnector`` on ``ZkvSpec``, with failures that become recomputes."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra = dict(transfer.kv_connector_extra_config or {})
        extra.update(spec_name=SPEC_NAME, spec_module_path=SPEC_MODULE)
        transfer.kv_connector_extra_config = extra
        # A failed load is a recompute, never a failed request: read by vLLM's
        # scheduler right after it built its connector.
        transfer.kv_load_failure_policy = "recompute"
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        offloading_config = build_offloading_config(vllm_config, kv_cache_config)
        self._canonical_layout = offloading_config.canonical_layout
        self.spec = ZkvSpec(offloading_config)
        if role == KVConnectorRole.SCHEDULER:
            self.spec.identity = identity_of(vllm_config)
        self.connector_scheduler: OffloadingConnectorScheduler | None = None
        self.connector_worker: OffloadingConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = OffloadingConnectorScheduler(self.spec, vllm_config, kv_cache_config)
        elif role == KVConnectorRole.WORKER:
            self.connector_worker = ZkvConnectorWorker(self.spec, vllm_config, kv_cache_config)

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.connector_worker
        return worker.take_load_errors() if isinstance(worker, ZkvConnectorWorker) else set()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ZkvWorkerMetadata) and meta.failed_jobs:
            manager = self.spec.manager
            # vLLM 0.32 keeps a job's keys in its scheduler's job table until the
            # job completes, which the call below does: hand the failure over first.
            jobs = self.scheduler._jobs
            for job_id, is_store in meta.failed_jobs.items():
                status = jobs.get(job_id)
                if status is not None and manager is not None:
                    manager.job_failed(status.keys, is_store)
        super().update_connector_output(connector_output)
