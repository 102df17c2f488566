"""A transformers engine on the real bus: a broker process, ``ranks`` engine
replicas each with a zkv rank attached in-process to its cache, a client,
and the swap controller over them.  The demo, the benchmark and the
end-to-end tests all start this, so they exercise the same path.

``rl_cycle`` is the trainer's step in the order of docs/architecture.md: pause (every rank
drained) -> clear (every rank dropped its views of the engine's cache) ->
the engines free their caches -> weights updated -> the engines allocate new
caches -> the ranks take them (a new generation) -> resume.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from ...client.client import Client
from ...engines.idle_policy import IdlePolicy
from ...engines.swap_controller import SwapController
from ...engines.transformers import attach
from ...engines.transformers.build import build_manager
from ...engines.transformers.engine import NoFreeBlocks, TransformersCBEngine
from ...testing.models import parameters
from ..bus.cluster import LocalCluster


class EngineRig:
    """Start with ``with EngineRig(model, ...) as rig``; ``rig.controller`` drives the conversations."""

    def __init__(
        self,
        model: Any,
        *,
        ranks: int = 2,
        num_blocks: int = 32,
        block_size: int = 16,
        cpu_rows: int = 128,
        prefix_sharing: bool = False,
        max_batch_tokens: int = 256,
        policy: IdlePolicy | None = None,
        timeout: float = 10.0,
        ready_timeout: float = 60.0,
        rank_rows: Sequence[int] | None = None,
    ):
        """``rank_rows``: each rank's CPU tier rows when they differ from ``cpu_rows`` (the controller's), to test a
        mis-sized rank."""
        self.model = model
        self.ranks = ranks
        self.cpu_rows = cpu_rows
        self.rank_rows = list(rank_rows) if rank_rows is not None else [cpu_rows] * ranks
        self.timeout = timeout
        self.ready_timeout = ready_timeout
        self._engine_args: dict[str, Any] = {
            "num_blocks": num_blocks,
            "block_size": block_size,
            "max_batch_tokens": max_batch_tokens,
            "prefix_sharing": prefix_sharing,
        }
        self._policy = policy
        self.cluster = LocalCluster(ranks, quiet=True)
        self.replicas: list[TransformersCBEngine] = []
        self.agents: list[Any] = []
        self.client: Client | None = None
        self._controller: SwapController | None = None

    @property
    def frontend(self) -> str:
        return self.cluster.endpoints.frontend

    @property
    def version(self) -> str:
        import transformers

        return transformers.__version__

    @property
    def parameters(self) -> int:
        return parameters(self.model)

    @property
    def controller(self) -> SwapController:
        assert self._controller is not None, "start() first"
        return self._controller

    def new_engine(self) -> TransformersCBEngine:
        """An engine like the replicas, with no zkv attached (for baselines)."""
        return TransformersCBEngine(build_manager(self.model, **self._engine_args))

    def start(self) -> "EngineRig":
        self.cluster.start_broker()
        try:
            self.replicas = [self.new_engine() for _ in range(self.ranks)]
            for rank, engine in enumerate(self.replicas):
                self.agents.append(
                    attach.start_rank(
                        engine,
                        rank,
                        self.ranks,
                        self.cluster.endpoints,
                        self.rank_rows[rank],
                        timeout=self.ready_timeout,
                    )
                )
            self.cluster.wait_ready(self.ready_timeout)
            self.client = Client(self.frontend)
            self._controller = SwapController(
                self.replicas, self.client, self.cpu_rows, policy=self._policy, timeout=self.timeout
            )
        except BaseException:
            self.stop()
            raise
        return self

    def rl_cycle(self, update_weights: Callable[[], None]) -> dict[str, Any]:
        """Pause -> clear -> engines free -> ``update_weights()`` -> new caches -> ranks attach -> resume;
        timings in s."""
        assert self.client is not None
        t: dict[str, Any] = {}
        start = time.perf_counter()
        self.client.pause(timeout=self.timeout)
        t["pause_s"] = time.perf_counter() - start
        start = time.perf_counter()
        self.client.clear(timeout=self.timeout)
        t["clear_s"] = time.perf_counter() - start
        storages = [attach.storage_ref(engine) for engine in self.replicas]
        start = time.perf_counter()
        for engine in self.replicas:
            engine.clear()
        t["engine_free_s"] = time.perf_counter() - start
        t["storage_expired"] = all(s.expired() for s in storages)
        del storages
        self.controller.cleared()
        start = time.perf_counter()
        update_weights()
        t["update_s"] = time.perf_counter() - start
        start = time.perf_counter()
        layouts = [engine.rebuild() for engine in self.replicas]
        t["rebuild_s"] = time.perf_counter() - start
        t["generation"] = layouts[0].generation
        start = time.perf_counter()
        for agent, engine in zip(self.agents, self.replicas):
            attach.reattach(agent, engine)
        self.client.resume(timeout=self.timeout)
        t["resume_s"] = time.perf_counter() - start
        return t

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        for agent in self.agents:
            attach.stop_rank(agent)
        self.agents = []
        self.cluster.stop()

    def __enter__(self) -> "EngineRig":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def hold_ids(replicas: list[TransformersCBEngine], ids: list[int]) -> list[list[int]]:
    """Take the free blocks among ``ids`` on every replica, so that a swap-in lands in other ids (the pool hands a
    just-freed id straight back).  Returns what each replica holds; give it back with ``return_blocks``."""
    wanted = set(ids)
    taken: list[list[int]] = [[] for _ in replicas]
    for _ in range(replicas[0].free_block_count()):
        try:
            got = [engine.take_blocks(1) for engine in replicas]
        except NoFreeBlocks:
            break
        for blocks, more in zip(taken, got):
            blocks.extend(more)
        if wanted <= set(taken[0]):
            break
    held = []
    for engine, blocks in zip(replicas, taken):
        engine.return_blocks([b for b in blocks if b not in wanted])
        held.append([b for b in blocks if b in wanted])
    return held
