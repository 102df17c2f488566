"""Regions: any engine's KV layout as byte pages per block, over memory zkv
does not own.

A rank's engine cache is a list of *regions*.  Each region is a canonical
``[num_blocks, page_bytes]`` uint8 view of one engine buffer (a tensor's
storage): row ``b`` is block ``b``'s bytes in that region, contiguous, and
rows are ``row_stride`` bytes apart.  Copying a block means copying its row
in every region; the order of bytes inside a page never matters, so NHD and
HND layouts are the same to zkv.  Where the engine indexes token slots
rather than blocks (SGLang), a block is ``units_per_block`` consecutive
slots and its page is their bytes.

The *descriptor* (``descriptor.py``) is the plain part: numbers and names,
no tensors.  ``canonicalize`` derives it from the engine's tensors;
``EngineCache`` binds a descriptor to the engine's storages and holds the
only references zkv keeps to engine memory; ``release()`` drops them all.
A tensor whose blocks cannot be copied row by row (block dimension not
outermost in storage, pages that are not one contiguous run, pages that
overlap) is refused here, at attach time, with ``CacheError("bad_layout")``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any, Callable, Iterable, Sequence

import torch

from ...wire.ids import encode_ids
from ..errors import CacheError
from .descriptor import DEVICE_KINDS, DTYPE_NAMES, BufferSpec, CacheDescriptor, RegionSpec, check_uint


@dataclass(frozen=True)
class TensorEntry:
    """One engine tensor to attach; ``block_dim`` is its logical block (or slot) dimension.

    Dimensions before ``block_dim`` are split: each index is its own region
    (vLLM FlashAttention's leading K/V dimension), named ``name[i]``.
    ``reserved_blocks``: block ids the engine keeps for itself (scratch rows, a
    null block); a block reserved by any entry is reserved for the whole cache,
    and no swap or fill may name it (``CacheDescriptor.reserved``)."""

    name: str
    tensor: torch.Tensor
    block_dim: int = 0
    units_per_block: int = 1
    reserved_blocks: Sequence[int] = ()


def _describe_tensor(t: torch.Tensor, name: str, units_per_block: int) -> tuple[int, int, int, int]:
    """(byte offset in storage, row stride, page bytes, blocks) of ``t`` whose dim 0 is the block dim."""
    where = f"tensor {name!r} (shape {tuple(t.shape)}, stride {tuple(t.stride())}, {t.dtype})"
    if t.dim() == 0:
        raise CacheError("bad_layout", f"{where}: a scalar has no block dimension")
    es = t.element_size()
    units, unit_stride = t.shape[0], t.stride(0)
    inner = sorted(((t.stride(d), t.shape[d], d) for d in range(1, t.dim()) if t.shape[d] > 1))
    outer = [(s, d) for s, size, d in inner if s > unit_stride and units > 1]
    if outer:
        raise CacheError(
            "bad_layout",
            f"{where}: the block dimension is not outermost in storage "
            f"(dim {outer[-1][1]} has stride {outer[-1][0]} > the block stride {unit_stride})",
        )
    expected = 1
    for stride, size, d in inner:
        if stride != expected:
            raise CacheError(
                "bad_layout",
                f"{where}: a block's page is not one contiguous run of bytes "
                f"(dim {d} has stride {stride}, a dense page needs {expected})",
            )
        expected *= size
    unit_elems = expected
    if units > 1 and unit_stride < unit_elems:
        raise CacheError(
            "bad_layout", f"{where}: pages overlap (block stride {unit_stride} < page {unit_elems} elements)"
        )
    if units_per_block > 1 and units > 1 and unit_stride != unit_elems:
        raise CacheError(
            "bad_layout",
            f"{where}: slots of one block are not adjacent (slot stride {unit_stride}, "
            f"slot size {unit_elems} elements)",
        )
    blocks = units // units_per_block
    if blocks < 1:
        raise CacheError("bad_layout", f"{where}: fewer than {units_per_block} slots, not one block")
    return (
        int(t.storage_offset()) * es,
        int(unit_stride) * units_per_block * es,
        int(unit_elems) * units_per_block * es,
        int(blocks),
    )


def _split_leading(entry: TensorEntry) -> Iterable[tuple[str, torch.Tensor]]:
    t = entry.tensor
    if not 0 <= entry.block_dim < max(t.dim(), 1):
        raise CacheError(
            "bad_layout",
            f"tensor {entry.name!r}: block_dim {entry.block_dim} is not a dimension of shape {tuple(t.shape)}",
        )
    lead = tuple(t.shape[: entry.block_dim])
    for index in product(*map(range, lead)):
        sub = t[index] if index else t
        yield (f"{entry.name}[{','.join(map(str, index))}]" if index else entry.name), sub


def _storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a flat uint8 tensor (it holds a reference to it)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def canonicalize(
    entries: Sequence[TensorEntry], num_blocks: int | None = None
) -> tuple[CacheDescriptor, list[torch.Tensor]]:
    """The descriptor of ``entries`` plus one flat uint8 tensor per buffer.

    Tensors sharing a storage share a buffer; identical regions (layers that
    share a tensor) are kept once.  Every region must have ``num_blocks``
    blocks (default: the count all regions agree on)."""
    keys: dict[tuple[str, int], int] = {}
    buffers: list[BufferSpec] = []
    flats: list[torch.Tensor] = []
    found: list[tuple[RegionSpec, int]] = []
    for entry in entries:
        if not isinstance(entry.tensor, torch.Tensor):
            raise CacheError(
                "bad_layout", f"tensor {entry.name!r} is a {type(entry.tensor).__name__}, not a torch.Tensor"
            )
        if entry.tensor.device.type not in DEVICE_KINDS or entry.tensor.dtype not in DTYPE_NAMES:
            raise CacheError(
                "bad_layout",
                f"tensor {entry.name!r}: {entry.tensor.device.type} / {entry.tensor.dtype} is not supported",
            )
        check_uint(f"tensor {entry.name!r} units_per_block", entry.units_per_block, 1)
        storage = entry.tensor.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key not in keys:
            keys[key] = len(buffers)
            buffers.append(
                BufferSpec(entry.name, storage.nbytes(), storage.device.type, DTYPE_NAMES[entry.tensor.dtype])
            )
            flats.append(_storage_bytes(storage))
        for name, sub in _split_leading(entry):
            offset, stride, page, blocks = _describe_tensor(sub, name, entry.units_per_block)
            found.append((RegionSpec(name, keys[key], offset, stride, page, entry.units_per_block), blocks))
    if not found:
        raise CacheError("bad_layout", "no tensors to attach")
    if num_blocks is None:
        counts = sorted({blocks for _, blocks in found})
        if len(counts) > 1:
            raise CacheError("bad_layout", f"regions disagree on the block count ({counts}); pass num_blocks")
        num_blocks = counts[0]
    reserved = {b for entry in entries for b in entry.reserved_blocks}
    bad = [b for b in reserved if type(b) is not int or not 0 <= b < num_blocks]
    if bad:
        raise CacheError(
            "bad_layout", f"reserved block id {bad[0]!r} is not a block of the cache (0..{num_blocks - 1})"
        )
    regions: list[RegionSpec] = []
    seen: set[tuple[int, int, int, int]] = set()
    for spec, blocks in found:
        if blocks < num_blocks:
            raise CacheError("bad_layout", f"tensor {spec.name!r} has {blocks} blocks, the cache has {num_blocks}")
        shape_key = (spec.buffer, spec.offset, spec.row_stride, spec.page_bytes)
        if shape_key not in seen:
            seen.add(shape_key)
            regions.append(spec)
    return CacheDescriptor(num_blocks, tuple(buffers), tuple(regions), tuple(sorted(reserved))), flats


class EngineCache:
    """An engine's cache as regions: ``views[i]`` is region ``i`` as ``[num_blocks, page_bytes]`` uint8.

    zkv never frees engine memory: ``release()`` only drops zkv's references
    (views and buffers), after which the engine's own free is a real free."""

    def __init__(
        self,
        descriptor: CacheDescriptor,
        flats: Sequence[torch.Tensor],
        generation: int = 0,
        instance: str = "",
        nonce: str = "",
    ):
        if len(flats) != len(descriptor.buffers):
            raise CacheError("bad_layout", f"{len(flats)} buffers for a descriptor of {len(descriptor.buffers)}")
        for spec, flat in zip(descriptor.buffers, flats):
            if flat.dtype != torch.uint8 or flat.dim() != 1 or flat.numel() < spec.nbytes:
                raise CacheError(
                    "size_mismatch", f"buffer {spec.name!r} has {flat.numel()} bytes, the descriptor says {spec.nbytes}"
                )
        self.descriptor = descriptor
        self.generation = generation
        self.instance = instance  # the exporting engine process (a manifest's ``instance``); "" in process
        self.nonce = nonce  # the export it was mapped from (a manifest's ``nonce``); "" in process
        self._flats: list[torch.Tensor] = list(flats)
        self.views: list[torch.Tensor] = [
            self._flats[r.buffer].as_strided(
                (descriptor.num_blocks, r.page_bytes),
                (r.row_stride, 1),
                self._flats[r.buffer].storage_offset() + r.offset,
            )
            for r in descriptor.regions
        ]
        self._derived: dict[Any, Any] = {}
        devices = {v.device for v in self.views}
        if len(devices) != 1:
            raise CacheError("bad_layout", f"one rank's cache must be on one device, found {sorted(map(str, devices))}")
        self.device: torch.device = devices.pop()

    @classmethod
    def from_tensors(
        cls, entries: Sequence[TensorEntry], num_blocks: int | None = None, generation: int = 0
    ) -> "EngineCache":
        descriptor, flats = canonicalize(entries, num_blocks)
        return cls(descriptor, flats, generation)

    @property
    def num_blocks(self) -> int:
        return self.descriptor.num_blocks

    @property
    def released(self) -> bool:
        return not self.views

    def storage_refs(self) -> list[Any]:
        """Weak references to every engine storage zkv holds (``expired()`` once nobody does)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        return [StorageWeakRef(flat.untyped_storage()) for flat in self._flats]

    def derived(self, key: Any, build: Callable[[list[torch.Tensor]], Any]) -> Any:
        """``build(views)`` (views derived from the regions, e.g. a copy engine's grouped views),
        made once and kept with the views: ``release()`` drops it with them."""
        if self.released:
            raise CacheError("released", "the engine cache was released (cleared); attach a new generation")
        if key not in self._derived:
            self._derived[key] = build(self.views)
        return self._derived[key]

    def release(self) -> None:
        """Drop every view and buffer reference zkv holds on engine memory (idempotent)."""
        self.views = []
        self._flats = []
        self._derived = {}


def check_ids(
    what: str, ids: Sequence[int], tier: str, limit: int, unique: bool, reserved: frozenset[int] = frozenset()
) -> None:
    """The one rule for the block ids of a tier of ``limit`` blocks: each in
    ``[0, limit)``, none of the engine's ``reserved`` ids (for a swap or fill
    of the device tier), and none twice where two copies would race into one
    block.  ``ids`` are non-empty ints (the wire decoder checks a task's;
    ``CopyEngine`` its callers')."""
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise CacheError("bad_block_id", f"{what} block id {bad} is out of range for the {tier} tier (0..{limit - 1})")
    if reserved and not reserved.isdisjoint(ids):
        bad = next(b for b in ids if b in reserved)
        held = encode_ids(sorted(reserved))
        raise CacheError("bad_block_id", f"{what} block id {bad} is reserved by the engine (reserved: {held})")
    if unique and len(set(ids)) != len(ids):
        raise CacheError("bad_block_id", f"{what} has duplicate block ids (two copies would race into one block)")


__all__ = ["TensorEntry", "EngineCache", "canonicalize", "check_ids"]
