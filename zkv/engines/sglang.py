"""SGLang's KV token pools as zkv regions.

``MHATokenToKVPool`` holds per layer ``k_buffer[i]`` and ``v_buffer[i]``
``[slots, kv_heads, head_dim]`` indexed by token slot; a zkv block is
``page_size`` consecutive slots (``units_per_block``).  Serve them with
``zkv.rank.agent.RankAgent(..., cache=mha(k, v, page_size), ...)``
(docs/engines.md).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..rank.memory.layouts import expect_dims
from ..rank.memory.regions import TensorEntry


def mha(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor], page_size: int) -> list[TensorEntry]:
    """``k_buffer[i]`` then ``v_buffer[i]``, one region each, a block = ``page_size`` slots."""
    entries = []
    for prefix, tensors in (("k_buffer", k_buffers), ("v_buffer", v_buffers)):
        for i, t in enumerate(tensors):
            name = f"{prefix}[{i}]"
            expect_dims(name, t, 3, "[slots, kv_heads, head_dim]")
            entries.append(TensorEntry(name, t, units_per_block=page_size))
    return entries
