"""A rank's blocks: ``store.BlockStore`` (the device tier's regions from a
``memory`` source, zkv's block-major CPU tier, the copy engine between them),
layout adapters and cross-process manifests.  Torch only; nothing here knows
about sockets or the protocol."""

from .errors import CacheError
from .regions import EngineCache, RegionSpec, CacheDescriptor
from .tier import CpuTier
from .copier import CopyEngine
from .memory import EngineMemory, MemorySource, OwnedMemory
from .store import BlockStore, TaskInvalid

__all__ = ["BlockStore", "CacheError", "CacheDescriptor", "CopyEngine", "CpuTier", "EngineCache", "EngineMemory",
           "MemorySource", "OwnedMemory", "RegionSpec", "TaskInvalid"]
