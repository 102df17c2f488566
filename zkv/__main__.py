"""``python -m zkv`` is the ``zkv`` command."""

from .cli import run

run()
