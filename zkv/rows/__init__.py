"""The book of tier rows every engine path keeps (``RowBook``): a pool of rows
per tier, the tasks that write and read them from submit to settlement (one
rule read off each outcome: ``ending.settle_of``), the generation each tier
lives under (``Loss``: what a move of the bus's generations took), whose KV
the rows hold (``EngineIdentity``, a tier's ``Journal``), the keys starting
and stopping to serve on rows, and the ``Bus`` every owner drives its tasks
through.  Sans-IO but for the journal's file; it imports only ``wire``."""

from .book import Fence, Flight, HeldRowError, ResidencyEvent, RowBook, RowChange, TaskKind
from .bus import Bus, ControlBus
from .ending import Settle, settle_of
from .identity import EngineIdentity
from .loss import LOST_ALL, LOST_GPU, LOST_NONE, UNKNOWN, Gens, Loss, lost_between, moved_under, read_gens
from .pool import DoubleFreeError, ForeignBlockError, OutOfBlocksError, RowPool, RowPoolError

__all__ = [
    "Bus",
    "ControlBus",
    "DoubleFreeError",
    "EngineIdentity",
    "Fence",
    "Flight",
    "ForeignBlockError",
    "Gens",
    "HeldRowError",
    "LOST_ALL",
    "LOST_GPU",
    "LOST_NONE",
    "Loss",
    "OutOfBlocksError",
    "ResidencyEvent",
    "RowBook",
    "RowChange",
    "RowPool",
    "RowPoolError",
    "Settle",
    "TaskKind",
    "UNKNOWN",
    "lost_between",
    "moved_under",
    "read_gens",
    "settle_of",
]
