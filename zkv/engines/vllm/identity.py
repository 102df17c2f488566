"""The identity of a vLLM engine's KV (``zkv.rows.identity.EngineIdentity``:
model, KV layout, weights), read from its ``VllmConfig`` (and its
``KVCacheConfig``: each KV cache group's spec) duck-typed: no vLLM import
(docs/engine-vllm.md, "Warm restart")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...rows.identity import EngineIdentity, checkpoint_version, short_digest
from .groups import describe

__all__ = ["EngineIdentity", "checkpoint_version", "identity_of"]


def identity_of(
    vllm_config: Any, kv_cache_config: Any = None, group_ids: Sequence[int] | None = None
) -> EngineIdentity:
    """The identity of the engine ``vllm_config`` describes (vLLM's ``VllmConfig``); with its
    ``kv_cache_config``, the layout names the spec of every KV cache group vLLM offloads
    (``group_ids``, default all): another window, state shape or grouping is another identity."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else dict(vars(mc.hf_config))
    commit = hf.pop("_commit_hash", None)
    kv_dtype = str(mc.dtype) if cc.cache_dtype == "auto" else str(cc.cache_dtype)
    layout: dict[str, Any] = {
        "block_size": int(cc.block_size),
        "layers": int(mc.get_num_layers(pc)),
        "kv_heads": int(mc.get_num_kv_heads(pc)),
        "head_dim": int(mc.get_head_size()),
        "kv_dtype": kv_dtype,
        "tp": int(pc.tensor_parallel_size),
    }
    if kv_cache_config is not None:
        ids = range(len(kv_cache_config.kv_cache_groups)) if group_ids is None else group_ids
        layout["groups"] = describe(kv_cache_config, list(ids))
    config = short_digest({"hf": hf, "dtype": str(mc.dtype), "quantization": getattr(mc, "quantization", None)})
    return EngineIdentity(
        model=str(mc.model),
        revision=str(mc.revision or commit or ""),
        config=config,
        layout=layout,
        weights=checkpoint_version(str(mc.model), mc.revision, commit),
    )
