"""``python -m zkv`` is the ``zkv`` command (and ``bin/zkv`` runs it from a
checkout): a dependency that is not installed is one line saying what to
install, never a traceback."""

import sys

_NEEDS = ("zmq", "msgpack", "msgspec", "torch", "numpy", "click", "prometheus_client")


def _missing(err: ModuleNotFoundError) -> None:
    if (err.name or "").split(".")[0] not in _NEEDS:
        raise err
    sys.stderr.write(
        f"zkv: error: a dependency is missing: {err.name} is not installed for {sys.executable} "
        "(install zkv with its dependencies: pip install -e . in the zkv checkout, as the README says)\n"
    )
    sys.exit(1)


try:
    from .cli import run
except ModuleNotFoundError as err:
    _missing(err)
else:
    try:
        run()
    except ModuleNotFoundError as err:
        _missing(err)
