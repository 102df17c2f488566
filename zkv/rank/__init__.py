"""A tensor-parallel rank: ``core`` is its control state machine (no sockets,
no torch), ``kvcache`` its KV tensors and copy engine, ``worker`` the ZMQ loop
and copy executor around both.

Importing this package does not import torch: ``RankWorker`` and ``KVCache``
load on first use.
"""

from typing import Any

from .core import RankCore, RankRefused

__all__ = ["KVCache", "RankCore", "RankRefused", "RankWorker"]


def __getattr__(name: str) -> Any:
    if name == "RankWorker":
        from .worker import RankWorker

        return RankWorker
    if name == "KVCache":
        from .kvcache import KVCache

        return KVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
