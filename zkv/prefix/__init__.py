"""Client-side prefix cache: a radix tree of KV blocks over a GPU, a CPU and
(optionally) a disk tier, moving blocks between them through the zkv bus (see
manager.py for the policies).

The pause / clear / resume cycle for a manager and its client is
``zkv.cycle.prefix`` (``drain_and_clear`` and ``pause_clear_resume`` read here
warn until zkv 0.3).
The synthetic chat workload over the real bus (``zkv up --demo``, ``zkv bench
manager``) is ``zkv.harness.prefix.workload``; an in-process fake bus for tests is
``zkv.testing.FakeBus``."""

from ..rows.pool import (
    DoubleFreeError,
    ForeignBlockError,
    OutOfBlocksError,
    RowPool,
    RowPoolError,
)
from .bus import Bus, ControlBus
from .manager import (
    BlockLease,
    CacheClearedError,
    InsertResult,
    InvalidBlockError,
    InvalidLeaseError,
    OutOfGpuBlocksError,
    PrefixCacheError,
    PrefixCacheManager,
)
from .radix import NodeState, RadixNode, RadixTree, block_keys

__all__ = [
    "RowPool",
    "RowPoolError",
    "DoubleFreeError",
    "ForeignBlockError",
    "OutOfBlocksError",
    "Bus",
    "ControlBus",
    "BlockLease",
    "CacheClearedError",
    "InsertResult",
    "InvalidBlockError",
    "InvalidLeaseError",
    "OutOfGpuBlocksError",
    "PrefixCacheError",
    "PrefixCacheManager",
    "NodeState",
    "RadixNode",
    "RadixTree",
    "block_keys",
]


def __getattr__(name: str) -> object:
    if name not in ("drain_and_clear", "pause_clear_resume"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    from ..cycle import prefix

    warnings.warn(
        f"zkv.prefix.{name} moved to zkv.cycle.prefix.{name}; the old name goes in zkv 0.3",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(prefix, name)
