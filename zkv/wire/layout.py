"""The cache layout: the one description of a rank's KV shard that the broker,
the ranks and clients agree on (it travels in READY, WELCOME, CONTROL, ACK
and RESUME).  A frozen ``msgspec.Struct``: the decoders hand it over typed
(a layout that breaks a bound never gets past them), and the encoder writes
it as the map of docs/protocol.md §4.8, its fields in order.  A resume names
only what changes: ``LayoutChange``."""

from __future__ import annotations

from typing import Any

import msgspec

from .bounds import LAYOUT_MAX
from .errors import ProtocolError, shown
from .vocab import Dtype

DTYPES = tuple(d.value for d in Dtype)


def _unknown(cls: type[msgspec.Struct], data: Any) -> None:
    """``bad_field`` unless ``data`` is a map of ``cls``'s fields only."""
    if not isinstance(data, dict):
        raise ProtocolError("bad_field", "layout must be a map")
    unknown = set(data) - set(cls.__struct_fields__)
    if unknown:
        names = sorted(map(str, unknown))
        more = f" and {len(names) - 4} more" if len(names) > 4 else ""
        raise ProtocolError("bad_field", f"unknown layout fields: {', '.join(map(shown, names[:4]))}{more}")


class CacheLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
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
        """A fresh map of the fields (every value a plain int or str), for JSON and logs."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_wire(cls, data: Any) -> "CacheLayout":
        """A layout from a map (a trace, a state file, a status reply): its checks, by name."""
        _unknown(cls, data)
        return cls(**data)

    def with_changes(self, **changes: Any) -> "CacheLayout":
        return type(self)(**{**self.to_wire(), **changes})  # checked as any new layout is


class LayoutChange(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """What a resume names of the bus's layout (the rest stays): each field None or
    its new value, checked when merged (``over``)."""

    layers: int | None = None
    gpu_blocks: int | None = None
    cpu_blocks: int | None = None
    block_size: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None

    def named(self) -> dict[str, Any]:
        """The fields it names, as a map."""
        return {name: value for name in _FIELDS if (value := getattr(self, name)) is not None}

    def over(self, base: CacheLayout) -> CacheLayout:
        """``base`` with these changes (``bad_field`` where one breaks a bound)."""
        return base.with_changes(**self.named())

    @classmethod
    def from_wire(cls, data: Any) -> "LayoutChange":
        _unknown(cls, data)
        return cls(**data)


_FIELDS = CacheLayout.__struct_fields__
assert LayoutChange.__struct_fields__ == _FIELDS, "a resume names the layout's own fields"
