"""The cache descriptor: an engine's cache as plain numbers and names (no tensors).

It travels in manifests as a msgpack-able dict, so everything in it is
range-checked where it is loaded: buffer and region specs, the rule that
regions fit their buffers and share no byte, and the block ids the engine
keeps for itself (``reserved``: scratch or null rows no task may write or swap).  ``regions.EngineCache`` binds one
to the engine's storages.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import torch

from ...wire import bounds
from ..errors import CacheError

DESCRIPTOR_VERSION = 1
MAX_INT = 2**53 - 1
MAX_NAME = 256
MAX_REGIONS = bounds.MAX_REGIONS  # every layout the broker accepts fits (zkv/wire/bounds.py)

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bfloat16",
        "float16",
        "float32",
        "float64",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
DEVICE_KINDS = ("cpu", "cuda")


def check_uint(where: str, value: Any, low: int = 0) -> int:
    """``value`` as a range-checked integer in ``[low, 2^53)`` (msgpack and JSON keep it exact)."""
    if type(value) is not int or not low <= value <= MAX_INT:
        raise CacheError("bad_layout", f"{where} must be an integer in [{low}, 2^53), got {value!r}")
    return value


def _name(where: str, value: Any) -> str:
    if type(value) is not str or not 0 < len(value) <= MAX_NAME:
        raise CacheError("bad_layout", f"{where} must be a non-empty string of at most {MAX_NAME} characters")
    return value


@dataclass(frozen=True)
class BufferSpec:
    """One engine storage that regions live in (a tensor's whole storage)."""

    name: str
    nbytes: int
    device: str  # "cpu" or "cuda"; which GPU is the manifest's business (by UUID)
    dtype: str  # the element type the engine's tensors use on it (informational)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "BufferSpec":
        fields = _fields(data, where, ("name", "nbytes", "device", "dtype"))
        if fields["device"] not in DEVICE_KINDS:
            raise CacheError(
                "bad_layout", f"{where}.device must be one of {', '.join(DEVICE_KINDS)}, got {fields['device']!r}"
            )
        if fields["dtype"] not in DTYPES:
            raise CacheError("bad_layout", f"{where}.dtype {fields['dtype']!r} is not a known dtype")
        return cls(
            _name(f"{where}.name", fields["name"]),
            check_uint(f"{where}.nbytes", fields["nbytes"], 1),
            fields["device"],
            fields["dtype"],
        )


@dataclass(frozen=True)
class RegionSpec:
    """Block ``b`` of this region is bytes ``[offset + b*row_stride, +page_bytes)`` of its buffer."""

    name: str
    buffer: int
    offset: int
    row_stride: int
    page_bytes: int
    units_per_block: int = 1

    def span(self, num_blocks: int) -> tuple[int, int]:
        """The byte range ``[start, end)`` of the buffer this region touches."""
        return self.offset, self.offset + (num_blocks - 1) * self.row_stride + self.page_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "RegionSpec":
        f = _fields(data, where, ("name", "buffer", "offset", "row_stride", "page_bytes", "units_per_block"))
        return cls(
            _name(f"{where}.name", f["name"]),
            check_uint(f"{where}.buffer", f["buffer"]),
            check_uint(f"{where}.offset", f["offset"]),
            check_uint(f"{where}.row_stride", f["row_stride"], 1),
            check_uint(f"{where}.page_bytes", f["page_bytes"], 1),
            check_uint(f"{where}.units_per_block", f["units_per_block"], 1),
        )


def _fields(data: Any, where: str, names: Sequence[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise CacheError("bad_layout", f"{where} must be a map")
    missing = [n for n in names if n not in data]
    unknown = sorted(str(k) for k in data if k not in names)
    if missing or unknown:
        raise CacheError("bad_layout", f"{where}: missing {missing or 'nothing'}, unknown {unknown or 'nothing'}")
    return data


def _overlap(a: RegionSpec, b: RegionSpec, num_blocks: int) -> bool:
    """Whether two regions of one buffer share a byte (interleaved rows of the
    same stride, like K and V halves of a FlashInfer block, do not)."""
    (a0, a1), (b0, b1) = a.span(num_blocks), b.span(num_blocks)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.row_stride != b.row_stride or num_blocks == 1:
        return True
    if a.offset > b.offset:
        a, b = b, a
    gap = (b.offset - a.offset) % a.row_stride
    return not (gap >= a.page_bytes and a.row_stride - gap >= b.page_bytes)


@dataclass(frozen=True)
class CacheDescriptor:
    """The engine's cache as numbers: block count, buffers, regions, reserved ids (no tensors).

    ``reserved``: sorted distinct ids in ``[0, num_blocks)`` that the engine
    never hands out (transformers' scratch rows, a null block); they count in
    ``num_blocks`` (ids are the engine's) but no swap or fill may name them."""

    num_blocks: int
    buffers: tuple[BufferSpec, ...]
    regions: tuple[RegionSpec, ...]
    reserved: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_uint("num_blocks", self.num_blocks, 1)
        ids = self.reserved
        if (
            not isinstance(ids, tuple)
            or any(type(b) is not int or not 0 <= b < self.num_blocks for b in ids)
            or any(a >= b for a, b in zip(ids, ids[1:]))
        ):
            raise CacheError(
                "bad_layout", f"reserved block ids must be sorted distinct ids in 0..{self.num_blocks - 1}"
            )
        if not self.regions or len(self.regions) > MAX_REGIONS:
            raise CacheError("bad_layout", f"a cache needs 1..{MAX_REGIONS} regions, got {len(self.regions)}")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise CacheError("bad_layout", "region names must be unique")
        for r in self.regions:
            if r.buffer >= len(self.buffers):
                raise CacheError(
                    "bad_layout", f"region {r.name!r} names buffer {r.buffer}, there are {len(self.buffers)}"
                )
            if r.row_stride < r.page_bytes and self.num_blocks > 1:
                raise CacheError(
                    "bad_layout",
                    f"region {r.name!r}: pages overlap (row stride {r.row_stride} < page {r.page_bytes} bytes)",
                )
            end = r.span(self.num_blocks)[1]
            if end > self.buffers[r.buffer].nbytes:
                raise CacheError(
                    "bad_layout",
                    f"region {r.name!r} ends at byte {end}, past buffer "
                    f"{self.buffers[r.buffer].name!r} of {self.buffers[r.buffer].nbytes} bytes",
                )
        self._check_overlaps()

    def _check_overlaps(self) -> None:
        """A sweep over regions sorted by buffer and start: each is compared only with
        the regions of its buffer whose span it starts inside."""
        active: list[RegionSpec] = []
        for r in sorted(self.regions, key=lambda r: (r.buffer, r.offset)):
            start = r.offset
            active = [a for a in active if a.buffer == r.buffer and a.span(self.num_blocks)[1] > start]
            for other in active:
                if _overlap(other, r, self.num_blocks):
                    raise CacheError(
                        "bad_layout",
                        f"regions {other.name!r} and {r.name!r} overlap in buffer {self.buffers[r.buffer].name!r}",
                    )
            active.append(r)

    @functools.cached_property
    def block_bytes(self) -> int:
        """Bytes one block id stands for: its page in every region (asked per task: computed once)."""
        return sum(r.page_bytes for r in self.regions)

    @functools.cached_property
    def reserved_ids(self) -> frozenset[int]:
        """``reserved`` as a set (asked per task: built once)."""
        return frozenset(self.reserved)

    @property
    def page_shape(self) -> tuple[tuple[str, int], ...]:
        """What a CPU tier row depends on: region names and page sizes, in order."""
        return tuple((r.name, r.page_bytes) for r in self.regions)

    def to_dict(self) -> dict[str, Any]:
        """The manifest form; ``reserved`` only when there are reserved ids (older readers take the rest)."""
        out: dict[str, Any] = {
            "version": DESCRIPTOR_VERSION,
            "num_blocks": self.num_blocks,
            "buffers": [b.to_dict() for b in self.buffers],
            "regions": [r.to_dict() for r in self.regions],
        }
        if self.reserved:
            out["reserved"] = list(self.reserved)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> "CacheDescriptor":
        names: tuple[str, ...] = ("version", "num_blocks", "buffers", "regions")
        if isinstance(data, dict) and "reserved" in data:  # written only when the engine reserves ids
            names += ("reserved",)
        f = _fields(data, "descriptor", names)
        if f["version"] != DESCRIPTOR_VERSION or type(f["version"]) is not int:
            raise CacheError("bad_layout", f"descriptor version {f['version']!r} is not {DESCRIPTOR_VERSION}")
        for key, limit in (("buffers", MAX_REGIONS), ("regions", MAX_REGIONS)):
            if not isinstance(f[key], list) or len(f[key]) > limit:
                raise CacheError("bad_layout", f"descriptor.{key} must be a list of at most {limit}")
        buffers = tuple(BufferSpec.from_dict(b, f"buffers[{i}]") for i, b in enumerate(f["buffers"]))
        regions = tuple(RegionSpec.from_dict(r, f"regions[{i}]") for i, r in enumerate(f["regions"]))
        num_blocks = check_uint("num_blocks", f["num_blocks"], 1)
        reserved = f.get("reserved", [])
        if not isinstance(reserved, list) or len(reserved) > num_blocks:
            raise CacheError("bad_layout", f"descriptor.reserved must be a list of at most {num_blocks} block ids")
        return cls(num_blocks, buffers, regions, tuple(reserved))


__all__ = ["BufferSpec", "CacheDescriptor", "RegionSpec", "DTYPES", "check_uint"]
