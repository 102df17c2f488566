"""The tier moves: which ops move blocks from one tier to another, and the
rules every side of the bus applies to them (docs/protocol.md §6).

Rule 1: a move is data.  ``MOVES`` maps each moving ``Op`` to its ``Move``;
the rank (``rank/store.py``: which ids a task may name, which rows it
checks and seals) and the prefix cache manager (``prefix/swaps.py``: which
blocks a task takes and frees) both read this table and spell no move of
their own.

Rule 2: the same rules for every move.  ``src[i]`` goes to ``dst[i]``; a
source id may repeat, a destination id may not (two copies into one block
would race); a host tier's rows are checked before they are read and sealed
after they are written (the rank's part: a block that does not check is
lost, never served).  A move to or from the keyed store names that side by
``keys[i]`` instead of ids (``Move.keyed``), once each.
"""

from __future__ import annotations

from dataclasses import dataclass

from .vocab import Op, Tier

#: the tiers of rows, nearest to the engine first
TIER_ORDER = (Tier.GPU, Tier.CPU, Tier.DISK)
_DEPTH = (*TIER_ORDER, Tier.STORE)  # the keyed store below them all: it outlives the engine


@dataclass(frozen=True)
class Move:
    """One op's move: ``src`` blocks of tier ``source`` to ``dst`` blocks of tier ``dest``."""

    op: Op
    source: Tier
    dest: Tier

    @property
    def down(self) -> bool:
        """Whether it moves blocks away from the engine (a demotion: swap_out, spill)."""
        return _DEPTH.index(self.dest) > _DEPTH.index(self.source)

    def tier_of(self, field: str) -> Tier:
        """The tier a task's ``src`` or ``dst`` ids name."""
        return self.source if field == "src" else self.dest

    @property
    def keyed(self) -> bool:
        """Whether one side is the keyed store: named by the body's ``keys`` (in a
        namespace, ``ns``), not by ids; the other side's ids are its CPU rows."""
        return Tier.STORE in (self.source, self.dest)

    @property
    def rows(self) -> str:
        """The field naming the CPU rows of a keyed move (``src`` of a put, ``dst`` of a get)."""
        return "src" if self.source == Tier.CPU else "dst"


#: keyed by the ``Op`` members, so that a decoded op (a plain ``str``) finds its move too
MOVES: dict[str, Move] = {
    Op.SWAP_OUT: Move(Op.SWAP_OUT, Tier.GPU, Tier.CPU),
    Op.SWAP_IN: Move(Op.SWAP_IN, Tier.CPU, Tier.GPU),
    Op.SPILL: Move(Op.SPILL, Tier.CPU, Tier.DISK),
    Op.LOAD: Move(Op.LOAD, Tier.DISK, Tier.CPU),
    Op.PUT: Move(Op.PUT, Tier.CPU, Tier.STORE),
    Op.GET: Move(Op.GET, Tier.STORE, Tier.CPU),
}
#: the moves between tiers of ids (rows on both sides): what a book of rows drives
ROW_MOVES = tuple(op for op, move in MOVES.items() if not move.keyed)
#: the moves to and from the keyed store
KEYED_MOVES = tuple(op for op, move in MOVES.items() if move.keyed)

__all__ = ["KEYED_MOVES", "MOVES", "Move", "ROW_MOVES", "TIER_ORDER"]
