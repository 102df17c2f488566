"""A transformers engine's cache as a zkv rank: ``RankAgent`` (in-process,
background threads) over the engine's own flat cache tensor.

The regions come from ``layouts.transformers_cb``: one region, a row per
block id (scratch rows included; the engine never hands those out, so no
task names them).  The layout the rank announces carries the model's
fields; zkv copies byte pages and only checks ``gpu_blocks``/``cpu_blocks``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..net.endpoints import Endpoints
from ..rank.agent import RankAgent
from ..rank.cache import layouts
from ..rank.cache.regions import TensorEntry
from ..wire.layout import CacheLayout
from .transformers_cb import TransformersCBEngine

_WIRE_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def cache_entries(engine: TransformersCBEngine) -> list[TensorEntry]:
    """The engine's current cache as regions zkv can copy block by block."""
    layout = engine.layout
    return layouts.transformers_cb(engine.cache_tensor, layout.layers, layout.block_size, layout.kv_heads,
                                   layout.head_dim, layout.dtype)


def bus_layout(engine: TransformersCBEngine, cpu_rows: int) -> CacheLayout:
    layout = engine.layout
    return CacheLayout(layers=layout.layers, gpu_blocks=layout.num_blocks, cpu_blocks=cpu_rows, block_size=layout.block_size,
                       kv_heads=layout.kv_heads, head_dim=layout.head_dim, dtype=_WIRE_DTYPES.get(layout.dtype, "bf16"))


def start_rank(engine: TransformersCBEngine, rank: int, world: int, endpoints: Endpoints, cpu_rows: int, *,
               timeout: float = 30.0, **agent_args: Any) -> RankAgent:
    """A rank of the bus on ``engine``'s cache, registered with the broker when this returns."""
    agent = RankAgent(rank, world, endpoints.backend, endpoints.control, cache_entries(engine), cpu_rows,
                      layout=bus_layout(engine, cpu_rows), **agent_args)
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
