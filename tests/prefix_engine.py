"""A stand-in engine over the prefix cache manager and the in-process fake bus,
for the tests of its tiers and generations: every request is match + allocate
+ compute (``kv_of(key)`` written into the fake GPU) + insert + release, and a
match's blocks must hold their data."""

from __future__ import annotations

from zkv.prefix import PrefixCacheManager, block_keys
from zkv.testing.fakebus import FakeBus

BS = 4


def prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * BS)]


def kv_of(key: bytes) -> tuple[str, str]:
    return ("kv", key.hex())


class Engine:
    """One manager on a fake bus (given, or a fresh one) and the requests it serves."""

    def __init__(self, gpu: int = 4, cpu: int = 4, disk: int = 8, bus: FakeBus | None = None, **kwargs) -> None:
        self.bus = bus or FakeBus()
        self.manager = PrefixCacheManager(self.bus, BS, gpu, cpu, num_disk_blocks=disk, **kwargs)

    def serve(self, tokens: list[int]):
        """match (its blocks must hold their data) + allocate + compute + insert + release."""
        manager, keys = self.manager, block_keys(tokens, BS)
        cached = manager.match(tokens)
        assert [self.bus.gpu.get(b) for b in cached.block_ids] == [kv_of(k) for k in keys[: cached.num_blocks]]
        fresh = manager.allocate(len(keys) - cached.num_blocks)
        for position, block in enumerate(fresh.block_ids, start=cached.num_blocks):
            self.bus.gpu[block] = kv_of(keys[position])
        manager.insert(tokens, cached.block_ids + fresh.block_ids)
        manager.release(cached)
        manager.release(fresh)
        manager.check_invariants()
        return cached

    def stats(self) -> dict:
        return self.manager.stats()
