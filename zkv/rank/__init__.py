"""A tensor-parallel rank, one room per concept:

- ``core`` (with ``actions``, ``registration``, ``batching``, ``cache_phase``):
  its control state machine, no sockets, no torch;
- ``memory/``: the KV memory it copies, as regions of block pages (engine
  layouts, descriptors, geometry, cross-process manifests and shared memory);
- ``tiers/``: zkv's own tiers below it (the CPU tier, its file and the rank's
  lock beside it, the disk tier);
- ``copies/``: the copies between the two (the copy engine, its CPU and CUDA
  paths);
- ``store.BlockStore``: one rank's memory, tiers and copy engine, on a memory
  source (``sources``: zkv's own tensors or an engine's);
- ``worker``, ``executor``, ``runner``: the ZMQ loop and the copy executor;
  ``agent``: the same rank embedded in an engine's process;
``attach_rank(manifest, ...)`` is a rank on an engine process's exported
tensors (``RankWorker.on_manifest``).

Importing this package does not import torch: ``RankWorker``, ``BlockStore``
and ``RankAgent`` load on first use.
"""

from typing import TYPE_CHECKING, Any

from .core import RankCore
from .registration import RankRefused

if TYPE_CHECKING:
    from .memory.geometry import LayoutGiven
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
        from .store import BlockStore

        return BlockStore
    if name == "RankAgent":
        from .agent import RankAgent

        return RankAgent
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
