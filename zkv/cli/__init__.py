"""The ``zkv`` command line (``commands``), its shared options, and the trace
and bench subcommands."""

from .commands import main

__all__ = ["main"]
