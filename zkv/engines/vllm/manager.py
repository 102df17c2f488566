"""vLLM's ``OffloadingManager`` on zkv: the scheduler's side of the offload
backend (docs/engine-vllm.md).

vLLM's scheduler keeps deciding what to store and load; this manager answers
from its ``OffloadIndex`` and is a zkv client of the engine's bus: it runs the
disk tier's spills and loads as zkv tasks, learns the bus's state and
generations from its broadcasts and a background ``status`` (``bus_view.py``:
the scheduler never waits on the bus), and so:

- while the bus is not running (paused, cleared, ranks missing), lookups
  miss and stores are skipped: vLLM serves by recompute, and no job of vLLM's
  waits on a paused bus;
- a CPU generation that moved (a clear without ``keep_cpu``) forgets every
  key, and so does vLLM's ``reset_cache`` unless the bus went through a clear
  that kept the CPU tier since the keys were stored (the caller said the
  weights did not change): nothing computed under old weights is served;
- a store or load that failed (``ZkvConnector`` hands the job's outcome over
  before vLLM completes it) is not indexed, or forgotten;
- every row that starts or stops serving a key is written to its tier's
  journal (``journal.py``) before the manager answers vLLM or submits a
  task that could rewrite it, under the engine's identity (``identity.py``):
  a restarted engine of the same identity on the same tiers serves them again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)

from ...client.client import Client
from ...rank.tiers.tier_file import bus_name, journal_path
from ...wire.errors import ZkvError
from ...wire.vocab import Op, Tier
from . import api
from .bus_view import BusView
from .identity import EngineIdentity
from .index import Found, OffloadIndex
from .journal import DISK_JOURNAL, Journal, JournalError
from .rows import ZkvRows
from .settings import ZkvSettings

log = logging.getLogger("zkv.vllm")

_FOUND = {
    Found.MISS: LookupResult.MISS,
    Found.HIT: LookupResult.HIT,
    Found.PENDING: LookupResult.HIT_PENDING,
}
_MEDIUM = {Tier.CPU: Medium.CPU, Tier.DISK: Medium.STORAGE}
_SPILLS_PER_STEP = 64
_COUNTS = (
    "hits",
    "misses_not_serving",
    "stores_skipped",
    "store_failed",
    "load_failed",
    "spills",
    "spill_failed",
    "disk_loads",
    "disk_load_failed",
    "resets",
    "resets_kept",
    "adopted",
)
_COMPACT_AT = 4096  # a journal is rewritten once it holds this many records more than twice its keys


def journals(settings: ZkvSettings) -> dict[Tier, Journal]:
    """The journals beside the engine's persistent tiers: the CPU tier file's (named
    by the bus, as the file is) and the disk tier's (synced: it outlives a power loss)."""
    made = {}
    if settings.tier_dir:
        path = journal_path(settings.tier_dir, bus_name(settings.endpoints.backend))
        made[Tier.CPU] = Journal(path, Tier.CPU, settings.cpu_blocks)
    if settings.disk_dir:
        made[Tier.DISK] = Journal(Path(settings.disk_dir) / DISK_JOURNAL, Tier.DISK, settings.disk_blocks, True)
    return made


