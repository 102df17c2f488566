"""The Python client (``client``) and its book of open tasks (``results``, sans-IO)."""

from ..wire.errors import ZkvError
from .client import Client
from .results import ResultBook

__all__ = ["Client", "ResultBook", "ZkvError"]
