"""The prefix cache's errors: ``ZkvError``s whose ``str()`` is the reason."""

from __future__ import annotations

from ..wire.errors import ReasonError


class PrefixCacheError(ReasonError):
    """Base of the prefix cache's errors (a ``ZkvError``; ``str()`` is the reason)."""

    CODE = "prefix_cache"


class CacheClearedError(PrefixCacheError):
    """The KV caches are cleared (between set_cleared() and resume()); nothing can be allocated."""

    CODE = "cache_cleared"


class OutOfGpuBlocksError(PrefixCacheError):
    """Not enough GPU blocks even after evicting every unreferenced cached block."""

    CODE = "out_of_gpu_blocks"


class InvalidBlockError(PrefixCacheError, ValueError):
    """A block id passed in is not one the caller owns at that position."""

    CODE = "invalid_block"


class InvalidLeaseError(PrefixCacheError, ValueError):
    """A lease released twice."""

    CODE = "invalid_lease"
