"""The Python client (``client``), the typed replies it returns (``wire/replies.py``) and its book
of open tasks (``results``, sans-IO)."""

from ..wire.errors import ZkvError
from ..wire.replies import CancelReply, ControlReply, PingReply, RankStatus, StatusReply
from .client import Client
from .results import ResultBook

__all__ = ["CancelReply", "Client", "ControlReply", "PingReply", "RankStatus", "ResultBook", "StatusReply", "ZkvError"]
