"""Each rank's tiers below the device as Prometheus families (docs/operations.md,
"Metrics"): read off the ``cpu_tier`` and ``disk`` maps of the rank's stats at
scrape time and range-checked like every value a rank sends.  The bytes per
tier are ``zkv_cache_bytes``; the read and write latencies ``zkv_copy_seconds``
(``swap_in`` / ``swap_out`` read and write the CPU tier, ``load`` / ``spill``
the disk tier)."""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..wire.moves import TIER_ORDER
from ..wire.vocab import Tier

TIERS = TIER_ORDER[1:]  # the tiers below the device


def _uint(value: Any) -> int | None:
    return value if type(value) is int and 0 <= value < 2**53 else None


class TierFamilies:
    """The tier families of one scrape; ``add`` each rank's stats, then ``families()``."""

    def __init__(self) -> None:
        labels = ["rank", "tier"]
        self.blocks = GaugeMetricFamily("zkv_tier_blocks", "Blocks a rank's tier has room for.", labels=labels)
        self.used = GaugeMetricFamily(
            "zkv_tier_blocks_used",
            "Blocks a rank's tier holds: CPU tier file rows whose header checks, disk blocks with a valid record.",
            labels=labels,
        )
        self.kept = GaugeMetricFamily(
            "zkv_tier_kept",
            "1 while the rank's tier serves blocks an earlier process of the rank left (a CPU tier file "
            "mapped again, a disk file reopened holding blocks) and no clear without keep_cpu or new tier "
            "has dropped them since, else 0.",
            labels=labels,
        )
        self.failures = CounterMetricFamily(
            "zkv_tier_digest_failures",
            "Blocks read back whose header or digest did not check: lost, never served.",
            labels=labels,
        )
        self.direct = GaugeMetricFamily(
            "zkv_disk_direct", "1 when the rank's disk tier does O_DIRECT I/O, 0 for buffered I/O.", labels=["rank"]
        )
        self.io_errors = CounterMetricFamily(
            "zkv_disk_io_errors", "Disk tier reads and writes that failed.", labels=["rank", "io"]
        )

    def add(self, rank: str, stats: dict[str, Any]) -> None:
        for tier in TIERS:
            got = stats.get("cpu_tier" if tier == Tier.CPU else "disk")
            if not isinstance(got, dict):
                continue
            for family, key in ((self.blocks, "blocks"), (self.used, "used"), (self.failures, "digest_failures")):
                if (v := _uint(got.get(key))) is not None:
                    family.add_metric([rank, tier], v)
            kept = got.get("kept")
            if type(kept) is bool or _uint(kept) is not None:
                self.kept.add_metric([rank, tier], 1.0 if kept else 0.0)
            if tier == Tier.DISK:
                if type(direct := got.get("direct")) is bool:
                    self.direct.add_metric([rank], 1.0 if direct else 0.0)
                for io in ("read", "write"):
                    if (v := _uint(got.get(f"{io}_errors"))) is not None:
                        self.io_errors.add_metric([rank, io], v)

    def families(self) -> Iterator[Any]:
        yield from (self.blocks, self.used, self.kept, self.failures, self.direct, self.io_errors)
