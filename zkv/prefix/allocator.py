"""Block allocator for one cache tier (GPU, CPU or disk): hands out block ids 0 … N-1.

A free stack plus an in-use byte per block gives O(1) alloc and free per block
and lets every free be checked: a double free or an id the tier never had is a
bug in the caller that would otherwise surface much later as two owners of one
block, so it raises at once, before anything changes.

``reserved`` ids are blocks of the tier the engine keeps for itself (vLLM's
null block, transformers' scratch rows: docs/engines.md "Reserved rows"):
they count in ``num_blocks`` (ids are the engine's) but are never handed out,
and freeing one is a foreign id.  The rank refuses a swap naming one, so an
allocator that handed one out would fail every swap of that block.  They do
not travel on the wire: the engine side knows them (``RankAgent.reserved_blocks``,
a manifest's ``descriptor.reserved``).
"""

from __future__ import annotations

from collections.abc import Iterable

from ..wire.vocab import Tier


class BlockAllocatorError(ValueError):
    """A block id was misused (double free, foreign id) or the tier is exhausted."""


class DoubleFreeError(BlockAllocatorError):
    """The block is already free."""


class ForeignBlockError(BlockAllocatorError):
    """The id is not a block of this tier (out of range or not an int)."""


class OutOfBlocksError(BlockAllocatorError):
    """Fewer free blocks than asked for; nothing was allocated."""


_RESERVED = 2


class BlockAllocator:
    """Free-list allocator over ``num_blocks`` ids of one tier.

    Freed blocks are reused first (LIFO): cheap, and it makes any use-after-free
    in tests show up immediately instead of by luck.
    """

    __slots__ = ("tier", "num_blocks", "reserved", "peak_used", "_free_stack", "_in_use")

    def __init__(self, num_blocks: int, tier: str = Tier.GPU, reserved: Iterable[int] = ()) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"{tier}: num_blocks must be an int >= 0, got {num_blocks!r}")
        self.tier = tier
        self.num_blocks = num_blocks
        held = frozenset(reserved)
        bad = sorted((b for b in held if type(b) is not int or not 0 <= b < num_blocks), key=repr)
        if bad:
            raise ValueError(f"{tier}: reserved id {bad[0]!r} is not a block id of this tier (0..{num_blocks - 1})")
        self.reserved: frozenset[int] = held
        ids = range(num_blocks - 1, -1, -1)
        self._free_stack: list[int] = [b for b in ids if b not in held] if held else list(ids)  # pops 0, 1, 2, …
        self._in_use = bytearray(num_blocks)  # 0 free, 1 in use, 2 reserved
        for block in held:
            self._in_use[block] = _RESERVED
        self.peak_used = 0  # the most blocks ever in use at once (how close the tier came to full)

    @property
    def num_free(self) -> int:
        return len(self._free_stack)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.reserved) - len(self._free_stack)

    @property
    def num_reserved(self) -> int:
        return len(self.reserved)

    def alloc(self, count: int = 1) -> list[int]:
        """Take ``count`` blocks, all or nothing (raises OutOfBlocksError)."""
        if count < 0:
            raise ValueError(f"{self.tier}: cannot allocate {count} blocks")
        if count > len(self._free_stack):
            raise OutOfBlocksError(
                f"{self.tier}: asked for {count} blocks, only {len(self._free_stack)} of {self.num_blocks} free"
            )
        stack = self._free_stack
        taken = stack[len(stack) - count :]
        del stack[len(stack) - count :]
        taken.reverse()
        in_use = self._in_use
        for block in taken:
            in_use[block] = 1
        used = self.num_blocks - len(self.reserved) - len(stack)
        if used > self.peak_used:
            self.peak_used = used
        return taken

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks; validates all of them first so a bad call changes nothing."""
        ids = list(block_ids)
        self._check_freeable(ids)
        in_use = self._in_use
        for block in ids:
            in_use[block] = 0
        self._free_stack.extend(ids)

    def is_allocated(self, block: int) -> bool:
        return self._owns(block) and self._in_use[block] == 1

    def allocated_ids(self) -> list[int]:
        """Every block in use, ascending (O(N): for invariant checks, not hot paths)."""
        return [block for block, used in enumerate(self._in_use) if used == 1]

    def check(self) -> None:
        """Raise AssertionError if the free stack and the in-use map disagree."""
        free = self._free_stack
        if len(set(free)) != len(free):
            raise AssertionError(f"{self.tier}: a block is on the free stack twice")
        if any(self._in_use[block] for block in free):
            raise AssertionError(f"{self.tier}: a block is both free and in use (or reserved)")
        if sorted(b for b, used in enumerate(self._in_use) if used == _RESERVED) != sorted(self.reserved):
            raise AssertionError(f"{self.tier}: the reserved ids changed")
        if len(free) + self._in_use.count(1) + len(self.reserved) != self.num_blocks:
            raise AssertionError(f"{self.tier}: free + used + reserved != total")

    def _owns(self, block: object) -> bool:
        return isinstance(block, int) and not isinstance(block, bool) and 0 <= block < self.num_blocks

    def _check_freeable(self, ids: list[int]) -> None:
        if not ids:
            return
        in_use = self._in_use
        if (
            all(type(block) is int for block in ids)
            and 0 <= min(ids)
            and max(ids) < self.num_blocks
            and all(in_use[block] == 1 for block in ids)
            and len(set(ids)) == len(ids)
        ):
            return  # the common case, checked in a few C loops; the loop below names a refusal
        seen: set[int] = set()
        for block in ids:
            if not self._owns(block):
                raise ForeignBlockError(
                    f"{self.tier}: {block!r} is not a block id of this tier (0..{self.num_blocks - 1})"
                )
            if self._in_use[block] == _RESERVED:
                raise ForeignBlockError(f"{self.tier}: block {block} is reserved by the engine, never handed out")
            if not self._in_use[block] or block in seen:
                raise DoubleFreeError(f"{self.tier}: block {block} freed twice")
            seen.add(block)
