"""Between a store's CPU tier and its disk tier (docs/protocol.md §6.3): the
disk tier opened for a layout, and ``spill`` / ``load`` under the CPU tier's
rules.

A spill reads CPU rows, so they are checked first, as a ``swap_in`` does (a
lost CPU block is never written to disk as if it were good); a load writes
CPU rows, so they are unsealed before and sealed after, as a ``swap_out``
does (a rank killed mid-load leaves them lost, never other bytes)."""

from __future__ import annotations

from typing import Sequence

from ...wire.layout import CacheLayout
from .disk_tier import DiskSpec, DiskTier, layout_key
from .tier import CpuTier


def sync_disk(
    disk: DiskTier | None, spec: DiskSpec, tier: CpuTier, layout: CacheLayout, kept: bool, rank: int
) -> DiskTier:
    """The disk tier for ``layout``: the open one, or its file opened (a file of this
    layout's blocks is reused: a restart keeps it); when the CPU tier was not kept
    or the layout changed, its blocks become those of the new layout (none)."""
    fields = (layout.layers, layout.block_size, layout.kv_heads, layout.head_dim, str(layout.dtype))
    key = layout_key(tier.page_shape, fields)
    if disk is not None and disk.row_bytes != tier.row_bytes:
        disk.close()  # another block size: the file is made anew below
        disk = None
    if disk is None:
        return DiskTier(spec, tier.row_bytes, key, rank)
    if not kept or key != disk.key:
        disk.invalidate(key)
    return disk


def _row_addresses(tier: CpuTier, rows: Sequence[int]) -> list[int]:
    base, stride = tier.store.data_ptr(), tier.store.stride(0)
    return [base + r * stride for r in rows]


def spill(disk: DiskTier, tier: CpuTier, src: Sequence[int], dst: Sequence[int]) -> int:
    """CPU rows ``src[i]`` to disk blocks ``dst[i]``; return bytes, once on the device.
    A lost CPU row fails it (``CacheError("lost_block")``) before anything is written."""
    tier.check_rows(src)
    return disk.write(dst, _row_addresses(tier, src))


def load(disk: DiskTier, tier: CpuTier, src: Sequence[int], dst: Sequence[int]) -> int:
    """Disk blocks ``src[i]`` to CPU rows ``dst[i]``, each digest checked (``DiskLost``
    names failures; the ``dst`` rows then stay unsealed: lost, never served)."""
    tier.writing(dst)
    nbytes = disk.read(src, _row_addresses(tier, dst))
    tier.written(dst)
    return nbytes
