"""A tensor-parallel rank: ``core`` is its control state machine (no sockets,
no torch), ``cache`` the memory it copies (``cache.store.BlockStore``, on
zkv's own tensors or an engine's), ``worker`` the ZMQ loop and copy executor,
and ``agent`` the same rank embedded in an engine's process.

Importing this package does not import torch: ``RankWorker``, ``BlockStore``
and ``RankAgent`` load on first use.
"""

from typing import Any

from .core import RankCore, RankRefused

__all__ = ["BlockStore", "RankAgent", "RankCore", "RankRefused", "RankWorker"]


def __getattr__(name: str) -> Any:
    if name == "RankWorker":
        from .worker import RankWorker

        return RankWorker
    if name == "BlockStore":
        from .cache.store import BlockStore

        return BlockStore
    if name == "RankAgent":
        from .agent import RankAgent

        return RankAgent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
