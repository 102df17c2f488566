"""The book of tier rows every engine path keeps (``RowBook``): a pool of rows
per tier, the rows a task that may still write them holds out of reach, the
generation each tier lives under (``Loss``: what a move of the bus's
generations took), and the residency events owners announce.  Sans-IO; it
imports only ``wire``."""

from .book import Held, HeldRowError, ResidencyEvent, RowBook, may_write_late
from .loss import LOST_ALL, LOST_GPU, LOST_NONE, UNKNOWN, Gens, Loss, lost_between, moved_under, read_gens
from .pool import DoubleFreeError, ForeignBlockError, OutOfBlocksError, RowPool, RowPoolError

__all__ = [
    "DoubleFreeError",
    "ForeignBlockError",
    "Gens",
    "Held",
    "HeldRowError",
    "LOST_ALL",
    "LOST_GPU",
    "LOST_NONE",
    "Loss",
    "OutOfBlocksError",
    "ResidencyEvent",
    "RowBook",
    "RowPool",
    "RowPoolError",
    "UNKNOWN",
    "lost_between",
    "may_write_late",
    "moved_under",
    "read_gens",
]
