"""vLLM's KV caches as zkv regions.

What a KV connector's ``register_kv_caches(dict[layer, Tensor])`` receives,
per attention backend: FlashAttention ``(2, blocks, block_size, kv_heads,
head_dim)`` per layer (``flash_attn``: a K and a V region, each
block-major), FlashInfer ``(blocks, 2, block_size, kv_heads, head_dim)``
(``flashinfer``: one region, a page holds K and V).  HND physical orders are
the same to zkv (a page's inner order does not matter); MLA ``(blocks,
block_size, head_size)`` and the cross-layer tensor are block-major already:
``zkv.rank.cache.layouts.per_layer``.  Serve them with
``zkv.rank.agent.RankAgent(..., cache=flash_attn(kv_caches), ...)``
(docs/engines.md).
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..rank.cache.errors import CacheError
from ..rank.cache.layouts import expect_dims
from ..rank.cache.regions import TensorEntry


def flash_attn(kv_caches: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """FlashAttention: per layer ``(2, blocks, block_size, kv_heads, head_dim)`` -> ``layer.k``, ``layer.v``."""
    entries = []
    for layer, t in kv_caches.items():
        expect_dims(layer, t, 5, "(2, blocks, block_size, kv_heads, head_dim)")
        if t.shape[0] != 2:
            raise CacheError("bad_layout", f"tensor {layer!r} has shape {tuple(t.shape)}: dim 0 must be 2 (K, V)")
        entries += [TensorEntry(f"{layer}.k", t[0]), TensorEntry(f"{layer}.v", t[1])]
    return entries


def flashinfer(kv_caches: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """FlashInfer: per layer ``(blocks, 2, block_size, kv_heads, head_dim)``, one page holds K and V."""
    for layer, t in kv_caches.items():
        expect_dims(layer, t, 5, "(blocks, 2, block_size, kv_heads, head_dim)")
        if t.shape[1] != 2:
            raise CacheError("bad_layout", f"tensor {layer!r} has shape {tuple(t.shape)}: dim 1 must be 2 (K, V)")
    return [TensorEntry(layer, t) for layer, t in kv_caches.items()]
