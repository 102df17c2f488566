"""``python -m zkv`` is the ``zkv`` command."""

from .cli import main

main(prog_name="zkv")
