"""Between a store's CPU tier and its disk tier (docs/protocol.md §6.3): the
disk tier opened for a layout, and ``spill`` / ``load`` under the CPU tier's
rules.

A spill reads CPU rows, so they are checked first, as a ``swap_in`` does (a
lost CPU block is never written to disk as if it were good); a load writes
CPU rows, so they are unsealed before and sealed after, as a ``swap_out``
does (a rank killed mid-load leaves them lost, never other bytes).

Disk blocks belong to the bus's CPU generation as CPU rows do: the disk
file's ``cpu_gen`` is always the store's (``sync_disk`` here, then
``BlockStore.set_cpu_gen`` before a task reads a row), so a rank never
serves blocks of a CPU generation the bus has left, even one that moved
while the rank was down."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ...wire.layout import CacheLayout
from .disk_tier import DiskTier, layout_key
from .tier import CpuTier

if TYPE_CHECKING:
    from .store import BlockStore


def sync_disk(store: "BlockStore", layout: CacheLayout, kept: bool) -> None:
    """Give ``store`` the disk tier for ``layout`` at its CPU generation: the open one, or
    its file opened (a file of this layout's blocks is reused: a restart keeps it); when
    the CPU tier was not kept or the layout changed, its blocks become those of the new
    layout (none).  A reused file's blocks of another CPU generation are dropped, unless
    the store knows none yet (a first allocation whose CPU tier is new): it takes the
    file's then (its ``kept_tiers`` names ``disk``; the broker judges it, §8.2)."""
    spec, tier, disk = store.disk_spec, store.tier, store.disk
    assert spec is not None and tier is not None
    fields = (layout.layers, layout.block_size, layout.kv_heads, layout.head_dim, str(layout.dtype))
    key = layout_key(tier.page_shape, fields)
    if disk is not None and disk.row_bytes != tier.row_bytes:
        disk.close()  # another block size: the file is made anew below
        store.disk = disk = None
    if disk is None:
        store.disk = disk = DiskTier(spec, tier.row_bytes, key, store.rank, store.cpu_gen)
        if store.generation is None and not store.restored and disk.kept:
            store.set_cpu_gen(disk.cpu_gen)  # the file's blocks name the store's generation
        else:
            disk.set_cpu_gen(store.cpu_gen)
    elif not kept or key != disk.key:
        disk.invalidate(key)


def ready_tiers(cpu: bool, disk: DiskTier | None, cpu_gen: int, fresh: bool) -> dict:
    """A READY's ``kept_tiers`` and their ``cpu_gen``: ``cpu`` when the CPU tier is the
    bus's content (``cpu``), ``disk`` when the disk file's blocks are at ``cpu_gen``
    and, for a fresh process, an earlier one spilled them."""
    tiers = ["cpu"] if cpu else []
    if disk is not None and disk.cpu_gen == cpu_gen and (disk.kept or not fresh):
        tiers.append("disk")
    return {"kept_tiers": tiers, "cpu_gen": cpu_gen} if tiers else {}


def _row_addresses(tier: CpuTier, rows: Sequence[int]) -> list[int]:
    base, stride = tier.store.data_ptr(), tier.store.stride(0)
    return [base + r * stride for r in rows]


def spill(disk: DiskTier, tier: CpuTier, src: Sequence[int], dst: Sequence[int]) -> int:
    """CPU rows ``src[i]`` to disk blocks ``dst[i]``; return bytes, once on the device.
    A lost CPU row fails it (``CacheError("lost_block")``) before anything is written."""
    tier.check_rows(src)
    return disk.write(dst, _row_addresses(tier, src), tier.stride)


def load(disk: DiskTier, tier: CpuTier, src: Sequence[int], dst: Sequence[int]) -> int:
    """Disk blocks ``src[i]`` to CPU rows ``dst[i]``, each digest checked (``DiskLost``
    names failures; the ``dst`` rows then stay unsealed: lost, never served)."""
    tier.writing(dst)
    nbytes = disk.read(src, _row_addresses(tier, dst), tier.stride)
    tier.written(dst)
    return nbytes
