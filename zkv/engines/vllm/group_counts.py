"""What zkv did for each KV cache group of a vLLM engine, counted in blocks by
the manager (docs/engine-vllm.md, "Models with several KV cache groups"),
and exported beside the bus's own metrics on the embedded broker's
``/metrics`` (``metrics_port``) as ``zkv_vllm_group_blocks_total{group,
spec, event}``.

The events: ``stored`` (vLLM's store into a CPU row ended ok), ``hit`` (a
lookup found a key readable on the CPU tier), ``served`` (vLLM's load from a
CPU row into its KV cache ended ok), ``from_disk`` (a key brought back from
the disk tier into a CPU row, before it was served), ``fetched`` (the same
from the shared store), ``spilled`` (a CPU row copied to the disk tier).
Every (group, event) exists from the start at 0, so the scrape thread reads a
dict that never changes size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from .groups import group_of

EVENTS = ("stored", "hit", "served", "from_disk", "fetched", "spilled")


class GroupCounts:
    """Blocks per (group, event); ``specs``: group index -> spec class name."""

    def __init__(self, specs: dict[int, str]):
        self.specs = dict(specs) or {0: "unknown"}
        self.blocks: dict[tuple[int, str], int] = {(g, e): 0 for g in self.specs for e in EVENTS}

    def add(self, event: str, keys: Iterable[bytes]) -> None:
        for key in keys:
            slot = (group_of(key), event)
            if slot in self.blocks:  # a key of a group vLLM never named: not counted
                self.blocks[slot] += 1

    def by_group(self) -> dict[int, dict[str, int]]:
        """group -> event -> blocks (what ``stats()`` and the log show)."""
        return {g: {e: self.blocks[(g, e)] for e in EVENTS} for g in self.specs}


class GroupCollector(Collector):
    """Reads a ``GroupCounts`` at scrape time (a copy: the scheduler thread writes it)."""

    def __init__(self, counts: GroupCounts):
        self.counts = counts

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "zkv_vllm_group_blocks",
            "vLLM blocks zkv stored, found, served, brought back from disk or spilled, per KV cache group",
            labels=["group", "spec", "event"],
        )
        for (group, event), n in sorted(dict(self.counts.blocks).items()):
            family.add_metric([str(group), self.counts.specs[group], event], n)
        yield family
