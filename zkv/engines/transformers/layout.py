"""transformers' continuous-batching cache as zkv sees it: ``KVLayout`` (its
shape, read from the engine by ``TransformersCBEngine.layout``), the one
region over it (``regions``) and the model fields a rank announces
(``model_layout``).  Torch only: importable without transformers.

The cache is one flat ``uint8`` tensor, block-major: block ``b`` is bytes
``[b*block_bytes, (b+1)*block_bytes)``, shaped ``(layers, 2, block_size,
kv_heads, head_dim)`` in the cache's dtype; the first ``scratch_blocks`` rows
are the engine's padding trash, never handed out and never to be swapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...rank.errors import CacheError
from ...rank.memory.dtypes import WIRE_DTYPES
from ...rank.memory.regions import TensorEntry
from ...wire.layout import CacheLayout


@dataclass(frozen=True)
class KVLayout:
    """transformers' flat cache seen as block rows (see the module docstring)."""

    num_blocks: int  # rows in the tensor, scratch rows included
    scratch_blocks: int  # rows [0, scratch_blocks) are engine trash
    layers: int
    block_size: int  # tokens per block
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    generation: int  # bumped by every rebuild: a new allocation, old KV invalid

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    def typed(self, cache_tensor: torch.Tensor) -> torch.Tensor:
        """``cache_tensor`` as ``(num_blocks, layers, 2, block_size, kv_heads, head_dim)`` of ``dtype``."""
        shape = (self.num_blocks, self.layers, 2, self.block_size, self.kv_heads, self.head_dim)
        return cache_tensor.view(self.dtype).view(shape)


def regions(
    cache_tensor: torch.Tensor,
    layers: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    scratch_blocks: int = 0,
) -> list[TensorEntry]:
    """The flat uint8 cache as one region, a row per block id; the first
    ``scratch_blocks`` rows are declared reserved (no task may swap or fill them)."""
    if not isinstance(cache_tensor, torch.Tensor) or cache_tensor.dtype != torch.uint8 or cache_tensor.dim() != 1:
        raise CacheError("bad_layout", "tensor 'cache_tensor' must be one flat uint8 tensor")
    page = layers * 2 * block_size * kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    if cache_tensor.numel() % page or not cache_tensor.is_contiguous():
        raise CacheError(
            "bad_layout",
            f"tensor 'cache_tensor' of {cache_tensor.numel()} bytes is not a contiguous "
            f"whole number of {page}-byte blocks",
        )
    rows = cache_tensor.view(-1, page)
    if not 0 <= scratch_blocks < rows.shape[0]:
        raise CacheError("bad_layout", f"{scratch_blocks} scratch rows leave no block of the {rows.shape[0]}")
    return [TensorEntry("cache_tensor", rows, reserved_blocks=tuple(range(scratch_blocks)))]


def model_layout(layout: KVLayout, cpu_rows: int) -> CacheLayout | None:
    """The layout a rank on this cache announces with ``cpu_rows`` CPU blocks: the
    model's fields and the cache's rows (scratch rows included: ids are the engine's).
    None when the wire has no name for the cache's dtype (fp8): the rank then
    announces the layout it derives from the bytes."""
    dtype = WIRE_DTYPES.get(layout.dtype)
    if dtype is None:
        return None
    return CacheLayout(
        gpu_blocks=layout.num_blocks,
        cpu_blocks=cpu_rows,
        layers=layout.layers,
        block_size=layout.block_size,
        kv_heads=layout.kv_heads,
        head_dim=layout.head_dim,
        dtype=dtype.value,
    )
