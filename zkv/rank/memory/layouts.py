"""Engine-neutral builders of ``TensorEntry`` lists (pass the result to
``EngineCache.from_tensors``), and the shape check every adapter uses.

Each engine's own adapter lives with that engine in ``zkv/engines/`` (its
tensors' names and shapes); here are only the layouts zkv itself defines:

- ``per_layer``: any named tensors whose dim 0 is the block dimension
  (block-major caches, MLA ``[blocks, bs, d]``, a cross-layer tensor);
- ``zkv_native``: zkv's own per layer K and V ``[blocks, kv_heads, block_size,
  head_dim]`` (slices of one ``[2*layers, blocks, ...]`` store, ``rank/sources.py``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..errors import CacheError
from .regions import TensorEntry


def expect_dims(name: str, t: torch.Tensor, dims: int, what: str) -> None:
    """Raise ``CacheError("bad_layout")`` naming ``name`` unless ``t`` is a tensor of ``dims`` dimensions."""
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise CacheError("bad_layout", f"tensor {name!r} has shape {shape}, expected {what}")


def per_layer(tensors: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """Any named tensors whose dim 0 is the block dimension, one region each."""
    return [TensorEntry(name, t) for name, t in tensors.items()]


def zkv_native(k_caches: Sequence[torch.Tensor], v_caches: Sequence[torch.Tensor]) -> list[TensorEntry]:
    """zkv's own per-layer K/V ``[blocks, kv_heads, block_size, head_dim]``."""
    entries = []
    for i, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
        for name, t in ((f"layer{i}.k", k), (f"layer{i}.v", v)):
            expect_dims(name, t, 4, "[blocks, kv_heads, block_size, head_dim]")
            entries.append(TensorEntry(name, t))
    return entries
