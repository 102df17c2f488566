"""Public test doubles for code built on zkv, in the spirit of ``trio.testing``.

- :class:`Sim` wires a ``BrokerCore`` to N ``RankCore`` objects through queues
  that only move when the test says so: exact interleavings, no sockets.
- :class:`FakeBus` is an in-process bus for the prefix cache manager whose
  outcome per task is scripted.

Not re-exported (each loads what it needs when used): ``models`` (seeded
random models), and ``runner/``, the machinery of zkv's own test runs, apart
from the doubles: ``runner.zygote`` (rank workers forked from one process
that imported torch, for test clusters), ``runner.netns`` and
``runner.netns_bus`` (many hosts on one machine, a Curve bus across them).
"""

from .fakebus import FakeBus, FakeBusError
from .sim import Sim

__all__ = ["FakeBus", "FakeBusError", "Sim"]
