"""What the ranks' cache memory holds for the bus: one layout and one
generation (docs/architecture.md, "One layout, one generation, whatever
restarts").  The generation moves whenever the content of the
caches is gone (a clear, a failed resume from cleared, a rank that lost its
memory once a task ran at this generation), so that no client reads old blocks
as if they were there.

The CPU tier has a generation of its own, ``cpu_gen`` (docs/protocol.md
§8.2): it moves only when CPU content is gone (a clear without
``keep_cpu``, a resume that could not keep it, a rank whose CPU tier did
not survive its restart), so a rank restart that kept its tier file moves
``gen`` alone: "GPU blocks of generation N are gone; CPU blocks kept"."""

from __future__ import annotations

from typing import Any

from ..wire import bounds
from ..wire.errors import ZkvError
from ..wire.layout import CacheLayout


def _within(gen: int) -> int:
    """Never a generation the wire cannot carry: a clear is refused before
    (``admission.check_clear``); a move past it fails the handler instead."""
    if gen > bounds.MAX_GEN:
        raise ZkvError("gen_exhausted", f"cache generation {gen} is past its maximum {bounds.MAX_GEN}")
    return gen


class Generation:
    """The bus's layout and cache generation, and why it last moved."""

    def __init__(self) -> None:
        self.layout: CacheLayout | None = None
        self.gen = 0
        self.used = False  # a task was dispatched at this generation: its content matters
        self.reason = ""  # why the generation last moved (status says it; empty: it never did)
        self.keep_cpu = False  # the last clear kept the CPU tier
        self.cpu_lost: list[int] = []  # ranks whose resume could not keep the CPU tier
        self.cpu_gen = 0  # the CPU tier's generation: moves only when CPU content is gone
        self.cpu_used = False  # a task was dispatched at this CPU generation
        # The name the last clear without keep_cpu gave the weights the engines serve after it (a
        # trainer's version, a cycle's label; None: unnamed).  The CPU generation says the blocks are
        # gone; this says whose the next ones are, so that engines of one fleet cleared by one cycle
        # name their new KV alike (docs/protocol.md §8.2).
        self.weights: str | None = None

    def mark_used(self) -> None:
        self.used = self.cpu_used = True

    def move_cpu(self, gen: int | None = None) -> None:
        """The CPU content is gone: a new CPU generation (above ``gen``, a rank's, when given)."""
        self.cpu_gen = _within(max(self.cpu_gen, gen or 0) + 1)
        self.cpu_used = False

    def adopt_layout(self, layout: CacheLayout) -> None:
        """The first registered rank names the layout of a bus that has none."""
        if self.layout is None:
            self.layout = layout

    def move(self, gen: int, reason: str, *, used: bool = False) -> None:
        """The one way the generation changes (docs/protocol.md §8.2): every
        move says why, and status reports it as ``gen_reason``.  ``used``:
        a task ran at ``gen`` already (one taken from a rank)."""
        if not reason:
            raise ValueError(f"the move of the cache generation from {self.gen} to {gen} names no reason")
        self.gen, self.used, self.reason = _within(gen), used, reason

    def adopt(self, gen: int, reason: str) -> None:
        """The first rank of a broker that lost its state: take its generation,
        counted as used (the old broker served it)."""
        self.move(gen, reason, used=True)

    def adopt_cpu(self, cpu_gen: int) -> None:
        """Likewise for the CPU generation of a kept tier."""
        self.cpu_gen, self.cpu_used = _within(cpu_gen), True

    def cleared(self, keep_cpu: bool, reason: str, weights: str | None = None) -> None:
        """A clear begins: the GPU blocks are gone at a new generation; one without
        ``keep_cpu`` names the weights after it (``weights``, None: unnamed)."""
        self.move(self.gen + 1, reason)
        self.keep_cpu = keep_cpu
        self.cpu_lost = []
        if not keep_cpu:
            self.move_cpu()
            self.weights = weights

    def reallocated(self, reason: str) -> None:
        """A resume from cleared failed: some ranks may have allocated, so a new
        generation (the CPU tier's only if the clear did not keep it: the ranks free it again)."""
        self.move(self.gen + 1, reason)
        if not self.keep_cpu:
            self.move_cpu()

    def cpu_not_kept(self, rank: int) -> None:
        if self.keep_cpu:
            self.cpu_lost.append(rank)

    def resumed(self, layout: CacheLayout | None) -> tuple[bool | None, str]:
        """A resume completed on every rank: take its layout; returns whether the
        CPU tier a clear kept survived (None: the clear kept none) and the note
        its reply carries when it did not."""
        if layout is not None:
            self.layout = layout
        cpu_kept, note = None, ""
        if self.keep_cpu:  # the clear before kept the CPU tier: say whether it survived
            cpu_kept = not self.cpu_lost
            if self.cpu_lost:
                self.move_cpu()
                note = (
                    f"the CPU tier could not be kept on ranks {sorted(set(self.cpu_lost))} (a new block shape, "
                    "or a rank that came back without it): the blocks the clear kept are gone"
                )
            self.keep_cpu = False
        return cpu_kept, note

    def restore(self, snap: dict[str, Any], cleared: bool) -> None:
        """Take a restarted broker's generation from its snapshot (``recovery.py``)."""
        self.gen = snap["gen"]
        self.used = snap.get("gen_used", True)
        self.cpu_gen = snap.get("cpu_gen", 0)
        self.cpu_used = snap.get("cpu_used", True)
        self.reason = snap.get("gen_reason", "")
        self.keep_cpu = bool(snap.get("keep_cpu")) and cleared
        self.weights = snap.get("weights")
        self.layout = CacheLayout.from_wire(snap["layout"]) if snap.get("layout") else None

    def is_acked_layout(self, acked: CacheLayout | None, named: CacheLayout) -> bool:
        """A resume's ack is for the ``named`` layout: it names that one (typed by
        the decoder: a rank acks every field), or names none while ``named`` is
        the bus's own."""
        if acked is None:
            return self.layout is not None and named == self.layout
        return acked == named
