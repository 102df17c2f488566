"""A store's disk tier under its CPU tier (docs/protocol.md §6.3): the disk
tier opened for a layout, and what a READY says the rank kept.  The moves
between the two (``spill``, ``load``) are the store's, under the one set of
rules of every move (``BlockStore.move``, ``wire/moves.py``).

Disk blocks belong to the bus's CPU generation as CPU rows do: the disk
file's ``cpu_gen`` is always the store's (``DiskLink.sync`` here, then
``BlockStore.set_cpu_gen`` before a task reads a row), so a rank never
serves blocks of a CPU generation the bus has left, even one that moved
while the rank was down."""

from __future__ import annotations

from ...wire.layout import CacheLayout
from ...wire.vocab import Tier
from .cpu_tier import CpuTier
from .disk_tier import DiskSpec, DiskTier, layout_key


class DiskLink:
    """A rank's disk tier under its CPU tier: where its file lives (``spec``)
    and the file open for the current layout (``disk``, None until the first
    allocation)."""

    def __init__(self, spec: DiskSpec, rank: int):
        self.spec = spec
        self.rank = rank
        self.disk: DiskTier | None = None

    def sync(self, tier: CpuTier, layout: CacheLayout, kept: bool, cpu_gen: int, adopt: bool) -> int | None:
        """Open (or keep) the disk tier for ``layout`` at ``cpu_gen``: a file of this layout's
        blocks is reused (a restart keeps it); when the CPU tier was not ``kept`` or the layout
        changed, its blocks become those of the new layout (none).  A reused file's blocks of
        another CPU generation are dropped, unless ``adopt`` (the store knows no generation
        yet: a first allocation whose CPU tier is new): then the file's CPU generation is
        returned for the store to take (its ``kept_tiers`` names ``disk``; the broker judges
        it, §8.2).  None: nothing adopted."""
        fields = (layout.layers, layout.block_size, layout.kv_heads, layout.head_dim, str(layout.dtype))
        key = layout_key(tier.page_shape, fields)
        if self.disk is not None and self.disk.row_bytes != tier.row_bytes:
            self.close()  # another block size: the file is made anew below
        if self.disk is None:
            self.disk = DiskTier(self.spec, tier.row_bytes, key, self.rank, cpu_gen)
            if adopt and self.disk.kept:
                return self.disk.cpu_gen  # the file's blocks name the store's generation
            self.disk.set_cpu_gen(cpu_gen)
        elif not kept or key != self.disk.key:
            self.disk.invalidate(key)
        return None

    def close(self) -> None:
        """Close the file (it stays valid for the next process of this rank)."""
        if self.disk is not None:
            self.disk.close()
            self.disk = None


def ready_tiers(cpu: bool, disk: DiskTier | None, cpu_gen: int, fresh: bool) -> dict:
    """A READY's ``kept_tiers`` and their ``cpu_gen``: ``cpu`` when the CPU tier is the
    bus's content (``cpu``), ``disk`` when the disk file's blocks are at ``cpu_gen``
    and, for a fresh process, an earlier one spilled them."""
    tiers = [Tier.CPU] if cpu else []
    if disk is not None and disk.cpu_gen == cpu_gen and (disk.kept or not fresh):
        tiers.append(Tier.DISK)
    return {"kept_tiers": tiers, "cpu_gen": cpu_gen} if tiers else {}
