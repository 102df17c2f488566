"""What a request holds of the prefix cache (``BlockLease``) and what an
insert did (``InsertResult``); the manager hands both out (manager.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .radix import RadixNode


@dataclass(eq=False)
class BlockLease:
    """GPU blocks lent to one request, in order; give them back with ``release()``.

    Leases from before a reset/clear are stale: releasing one is a no-op.
    """

    block_ids: list[int]
    epoch: int
    gpu_hit_blocks: int = 0  # match only: blocks that were already on the GPU
    cpu_hit_blocks: int = 0  # match only: blocks swapped in from the CPU
    disk_hit_blocks: int = 0  # match only: blocks loaded from the disk, then swapped in
    released: bool = False
    allocated: bool = False  # made by allocate(): its blocks are private until inserted
    # the stretches of the tree it holds: (deepest node, the node above the shallowest); a node
    # cut later leaves both halves inside the stretch (``PrefixCacheManager.release``)
    held: list[tuple[RadixNode, RadixNode]] = field(default_factory=list, repr=False)
    keys: list[bytes] = field(default_factory=list, repr=False)  # match only: block keys of the tokens asked for

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class InsertResult:
    new_blocks: int  # blocks that became new tree nodes
    duplicate_blocks: int  # already cached on the GPU elsewhere: the caller's block stays private
    adopted_from_cpu: int  # cached on the CPU only: the node moved onto the caller's block
    adopted_from_disk: int = 0  # cached on the disk only: likewise
