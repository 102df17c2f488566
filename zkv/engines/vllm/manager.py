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
  journal (``zkv.rows.records``) before the manager answers vLLM or submits a
  task that could rewrite it, under the engine's identity (``identity.py``):
  a restarted engine of the same identity on the same tiers serves them again;
- a key names its KV cache group (``groups.py``), so rows, journals and
  events are per group as they are per key; vLLM asks for every group a hit
  needs.  If zkv refuses any group of the engine (``groups.refusals``), it
  serves no request (lookups miss, stores are skipped: vLLM recomputes), as a
  hit would need that group too, and says so at start.  The keys of one call
  are made recent in the order of their token positions across groups, as
  vLLM's own CPU manager orders them, so that eviction takes every group's
  deepest blocks first (``GroupCounts`` counts what each group was served).
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
from ...rank.tiers.store_tier import open_store
from ...rank.tiers.tier_file import bus_name, journal_path
from ...rows.book import TaskKind
from ...rows.identity import EngineIdentity
from ...rows.journal import DISK_JOURNAL, Journal
from ...rows.loss import UNKNOWN, Gens, Loss, lost_between
from ...rows.records import TierRecords
from ...wire.errors import ZkvError
from ...wire.vocab import Op, Tier
from . import api
from .bus_view import BusView
from .group_counts import GroupCollector, GroupCounts
from .groups import chain_order, name, refusals
from .index import Found, OffloadIndex
from .rows import ZkvRows
from .settings import ZkvSettings
from .shared import Known, SharedTier

log = logging.getLogger("zkv.vllm")

