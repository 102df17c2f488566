"""The Python client (``client``), its typed replies (``replies``) and its book
of open tasks (``results``, sans-IO)."""

from ..wire.errors import ZkvError
from .client import Client
from .replies import CancelReply, ControlReply, PingReply, RankStatus, StatusReply
from .results import ResultBook

__all__ = ["CancelReply", "Client", "ControlReply", "PingReply", "RankStatus", "ResultBook", "StatusReply", "ZkvError"]
