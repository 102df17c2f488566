"""The floor of any KV offload backend on this machine, for ``zkv bench
vllm``: vLLM's own ``CPUOffloadingManager`` for the bookkeeping and a worker
that copies with torch in the worker's process, synchronously, between vLLM's
canonical block tensors and CPU tensors of its own.  No bus, no tiers, no
failure handling: what zkv's backend is measured beside (docs/benchmarks.md)."""

from __future__ import annotations

import time

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager


class TorchCopyWorker(OffloadingWorker):
    def __init__(self, kv_caches: CanonicalKVCaches, rows: int):
        self.gpu = [t.tensor for t in kv_caches.tensors]
        self.cpu = [torch.empty((rows, t.shape[1]), dtype=t.dtype) for t in self.gpu]
        self.done: list[TransferResult] = []

    def _copy(self, job_id: int, src: list[torch.Tensor], dst: list[torch.Tensor], s: list[int], d: list[int]) -> bool:
        t0 = time.perf_counter()
        si, di = torch.tensor(s), torch.tensor(d)
        nbytes = 0
        for a, b in zip(src, dst):
            b.index_copy_(0, di, a.index_select(0, si))
            nbytes += a.shape[1] * len(s)
        self.done.append(TransferResult(job_id, True, nbytes, time.perf_counter() - t0))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, CPULoadStoreSpec)
        return self._copy(job_id, self.gpu, self.cpu, src_spec.block_ids.tolist(), dst_spec.block_ids.tolist())

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, CPULoadStoreSpec)
        return self._copy(job_id, self.cpu, self.gpu, src_spec.block_ids.tolist(), dst_spec.block_ids.tolist())

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is over when its submit returns


class TorchCopySpec(OffloadingSpec):
    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.rows = int(self.extra_config["cpu_blocks"])
        self._manager: OffloadingManager | None = None
        self._worker: TorchCopyWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(num_chunks=self.rows)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = TorchCopyWorker(kv_caches, self.rows)
        return self._worker
