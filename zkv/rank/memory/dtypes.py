"""The torch dtype each wire ``Dtype`` stands for.

The wire names an element type and its size only (zkv/wire/vocab.py); which
torch dtype holds it is the rank's choice, made here once for the rank, the
engine adapters and the tools."""

from __future__ import annotations

import torch

from ...wire.vocab import Dtype

TORCH_DTYPES: dict[Dtype, torch.dtype] = {
    Dtype.BF16: torch.bfloat16,
    Dtype.FP16: torch.float16,
    Dtype.FP32: torch.float32,
}
WIRE_DTYPES: dict[torch.dtype, Dtype] = {t: d for d, t in TORCH_DTYPES.items()}  # a torch dtype's wire name

__all__ = ["TORCH_DTYPES", "WIRE_DTYPES"]
