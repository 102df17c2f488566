"""zkv 0.1's ``zkv.rank.cache``, split by concept in zkv 0.2 (``memory/``, ``tiers/``,
``copies/``, ``store``, ``sources``, ``errors``): each old module and each name the
package re-exported works, with a ``DeprecationWarning``, until zkv 0.3."""

from zkv.wire.moved import forward

__getattr__ = forward(
    __name__,
    {
        "BlockStore": "zkv.rank.store.BlockStore",
        "CacheError": "zkv.rank.errors.CacheError",
        "CacheDescriptor": "zkv.rank.memory.descriptor.CacheDescriptor",
        "CopyEngine": "zkv.rank.copies.copier.CopyEngine",
        "CpuTier": "zkv.rank.tiers.cpu_tier.CpuTier",
        "EngineCache": "zkv.rank.memory.regions.EngineCache",
        "EngineMemory": "zkv.rank.sources.EngineMemory",
        "MemorySource": "zkv.rank.sources.MemorySource",
        "OwnedMemory": "zkv.rank.sources.OwnedMemory",
        "RegionSpec": "zkv.rank.memory.descriptor.RegionSpec",
        "TaskInvalid": "zkv.rank.store.TaskInvalid",
    },
)
