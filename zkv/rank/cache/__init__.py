"""Engine-attached KV cache: regions over memory an engine owns, zkv's
block-major CPU tier, the copy engine between them, and cross-process
manifests.  Torch only; nothing here knows about sockets or the protocol."""

from .errors import CacheError
from .regions import EngineCache, RegionSpec, CacheDescriptor
from .tier import CpuTier
from .copier import CopyEngine
from .attached import AttachedCache

__all__ = ["CacheError", "EngineCache", "RegionSpec", "CacheDescriptor", "CpuTier", "CopyEngine", "AttachedCache"]