_FOUND = {
    Found.MISS: LookupResult.MISS,
    Found.HIT: LookupResult.HIT,
    Found.PENDING: LookupResult.HIT_PENDING,
}
_MEDIUM = {Tier.CPU: Medium.CPU, Tier.DISK: Medium.STORAGE}
_SPILLS_PER_STEP = 64
_GROUP_EVENT = {Op.SPILL: "spilled", Op.LOAD: "from_disk", Op.GET: "fetched"}  # what a task's filled keys count as
_COUNTS = (
    "hits",
    "store_gets",
    "store_get_failed",
    "store_puts",
    "store_put_failed",
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
    "misses_refused",
    "stores_refused",
)


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
        self,
        settings: ZkvSettings,
        world: int,
        identity: EngineIdentity | None = None,
        emit_events: bool = True,
        broker: Any = None,
        groups: list[dict[str, Any]] | None = None,
    ):
        """``broker``: the engine's embedded broker (``connector.EmbeddedBroker``), stopped with the
        manager; ``groups``: the KV cache groups vLLM offloads (``groups.describe``)."""
        self.settings = settings
        self.groups = list(groups or [])
        self.refused = refusals(self.groups)
        self.by_group = GroupCounts({g["group"]: g["spec"] for g in self.groups})
        for g in self.groups:
            if g["group"] in self.refused:
                log.warning(
                    "zkv: KV cache %s is refused: %s. zkv serves no request of this engine (a hit needs every "
                    'group): vLLM recomputes (docs/engine-vllm.md, "Models with several KV cache groups")',
                    name(g),
                    self.refused[g["group"]],
                )
        if len(self.groups) > 1 and not self.refused:
            log.warning("zkv: serves every KV cache group: %s", "; ".join(name(g) for g in self.groups))
        if broker is not None and getattr(broker, "registry", None) is not None:
            broker.registry.register(GroupCollector(self.by_group))
        disk_rows = settings.disk_blocks if settings.disk_dir else 0
        records = TierRecords(identity, journals(settings)) if identity is not None else None
        self.index = OffloadIndex(settings.cpu_blocks, disk_rows, settings.spill_below or 0, records)
        self.client = Client(settings.endpoints.frontend, request_timeout=0.25)  # a send to no broker: 0.25 s
        control = settings.endpoints.control if settings.hear_broadcasts else None
        self.bus = BusView(self.client, world, settings.status_interval_s, control=control)
        self.emit_events = emit_events
        self.broker = broker
        self._stored_at: Gens = UNKNOWN  # the bus's generations when the keys were stored
        self._loads: list[tuple[bytes, int, int]] = []  # disk -> CPU loads of this step, sent as one task
        # The shared store below (settings.store): what it holds, asked off this thread, and this
        # step's fetches from it and puts into it, each sent as one task.
        self.shared = (
            SharedTier(open_store(settings.store), records.identity.namespace())
            if settings.store is not None and records is not None
            else None
        )
        self._fetches: list[tuple[bytes, int]] = []
        self._puts: list[tuple[bytes, int]] = []
        self._failed_stores: set[OffloadKey] = set()
        self._failed_loads: set[OffloadKey] = set()
        self._events_file = open(settings.events_path, "a") if settings.events_path else None  # noqa: SIM115
        self.counts = dict.fromkeys(_COUNTS, 0)  # vLLM calls us from its scheduler thread only
        self._unconfirmed = False  # adopted rows not yet seen at the bus's CPU generation
        if records is not None and records.journals:
            self._adopt(records)

    @property
    def identity(self) -> EngineIdentity | None:
        """Whose KV the tiers hold (it moves when the weights may have changed in place)."""
        records = self.index.records
        return records.identity if records is not None else None

    # --- the journals ------------------------------------------------------------

    def _adopt(self, records: TierRecords) -> None:
        """Serve again what the journals of an earlier engine on these tiers name, if it
        had this identity and both journals agree on the CPU generation; whatever
        else they hold is thrown away (its rows are free, so the space is reclaimed)."""
        found = records.adoption()
        if found.cpu_gen is None:
            if found.why:
                log.warning("zkv: none of the blocks the tiers hold is served: %s", found.why)
            return
        n = self.index.adopt(found.rows.get(Tier.CPU, []), found.rows.get(Tier.DISK, []))
        self.index.take_changes()
        self._stored_at = (None, found.cpu_gen)
        self._unconfirmed = True
        self.counts["adopted"] = n
        records.start(found.cpu_gen, self.index.rows_of)
        log.warning(
            "zkv: %d blocks of an earlier engine of this identity are in the tiers (CPU gen %d)", n, found.cpu_gen
        )

    # --- the bus ---------------------------------------------------------------

    def _serving(self) -> bool:
        self.bus.refresh(time.monotonic())
        if self.bus.serving and lost_between(self._stored_at, self._bus_gens()) is Loss.ALL:
            if self._unconfirmed:  # the ranks did not find the tiers the journals name: nothing changed the weights
                self._forget("the tiers came back at another CPU generation than their journals", moved=False)
            else:
                self._forget("the bus's CPU generation moved (a clear without keep_cpu)")
        if self.bus.serving:
            self._unconfirmed = False
        return self.bus.serving

    def _bus_gens(self) -> Gens:
        return (self.bus.gen, self.bus.cpu_gen)

    def _pump(self) -> None:
        """Take the outcomes of our tasks (the index's book settles their rows); send this
        step's loads, fetches and puts, and the spills due."""
        self._take_outcomes()
        index = self.index
        if self._loads and not self.bus.serving:
            for key, _, cpu_row in self._loads:
                index.cancel_load(key, cpu_row)
            self._loads = []
        index.record()  # the CPU rows this step's loads and fetches take were given up in lookups
        if self._loads:
            loads, self._loads = self._loads, []
            task = self._submit(Op.LOAD, [d for _, d, _ in loads], [c for _, _, c in loads])
            if task is None:
                for key, _, cpu_row in loads:
                    index.cancel_load(key, cpu_row)
            else:
                index.loads_sent(task, loads)
        if self.shared is not None:
            self._pump_shared()
        if self.bus.serving:
            spills = index.plan_spills(_SPILLS_PER_STEP)
            index.record()
            if spills:
                if index.records is not None:
                    index.records.flush_drops(Tier.DISK)  # a reused disk row's old key is gone for good first
                task = self._submit(Op.SPILL, [c for _, c, _ in spills], [d for _, _, d in spills])
                if task is None:
                    index.spills_not_sent(spills)
                else:
                    index.spills_sent(task, spills)

    def _take_outcomes(self, wait_for: int | None = None, bound_s: float = 0.0) -> None:
        """The outcomes of our spills, loads, fetches and puts, and the late copies settled since;
        ``wait_for``: a task whose outcome is worth up to ``bound_s`` of this step (a fetch its
        request waits on: ending it now lets the next step load the blocks instead of asking
        again)."""
        index = self.index
        end = time.monotonic() + bound_s
        outs = self.client.poll(0.0)
        while wait_for is not None and all(o.task != wait_for for o in outs) and time.monotonic() < end:
            outs += self.client.poll(max(0.0, end - time.monotonic()))
        for out in outs:
            ended = index.task_ended(out.task, out)
            if ended is None:
                continue
            op, n, filled = ended
            if op in _GROUP_EVENT:
                self.by_group.add(_GROUP_EVENT[op], filled)
            if op is Op.SPILL:
                self.counts["spills" if out.ok else "spill_failed"] += n
            elif op is Op.PUT or op is Op.GET:
                self._shared_ended(op, n, out)
            else:
                self.counts["disk_loads" if out.ok else "disk_load_failed"] += n
                if not out.ok:
                    log.info("zkv: a load of %d disk rows failed (%s): recomputed", n, out.reason)
        if index.book.num_held_tasks:
            index.settle(self.client.settled())

    def _shared_ended(self, op: Op, n: int, out: Any) -> None:
        """A put into or a get from the shared store ended: counted, and what it showed learned."""
        assert self.shared is not None
        if op is Op.PUT:
            self.counts["store_puts" if out.ok else "store_put_failed"] += n
            return
        self.counts["store_gets" if out.ok else "store_get_failed"] += n
        if not out.ok:
            log.info("zkv: a get of %d blocks from the shared store failed (%s): recomputed", n, out.reason)

    def _pump_shared(self) -> None:
        """This step's fetches from the shared store and puts into it, one task each; while the
        bus is not serving none is sent (fetches are cancelled, puts dropped: a later store puts again)."""
        assert self.shared is not None
        index, ns = self.index, self.shared.ns
        fetches, self._fetches = self._fetches, []
        puts, self._puts = self._puts, []
        if not self.bus.serving:
            for key, row in fetches:
                index.cancel_fetch(key, row)
            return
        if fetches:
            keys, rows = [k for k, _ in fetches], [r for _, r in fetches]
            task = self._submit(Op.GET, None, rows, keys=keys, ns=ns)
            if task is None:
                for key, row in fetches:
                    index.cancel_fetch(key, row)
            else:
                index.fetches_sent(task, fetches)
                if self.settings.fetch_wait_s > 0:
                    self._take_outcomes(wait_for=task, bound_s=self.settings.fetch_wait_s)
        ready = [(k, r) for k, r in puts if index.lookup(k) is Found.HIT and index.entries[k].cpu_row == r]
        if ready:
            task = self._submit(Op.PUT, [r for _, r in ready], None, keys=[k for k, _ in ready], ns=ns)
            if task is not None:
                index.puts_sent(task, ready)

    def _submit(self, op: Op, src: list[int] | None, dst: list[int] | None, **keyed: Any) -> int | None:
        try:
            return self.client.submit(op, src, dst, timeout=self.settings.task_timeout_s, **keyed)
        except ZkvError as err:
            log.warning("zkv: %s not submitted: %s", op, err)
            return None

    def _forget(self, why: str, moved: bool = True, fenced: bool = False) -> None:
        for key, _, cpu_row in self._loads:  # not sent yet: never will be
            self.index.cancel_load(key, cpu_row)
        for key, row in self._fetches:
            self.index.cancel_fetch(key, row)
        self._loads, self._fetches, self._puts = [], [], []
        gone = self.index.reset(fenced=fenced)
        self.index.take_changes()
        self._stored_at = UNKNOWN
        if self.index.records is not None:
            # zkv learns the weights may have changed only this way (``moved``): what is stored
            # from now on is under weights no checkpoint holds, so it never outlives this engine.
            self.index.records.forget(moved, self.bus.weights)
            if self.shared is not None:  # nor is it shared with engines of the old weights, whose blocks go
                self.shared.use(self.index.records.identity.namespace(), retire_old=moved)
        if gone:
            log.info("zkv: %d offloaded blocks forgotten: %s", len(gone), why)

    # --- OffloadingManager -------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self.refused:
            self.counts["misses_refused"] += 1
            return LookupResult.MISS
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
            self.by_group.add("hit", [key])
        if found is Found.MISS and self.shared is not None:
            return self._from_shared(key)
        return _FOUND[found]

    def _from_shared(self, key: OffloadKey) -> LookupResult:
        """A key this engine does not hold: the shared store may (another engine put it).
        Not known yet: ask again next step; there: fetch it into a CPU row (a ``get`` sent
        with this step's others) and ask again; not there: a miss."""
        assert self.shared is not None
        known = self.shared.known(key)
        if known is Known.ABSENT:
            return LookupResult.MISS
        if known is Known.UNKNOWN:
            return LookupResult.RETRY
        row = self.index.start_fetch(key)
        if row is None:
            return LookupResult.MISS
        self._fetches.append((key, row))
        return LookupResult.RETRY

    def _recent(self, keys: list[OffloadKey], req_context: ReqContext) -> None:
        """Make ``keys`` (of one call, already in the index) recent head to tail by token
        position across their groups (the index made them recent in the order given,
        which for several groups is group by group)."""
        if len({k[-4:] for k in keys}) > 1:
            chain = chain_order(keys, req_context)
            if chain is not None:
                self.index.touch(chain)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> ZkvRows:
        keys = list(keys)
        rows = self.index.prepare_load(keys)  # in vLLM's order: its GPU blocks follow it
        self._recent(keys, req_context)
        return ZkvRows(rows)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.index.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        failed = bool(self._failed_loads.intersection(keys))
        self._failed_loads.difference_update(keys)
        if failed:
            self.counts["load_failed"] += 1
        self.index.complete_load(keys, ok=not failed)
        if not failed:
            self.by_group.add("served", keys)
        self.index.record()

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if self.refused:
            self.counts["stores_refused"] += 1
            return None
        if not self._serving():
            self.counts["stores_skipped"] += 1
            return None
        planned = self.index.prepare_store(list(keys))
        if planned is None:
            self.counts["stores_skipped"] += 1
            return None
        if self._stored_at[1] is None:
            self._stored_at = self._bus_gens()
            if self.index.records is not None and self.bus.cpu_gen is not None:
                self.index.records.start(self.bus.cpu_gen, self.index.rows_of)
        self.index.record()
        new, rows, evicted = planned  # rows in vLLM's order of the keys: its GPU blocks follow it
        self._recent(new, req_context)
        return PrepareStoreOutput(keys_to_store=new, store_spec=ZkvRows(rows), evicted_keys=evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        keys = list(keys)
        failed = not success or bool(self._failed_stores.intersection(keys))
        self._failed_stores.difference_update(keys)
        if failed:
            self.counts["store_failed"] += 1
        self.by_group.add("stored", self.index.complete_store(keys, ok=not failed))
        self.index.record()
        if self.shared is not None and not failed:  # into the shared store too (sent with this step's others)
            entries = self.index.entries
            for key in keys:
                row = entries[key].cpu_row if key in entries else None
                if row is not None:
                    self._puts.append((key, row))

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
        """Tasks of ours to send or in flight (vLLM keeps stepping until their outcomes are in;
        one held for a late copy is not pending work: it settles whenever it does)."""
        in_flight = any(not f.ended for f in self.index.book.flights(TaskKind.BUS))
        return bool(self._loads or self._fetches or self._puts or in_flight)

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
        if lost_between(self._stored_at, self._bus_gens()) is Loss.GPU:  # a clear that kept the CPU tier
            self.counts["resets_kept"] += 1
            self._stored_at = self._bus_gens()
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
            "groups": self.by_group.by_group(),
            "refused_groups": dict(self.refused),
        }

    def shutdown(self) -> None:
        if len(self.groups) > 1:
            log.warning("zkv: blocks per KV cache group: %s", self.by_group.by_group())
        if self.index.records is not None:
            self.index.records.close()
        if self.shared is not None:
            self.shared.close()
        self.bus.close()
        self.client.close()
        if self._events_file is not None:
            self._events_file.close()
        if self.broker is not None:
            self.broker.stop()
