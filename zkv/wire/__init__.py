"""The wire contract every party shares: its vocabulary, one typed message
per kind and their codec, the cache layout, task outcomes and how per-rank
results fold into one.

Rule: this package imports msgpack, msgspec (the typed fast path of the hot
kinds, ``fast.py``) and the standard library only, never torch and nothing
else of zkv.
"""

from .errors import ZkvError
from .layout import CacheLayout
from .messages import Message
from .outcome import RankFold, TaskOutcome
from .protocol import ProtocolError, TaskBody
from .vocab import VERSION, ControlOp, Dtype, Op, Outcome, Tier

__all__ = [
    "VERSION",
    "CacheLayout",
    "ControlOp",
    "Dtype",
    "Message",
    "Op",
    "Outcome",
    "ProtocolError",
    "RankFold",
    "TaskBody",
    "TaskOutcome",
    "Tier",
    "ZkvError",
]
