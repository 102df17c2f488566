"""A tensor-parallel rank: ``core`` is its control state machine (no sockets,
no torch), ``cache`` the memory it copies (``cache.backend.CacheBackend``:
zkv's own tensors in ``cache.owned`` or an engine's in
``cache.engine_backend``), ``worker`` the ZMQ loop and copy executor, and
``agent`` the same rank embedded in an engine's process.

Importing this package does not import torch: ``RankWorker``, ``KVCache``
and ``RankAgent`` load on first use.
"""

from typing import Any

from .core import RankCore, RankRefused

__all__ = ["KVCache", "RankAgent", "RankCore", "RankRefused", "RankWorker"]


def __getattr__(name: str) -> Any:
    if name == "RankWorker":
        from .worker import RankWorker

        return RankWorker
    if name == "KVCache":
        from .cache.owned import KVCache

        return KVCache
    if name == "RankAgent":
        from .agent import RankAgent

        return RankAgent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
