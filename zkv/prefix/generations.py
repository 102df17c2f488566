"""Which of the prefix cache's tiers a move of the bus's generations took.

The bus keeps two (docs/protocol.md §8.2): ``gen`` moves whenever GPU
content is gone, ``cpu_gen`` only when CPU content is gone too (and the
disk tier lives under ``cpu_gen`` as the CPU tier does).  So a move of
``gen`` with ``cpu_gen`` unchanged loses the GPU tier alone; a move of
``cpu_gen``, or of ``gen`` on a bus that names no ``cpu_gen``, loses them
all.  A bus that names no ``gen`` (a test double, an older client) is never
taken to have moved.  Plain functions of the two pairs: the manager follows
the bus with them between calls, the swap runner checks a task's tiers with
them around each task."""

from __future__ import annotations

from typing import Any

from ..wire.vocab import Op

#: (``gen``, ``cpu_gen``) as a bus names them, None where it names none
Gens = tuple[int | None, int | None]

LOST_NONE, LOST_GPU, LOST_ALL = "none", "gpu", "all"
#: ops that touch only the tiers under ``cpu_gen`` (CPU and disk)
CPU_SIDE_OPS = frozenset({Op.SPILL, Op.LOAD})
UNKNOWN: Gens = (None, None)


def read_gens(bus: Any) -> Gens:
    """The bus's generations (``zkv.client.Client.gen`` / ``.cpu_gen``), None where it tells none."""
    gen, cpu_gen = getattr(bus, "gen", None), getattr(bus, "cpu_gen", None)
    return (gen if type(gen) is int else None, cpu_gen if type(cpu_gen) is int else None)


def lost_between(before: Gens, after: Gens) -> str:
    """What went between two readings: ``LOST_NONE``, ``LOST_GPU`` or ``LOST_ALL``."""
    gen0, cpu0 = before
    gen1, cpu1 = after
    if gen0 is None or gen1 is None:
        return LOST_NONE  # the first generation heard of, or a bus that tells none
    if cpu0 is not None and cpu1 != cpu0:
        return LOST_ALL  # the CPU generation moved, or a move came without one (take it as both)
    if gen1 == gen0:
        return LOST_NONE
    return LOST_GPU if cpu0 is not None else LOST_ALL


def moved_under(op: str, before: Gens, after: Gens) -> bool:
    """Whether a task of ``op`` ran while a tier it touches was lost."""
    lost = lost_between(before, after)
    return lost == LOST_ALL if op in CPU_SIDE_OPS else lost != LOST_NONE
