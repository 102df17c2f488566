"""Client-side prefix cache: a radix tree of KV blocks over a GPU and a CPU tier,
moving blocks between them through the zkv bus (see manager.py for the policies)."""

from .allocator import (
    BlockAllocator,
    BlockAllocatorError,
    DoubleFreeError,
    ForeignBlockError,
    OutOfBlocksError,
)
from .manager import (
    BlockLease,
    BusLike,
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
    "BlockAllocator", "BlockAllocatorError", "DoubleFreeError", "ForeignBlockError", "OutOfBlocksError",
    "BlockLease", "BusLike", "CacheClearedError", "InsertResult", "InvalidBlockError", "InvalidLeaseError",
    "OutOfGpuBlocksError", "PrefixCacheError", "PrefixCacheManager",
    "NodeState", "RadixNode", "RadixTree", "block_keys",
]
