"""Which tiers a move of the bus's generations took: one typed reason, ``Loss``.

The bus keeps two (docs/protocol.md §8.2): ``gen`` moves whenever GPU
content is gone, ``cpu_gen`` only when CPU content is gone too (and the
disk tier lives under ``cpu_gen`` as the CPU tier does).  So a move of
``gen`` with ``cpu_gen`` unchanged loses the GPU tier alone; a move of
``cpu_gen``, or of ``gen`` on a bus that names no ``cpu_gen``, loses them
all.  A bus that names no ``gen`` (a test double, an older client) is never
taken to have moved; rows known only by their CPU generation (adopted from a
journal) are lost when the bus's CPU generation differs.  Plain functions of the two pairs: every book of rows
follows the bus with them between calls, and checks a task's tiers with them
around each task."""

from __future__ import annotations

import enum
from typing import Any

from ..wire.vocab import Op, Tier

#: (``gen``, ``cpu_gen``) as a bus names them, None where it names none
Gens = tuple[int | None, int | None]
UNKNOWN: Gens = (None, None)


class Loss(str, enum.Enum):
    """What a generation move took: nothing, the GPU tier alone, or every tier."""

    NONE = "none"
    GPU = "gpu"
    ALL = "all"

    def took(self, tier: Tier | str) -> bool:
        """Whether rows of ``tier`` went with this move."""
        return self is Loss.ALL or (self is Loss.GPU and tier == Tier.GPU)


LOST_NONE, LOST_GPU, LOST_ALL = Loss.NONE, Loss.GPU, Loss.ALL
#: ops that touch only the tiers under ``cpu_gen`` (CPU and disk)
CPU_SIDE_OPS = frozenset({Op.SPILL, Op.LOAD})


def read_gens(bus: Any) -> Gens:
    """The bus's generations (``zkv.client.Client.gen`` / ``.cpu_gen``), None where it tells none."""
    gen, cpu_gen = getattr(bus, "gen", None), getattr(bus, "cpu_gen", None)
    return (gen if type(gen) is int else None, cpu_gen if type(cpu_gen) is int else None)


def lost_between(before: Gens, after: Gens) -> Loss:
    """What went between two readings."""
    gen0, cpu0 = before
    gen1, cpu1 = after
    if gen1 is None:
        return Loss.NONE  # a bus that tells none
    if gen0 is None:  # the first generation heard of; or only the CPU tier's known (rows adopted from a journal)
        return Loss.ALL if cpu0 is not None and cpu1 != cpu0 else Loss.NONE
    if cpu0 is not None and cpu1 != cpu0:
        return Loss.ALL  # the CPU generation moved, or a move came without one (take it as both)
    if gen1 == gen0:
        return Loss.NONE
    return Loss.GPU if cpu0 is not None else Loss.ALL


def moved_under(op: str, before: Gens, after: Gens) -> bool:
    """Whether a task of ``op`` ran while a tier it touches was lost."""
    lost = lost_between(before, after)
    return lost is Loss.ALL if op in CPU_SIDE_OPS else lost is not Loss.NONE
