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
from ..wire.moved import forward
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

# zkv 0.1's names of the allocator (zkv.rows.pool since 0.2) and of the clear cycle (zkv.cycle.prefix), until 0.3
__getattr__ = forward(
    __name__,
    {
        "BlockAllocator": "zkv.rows.pool.RowPool",
        "BlockAllocatorError": "zkv.rows.pool.RowPoolError",
        "drain_and_clear": "zkv.cycle.prefix.drain_and_clear",
        "pause_clear_resume": "zkv.cycle.prefix.pause_clear_resume",
    },
)

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