class ZkvOffloadManager(OffloadingManager):
    """The scheduler-side book of zkv's CPU and disk tiers for one engine."""

    def __init__(
        self, settings: ZkvSettings, world: int, identity: EngineIdentity | None = None, emit_events: bool = True
    ):
        self.settings = settings
        self.identity = identity
        disk_rows = settings.disk_blocks if settings.disk_dir else 0
        self.index = OffloadIndex(settings.cpu_blocks, disk_rows, settings.spill_below)
        self.client = Client(settings.endpoints.frontend, request_timeout=0.25)  # a send to no broker: 0.25 s
        control = settings.endpoints.control if settings.hear_broadcasts else None
        self.bus = BusView(self.client, world, settings.status_interval_s, control=control)
        self.emit_events = emit_events
        self.broker: Any = None  # the embedded broker (connector.py), stopped with the manager
        self._stored_at: tuple[int | None, int | None] = (None, None)  # (gen, cpu_gen) the keys were stored at
        self._tasks: dict[
            int, tuple[Op, list[tuple[bytes, int]]]
        ] = {}  # our spills / loads: task -> (op, [(key, row)])
        self._loads: list[tuple[bytes, int, int]] = []  # disk -> CPU loads of this step, sent as one task
        self._failed_stores: set[OffloadKey] = set()
        self._failed_loads: set[OffloadKey] = set()
        self._events_file = open(settings.events_path, "a") if settings.events_path else None  # noqa: SIM115
        self.counts = dict.fromkeys(_COUNTS, 0)  # vLLM calls us from its scheduler thread only
        self.journals = journals(settings) if identity is not None else {}
        self._unconfirmed = False  # adopted rows not yet seen at the bus's CPU generation
        if self.journals:
            self._adopt()

    # --- the journals ------------------------------------------------------------

    def _adopt(self) -> None:
        """Serve again what the journals of an earlier engine on these tiers name, if it
        had this identity and both journals agree on the CPU generation; whatever
        else they hold is thrown away (its rows are free, so the space is reclaimed)."""
        replays, why = {}, ""
        for tier, journal in self.journals.items():
            try:
                found = journal.read()
            except JournalError as err:
                found, why = None, f"the {tier} journal does not check ({err})"
            if found is not None:
                replays[tier] = found
        assert self.identity is not None
        for tier, found in replays.items():
            h = found.header
            if h.identity != self.identity:
                why = f"another identity (its {', '.join(h.identity.differs(self.identity))} differ)"
            elif h.rows != self.journals[tier].rows:
                why = f"the {tier} tier had {h.rows} rows, it has {self.journals[tier].rows} now"
        if len({f.header.cpu_gen for f in replays.values()}) > 1:
            why = "the journals name different CPU generations"
        if why or not replays:
            if why:
                log.warning("zkv: none of the blocks the tiers hold is served: %s", why)
            for journal in self.journals.values():
                journal.remove()
            return
        cpu_gen = next(iter(replays.values())).header.cpu_gen
        cpu, disk = replays.get(Tier.CPU), replays.get(Tier.DISK)
        n = self.index.adopt(list(cpu.rows.items()) if cpu else [], list(disk.rows.items()) if disk else [])
        self.index.take_changes()
        self._stored_at = (None, cpu_gen)
        self._unconfirmed = True
        self.counts["adopted"] = n
        self._compact(force=True)
        log.warning("zkv: %d blocks of an earlier engine of this identity are in the tiers (CPU gen %d)", n, cpu_gen)

    def _record(self) -> None:
        """Write the index's row changes to the journals (before anything can reuse a row)."""
        changes = self.index.take_changes()
        if not changes or self._stored_at[1] is None:
            return
        for tier, journal in self.journals.items():
            journal.append([c for c in changes if c.tier is tier])
        self._compact()

    def _compact(self, force: bool = False) -> None:
        cpu_gen = self._stored_at[1]
        if cpu_gen is None or self.identity is None:
            return
        keys = len(self.index.entries)  # at least the rows of either tier: no scan unless one is due
        for tier, journal in self.journals.items():
            if force or journal.records > 2 * keys + _COMPACT_AT:
                journal.start(self.identity, cpu_gen, self.index.rows_of(tier))

    # --- the bus ---------------------------------------------------------------

    def _serving(self) -> bool:
        self.bus.refresh(time.monotonic())
        if self.bus.serving and self._stored_at[1] is not None and self.bus.cpu_gen != self._stored_at[1]:
            if self._unconfirmed:  # the ranks did not find the tiers the journals name: nothing changed the weights
                self._forget("the tiers came back at another CPU generation than their journals", moved=False)
            else:
                self._forget("the bus's CPU generation moved (a clear without keep_cpu)")
        if self.bus.serving:
            self._unconfirmed = False
        return self.bus.serving

    def _pump(self) -> None:
        """Take the outcomes of our spills and loads; send this step's loads and the spills due."""
        for out in self.client.poll(0.0):
            op, done = self._tasks.pop(out.task, (None, []))
            if op is Op.SPILL:
                self.counts["spills" if out.ok else "spill_failed"] += len(done)
                for key, row in done:
                    self.index.spill_done(key, row, out.ok)
            elif op is Op.LOAD:
                self.counts["disk_loads" if out.ok else "disk_load_failed"] += len(done)
                if not out.ok:
                    log.info("zkv: a load of %d disk rows failed (%s): recomputed", len(done), out.reason)
                for key, row in done:
                    self.index.load_done(key, row, out.ok)
        if self._loads and not self.bus.serving:
            for key, _, cpu_row in self._loads:
                self.index.cancel_load(key, cpu_row)
            self._loads = []
        self._record()  # the CPU rows this step's loads take were given up in lookups
        if self._loads:
            loads, self._loads = self._loads, []
            self._submit(Op.LOAD, [d for _, d, _ in loads], [c for _, _, c in loads], [(k, c) for k, _, c in loads])
        if self.bus.serving:
            spills = self.index.plan_spills(_SPILLS_PER_STEP)
            self._record()
            if spills:
                disk = self.journals.get(Tier.DISK)
                if disk is not None:
                    disk.flush_drops()  # a reused disk row's old key is gone for good before it is rewritten
                self._submit(
                    Op.SPILL, [c for _, c, _ in spills], [d for _, _, d in spills], [(k, d) for k, _, d in spills]
                )

    def _submit(self, op: Op, src: list[int], dst: list[int], rows: list[tuple[bytes, int]]) -> None:
        try:
            task = self.client.submit(op, src, dst, timeout=self.settings.task_timeout_s)
        except ZkvError as err:
            log.warning("zkv: %s not submitted: %s", op, err)
            for key, row in rows:
                (self.index.spill_done if op is Op.SPILL else self.index.load_done)(key, row, False)
            return
        self._tasks[task] = (op, rows)

    def _forget(self, why: str, moved: bool = True, fenced: bool = False) -> None:
        for key, _, cpu_row in self._loads:  # not sent yet: never will be
            self.index.cancel_load(key, cpu_row)
        self._loads = []
        gone = self.index.reset(fenced=fenced)
        self.index.take_changes()
        self._stored_at = (None, None)
        for journal in self.journals.values():
            journal.remove()
        if self.identity is not None and moved:
            # zkv learns the weights may have changed only this way: what is stored from now on
            # is under weights no checkpoint holds, so it never outlives this engine.
            self.identity = self.identity.moved()
        if gone:
            log.info("zkv: %d offloaded blocks forgotten: %s", len(gone), why)

    # --- OffloadingManager -------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._serving():
            self.counts["misses_not_serving"] += 1
            return LookupResult.MISS
        found = self.index.lookup(key)
        if found is Found.ON_DISK:
            where = self.index.start_load(key)
            if where is None:
                return LookupResult.MISS
            self._loads.append((key, *where))  # sent with this step's others (on_schedule_end)
            return LookupResult.RETRY
        if found is Found.HIT:
            self.counts["hits"] += 1
        return _FOUND[found]

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> ZkvRows:
        return ZkvRows(self.index.prepare_load(list(keys)))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.index.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        failed = bool(self._failed_loads.intersection(keys))
        self._failed_loads.difference_update(keys)
        if failed:
            self.counts["load_failed"] += 1
        self.index.complete_load(keys, ok=not failed)
        self._record()

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if not self._serving():
            self.counts["stores_skipped"] += 1
            return None
        planned = self.index.prepare_store(list(keys))
        if planned is None:
            self.counts["stores_skipped"] += 1
            return None
        if self._stored_at[1] is None:
            self._stored_at = (self.bus.gen, self.bus.cpu_gen)
            self._compact(force=True)
        self._record()
        new, rows, evicted = planned
        return PrepareStoreOutput(keys_to_store=new, store_spec=ZkvRows(rows), evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        keys = list(keys)
        failed = not success or bool(self._failed_stores.intersection(keys))
        self._failed_stores.difference_update(keys)
        if failed:
            self.counts["store_failed"] += 1
        self.index.complete_store(keys, ok=not failed)
        self._record()

    def rows_failed(self, rows: Iterable[int], is_store: bool) -> None:
        """A worker reported that a job on these CPU rows failed (``ZkvConnector``): called
        before vLLM completes the job, so the completion sees it (no store indexed, no key
        read again)."""
        keys = self.index.keys_in(list(rows), writing=is_store)
        (self._failed_stores if is_store else self._failed_loads).update(keys)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_schedule_end(self, context: Any) -> None:
        self._serving()  # the broadcasts heard, the background status sent or read
        self._pump()

    def has_pending_work(self) -> bool:
        return bool(self._tasks or self._loads)

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self.index.take_events()
        if self._events_file is not None and events:
            stamp = {"gen": self.bus.gen, "cpu_gen": self.bus.cpu_gen, "t": round(time.time(), 3)}
            for ev in events:
                line = {**stamp, "tier": str(ev.tier), "removed": ev.removed, "keys": [k.hex() for k in ev.keys]}
                self._events_file.write(json.dumps(line) + "\n")
            self._events_file.flush()
        if not self.emit_events:
            return []
        return [OffloadingEvent(keys=list(ev.keys), medium=_MEDIUM[ev.tier], removed=ev.removed) for ev in events]

    def reset_cache(self) -> None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: keep the keys only
        if the bus went through a clear that kept its CPU tier since they were
        stored (the caller's word that the weights did not change)."""
        self.counts["resets"] += 1
        self.bus.refresh(time.monotonic(), force=True)
        gen, cpu_gen = self._stored_at
        kept = gen is not None and self.bus.gen != gen and self.bus.cpu_gen == cpu_gen
        if kept:
            self.counts["resets_kept"] += 1
            self._stored_at = (self.bus.gen, cpu_gen)
            log.info("zkv: reset kept %d offloaded blocks: the bus's clear kept its CPU tier", len(self.index.entries))
            return
        # vLLM 0.34 ends its jobs in flight after this call and says when (on_reset_flushed):
        # their rows stay out of reach until then.  0.32 flushed them before.
        self._forget("vLLM reset the cache and the bus did not keep its CPU tier", fenced=api.NATIVE_FAILURES)

    def on_reset_flushed(self) -> None:
        """vLLM 0.34: every job in flight at the last ``reset_cache`` is over."""
        self.index.flushed()

    def stats(self) -> dict[str, Any]:
        return {
            **self.counts,
            "cpu_used": self.index.used(Tier.CPU),
            "disk_used": self.index.used(Tier.DISK),
            "keys": len(self.index.entries),
        }

    def shutdown(self) -> None:
        for journal in self.journals.values():
            journal.close()
        self.bus.close()
        self.client.close()
        if self._events_file is not None:
            self._events_file.close()
        if self.broker is not None:
            self.broker.stop()
