"""The zkv offload backend's settings: ``kv_connector_extra_config`` of the
one ``--kv-transfer-config`` a vLLM user passes (docs/engine-vllm.md), read
once, range-checked, with no vLLM import (the scheduler and every worker
read the same map and must agree)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ...net.endpoints import Endpoints, runtime_dir

BROKER_MODES = ("embedded", "external")
_MAX_ROWS = 1 << 24


def _int(extra: Mapping[str, Any], name: str, default: int, low: int, high: int = _MAX_ROWS) -> int:
    value = extra.get(name, default)
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"zkv: kv_connector_extra_config[{name!r}] must be an int in [{low}, {high}], got {value!r}")
    return value


def _seconds(extra: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = extra.get(name, default)
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"zkv: kv_connector_extra_config[{name!r}] must be seconds in [{low}, {high}], got {value!r}")
    return float(value)


def _flag(extra: Mapping[str, Any], name: str, default: bool) -> bool:
    value = extra.get(name, default)
    if type(value) is not bool:
        raise ValueError(f"zkv: kv_connector_extra_config[{name!r}] must be true or false, got {value!r}")
    return value


def _path(extra: Mapping[str, Any], name: str) -> str | None:
    value = extra.get(name)
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"zkv: kv_connector_extra_config[{name!r}] must be a directory path, got {value!r}")
    return value


@dataclass(frozen=True)
class ZkvSettings:
    """``bus_dir``: where the bus's sockets live (``zkv status --broker
    ipc://BUS_DIR/frontend.sock`` reaches it); ``broker``: ``embedded`` (the
    engine's scheduler process runs it) or ``external`` (a ``zkv broker`` the
    operator runs there).  ``cpu_blocks`` rows of zkv's CPU tier per worker,
    in a file under ``tier_dir`` (None: process memory); ``disk_dir`` /
    ``disk_blocks``: the disk tier below it.  ``hear_broadcasts``: the
    manager hears the bus's control broadcasts (false: it learns only from
    the status poll, every ``status_interval_s``).  ``task_timeout_s``: how long a
    store or load may take before vLLM recomputes instead.  ``metrics_port``:
    the embedded broker's Prometheus ``/metrics`` on loopback (0: a free
    port, named in the engine's log).  ``events_path``: a JSON line per
    residency change (keys stored or removed per tier, with the bus's
    generations), for a KV-aware router.  Without a ``bus_dir`` every start
    is a new bus, so its CPU tier file can never be served again: the
    workers remove it when the engine stops (``bus_named`` False).  ``trace_path``: the embedded
    broker records every task and control operation there (docs/traces.md),
    as ``zkv broker --record``."""

    bus_dir: str
    broker: str = "embedded"
    cpu_blocks: int = 1024
    tier_dir: str | None = "/dev/shm"
    disk_dir: str | None = None
    disk_blocks: int = 4096
    spill_below: int = 0
    task_timeout_s: float = 5.0
    status_interval_s: float = 1.0
    hear_broadcasts: bool = True
    load_wait_s: float = 0.0
    events_path: str | None = None
    metrics_port: int | None = None
    trace_path: str | None = None
    bus_named: bool = True  # bus_dir was given: the CPU tier file and its journal outlive the engine

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], engine_id: str) -> "ZkvSettings":
        # Other keys are vLLM's own (blocks_per_chunk, offload_prompt_only, ...): not ours to refuse.
        broker = extra.get("broker", "embedded")
        if broker not in BROKER_MODES:
            raise ValueError(f"zkv: kv_connector_extra_config['broker'] must be one of {BROKER_MODES}, got {broker!r}")
        bus_dir = _path(extra, "bus_dir") or str(runtime_dir() / f"vllm-{engine_id[:12]}")
        cpu_blocks = _int(extra, "cpu_blocks", 1024, 1)
        disk_dir = _path(extra, "disk_dir")
        disk_blocks = _int(extra, "disk_blocks", 4096, 1)
        default_spill = cpu_blocks if disk_dir else 0  # every row clean: no store drops a row's only copy
        # Absent: the documented default, a file in /dev/shm; None: process memory.
        tier_dir = _path(extra, "tier_dir") if "tier_dir" in extra else "/dev/shm"
        return cls(
            bus_dir=bus_dir,
            broker=broker,
            cpu_blocks=cpu_blocks,
            tier_dir=tier_dir,
            disk_dir=disk_dir,
            disk_blocks=disk_blocks,
            spill_below=_int(extra, "spill_below", default_spill, 0, cpu_blocks) if disk_dir else 0,
            task_timeout_s=_seconds(extra, "task_timeout_s", 5.0, 0.01, 3600.0),
            status_interval_s=_seconds(extra, "status_interval_s", 1.0, 0.0, 3600.0),
            hear_broadcasts=_flag(extra, "hear_broadcasts", True),
            load_wait_s=_seconds(extra, "load_wait_s", 0.0, 0.0, 10.0),
            events_path=_path(extra, "events_path"),
            metrics_port=_int(extra, "metrics_port", 0, 0, 65535) if "metrics_port" in extra else None,
            trace_path=_path(extra, "trace_path"),
            bus_named=_path(extra, "bus_dir") is not None,
        )

    def reserved(self, rank: int, block_bytes: int) -> str:
        """What a worker's tiers take, said once at its start: both are sized in vLLM blocks,
        whose bytes only the model's layout fixes (the disk tier's file is preallocated)."""
        gib = block_bytes / 2**30
        cpu_where = f"a file in {self.tier_dir}" if self.tier_dir else "process memory"
        said = (
            f"rank {rank} reserves {self.cpu_blocks * gib:.2f} GiB for its CPU tier in {cpu_where} "
            f"({self.cpu_blocks} blocks of {block_bytes} bytes)"
        )
        if self.disk_dir:
            said += f" and {self.disk_blocks * gib:.2f} GiB of disk in {self.disk_dir} ({self.disk_blocks} blocks)"
        return said

    @property
    def endpoints(self) -> Endpoints:
        Path(self.bus_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        return Endpoints.in_dir(self.bus_dir)
