"""zkv: a KV-cache transfer bus over ZeroMQ.

Swap KV blocks between GPU memory and CPU swap space on every tensor-parallel
rank at once, and pause / clear / resume every transfer with an explicit
outcome for every task.  See docs/protocol.md for the wire protocol and
docs/architecture.md for the packages and the import rules between them.

Importing zkv changes nothing process-wide (no warning filters, no torch
settings, no torch import), and loads nothing until a name is used: a
process that runs one part of zkv (a rank worker) imports only that part.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Client
    from .fleet import Fleet, FleetError
    from .wire import CacheLayout, TaskOutcome
    from .wire.errors import ZkvError

__all__ = ["Client", "Fleet", "FleetError", "ZkvError", "CacheLayout", "TaskOutcome"]
__version__ = "0.2.0"


def __getattr__(name: str) -> Any:
    if name == "Client":
        from .client import Client

        return Client
    if name in ("Fleet", "FleetError"):
        from . import fleet

        return getattr(fleet, name)
    if name in ("CacheLayout", "TaskOutcome"):
        from . import wire

        return getattr(wire, name)
    if name == "ZkvError":
        from .wire.errors import ZkvError

        return ZkvError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
