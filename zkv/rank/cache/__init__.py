"""A rank's blocks: ``store.BlockStore`` (the device tier's regions from a
``memory`` source, zkv's block-major CPU tier, the copy engine between them),
layout adapters and cross-process manifests.  Torch only; nothing here knows
about sockets or the protocol."""

from .copier import CopyEngine
from .cpu_tier import CpuTier
from .descriptor import CacheDescriptor, RegionSpec
from .errors import CacheError
from .memory import EngineMemory, MemorySource, OwnedMemory
from .regions import EngineCache
from .store import BlockStore, TaskInvalid

__all__ = [
    "BlockStore",
    "CacheError",
    "CacheDescriptor",
    "CopyEngine",
    "CpuTier",
    "EngineCache",
    "EngineMemory",
    "MemorySource",
    "OwnedMemory",
    "RegionSpec",
    "TaskInvalid",
]
