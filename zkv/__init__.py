"""zkv: a KV-cache transfer bus over ZeroMQ.

Swap KV blocks between GPU memory and CPU swap space on every tensor-parallel
rank at once, and pause / clear / resume every transfer with an explicit
outcome for every task.  See docs/protocol.md for the wire protocol.
"""

import warnings

# zkv never needs numpy, and torch (which does not depend on it) warns at
# import when it is missing; keep that out of every worker's output.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

from .client.client import Client, ZkvError  # noqa: E402
from .wire.layout import CacheLayout  # noqa: E402
from .wire.outcome import TaskOutcome  # noqa: E402

__all__ = ["Client", "ZkvError", "CacheLayout", "TaskOutcome"]
__version__ = "0.1.0"
