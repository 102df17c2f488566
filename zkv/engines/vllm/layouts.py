"""vLLM's KV caches as zkv regions.

What a KV connector's ``register_kv_caches(dict[layer, Tensor])`` receives,
per attention backend: FlashAttention ``(2, blocks, block_size, kv_heads,
head_dim)`` per layer (``flash_attn``: a K and a V region, each
block-major), FlashInfer ``(blocks, 2, block_size, kv_heads, head_dim)``
(``flashinfer``: one region, a page holds K and V).  HND physical orders are
the same to zkv (a page's inner order does not matter); MLA ``(blocks,
block_size, head_size)`` per layer and the cross-layer tensor are
block-major already (``block_major``).  What vLLM's offloading spec hands a
worker, its canonical ``(num_blocks, page_bytes)`` int8 tensors, is
``canonical_pages``.  Serve them with
``zkv.rank.agent.RankAgent(..., cache=flash_attn(kv_caches), ...)``
(docs/engines.md).

Every adapter declares vLLM's null block reserved (docs/engines.md,
"Reserved rows"): vLLM v1's ``BlockPool`` takes block 0 off its free queue
when it starts (``self.null_block = self.free_block_queue.popleft()``, "a
placeholder block with block_id=0") and puts it in block tables where a
request has no block of its own (the blocks a sliding window dropped); it is
never handed to a request.  So no swap or fill may name it, and a prefix
cache manager on this cache must never hand it out (``RankAgent.reserved_blocks``).  Pass
``null_block=None`` for a cache with no null block.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ...rank.errors import CacheError
from ...rank.memory.layouts import expect_dims
from ...rank.memory.regions import TensorEntry

NULL_BLOCK = 0  # vLLM v1 BlockPool's null block


def _reserved(null_block: int | None) -> tuple[int, ...]:
    return () if null_block is None else (null_block,)


def flash_attn(kv_caches: Mapping[str, torch.Tensor], null_block: int | None = NULL_BLOCK) -> list[TensorEntry]:
    """FlashAttention: per layer ``(2, blocks, block_size, kv_heads, head_dim)`` -> ``layer.k``, ``layer.v``."""
    entries = []
    for layer, t in kv_caches.items():
        expect_dims(layer, t, 5, "(2, blocks, block_size, kv_heads, head_dim)")
        if t.shape[0] != 2:
            raise CacheError("bad_layout", f"tensor {layer!r} has shape {tuple(t.shape)}: dim 0 must be 2 (K, V)")
        reserved = _reserved(null_block)
        entries += [TensorEntry(f"{layer}.k", t[0], reserved_blocks=reserved), TensorEntry(f"{layer}.v", t[1])]
    return entries


def flashinfer(kv_caches: Mapping[str, torch.Tensor], null_block: int | None = NULL_BLOCK) -> list[TensorEntry]:
    """FlashInfer: per layer ``(blocks, 2, block_size, kv_heads, head_dim)``, one page holds K and V."""
    for layer, t in kv_caches.items():
        expect_dims(layer, t, 5, "(blocks, 2, block_size, kv_heads, head_dim)")
        if t.shape[1] != 2:
            raise CacheError("bad_layout", f"tensor {layer!r} has shape {tuple(t.shape)}: dim 1 must be 2 (K, V)")
    return [TensorEntry(layer, t, reserved_blocks=_reserved(null_block)) for layer, t in kv_caches.items()]


def block_major(tensors: Mapping[str, torch.Tensor], null_block: int | None = NULL_BLOCK) -> list[TensorEntry]:
    """MLA ``(blocks, block_size, head_size)`` per layer, or the cross-layer ``(blocks, layers, 2, block_size,
    kv_heads, head_dim)`` tensor: any tensors whose dim 0 is the block, one region each."""
    return [TensorEntry(name, t, reserved_blocks=_reserved(null_block)) for name, t in tensors.items()]


def canonical_pages(
    tensors: Sequence[Any], names: Sequence[str] | None = None, null_block: int | None = NULL_BLOCK
) -> list[TensorEntry]:
    """vLLM's canonical KV caches as its offloading spec's ``get_worker`` receives them
    (``CanonicalKVCaches.tensors``): block-major ``(num_blocks, page_bytes)`` int8 tensors, one per
    layer, per K or V half, or one cross-layer tensor, or ``CanonicalKVCacheTensor``s holding one
    (``.tensor``; ``.page_size_bytes`` must then be its row).  One region each, named ``names[i]``
    (default ``canonical[i]``); halves of one storage are one buffer (docs/engines.md)."""
    if names is not None and len(names) != len(tensors):
        raise CacheError("bad_layout", f"{len(names)} names for {len(tensors)} canonical tensors")
    entries = []
    for i, item in enumerate(tensors):
        name = names[i] if names is not None else f"canonical[{i}]"
        t = getattr(item, "tensor", item)
        expect_dims(name, t, 2, "(num_blocks, page_bytes)")
        page, row = getattr(item, "page_size_bytes", None), t.shape[1] * t.element_size()
        if page is not None and page != row:
            raise CacheError("bad_layout", f"tensor {name!r}: page_size_bytes {page} but rows of {row} bytes")
        entries.append(TensorEntry(name, t, reserved_blocks=_reserved(null_block)))
    return entries
