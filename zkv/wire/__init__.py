"""The wire contract every party shares: message kinds and their codec, the
cache layout, task outcomes and how per-rank results fold into one.

Rule: this package imports msgpack and the standard library only, never torch
and nothing else of zkv (one phase-2 exception: ``protocol.pack_ids`` reaches
``zkv.rank.cache.owned`` lazily when it is handed a tensor).
"""

from .layout import CacheLayout
from .outcome import RankFold, TaskOutcome
from .protocol import ProtocolError, TaskBody

__all__ = ["CacheLayout", "ProtocolError", "RankFold", "TaskBody", "TaskOutcome"]
