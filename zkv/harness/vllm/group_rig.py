"""A real vLLM engine on a model with several KV cache groups (``models.py``)
with zkv as its offload backend, and what zkv did for each group: what the
vLLM tests, the GPU check and ``zkv bench vllm`` share (docs/engine-vllm.md,
"Models with several KV cache groups").

``GroupEngine`` starts one (``start_engine`` of ``rig.py``) with zkv's tiers
and the embedded broker's ``/metrics`` on a port of its own, where the
manager counts blocks per group (``zkv_vllm_group_blocks_total``);
``reference`` is the same engine with zkv out of the way (its bus paused:
every lookup misses, every store is skipped), vLLM's own cache reset
around it.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...engines.vllm.settings import METRICS_URL_FILE
from .rig import BusProbe, start_engine, stop_engine, zkv_transfer

METRIC = "zkv_vllm_group_blocks_total"


def group_blocks(url: str) -> dict[int, dict[str, int]]:
    """group -> event -> blocks, scraped from the manager's ``/metrics`` (one bounded read)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[int, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == METRIC:
                out.setdefault(int(s.labels["group"]), {})[s.labels["event"]] = int(s.value)
    return out


def delta(after: dict[int, dict[str, int]], before: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
    """What each group's counts grew by between two scrapes."""
    return {g: {e: n - before.get(g, {}).get(e, 0) for e, n in ev.items()} for g, ev in after.items()}


@dataclass
class GroupEngine:
    """One engine with zkv on ``root``'s tiers: ``restart`` keeps the tiers and the bus."""

    model: str
    root: Path
    gpu_blocks: int
    settings: dict[str, Any] = field(default_factory=dict)
    dtype: str = "auto"
    max_model_len: int = 1024
    llm: Any = None

    def __post_init__(self) -> None:
        self.transfer = zkv_transfer(
            self.root / "bus",
            **{
                "cpu_blocks": 40,
                "tier_dir": str(self.root),
                "status_interval_s": 0.0,  # see a pause at once (a test pauses and reads right after)
                "metrics_port": 0,  # a free port, said in bus_dir/metrics.url
                **self.settings,
            },
        )
        self.probe = BusProbe(self.root / "bus")

    @property
    def metrics_url(self) -> str:
        """The manager's ``/metrics``, where the engine's broker says it serves them."""
        return (self.root / "bus" / METRICS_URL_FILE).read_text().strip()

    def start(self) -> GroupEngine:
        self.llm = start_engine(self.model, self.transfer, self.gpu_blocks, self.max_model_len, dtype=self.dtype)
        self.probe.status(wait_ranks=1)
        return self

    def stop(self) -> None:
        if self.llm is not None:
            stop_engine(self.llm)
            self.llm = None

    def restart(self, model: str | None = None) -> GroupEngine:
        """Stop, then start on the same tiers (``model``: another checkpoint)."""
        self.stop()
        self.model = model or self.model
        return self.start()

    def blocks(self) -> dict[int, dict[str, int]]:
        return group_blocks(self.metrics_url)

    def counted(self, run: Callable[[Any], Any]) -> tuple[Any, dict[int, dict[str, int]]]:
        """``run(llm)``'s result and the blocks per group it moved."""
        before = self.blocks()
        out = run(self.llm)
        return out, delta(self.blocks(), before)

    def reference(self, run: Callable[[Any], Any]) -> Any:
        """``run(llm)`` with zkv out of the way: the engine's own recompute."""
        with self.probe.client() as c:
            c.pause(timeout=30)
            self.llm.reset_prefix_cache()
            try:
                return run(self.llm)
            finally:
                c.resume(timeout=30)
                self.llm.reset_prefix_cache()
