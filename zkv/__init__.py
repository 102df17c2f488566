"""zkv: a KV-cache transfer bus over ZeroMQ.

Swap KV blocks between GPU memory and CPU swap space on every tensor-parallel
rank at once, and pause / clear / resume every transfer with an explicit
outcome for every task.  See docs/protocol.md for the wire protocol and
docs/architecture.md for the packages and the import rules between them.

Importing zkv changes nothing process-wide (no warning filters, no torch
settings, no torch import).
"""

from .client import Client
from .fleet import Fleet, FleetError
from .wire import CacheLayout, TaskOutcome
from .wire.errors import ZkvError

__all__ = ["Client", "Fleet", "FleetError", "ZkvError", "CacheLayout", "TaskOutcome"]
__version__ = "0.1.0"
