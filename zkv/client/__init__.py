"""The Python client (``client``) and its book of open tasks (``results``, sans-IO)."""

from .client import Client, ZkvError
from .results import ResultBook

__all__ = ["Client", "ResultBook", "ZkvError"]
