"""Whose KV a book's filled rows hold, written down beside the tiers that
outlive a process: the ``EngineIdentity`` and one ``Journal`` per persistent
tier, under the CPU generation the rows belong to (docs/engine-vllm.md,
"Warm restart").  A ``RowBook`` carries one as its optional record
(``RowBook.records``); its owner hands it the book's row changes before it
answers anything that could reuse a row.

- ``adoption()``: what the journals an earlier engine left name, if they were
  written under this identity, on tiers of this size, at one CPU generation;
  anything else is thrown away whole (the space is reclaimed) and the reason
  said;
- ``start`` / ``append``: a journal per tier, compacted when it holds far more
  records than keys;
- ``forget``: nothing recorded is served any more (a generation moved); when
  the weights may have changed in place the identity moves too, so that what
  is written after never outlives this engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..wire.vocab import Tier
from .book import RowChange
from .identity import EngineIdentity
from .journal import Journal, JournalError

COMPACT_AT = 4096  # a journal is rewritten once it holds this many records more than twice its keys
RowsOf = Callable[[Tier], list[tuple[bytes, int]]]


@dataclass
class Adoption:
    """What the journals say: each tier's (key, row) pairs at ``cpu_gen``, or why none is served."""

    cpu_gen: int | None = None
    rows: dict[Tier, list[tuple[bytes, int]]] = field(default_factory=dict)
    why: str = ""


class TierRecords:
    """The identity and the journals of one engine's persistent tiers (see the module docstring)."""

    def __init__(self, identity: EngineIdentity, journals: Mapping[Tier, Journal]):
        self.identity = identity
        self.journals = dict(journals)
        self.cpu_gen: int | None = None  # the CPU generation the recorded rows belong to (None: none recorded)

    def adoption(self) -> Adoption:
        """The rows an earlier engine of this identity left in these tiers, or, with ``why``,
        none: then its journals are removed (the rows are free, their space reclaimed)."""
        replays, why = {}, ""
        for tier, journal in self.journals.items():
            try:
                found = journal.read()
            except JournalError as err:
                found, why = None, f"the {tier} journal does not check ({err})"
            if found is not None:
                replays[tier] = found
        for tier, found in replays.items():
            head = found.header
            if head.identity != self.identity:
                why = f"another identity (its {', '.join(head.identity.differs(self.identity))} differ)"
            elif head.rows != self.journals[tier].rows:
                why = f"the {tier} tier had {head.rows} rows, it has {self.journals[tier].rows} now"
        if len({f.header.cpu_gen for f in replays.values()}) > 1:
            why = "the journals name different CPU generations"
        if why or not replays:
            for journal in self.journals.values():
                journal.remove()
            return Adoption(why=why)
        cpu_gen = next(iter(replays.values())).header.cpu_gen
        return Adoption(cpu_gen, {tier: list(found.rows.items()) for tier, found in replays.items()})

    def start(self, cpu_gen: int, rows_of: RowsOf) -> None:
        """Journals anew at ``cpu_gen``, naming what each tier serves now."""
        self.cpu_gen = cpu_gen
        for tier, journal in self.journals.items():
            journal.start(self.identity, cpu_gen, rows_of(tier))

    def append(self, changes: list[RowChange], rows_of: RowsOf, keys: int) -> None:
        """Write the changes (nothing is recorded before a CPU generation is known);
        compact a journal holding far more records than ``keys``."""
        if not changes or self.cpu_gen is None:
            return
        for tier, journal in self.journals.items():
            journal.append([c for c in changes if c.tier is tier])
        for tier, journal in self.journals.items():
            if journal.records > 2 * keys + COMPACT_AT:
                journal.start(self.identity, self.cpu_gen, rows_of(tier))

    def flush_drops(self, tier: Tier) -> None:
        """Drops written so far are durable before a row they freed is rewritten."""
        journal = self.journals.get(tier)
        if journal is not None:
            journal.flush_drops()

    def forget(self, moved: bool, weights: str | None = None) -> None:
        """Nothing recorded is served any more; ``moved``: the weights may have changed
        in place, so what is written from now on is under the weights the clear named
        (``weights``: every engine the same cycle cleared names them alike) or, unnamed,
        under weights no checkpoint holds."""
        self.cpu_gen = None
        for journal in self.journals.values():
            journal.remove()
        if moved:
            self.identity = self.identity.with_weights(weights) if weights else self.identity.moved()

    def close(self) -> None:
        for journal in self.journals.values():
            journal.close()
