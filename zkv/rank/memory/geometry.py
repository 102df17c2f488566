"""The layout a rank on engine memory announces: derived from the memory, or
a given one checked against it (docs/engines.md, "The layout a rank announces").

The broker, ``zkv status`` and every client read a rank's block count and
bytes per block off the layout it announces (``CacheLayout.block_bytes``:
the ``bytes`` a swap reports are ``ids × block_bytes``), so that layout must
be the engine's: ``gpu_blocks`` its block count, ``block_bytes`` the bytes of
a block's page in every region.  Without a layout the rank derives one from
the cache's descriptor; a given layout (or given fields) that disagrees is
refused with ``CacheError("bad_layout")`` naming both values.  The model
fields of a derived layout only count bytes: zkv cannot read layers or heads
off memory (pass them to announce them).
"""

from __future__ import annotations

from typing import Any, Mapping

from ...wire.bounds import LAYOUT_MAX
from ...wire.layout import CacheLayout
from ...wire.protocol import ProtocolError
from ...wire.vocab import Dtype
from ..errors import CacheError
from .descriptor import DTYPES, CacheDescriptor
from .dtypes import WIRE_DTYPES

MODEL_FIELDS = ("layers", "block_size", "kv_heads", "head_dim", "dtype")
_SEARCH = 1 << 16  # divisors tried per field before a block's size is called inexpressible
_FACTORS = ("head_dim", "block_size", "kv_heads", "layers")  # filled in this order, each within its bound

LayoutGiven = CacheLayout | Mapping[str, Any] | None


def _largest_divisor(n: int, limit: int) -> int | None:
    """The largest divisor of ``n`` that is at most ``limit`` (None if the bounded search finds none)."""
    if n <= limit:
        return n
    k = -(-n // limit)  # the smallest cofactor that can work
    for cofactor in range(k, k + _SEARCH):
        if n % cofactor == 0:
            return n // cofactor
    return None


def _wire_dtype(descriptor: CacheDescriptor, block_bytes: int) -> Dtype:
    """The cache's element type when every buffer has the same one the wire names
    (and it divides the block), else bf16: a block counted in 2-byte elements."""
    names = {b.dtype for b in descriptor.buffers}
    if len(names) == 1:
        wire = WIRE_DTYPES.get(DTYPES[names.pop()])
        if wire is not None and block_bytes % (2 * wire.itemsize) == 0:
            return wire
    return Dtype.BF16


def derive(descriptor: CacheDescriptor, cpu_rows: int) -> CacheLayout:
    """The layout of ``descriptor``'s memory: its block count, ``cpu_rows`` CPU
    blocks, and model fields whose product is its bytes per block
    (``layers = kv_heads = block_size = 1`` unless ``head_dim`` would pass its bound)."""
    block_bytes = descriptor.block_bytes
    dtype = _wire_dtype(descriptor, block_bytes)
    per = 2 * dtype.itemsize  # K and V of one element
    if block_bytes % per:
        raise CacheError(
            "bad_layout",
            f"the engine's blocks are {block_bytes} bytes, not a multiple of {per}: no layout "
            f"(2 x layers x kv_heads x block_size x head_dim x itemsize) describes them",
        )
    left = block_bytes // per
    fields: dict[str, Any] = {}
    for name in _FACTORS:
        part = _largest_divisor(left, LAYOUT_MAX[name])
        if part is None:
            break
        fields[name], left = part, left // part
    if left != 1:
        raise CacheError(
            "bad_layout",
            f"the engine's blocks of {block_bytes} bytes cannot be written as a layout within its bounds: pass one",
        )
    return _layout({"gpu_blocks": descriptor.num_blocks, "cpu_blocks": cpu_rows, "dtype": dtype.value, **fields})


def _layout(fields: Mapping[str, Any]) -> CacheLayout:
    unknown = sorted(set(fields) - set(CacheLayout.__struct_fields__))
    if unknown:
        raise CacheError("bad_layout", f"unknown layout fields {unknown}")
    try:
        return CacheLayout(**fields)
    except ProtocolError as err:
        raise CacheError("bad_layout", err.reason) from None


def describe(layout: CacheLayout) -> str:
    """A layout's bytes per block and where they come from, for refusals."""
    return (
        f"{layout.block_bytes} bytes per block (2 x {layout.layers} layers x {layout.kv_heads} kv_heads "
        f"x {layout.block_size} block_size x {layout.head_dim} head_dim x {Dtype(layout.dtype).itemsize}-byte "
        f"{layout.dtype})"
    )


def check(
    layout: CacheLayout, descriptor: CacheDescriptor, whose: str = "the engine's cache", resume: bool = False
) -> None:
    """Raise ``CacheError("bad_layout")`` naming both values unless ``layout``
    has ``descriptor``'s block count and bytes per block (``resume``: say
    what the resume must name instead)."""
    if layout.gpu_blocks != descriptor.num_blocks:
        hint = f" (resume with layout {{gpu_blocks: {descriptor.num_blocks}}})" if resume else ""
        raise CacheError(
            "bad_layout",
            f"{whose} has {descriptor.num_blocks} blocks, the layout says gpu_blocks={layout.gpu_blocks}{hint}",
        )
    if layout.block_bytes != descriptor.block_bytes:
        hint = f" (resume with a layout of {descriptor.block_bytes} bytes per block)" if resume else ""
        raise CacheError(
            "bad_layout",
            f"{whose} has {descriptor.block_bytes} bytes per block, the layout says {describe(layout)}{hint}",
        )


def announced(descriptor: CacheDescriptor, cpu_rows: int, given: LayoutGiven = None) -> CacheLayout:
    """What a rank on ``descriptor``'s memory announces with ``cpu_rows`` CPU blocks.

    ``given``: None (derive it), a whole ``CacheLayout`` (checked: block count,
    bytes per block, and ``cpu_blocks`` against ``cpu_rows``), or a map of some
    fields (the rest are the derived layout's, so the model fields given must
    multiply out to the engine's bytes per block; then checked the same way)."""
    if given is None:
        return derive(descriptor, cpu_rows)
    if isinstance(given, CacheLayout):
        layout = given
    else:
        base: dict[str, Any] = {"gpu_blocks": descriptor.num_blocks, "cpu_blocks": cpu_rows}
        if not set(MODEL_FIELDS) <= set(given):
            base = derive(descriptor, cpu_rows).to_wire()
        layout = _layout({**base, **given})
    if layout.cpu_blocks != cpu_rows:
        raise CacheError(
            "bad_layout", f"zkv's CPU tier has {cpu_rows} rows, the layout says cpu_blocks={layout.cpu_blocks}"
        )
    check(layout, descriptor)
    return layout


__all__ = ["MODEL_FIELDS", "LayoutGiven", "announced", "check", "derive", "describe"]
