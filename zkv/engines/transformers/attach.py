"""A transformers engine's cache as a zkv rank: ``RankAgent`` (in-process,
background threads) over the engine's own flat cache tensor.

The regions come from ``layout.regions``: one region, a row per block id,
the scratch rows declared reserved (the engine never hands them out, and the
rank refuses a swap or fill that names one).  The layout the rank announces
carries the model's fields and the cache's rows (``layout.model_layout``);
the rank checks it against the tensor (block count, bytes per block).
"""

from __future__ import annotations

from typing import Any

from torch.multiprocessing.reductions import StorageWeakRef

from ...net.endpoints import Endpoints
from ...rank.agent import RankAgent
from ...rank.memory.regions import TensorEntry
from .engine import TransformersCBEngine
from .layout import model_layout, regions


def cache_entries(engine: TransformersCBEngine) -> list[TensorEntry]:
    """The engine's current cache as regions zkv can copy block by block."""
    layout = engine.layout
    return regions(
        engine.cache_tensor,
        layout.layers,
        layout.block_size,
        layout.kv_heads,
        layout.head_dim,
        layout.dtype,
        layout.scratch_blocks,
    )


def start_rank(
    engine: TransformersCBEngine,
    rank: int,
    world: int,
    endpoints: Endpoints,
    cpu_rows: int,
    *,
    timeout: float = 30.0,
    **agent_args: Any,
) -> RankAgent:
    """A rank of the bus on ``engine``'s cache, registered with the broker when this returns."""
    agent = RankAgent(
        rank,
        world,
        endpoints.backend,
        endpoints.control,
        cache_entries(engine),
        cpu_rows,
        layout=model_layout(engine.layout, cpu_rows),
        **agent_args,
    )
    agent.start(timeout)
    return agent


def reattach(agent: RankAgent, engine: TransformersCBEngine) -> None:
    """After the engine's ``rebuild()``: its new cache for the bus's next resume (a new generation)."""
    agent.attach(cache_entries(engine))


def stop_rank(agent: RankAgent, timeout: float = 10.0) -> None:
    agent.stop(timeout)


def storage_ref(engine: TransformersCBEngine) -> StorageWeakRef:
    """A weak reference to the engine cache's storage: ``expired()`` once nobody, zkv included, holds it."""
    return StorageWeakRef(engine.cache_tensor.untyped_storage())
