"""The seam between a rank's executor and the memory it copies: ``CacheBackend``.

The executor (``zkv.rank.worker``) works only through this protocol, so a
rank can serve a cache zkv allocates itself (``owned.KVCache``) or one an
inference engine owns (``engine_backend.EngineBackend``, over
``attached.AttachedCache``).  Every method runs on the executor thread.

Tiers are named as on the wire: ``gpu`` is the device tier (zkv's own
tensors, or the engine's), ``cpu`` is zkv's swap space.  ``validate``
refuses what cannot run with ``TaskInvalid`` (its message is the reason the
client sees); the copy methods may assume a validated task.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from ...wire.layout import CacheLayout
from ...wire.protocol import TaskBody


class TaskInvalid(ValueError):
    """A task that cannot run on this cache; the message is the reason."""


@dataclass(frozen=True)
class Freed:
    """What a clear did: bytes released (zkv's own, or engine memory it stopped
    viewing) and whether zkv's CPU tier survived it (``keep_cpu``)."""

    nbytes: int
    cpu_kept: bool


class CacheBackend(Protocol):
    """What a rank's executor needs from a cache (see the module docstring)."""

    layout: CacheLayout  # what the rank announces; gpu_blocks / cpu_blocks bound the ids
    cpu_kept: bool  # whether the last allocate kept the CPU tier of a keep_cpu clear

    @property
    def device(self) -> Any: ...

    @property
    def allocated(self) -> bool: ...

    def validate(self, body: TaskBody) -> None: ...

    def swap(self, op: str, src: Sequence[int], dst: Sequence[int]) -> int: ...

    def fill(self, tier: str, ids: Sequence[int], seed: int) -> int: ...

    def checksum(self, tier: str, ids: Sequence[int]) -> list[bytes]: ...

    def free(self, keep_cpu: bool = False) -> Freed: ...

    def allocate(self, layout: CacheLayout) -> int: ...

    def tier_nbytes(self) -> dict[str, int]: ...

    def nbytes(self) -> int: ...


def check_ids(name: str, ids: Sequence[int], tier: str, limit: int, unique: bool) -> None:
    """Range-check one id list of a task against a tier of ``limit`` blocks."""
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise TaskInvalid(f"{name} block id {bad} is out of range for the {tier} tier (0..{limit - 1})")
    if unique and len(set(ids)) != len(ids):
        raise TaskInvalid(f"{name} has duplicate block ids (two copies would race into one block)")


def check_task(body: TaskBody, gpu_blocks: int, cpu_blocks: int) -> None:
    """The one rule for which ids a task may name, for every backend."""
    blocks = {"gpu": gpu_blocks, "cpu": cpu_blocks}
    if body.op == "swap_out":
        check_ids("src", body.src, "gpu", gpu_blocks, unique=False)
        check_ids("dst", body.dst, "cpu", cpu_blocks, unique=True)
    elif body.op == "swap_in":
        check_ids("src", body.src, "cpu", cpu_blocks, unique=False)
        check_ids("dst", body.dst, "gpu", gpu_blocks, unique=True)
    elif body.op == "fill":
        check_ids("dst", body.dst, body.tier, blocks[body.tier], unique=True)
    elif body.op == "checksum":
        check_ids("src", body.src, body.tier, blocks[body.tier], unique=False)
