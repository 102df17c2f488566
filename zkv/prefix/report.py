"""What ``PrefixCacheManager.stats()`` reports: every counter in its order, the hit
rates and the tiers' occupancy.  A plain function of the state it reads, so the
report's shape lives in one place and the manager passes its own state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .radix import NodeState
from .swaps import SwapRunner
from .tiers import Tiers

#: every counter ``stats()`` reports, in its order (the swap runner keeps those it moves)
COUNTERS = (
    "lookups",
    "lookups_while_cleared",
    "queried_blocks",
    "gpu_hit_blocks",
    "cpu_hit_blocks",
    "swapped_out_blocks",
    "dropped_gpu_blocks",
    "dropped_cpu_blocks",
    "duplicate_inserts",
    "late_outcomes",
    "reclaimed_blocks",
    "resets",
    "generation_resets",
)


def stats_of(
    tiers: Tiers, swaps: SwapRunner, mine: Mapping[str, int], epoch: int, cleared: bool, block_size: int
) -> dict[str, Any]:
    """The ``stats()`` dict: ``mine`` holds the manager's counters, ``swaps`` the rest."""
    counters = {name: mine[name] if name in mine else swaps.counters[name] for name in COUNTERS}
    queried = counters["queried_blocks"]
    nodes_by_state = dict.fromkeys((state.name for state in NodeState), 0)
    for node in tiers.tree.iter_nodes():
        nodes_by_state[node.state.name] += 1
    gpu, cpu = tiers.gpu, tiers.cpu
    return {
        "epoch": epoch,
        "cleared": cleared,
        "block_size": block_size,
        "gpu_hit_rate": counters["gpu_hit_blocks"] / queried if queried else 0.0,
        "cpu_hit_rate": counters["cpu_hit_blocks"] / queried if queried else 0.0,
        "gpu": {"total": gpu.num_blocks, "used": gpu.num_used, "free": gpu.num_free, "reserved": gpu.num_reserved},
        "cpu": {"total": cpu.num_blocks, "used": cpu.num_used, "free": cpu.num_free},
        "nodes": nodes_by_state,
        "quarantined_blocks": swaps.quarantined_blocks(),
        "quarantined_tasks": len(swaps.quarantine),
        "swaps": {op: dict(values) for op, values in swaps.swap_stats.items()},
        **counters,
    }
