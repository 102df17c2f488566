"""The keyed store below an engine's tiers, as its scheduler sees it
(docs/engine-vllm.md, "KV that outlives one engine"): which of vLLM's keys it
holds, learned in the background so that vLLM's scheduler never waits on it.

The store is shared: a host tier every engine on a host writes, or a Redis
server a fleet writes.  Its values are put and got by the engine's ranks
(``put`` / ``get`` tasks, docs/protocol.md §6.4), in the namespace of the
engine's identity; here the manager asks only *whether* a key is there, by
name (rank 0's value stands for the block: every rank puts its shard in the
same task, and a get that finds one missing fails whole).

``known(key)`` answers at once from what was learned (present, absent) and
queues what is not known for the prober thread, which asks the store in
batches.  A store that does not answer is taken to hold nothing for a while
(``backoff_s``), said once in the log, and asked again after: vLLM serves
from the engine's own tiers and by recompute meanwhile.  What was learned
ages out (``ttl_s``): another engine may have put a key since, or the store
evicted it."""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from ...rank.errors import CacheError
from ...rank.tiers.store_tier import KeyedStore, name_of

log = logging.getLogger("zkv.vllm")

MAX_KNOWN = 65536  # keys remembered (least recently learned go first)
BATCH = 256  # keys asked in one round trip


@dataclass(frozen=True)
class _Retire:
    """Work for the prober: drop namespace ``ns`` from the store."""

    ns: str


class Known(enum.Enum):
    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"  # being asked: ask again next step


class SharedTier:
    """What the store holds of namespace ``ns``, learned off the scheduler's thread."""

    def __init__(self, store: KeyedStore, ns: str, *, ttl_s: float = 5.0, backoff_s: float = 2.0):
        self.store = store
        self.ns = ns
        self.ttl_s, self.backoff_s = ttl_s, backoff_s
        self._known: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()
        self._asked: set[bytes] = set()
        self._lock = threading.Lock()
        self._work: queue.Queue[bytes | _Retire | None] = queue.Queue()
        self._down_until = 0.0
        self._said_down = False
        self.counts = {"probes": 0, "probe_rounds": 0, "store_down": 0}
        self._thread = threading.Thread(target=self._run, name="zkv-store-probe", daemon=True)
        self._thread.start()

    def known(self, key: bytes, now: float | None = None) -> Known:
        """Whether the store holds ``key``, as far as learned; an unknown key is asked (at
        once where that is a system call: a host tier; else in the background)."""
        now = time.monotonic() if now is None else now
        if self.store.local:
            try:
                return Known.PRESENT if self.store.exists([name_of(self.ns, 0, key)])[0] else Known.ABSENT
            except CacheError:
                return Known.ABSENT
        with self._lock:
            if now < self._down_until:
                return Known.ABSENT
            got = self._known.get(key)
            if got is not None and now - got[1] < self.ttl_s:
                return Known.PRESENT if got[0] else Known.ABSENT
            if key in self._asked:
                return Known.UNKNOWN
            self._asked.add(key)
        self._work.put(key)
        return Known.UNKNOWN

    def use(self, ns: str, retire_old: bool = False) -> None:
        """From now on the engine's blocks are in namespace ``ns`` (its weights moved): nothing
        learned of the old one holds.  ``retire_old``: the old namespace is dropped from the
        store (in the background): no engine of these weights will read it again."""
        with self._lock:
            old, self.ns = self.ns, ns
            self._known.clear()
        if retire_old and old != ns:
            self._work.put(_Retire(old))

    def learned(self, keys: list[bytes], present: bool, now: float | None = None) -> None:
        """What a put or a get just showed: ``keys`` are in the store (or are not)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for key in keys:
                self._remember(key, present, now)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=5)
        self.store.close()

    def _remember(self, key: bytes, present: bool, now: float) -> None:
        self._known[key] = (present, now)
        self._known.move_to_end(key)
        while len(self._known) > MAX_KNOWN:
            self._known.popitem(last=False)

    def _run(self) -> None:
        while True:
            key = self._work.get()
            if key is None:
                return
            if isinstance(key, _Retire):
                self._retire(key.ns)
                continue
            batch = [key]
            while len(batch) < BATCH:
                try:
                    more = self._work.get_nowait()
                except queue.Empty:
                    break
                if more is None or isinstance(more, _Retire):
                    self._work.put(more)
                    break
                batch.append(more)
            self._ask(batch)

    def _retire(self, ns: str) -> None:
        try:
            gone = self.store.retire(ns)
        except CacheError as err:
            log.warning("zkv: namespace %s not retired from the shared store (%s): zkv store retire does it", ns, err)
            return
        self.counts["retired"] = self.counts.get("retired", 0) + gone
        log.info("zkv: %d blocks of the old weights' namespace %s retired from the shared store", gone, ns)

    def _ask(self, keys: list[bytes]) -> None:
        self.counts["probe_rounds"] += 1
        self.counts["probes"] += len(keys)
        try:
            there = self.store.exists([name_of(self.ns, 0, key) for key in keys])
        except CacheError as err:
            there = [False] * len(keys)
            self.counts["store_down"] += 1
            with self._lock:
                self._down_until = time.monotonic() + self.backoff_s
            if not self._said_down:
                self._said_down = True
                log.warning("zkv: the shared store does not answer (%s): served from this engine's tiers", err)
        else:
            if self._said_down:
                self._said_down = False
                log.warning("zkv: the shared store answers again")
        now = time.monotonic()
        with self._lock:
            for key, present in zip(keys, there):
                self._asked.discard(key)
                self._remember(key, present, now)
