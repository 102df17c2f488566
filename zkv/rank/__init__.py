"""A tensor-parallel rank: ``core`` is its control state machine (no sockets,
no torch), ``cache`` the memory it copies (``cache.store.BlockStore``, on
zkv's own tensors or an engine's), ``worker`` the ZMQ loop and copy executor,
and ``agent`` the same rank embedded in an engine's process;
``attach_rank(manifest, ...)`` is a rank on an engine process's exported
tensors (``RankWorker.on_manifest``).

Importing this package does not import torch: ``RankWorker``, ``BlockStore``
and ``RankAgent`` load on first use.
"""

from typing import TYPE_CHECKING, Any

from .core import RankCore
from .registration import RankRefused

if TYPE_CHECKING:
    from .cache.geometry import LayoutGiven
    from .worker import RankWorker

__all__ = ["BlockStore", "RankAgent", "RankCore", "RankRefused", "RankWorker", "attach_rank"]


def attach_rank(
    manifest: str, rank: int, world: int, backend: str, control: str, layout: "LayoutGiven" = None, **options: Any
) -> "RankWorker":
    """A ``RankWorker`` on the tensors an engine process exported in
    ``manifest`` (see ``RankWorker.on_manifest``); call ``serve()`` to run it.
    ``layout`` None: announce the layout of the engine's memory; given, it is
    checked against that memory (``CacheError("bad_layout")`` naming both)."""
    from .worker import RankWorker as Worker

    return Worker.on_manifest(manifest, rank, world, backend, control, layout, **options)


def __getattr__(name: str) -> Any:
    if name == "RankWorker":
        from .worker import RankWorker

        return RankWorker
    if name == "BlockStore":
        from .cache.store import BlockStore

        return BlockStore
    if name == "RankAgent":
        from .agent import RankAgent

        return RankAgent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
