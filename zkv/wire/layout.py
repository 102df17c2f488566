"""The cache layout: the one description of a rank's KV shard that the broker,
the ranks and clients agree on (it travels in READY, WELCOME and RESUME)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from .bounds import LAYOUT_MAX
from .protocol import DTYPES, ProtocolError, shown
from .vocab import Dtype


@dataclass(frozen=True)
class CacheLayout:
    """Per rank: ``layers`` K and V tensors ``[blocks, kv_heads, block_size, head_dim]``."""

    layers: int = 4
    gpu_blocks: int = 256
    cpu_blocks: int = 512
    block_size: int = 16
    kv_heads: int = 4
    head_dim: int = 64
    dtype: str = Dtype.BF16.value  # a Dtype's value

    def __post_init__(self) -> None:
        for name in ("layers", "gpu_blocks", "cpu_blocks", "block_size", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int or not 0 < value <= LAYOUT_MAX[name]:
                raise ProtocolError(
                    "bad_field", f"layout.{name} must be an integer in 1..{LAYOUT_MAX[name]}, got {shown(value)}"
                )
        if self.dtype not in DTYPES:
            raise ProtocolError(
                "bad_field", f"layout.dtype must be one of {', '.join(DTYPES)}, got {shown(self.dtype)}"
            )

    @property
    def block_bytes_per_layer(self) -> int:
        """Bytes of one block of one K (or V) tensor."""
        return self.kv_heads * self.block_size * self.head_dim * Dtype(self.dtype).itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes one block id stands for on a rank: K and V of every layer."""
        return 2 * self.layers * self.block_bytes_per_layer

    def to_wire(self) -> dict[str, Any]:
        """A fresh map of the fields (every value a plain int or str: ``asdict``'s deep copy
        costs ~6 us, three times per pause in the broker)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_wire(cls, data: Any) -> "CacheLayout":
        if not isinstance(data, dict):
            raise ProtocolError("bad_field", "layout must be a map")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            names = sorted(map(str, unknown))
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            raise ProtocolError("bad_field", f"unknown layout fields: {', '.join(map(shown, names[:4]))}{more}")
        return cls(**data)

    def with_changes(self, **changes: Any) -> "CacheLayout":
        return replace(self, **changes)


_FIELDS = tuple(f.name for f in fields(CacheLayout))
