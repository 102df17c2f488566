"""``python -m zkv`` is the ``zkv`` command."""

from .cli.commands import main

main(prog_name="zkv")
