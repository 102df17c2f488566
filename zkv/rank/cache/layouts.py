"""Adapters: each common engine's KV tensors as ``TensorEntry`` lists.

Pass the result to ``EngineCache.from_tensors``.  Each adapter checks the
shape it expects and names regions after the engine's own tensors, so an
error says which tensor is wrong.  Shapes (logical, per rank):

- zkv's own cache: per layer K and V ``[blocks, kv_heads, block_size, head_dim]``
  (zkv/kvcache.py: slices of one ``[2*layers, blocks, ...]`` store);
- FastDeploy: the same per-layer shape, named ``key_caches_{i}`` /
  ``value_caches_{i}``, plus optional fp8 scales ``[blocks, kv_heads, block_size]``;
- vLLM FlashAttention: per layer ``(2, blocks, block_size, kv_heads, head_dim)``,
  two regions (K and V halves, each block-major);
- vLLM FlashInfer: per layer ``(blocks, 2, block_size, kv_heads, head_dim)``, one region;
- transformers continuous batching: one flat uint8 tensor, block-major
  ``(blocks, layers, 2, block_size, kv_heads, head_dim)`` in its dtype, one region;
- SGLang MHA token pools: per layer K and V ``[slots, kv_heads, head_dim]``,
  a block is ``page_size`` consecutive slots.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .errors import CacheError
from .regions import TensorEntry


def _expect(name: str, t: torch.Tensor, dims: int, what: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise CacheError("bad_layout", f"tensor {name!r} has shape {shape}, expected {what}")


def per_layer(tensors: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """Any named tensors whose dim 0 is the block dimension (FastDeploy, zkv, MLA ``[blocks, bs, d]``)."""
    return [TensorEntry(name, t) for name, t in tensors.items()]


def zkv_native(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> list[TensorEntry]:
    """zkv's own per-layer K/V ``[blocks, kv_heads, block_size, head_dim]`` (zkv/kvcache.py)."""
    entries = []
    for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
        for name, t in ((f"layer{i}.k", k), (f"layer{i}.v", v)):
            _expect(name, t, 4, "[blocks, kv_heads, block_size, head_dim]")
            entries.append(TensorEntry(name, t))
    return entries


def fastdeploy(key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor] | None = None,
               key_scales: Sequence[torch.Tensor] | None = None,
               value_scales: Sequence[torch.Tensor] | None = None) -> list[TensorEntry]:
    """FastDeploy's ``key_caches_{i}`` / ``value_caches_{i}`` ``[blocks, kv_heads, block_size, head_dim]``.

    ``value_caches`` is None for MLA; the block_wise_fp8 scales
    ``[blocks, kv_heads, block_size]`` become regions of their own."""
    entries = []
    groups = [("key_caches", key_caches, 4), ("value_caches", value_caches, 4),
              ("key_cache_scales", key_scales, 3), ("value_cache_scales", value_scales, 3)]
    for prefix, tensors, dims in groups:
        for i, t in enumerate(tensors or ()):
            name = f"{prefix}_{i}"
            _expect(name, t, dims, "[blocks, kv_heads, block_size, head_dim]" if dims == 4 else "[blocks, kv_heads, block_size]")
            entries.append(TensorEntry(name, t))
    return entries


def vllm_flash_attn(kv_caches: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """vLLM FlashAttention: per layer ``(2, blocks, block_size, kv_heads, head_dim)`` -> ``layer.k``, ``layer.v``."""
    entries = []
    for layer, t in kv_caches.items():
        _expect(layer, t, 5, "(2, blocks, block_size, kv_heads, head_dim)")
        if t.shape[0] != 2:
            raise CacheError("bad_layout", f"tensor {layer!r} has shape {tuple(t.shape)}: dim 0 must be 2 (K, V)")
        entries += [TensorEntry(f"{layer}.k", t[0]), TensorEntry(f"{layer}.v", t[1])]
    return entries


def flashinfer(kv_caches: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """vLLM FlashInfer: per layer ``(blocks, 2, block_size, kv_heads, head_dim)``, one page holds K and V."""
    for layer, t in kv_caches.items():
        _expect(layer, t, 5, "(blocks, 2, block_size, kv_heads, head_dim)")
        if t.shape[1] != 2:
            raise CacheError("bad_layout", f"tensor {layer!r} has shape {tuple(t.shape)}: dim 1 must be 2 (K, V)")
    return [TensorEntry(layer, t) for layer, t in kv_caches.items()]


def transformers_cb(cache_tensor: torch.Tensor, layers: int, block_size: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> list[TensorEntry]:
    """transformers' continuous-batching flat uint8 cache, block-major over every layer."""
    if not isinstance(cache_tensor, torch.Tensor) or cache_tensor.dtype != torch.uint8 or cache_tensor.dim() != 1:
        raise CacheError("bad_layout", "tensor 'cache_tensor' must be one flat uint8 tensor")
    page = layers * 2 * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    if cache_tensor.numel() % page or not cache_tensor.is_contiguous():
        raise CacheError("bad_layout", f"tensor 'cache_tensor' of {cache_tensor.numel()} bytes is not a contiguous "
                         f"whole number of {page}-byte blocks")
    return [TensorEntry("cache_tensor", cache_tensor.view(-1, page))]


def sglang_mha(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int) -> list[TensorEntry]:
    """SGLang MHATokenToKVPool: per layer ``[slots, kv_heads, head_dim]``; block = ``page_size`` slots."""
    entries = []
    for prefix, tensors in (("k_buffer", k_buffers), ("v_buffer", v_buffers)):
        for i, t in enumerate(tensors):
            name = f"{prefix}[{i}]"
            _expect(name, t, 3, "[slots, kv_heads, head_dim]")
            entries.append(TensorEntry(name, t, units_per_block=page_size))
    return entries
