"""The rows of one tier (GPU blocks, CPU rows, disk rows): hands out ids 0 … N-1.

A free stack plus the set of blocks in use gives O(1) alloc and free per block
(the set's updates and checks run in C, a block list at a time) and lets every
free be checked: a double free or an id the tier never had is a
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


class RowPoolError(ValueError):
    """A block id was misused (double free, foreign id) or the tier is exhausted."""


class DoubleFreeError(RowPoolError):
    """The block is already free."""


class ForeignBlockError(RowPoolError):
    """The id is not a block of this tier (out of range or not an int)."""


class OutOfBlocksError(RowPoolError):
    """Fewer free blocks than asked for; nothing was allocated."""


_INT_ONLY = {int}  # the types of a list of good ids (type(), so a bool is not one)


class RowPool:
    """Free-list pool over ``num_blocks`` ids of one tier (``RowBook`` holds one per tier).

    Freed blocks are reused first (LIFO): cheap, and it makes any use-after-free
    in tests show up immediately instead of by luck.
    """

    __slots__ = ("tier", "num_blocks", "reserved", "peak_used", "_free_stack", "_used")

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
        self._used: set[int] = set()  # handed out and not yet freed
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
        self._used.update(taken)
        used = self.num_blocks - len(self.reserved) - len(stack)
        if used > self.peak_used:
            self.peak_used = used
        return taken

    def claim(self, block_ids: Iterable[int]) -> None:
        """Take these free blocks, all or nothing: rows a restarted owner finds
        its own in a record it kept (raises before anything changes)."""
        ids = list(block_ids)
        if len(set(ids)) != len(ids):
            raise DoubleFreeError(f"{self.tier}: a block is claimed twice in {ids}")
        for block in ids:
            if not self._owns(block) or block in self.reserved:
                raise ForeignBlockError(f"{self.tier}: {block!r} is not a block id this tier hands out")
            if block in self._used:
                raise DoubleFreeError(f"{self.tier}: block {block} is in use, not free to claim")
        taken = set(ids)
        self._free_stack = [b for b in self._free_stack if b not in taken]
        self._used.update(taken)
        self.peak_used = max(self.peak_used, self.num_used)

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks; validates all of them first so a bad call changes nothing."""
        ids = list(block_ids)
        self.check_freeable(ids)
        self._used.difference_update(ids)
        self._free_stack.extend(ids)

    def is_allocated(self, block: int) -> bool:
        return self._owns(block) and block in self._used

    def free_ids(self) -> list[int]:
        """The free ids, the next one handed out last (for checks, not hot paths)."""
        return list(self._free_stack)

    def allocated_ids(self) -> list[int]:
        """Every block in use, ascending (O(N): for invariant checks, not hot paths)."""
        return sorted(self._used)

    def check(self) -> None:
        """Raise AssertionError if the free stack and the in-use map disagree."""
        free = self._free_stack
        if len(set(free)) != len(free):
            raise AssertionError(f"{self.tier}: a block is on the free stack twice")
        if (
            not self._used.isdisjoint(free)
            or not self.reserved.isdisjoint(free)
            or not self.reserved.isdisjoint(self._used)
        ):
            raise AssertionError(f"{self.tier}: a block is both free and in use (or reserved)")
        if any(type(b) is not int or not 0 <= b < self.num_blocks for b in (*free, *self._used)):
            raise AssertionError(f"{self.tier}: a block id out of range is free or in use")
        if len(free) + len(self._used) + len(self.reserved) != self.num_blocks:
            raise AssertionError(f"{self.tier}: free + used + reserved != total")

    def _owns(self, block: object) -> bool:
        return isinstance(block, int) and not isinstance(block, bool) and 0 <= block < self.num_blocks

    def check_freeable(self, ids: list[int]) -> None:
        """Raise (``DoubleFreeError``, ``ForeignBlockError``) unless every id is in use, once."""
        if not ids:
            return
        if set(map(type, ids)) == _INT_ONLY and self._used.issuperset(ids) and len(set(ids)) == len(ids):
            return  # the common case (ints in use, once each: in range), in C; the loop below names a refusal
        seen: set[int] = set()
        for block in ids:
            if not self._owns(block):
                raise ForeignBlockError(
                    f"{self.tier}: {block!r} is not a block id of this tier (0..{self.num_blocks - 1})"
                )
            if block in self.reserved:
                raise ForeignBlockError(f"{self.tier}: block {block} is reserved by the engine, never handed out")
            if block not in self._used or block in seen:
                raise DoubleFreeError(f"{self.tier}: block {block} freed twice")
            seen.add(block)
