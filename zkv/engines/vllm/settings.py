"""The zkv offload backend's settings: ``kv_connector_extra_config`` of the
one ``--kv-transfer-config`` a vLLM user passes (docs/engine-vllm.md), as one
typed record: every key's type, bounds and default written once, on its field,
checked where the map enters (``from_extra``), with no vLLM import (the
scheduler and every worker read the same map and must agree)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import msgspec

from ...net.endpoints import Endpoints, runtime_dir

BROKER_MODES = ("embedded", "external")
_DERIVED = frozenset({"bus_named"})  # what zkv works out from the others: never read from the map
_MAX_ROWS = 1 << 24
Rows = Annotated[int, msgspec.Meta(ge=1, le=_MAX_ROWS)]
Path_ = Annotated[str, msgspec.Meta(min_length=1)]


def seconds(low: float, high: float) -> Any:
    return Annotated[float, msgspec.Meta(ge=low, le=high)]


METRICS_URL_FILE = "metrics.url"  # in bus_dir: the embedded broker's /metrics URL, while it serves


class ZkvSettings(msgspec.Struct, frozen=True, kw_only=True):
    """``bus_dir``: where the bus's sockets live (``zkv status --broker
    ipc://BUS_DIR/frontend.sock`` reaches it); without one every start is a
    new bus in the runtime directory, so its CPU tier file can never be served
    again: the workers remove it when the engine stops (``bus_named`` False).
    ``broker``: ``embedded`` (the engine's scheduler process runs it) or
    ``external`` (a ``zkv broker`` the operator runs there).  ``cpu_blocks``
    rows of zkv's CPU tier per worker, in a file under ``tier_dir`` (null:
    process memory); ``disk_dir`` / ``disk_blocks``: the disk tier below it,
    ``spill_below``: how many CPU rows the spills keep free or clean (with a
    disk tier, every row by default: no store drops a row's only copy).
    ``hear_broadcasts``: the manager hears the bus's control broadcasts
    (false: it learns only from the status poll, every ``status_interval_s``).
    ``task_timeout_s``: how long a store or load may take before vLLM
    recomputes instead; ``load_wait_s``: how long a worker waits in a step for
    a load to land.  ``metrics_port``: the embedded broker's Prometheus
    ``/metrics`` on loopback (0: a free port, named in the engine's log).
    ``events_path``: a JSON line per residency change (keys stored or removed
    per tier, with the bus's generations), for a KV-aware router.
    ``trace_path``: the embedded broker records every task and control
    operation there (docs/traces.md), as ``zkv broker --record``.  ``store``:
    a keyed store below the tiers, shared with other engines (a host tier
    ``file:///dev/shm/zkv-host?budget=8GiB``, or ``redis://HOST:PORT/DB``):
    every block stored is put there too, and a block this engine lacks is
    fetched from there when another engine of its identity put it.
    ``weights_version``: the weights named by a version the trainer sets (one
    name fleet-wide) instead of the checkpoint's file listing, which differs
    between hosts whose copies differ in modification time.  ``fetch_wait_s``:
    how long the scheduler may wait, in the step that sent a fetch from the
    store, for it to land (the request it serves then loads at the next step
    instead of asking again)."""

    bus_dir: Path_ | None = None
    broker: Literal["embedded", "external"] = "embedded"
    cpu_blocks: Rows = 1024
    tier_dir: Path_ | None = "/dev/shm"
    disk_dir: Path_ | None = None
    disk_blocks: Rows = 4096
    spill_below: Annotated[int, msgspec.Meta(ge=0, le=_MAX_ROWS)] | None = None
    task_timeout_s: seconds(0.01, 3600.0) = 5.0  # type: ignore[valid-type]
    status_interval_s: seconds(0.0, 3600.0) = 1.0  # type: ignore[valid-type]
    hear_broadcasts: bool = True
    load_wait_s: seconds(0.0, 10.0) = 0.0  # type: ignore[valid-type]
    fetch_wait_s: seconds(0.0, 1.0) = 0.05  # type: ignore[valid-type]
    events_path: Path_ | None = None
    metrics_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    trace_path: Path_ | None = None
    store: Annotated[str, msgspec.Meta(min_length=1, max_length=1024)] | None = None
    weights_version: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    bus_named: bool = False  # bus_dir was given: the CPU tier file and its journal outlive the engine

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any], engine_id: str) -> ZkvSettings:
        """The settings ``extra`` names; other keys are vLLM's own (blocks_per_chunk, ...): not ours
        to refuse.  A bad value raises ``ValueError`` naming the key."""
        ours = {name: extra[name] for name in cls.__struct_fields__ if name in extra and name not in _DERIVED}
        try:
            said = msgspec.convert(ours, cls)
        except msgspec.ValidationError as err:
            raise ValueError(f"zkv: kv_connector_extra_config: {err}") from None
        spill = said.spill_below if said.spill_below is not None else said.cpu_blocks
        if said.disk_dir and spill > said.cpu_blocks:
            raise ValueError(
                f"zkv: kv_connector_extra_config: spill_below {spill} exceeds cpu_blocks {said.cpu_blocks}"
            )
        return msgspec.structs.replace(
            said,
            bus_dir=said.bus_dir or str(runtime_dir() / f"vllm-{engine_id[:12]}"),
            spill_below=spill if said.disk_dir else 0,
            bus_named=said.bus_dir is not None,
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
        """The bus's sockets in ``bus_dir`` (``make_bus_dir`` makes it)."""
        assert self.bus_dir is not None, "settings come from from_extra"
        return Endpoints.in_dir(self.bus_dir)

    def make_bus_dir(self) -> Path:
        """Make ``bus_dir`` (0700) and return it: before a broker binds there."""
        assert self.bus_dir is not None, "settings come from from_extra"
        path = Path(self.bus_dir)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path
