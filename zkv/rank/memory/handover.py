"""Which engine cache a resume may attach (docs/engines.md, "Generations and
restarts"): a store's record of the caches it attached, and the rule that a
resume's cache is new memory.

A cache is new when it is a later generation of the engine instance the
store holds, or the first cache of another instance (a restarted engine),
never one of an instance a newer one replaced.  The manifest export a rank
attached at its start counts only once the bus used it (a task named it, or
a resume attached it): until then that very export (its ``nonce``) may be
taken again, so a fresh engine's rank serves on a bus that must resume, or
one restored cleared."""

from __future__ import annotations

from ..errors import CacheError
from .regions import EngineCache


class Attached:
    """The engine cache a store attached last (``generation``, ``instance``,
    ``nonce``), whether the bus used it, and the instances replaced."""

    def __init__(self) -> None:
        self.generation: int | None = None  # of the device tier last attached
        self.instance = ""  # the engine process that exported it ("" in process)
        self.nonce = ""  # the manifest export it was mapped from ("" in process)
        self.used = False  # the bus used it (a resume attached it, or a task named it)
        self._retired: set[str] = set()  # engine instances replaced by a newer one: their manifests are stale

    def check(self, cache: EngineCache) -> None:
        """``CacheError("stale_manifest")`` unless ``cache`` is new memory (see the module docstring)."""
        if self.generation is None:
            return
        if cache.instance in self._retired:
            raise CacheError(
                "stale_manifest",
                f"engine instance {cache.instance} was replaced by {self.instance}: its cache is not the engine's",
            )
        if cache.instance != self.instance:
            return  # a restarted engine: its generations start again
        if not self.used and cache.nonce and cache.nonce == self.nonce:
            return  # the very export attached at start, never part of the bus: taken for the first time
        if type(cache.generation) is not int or cache.generation <= self.generation:
            after = self.generation + 1 if type(self.generation) is int else "N+1"
            raise CacheError(
                "stale_manifest",
                f"generation {cache.generation} is not newer than {self.generation}, which this rank served: "
                f"the engine must hand over its next cache (export generation {after} or later) before the resume",
            )

    def took(self, cache: EngineCache, first: bool) -> None:
        """``cache`` is attached; ``first``: at the store's start (the bus has not used it yet)."""
        self.generation, self.nonce, self.used = cache.generation, cache.nonce, not first
        if cache.instance != self.instance:
            if self.instance:
                self._retired.add(self.instance)
            self.instance = cache.instance
