"""FastDeploy's KV cache as zkv regions.

FastDeploy's cache transfer manager holds per layer ``key_caches_{i}`` and
``value_caches_{i}`` ``[blocks, kv_heads, block_size, head_dim]`` (no values
for MLA), plus optional block_wise_fp8 scales ``[blocks, kv_heads,
block_size]``.  ``regions`` names each region after its tensor, so an error
says which one is wrong.  Serve them in process with
``zkv.rank.agent.RankAgent(..., cache=regions(ks, vs), ...)`` or across
processes with ``zkv.rank.memory.manifest.export_manifest`` (docs/engines.md).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..rank.memory.layouts import expect_dims
from ..rank.memory.regions import TensorEntry


def regions(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor] | None = None,
    key_scales: Sequence[torch.Tensor] | None = None,
    value_scales: Sequence[torch.Tensor] | None = None,
) -> list[TensorEntry]:
    """``key_caches_{i}`` / ``value_caches_{i}`` (then the scales), one region each."""
    entries = []
    groups = [
        ("key_caches", key_caches, 4),
        ("value_caches", value_caches, 4),
        ("key_cache_scales", key_scales, 3),
        ("value_cache_scales", value_scales, 3),
    ]
    for prefix, tensors, dims in groups:
        for i, t in enumerate(tensors or ()):
            name = f"{prefix}_{i}"
            expect_dims(
                name,
                t,
                dims,
                "[blocks, kv_heads, block_size, head_dim]" if dims == 4 else "[blocks, kv_heads, block_size]",
            )
            entries.append(TensorEntry(name, t))
    return entries
