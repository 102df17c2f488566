"""The ``zkv`` command line: ``commands`` (the click group and the processes),
``up`` (all of them on this machine), ``control`` (the client commands),
``options`` (shared options), ``trace`` (``zkv trace`` / ``zkv replay``), ``bench``.

:func:`run` is the process entry point (the ``zkv`` console script and
``python -m zkv``); process-wide settings belong there, not in an import.
"""

import warnings

from ..obs import startup

startup.mark("interpreter")  # the first zkv code a process runs (zkv worker --startup-times)

from .commands import main  # noqa: E402

__all__ = ["main", "run"]


def run() -> None:
    """Run the ``zkv`` command in this process, as its entry point."""
    # zkv never needs numpy, and torch (which does not depend on it) warns at
    # import when it is missing; keep that out of every worker's output.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    main(prog_name="zkv")
