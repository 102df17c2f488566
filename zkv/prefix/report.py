"""What ``PrefixCacheManager.stats()`` reports: every counter in its order, the hit
rates per tier and the tiers' occupancy.  A plain function of the state it reads, so the
report's shape lives in one place and the manager passes its own state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..rows.pool import RowPool
from ..wire.vocab import Tier
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
    "disk_hit_blocks",
    "swapped_out_blocks",
    "spilled_blocks",
    "loaded_blocks",
    "dropped_gpu_blocks",
    "dropped_cpu_blocks",
    "dropped_disk_blocks",
    "duplicate_inserts",
    "late_outcomes",
    "reclaimed_blocks",
    "resets",
    "generation_resets",  # the bus lost every tier (its cpu_gen moved): the tree reset
    "gpu_generation_drops",  # the bus lost the GPU tier only (its gen moved alone): the GPU nodes went
)


def _usage(pool: RowPool) -> dict[str, int]:
    return {
        "total": pool.num_blocks,
        "used": pool.num_used,
        "free": pool.num_free,
        "peak_used": pool.peak_used,
    }


def stats_of(
    tiers: Tiers, swaps: SwapRunner, mine: Mapping[str, int], epoch: int, cleared: bool, block_size: int
) -> dict[str, Any]:
    """The ``stats()`` dict: ``mine`` holds the manager's counters, ``swaps`` the rest.

    ``<tier>_hit_rate``: the share of queried blocks served from that tier (a
    CPU or disk hit came to the GPU for the lease); ``dropped_<tier>_blocks``:
    blocks forgotten on that tier for want of room below it, or after a
    failed task; ``nodes``: the tree's runs in each state, ``blocks``: the
    blocks those runs hold."""
    counters = {name: mine[name] if name in mine else swaps.counters[name] for name in COUNTERS}
    queried = counters["queried_blocks"]
    nodes_by_state = dict.fromkeys((state.name for state in NodeState), 0)
    blocks_by_state = dict.fromkeys((state.name for state in NodeState), 0)
    for node in tiers.tree.iter_nodes():
        nodes_by_state[node.state.name] += 1
        blocks_by_state[node.state.name] += len(node.keys)
    return {
        "epoch": epoch,
        "cleared": cleared,
        "block_size": block_size,
        "gpu_hit_rate": counters["gpu_hit_blocks"] / queried if queried else 0.0,
        "cpu_hit_rate": counters["cpu_hit_blocks"] / queried if queried else 0.0,
        "disk_hit_rate": counters["disk_hit_blocks"] / queried if queried else 0.0,
        Tier.GPU: {**_usage(tiers.gpu), "reserved": tiers.gpu.num_reserved},
        Tier.CPU: _usage(tiers.cpu),
        Tier.DISK: _usage(tiers.disk),
        "nodes": nodes_by_state,
        "blocks": blocks_by_state,
        "quarantined_blocks": tiers.book.held(),
        "quarantined_tasks": tiers.book.num_held_tasks,
        "swaps": {op: dict(values) for op, values in swaps.swap_stats.items()},
        **counters,
    }
