"""Import paths a release moved keep working for one minor release, and say
where to go (docs/versions.md, "How an interface goes away").

Each old module is a stub of two lines, ``moved(globals(), "new.path")``:
imported, it warns (a ``DeprecationWarning`` naming the new path and the
release that removes the old one) and *is* the new module, so every name and
``isinstance`` keeps its meaning; run as ``python -m old.path``, it says the
same on stderr and runs the new module as the command.  A name that changed
too is looked up under its new one (``renamed``), and a package whose
``__init__`` re-exported names forwards them (``forward``).  Standard library
only: nothing here imports the new module until the old one is used.
"""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings
from typing import Any, Callable

MOVED_IN = "0.2"
REMOVED_IN = "0.3"  # the release whose import of an old path fails


def said(old: str, new: str) -> str:
    """What an old path says: where it went, and when it stops working."""
    return f"{old} moved to {new} in zkv {MOVED_IN}; the old path stops working in zkv {REMOVED_IN}"


def moved(namespace: dict[str, Any], new: str, renamed: dict[str, str] | None = None) -> None:
    """Called from the body of the stub at the old path (``namespace``: its ``globals()``).
    ``renamed``: old name -> name in ``new`` for the names that changed too."""
    spec = namespace.get("__spec__")
    old = spec.name if spec is not None else namespace["__name__"]
    if namespace["__name__"] == "__main__":  # python -m OLD: a command, told on stderr like the CLI's notes
        sys.stderr.write(f"zkv: note: {said(old, new)}: run python -m {new}\n")
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    # stacklevel 3: past this function and the stub's body, to the import that named the old path
    warnings.warn(said(old, new), DeprecationWarning, stacklevel=3)
    target = importlib.import_module(new)
    if not renamed:
        sys.modules[old] = target  # the import returns what sys.modules holds: the module itself
        return
    namespace["__getattr__"] = _lookup(target, renamed)
    namespace["__all__"] = [*renamed, *getattr(target, "__all__", ())]


def forward(package: str, names: dict[str, str]) -> Callable[[str], Any]:
    """A package ``__getattr__`` for the names its old ``__init__`` re-exported
    (name -> ``module.attribute`` where it lives now); each use warns."""

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = where.rpartition(".")
        warnings.warn(said(f"{package}.{name}", where), DeprecationWarning, stacklevel=2)
        value = getattr(importlib.import_module(module), attribute)
        setattr(sys.modules[package], name, value)  # found from now on: one warning per name
        return value

    return __getattr__


def _lookup(target: Any, renamed: dict[str, str]) -> Callable[[str], Any]:
    def __getattr__(name: str) -> Any:
        return getattr(target, renamed.get(name, name))

    return __getattr__


__all__ = ["MOVED_IN", "REMOVED_IN", "forward", "moved", "said"]
