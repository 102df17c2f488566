"""The wire contract every party shares: message kinds and their codec, the
cache layout, task outcomes and how per-rank results fold into one.

Rule: this package imports msgpack, msgspec (the typed fast path of the hot
kinds, ``fast.py``) and the standard library only, never torch and nothing
else of zkv.
"""

from .errors import ZkvError
from .layout import CacheLayout
from .outcome import RankFold, TaskOutcome
from .protocol import ProtocolError, TaskBody

__all__ = ["CacheLayout", "ProtocolError", "RankFold", "TaskBody", "TaskOutcome", "ZkvError"]
