"""The CPU path of ``CopyEngine``: one plan per swap, a few C calls per region group.

Each part of a swap goes by one of six named strategies (``Strategy``), each
with the domain it was measured best in (``STRATEGIES``); ``choose`` picks
them for a plan, ``CpuCopier.copy`` runs them.  Why each is where it is:

A page is 4-128 KiB, so a per-page Python loop (a ``memmove`` per page per
region) costs as much as the copy itself: 256 scattered blocks of 8 regions
ran at half a plain copy.  Here Python works per *run*, C per page:

- ``plan`` sorts the (tier row, engine block) pairs by tier row and cuts them
  where the rows stop being consecutive.  A run whose engine blocks are
  consecutive too is one slice copy per group (``copy_runs``), except a
  swap-in where the regions have a ``Span``: there it is one call, as a
  scattered run is, which reads the tier rows once in order where a call per
  group reads a page of every row in turn (0.65x -> 0.8-0.9x of a plain
  copy).  A run whose blocks are scattered is one indexed copy per group:
  swap-out is
  ``torch.index_select(group, 1, blocks, out=the run's tier columns)`` (a
  ``memcpy`` per page in C++), swap-in numpy's ``group[:, blocks] = the run's
  tier columns`` (a ``memcpy`` per page in C).  No temporaries, no page faults.
- Pairs left in runs shorter than ``MIN_RUN`` (tier rows scattered too) go
  through a staging buffer allocated once per copy engine, a chunk at a time:
  swap-out gathers a chunk's pages per group into staging rows laid out as
  tier rows, then scatters whole rows to the tier; swap-in the reverse.  The
  second pass reads what the first wrote, from cache.  A handful of them are
  a ``memmove`` per page instead.
- A swap of fewer than ``MIN_RUN`` blocks skips the plan: a ``memmove`` per
  page, or one strided copy per group (the 1-block task, a few us).  So does
  a cache whose calls move 64 KiB or more each (block-major, zkv's own store):
  there a call per block costs little, and a block at a time reads the source
  in address order, which an indexed copy in tier-row order does not (measured,
  block-major swap-out 0.73-0.82x of a plain copy through the plan, 0.79-0.87x
  a block at a time).

With two copy threads (``copy_threads``) a large run (``SPLIT_BYTES``) is
cut in two halves, one copied on a helper thread while the caller copies the
other: a page gather or scatter is bound by memory latency, not bandwidth
(one thread gathers scattered 16 KiB pages at about half a plain copy
here), and torch, numpy and ``ctypes.memmove`` release the GIL in these
copies.  Not torch's intra-op threads: their OpenMP workers spin, and on a
loaded machine they copied 10x slower.  Only where the process may use 4
cores or more, by default: on 2 cores shared with the rest of a bus the
second thread cost 8 % of 256-block task throughput.

A *group* is a run of regions equally spaced in one buffer with the same
page and row stride (``staging.group_regions``: zkv's own store, vLLM's K and V
halves); it is one 3-D view ``[count, blocks, page]``, whose pages sit side by
side in a tier row, so one call moves every region of the group.  Ids are
already checked (range, duplicates) when these run.
"""

from __future__ import annotations

import ctypes
import enum
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence, cast

import numpy as np
import torch

from .staging import group_regions

# A run of at least this many pages per group is one slice copy or one indexed copy; a shorter
# one is a memmove per page, which costs ~0.3 us of Python instead of ~5 us for a torch call.
SLICE_COPY_MIN_ROWS = 8
# Tier runs shorter than this (rows scattered on both sides) go through staging (or a block at a
# time): an indexed copy costs ~3 us per region, a memmove ~0.4 us per page, a group's strided copy ~3 us.
MIN_RUN = 8
# Staging for pairs scattered on both sides: a chunk is at most this many bytes (L3-resident).
STAGE_BYTES = 4 << 20
# Fewer loose pairs than this, or pages this large, are a memmove per page (no staging pass).
STAGE_MIN_PAIRS = 8
STAGE_PAGE_BYTES = 64 << 10
# With two copy threads, a run moving at least this many bytes is copied in two halves at once (one
# on a helper thread); below it a thread hand-off costs more than the second thread wins.
SPLIT_BYTES = 8 << 20
COPY_THREADS_ENV = "ZKV_COPY_THREADS"
_chosen: int | None = None  # set_copy_threads: what a rank's entry point was told


def set_copy_threads(threads: int | None) -> None:
    """For a rank's own process (``zkv worker --copy-threads``): 1 or 2, None to decide as
    ``copy_threads`` does."""
    global _chosen
    if threads not in (None, 1, 2):
        raise ValueError(f"copy threads must be 1 or 2, got {threads!r}")
    _chosen = threads


def copy_threads() -> int:
    """Threads for one large CPU copy: what ``set_copy_threads`` chose, else ``ZKV_COPY_THREADS``
    (1 or 2; a rank inside an engine's process reads it), else 2 where this process may use
    4 cores or more and 1 where fewer (the module docstring says why)."""
    if _chosen is not None:
        return _chosen
    given = os.environ.get(COPY_THREADS_ENV)
    if given is None or given == "":
        return 2 if len(os.sched_getaffinity(0)) >= 4 else 1
    if given not in ("1", "2"):
        raise ValueError(f"{COPY_THREADS_ENV} must be 1 or 2, got {given!r}")
    return int(given)


Runs = list[tuple[int, int, int]]


class Strategy(enum.Enum):
    """How one part of a swap is copied; ``STRATEGIES`` gives each its domain and what was measured."""

    BLOCKS = "blocks"
    SLICES = "slices"
    SPAN = "span"
    INDEXED = "indexed"
    STAGED = "staged"
    PAGES = "pages"


@dataclass(frozen=True)
class Domain:
    """Where a strategy is chosen, in the thresholds' terms, and the figure that put it there."""

    chosen: str
    measured: str


#: the copy strategies, in the order ``choose`` tries them (the module docstring tells the story)
STRATEGIES: dict[Strategy, Domain] = {
    Strategy.BLOCKS: Domain(
        f"a swap of fewer than MIN_RUN ({MIN_RUN}) pairs, or whose calls move STAGE_PAGE_BYTES "
        f"({STAGE_PAGE_BYTES >> 10} KiB) or more each: a block at a time, in address order",
        "the 1-block task in a few us; block-major swap-out 0.79-0.87x of a plain copy (0.73-0.82x through the plan)",
    ),
    Strategy.SLICES: Domain(
        f"a run of MIN_RUN or more tier rows whose engine blocks are consecutive too (swap-out, or swap-in "
        f"without a span): one strided copy per group of SLICE_COPY_MIN_ROWS ({SLICE_COPY_MIN_ROWS}) pages or "
        "more, else a memmove per page",
        "numpy's copyto ~3 us for one block of 8 pages, where torch's copy_ takes ~15 us to set up",
    ),
    Strategy.SPAN: Domain(
        "a run of MIN_RUN or more tier rows whose engine blocks are scattered (and a swap-in's consecutive ones), "
        "where the regions have a Span the tier rows fit: one call per run",
        "contiguous swap-in 0.65x -> 0.8-0.9x of a plain copy (the tier rows read once, in order)",
    ),
    Strategy.INDEXED: Domain(
        "the same runs with no span (or a swap-in whose tier rows lie among the regions): an index_select per "
        "region, a numpy assignment per group",
        "index_select on 2-D views 0.75x of a plain copy where a 3-D group set up a copy per row (0.62x)",
    ),
    Strategy.STAGED: Domain(
        f"STAGE_MIN_PAIRS ({STAGE_MIN_PAIRS}) or more pairs in no run of MIN_RUN rows: through staging rows, "
        f"STAGE_BYTES ({STAGE_BYTES >> 20} MiB) at a time",
        "an indexed copy ~3 us per region beside a memmove ~0.4 us per page; the second pass reads from cache",
    ),
    Strategy.PAGES: Domain(
        "fewer loose pairs than STAGE_MIN_PAIRS: a memmove per page", "~0.4 us a page, no staging pass to pay"
    ),
}
# Beside any of them: with two copy threads, a run moving SPLIT_BYTES or more goes in two halves at once.


def coalesce(src: Sequence[int], dst: Sequence[int]) -> Runs:
    """Merge id pairs into runs ``(src_start, dst_start, length)``."""
    if len(src) == 1:  # the common small swap
        return [(src[0], dst[0], 1)]
    runs: Runs = []
    s0 = d0 = length = 0
    for s, d in sorted(zip(src, dst)):
        if length and s == s0 + length and d == d0 + length:
            length += 1
            continue
        if length:
            runs.append((s0, d0, length))
        s0, d0, length = s, d, 1
    if length:
        runs.append((s0, d0, length))
    return runs


def halve(runs: Runs, rows: int) -> tuple[Runs, Runs]:
    """``runs`` as the runs of their first ``rows`` rows and the runs of the rest (the run
    where they meet cut in two)."""
    first: Runs = []
    for i, (s, d, n) in enumerate(runs):
        if rows <= 0:
            return first, runs[i:]
        if n > rows:
            return first + [(s, d, rows)], [(s + rows, d + rows, n - rows)] + runs[i + 1 :]
        first.append((s, d, n))
        rows -= n
    return first, []


@dataclass(frozen=True)
class Plan:
    """A swap as runs of tier rows: ``slices`` (tier row, engine block, n) both consecutive;
    ``indexed`` (tier row, engine blocks) rows consecutive, blocks not; ``loose`` (tier rows,
    engine blocks) in no run of ``MIN_RUN`` rows."""

    slices: Runs
    indexed: list[tuple[int, np.ndarray]]
    loose: tuple[np.ndarray, np.ndarray]


def plan(tier_ids: Sequence[int], engine_ids: Sequence[int]) -> Plan:
    """Cut the pairs into runs of consecutive tier rows (vectorized: Python works only per run
    of at least MIN_RUN rows; ~20 us for 256 pairs)."""
    t = np.asarray(tier_ids, dtype=np.int64)
    e = np.asarray(engine_ids, dtype=np.int64)
    order = np.argsort(t, kind="stable")
    t, e = t[order], e[order]
    cuts = np.flatnonzero(np.diff(t) != 1) + 1
    starts = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((starts, [len(t)])))
    long = lengths >= MIN_RUN
    slices: Runs = []
    indexed: list[tuple[int, np.ndarray]] = []
    for a, n in zip(starts[long].tolist(), lengths[long].tolist()):
        blocks = e[a : a + n]
        if blocks[-1] - blocks[0] == n - 1 and bool((np.diff(blocks) == 1).all()):
            slices.append((int(t[a]), int(blocks[0]), n))
        else:
            indexed.append((int(t[a]), blocks))
    loose = np.repeat(~long, lengths)
    return Plan(slices, indexed, (t[loose], e[loose]))


def is_block_at_a_time(pairs: int, small_pages: bool) -> bool:
    """``Strategy.BLOCKS``'s domain: too few pairs for a plan, or pages too large for one to pay."""
    return pairs < MIN_RUN or not small_pages


def choose(p: Plan, has_span: bool, out: bool) -> list[tuple[Strategy, Any]]:
    """The parts of a planned swap and the strategy of each, in the order they run:
    ``SLICES`` (its runs, engine-first on a swap-out), then ``SPAN`` or ``INDEXED`` per run
    ``(tier row, engine blocks)``, then ``STAGED`` or ``PAGES`` for the loose pairs
    ``(tier rows, engine blocks)`` (a swap-out's sorted by engine block: it reads the engine in
    address order).  Pure: ``CpuCopier.copy`` runs them."""
    parts: list[tuple[Strategy, Any]] = []
    indexed = p.indexed
    if p.slices and has_span and not out:  # through the span: a run's tier rows read once, in order
        indexed = indexed + [(t, np.arange(e, e + n, dtype=np.int64)) for t, e, n in p.slices]
    elif p.slices:
        parts.append((Strategy.SLICES, [(e, t, n) if out else (t, e, n) for t, e, n in p.slices]))
    by_run = Strategy.SPAN if has_span else Strategy.INDEXED
    parts += [(by_run, run) for run in indexed]
    rows, blocks = p.loose  # sorted by tier row: swap-in reads in address order
    if out:
        order = np.argsort(blocks, kind="stable")
        rows, blocks = rows[order], blocks[order]
    if len(rows) >= STAGE_MIN_PAIRS:
        parts.append((Strategy.STAGED, (rows, blocks)))
    elif len(rows):
        parts.append((Strategy.PAGES, (rows, blocks)))
    return parts


def copy_rows(src: torch.Tensor, dst: torch.Tensor, runs: Runs) -> None:
    """Copy rows of two CPU ``[rows, page]`` uint8 views (row-contiguous, ids already range-checked);
    a long run is numpy's ``copyto`` (a ``memmove`` per row: 1.05-1.1x torch's contiguous ``copy_``
    where torch's own ``copy_`` of the strided rows ran at 0.8x)."""
    page = src.shape[1]
    sp, ss, dp, ds = src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(0)
    memmove = ctypes.memmove
    for s, d, n in runs:
        if n >= SLICE_COPY_MIN_ROWS:
            np.copyto(dst[d : d + n].numpy(), src[s : s + n].numpy())
        elif ss == ds == page:
            memmove(dp + d * ds, sp + s * ss, n * page)
        else:
            for i in range(n):
                memmove(dp + (d + i) * ds, sp + (s + i) * ss, page)


@dataclass(frozen=True)
class CpuGroup:
    """One group's engine memory ``[count, blocks, page]`` and its tier columns ``[rows, count, page]``
    (torch and numpy views of the same bytes), and its regions' own views and tier columns."""

    engine: torch.Tensor
    tier: torch.Tensor
    views: list[torch.Tensor]
    columns: list[torch.Tensor]
    engine_np: Any
    tier_np: Any
    column: int  # the group's first byte in a tier row
    count: int  # regions (asked per run: a torch shape costs more than a field)


def groups_of(views: list[torch.Tensor], store: torch.Tensor, columns: list[torch.Tensor]) -> list[CpuGroup]:
    """The groups of a cache's region ``views`` over a tier ``store`` (kept by the cache:
    ``EngineCache.derived``, so its release drops them, numpy views too)."""
    out, i = [], 0
    for g in group_regions(views, 1):
        tier3 = store[:, g.column : g.column + g.count * g.page].view(store.shape[0], g.count, g.page)
        out.append(
            CpuGroup(
                g.source,
                tier3,
                views[i : i + g.count],
                columns[i : i + g.count],
                g.source.numpy(),
                tier3.numpy(),
                g.column,
                g.count,
            )
        )
        i += g.count
    return out


def copy_runs(groups: list[CpuGroup], runs: Runs, out: bool) -> None:
    """Runs ``(src, dst, n)`` consecutive on both sides: a run that moves at least SLICE_COPY_MIN_ROWS
    pages is one strided copy per group (numpy's ``copyto``: ~3 us for one block of 8 pages where
    torch's ``copy_`` takes ~15 us to set up); the others go region by region (``copy_rows``)."""
    for g in groups:
        count, rest = g.count, []
        for s, d, n in runs:
            if count == 1 or n * count < SLICE_COPY_MIN_ROWS:
                rest.append((s, d, n))
            elif out:
                np.copyto(g.tier_np[d : d + n], g.engine_np[:, s : s + n].transpose(1, 0, 2))
            else:
                np.copyto(g.engine_np[:, d : d + n], g.tier_np[s : s + n].transpose(1, 0, 2))
        for view, column in zip(g.views, g.columns) if rest else ():
            if out:
                copy_rows(view, column, rest)
            else:
                copy_rows(column, view, rest)


class Span:
    """Every region's pages as rows of one byte-addressed view: ``pages[offset]`` is the page that
    starts ``offset`` bytes into the address range the regions cover (a ``[span - page + 1, page]``
    view with strides ``(1, 1)``, torch and numpy over the same memory; only the indexed pages are
    ever touched).  Page ``(region r, block b)`` starts at ``start[r] + b * stride[r]``.

    So a run of tier rows moves every region's pages with one call: swap-out one ``index_select``
    into the run's tier rows seen as ``[rows * regions, page]`` (one contiguous write), swap-in one
    numpy assignment from them (one contiguous read), where a call per region (or group) wrote or
    read a column of every row.  Only for regions of one page size laid side by side in a tier
    row (``of``); it holds the views, so the memory it addresses lives as long as it does."""

    def __init__(self, views: list[torch.Tensor], page: int):
        ptrs = [v.data_ptr() for v in views]
        base = min(ptrs)
        size = max(p + (v.shape[0] - 1) * v.stride(0) + page for p, v in zip(ptrs, views)) - base
        raw = (ctypes.c_uint8 * size).from_address(base)
        self.views = views  # keeps the engine's storages alive while the span addresses them
        self.page = page
        self.count = len(views)
        self.start = np.asarray(ptrs, dtype=np.int64) - base
        self.stride = np.asarray([v.stride(0) for v in views], dtype=np.int64)
        self.pages_np = np.ndarray(buffer=raw, dtype=np.uint8, shape=(size - page + 1, page), strides=(1, 1))
        self.pages = torch.from_numpy(self.pages_np)

    @staticmethod
    def of(views: list[torch.Tensor]) -> "Span | None":
        """The span of a cache's region ``views``, or None where their pages differ in size."""
        page = views[0].shape[1] if views else 0
        if not views or any(v.shape[1] != page or v.stride(1) != 1 or v.stride(0) <= 0 for v in views):
            return None
        try:
            return Span(views, page)
        except (ValueError, OverflowError, RuntimeError):  # regions so far apart that the view's size overflows
            return None

    def fits(self, store: torch.Tensor, columns: list[torch.Tensor]) -> bool:
        """Whether a tier's rows are this span's pages side by side, rows unpadded: a run of rows is
        then one ``[rows * regions, page]`` view."""
        base, page = store.data_ptr(), self.page
        return (
            store.stride(0) == store.shape[1] == page * self.count
            and store.stride(1) == 1
            and len(columns) == self.count
            and all(c.data_ptr() == base + i * page and c.shape[1] == page for i, c in enumerate(columns))
        )

    def offsets(self, blocks: np.ndarray) -> torch.Tensor:
        """Each block's pages, region after region: the order of a tier row's pages."""
        return torch.from_numpy((blocks[:, None] * self.stride + self.start).reshape(-1))

    def gather(self, blocks: np.ndarray, out: torch.Tensor) -> None:
        """The blocks' pages into ``out`` (``[n * regions, page]``, tier-row order)."""
        torch.index_select(self.pages, 0, self.offsets(blocks), out=out)

    def overlaps(self, pages: Any) -> bool:
        """Whether numpy ``pages`` lie inside the address range the regions cover: a ``scatter``
        from them would first copy them to a fresh temporary (measured 0.35x of a plain copy
        instead of 0.9x)."""
        return bool(np.may_share_memory(self.pages_np, pages))

    def scatter(self, blocks: np.ndarray, pages: Any) -> bool:
        """``pages`` (numpy ``[n * regions, page]``, tier-row order) into the blocks; False (nothing
        done) where they ``overlaps``."""
        if self.overlaps(pages):
            return False
        self.pages_np[self.offsets(blocks).numpy()] = pages
        return True


class CpuCopier:
    """Swaps between one cache's groups and one tier on CPU (see the module docstring); one thread
    drives it.  ``groups()`` returns the cache's groups, ``span()`` its ``Span`` or None (both built
    once and kept by the cache)."""

    def __init__(
        self, tier: Any, groups: Any, stage_bytes: int = STAGE_BYTES, span: Any = None, split: bool | None = None
    ):
        self.tier = tier  # its ``store`` is read per swap, never kept: a mapped tier's file must close
        self.groups = groups
        self.span = span or (lambda: None)
        self._fits: bool | None = None
        self.row_bytes = tier.store.shape[1]
        self.stage_rows = max(1, stage_bytes // self.row_bytes)
        self._stage: tuple[torch.Tensor, Any, list[torch.Tensor], list[Any]] | None = None
        self.split = copy_threads() == 2 if split is None else split  # large runs in two halves at once
        self._helper: ThreadPoolExecutor | None = None

    def close(self) -> None:
        self._stage = None
        if self._helper is not None:
            self._helper.shutdown(wait=True)
            self._helper = None

    def _halves(self, copy: Callable[[np.ndarray, Any], Any], blocks: np.ndarray, pages: Any, count: int) -> None:
        """``copy(blocks, pages)`` (``pages``: ``[n * count, page]`` rows in tier-row order),
        in two halves at once when the run is large (``SPLIT_BYTES``), else in one call."""
        n, half = len(blocks), len(blocks) // 2
        if not self._large(n):
            copy(blocks, pages)
            return
        self._both(
            lambda: copy(blocks[:half], pages[: half * count]), lambda: copy(blocks[half:], pages[half * count :])
        )

    def _copy_runs(self, groups: list[CpuGroup], runs: Runs, out: bool, rows: int) -> None:
        """``copy_runs``, in two halves of ``rows`` at once when they are large (a run cut in two
        where the halves meet)."""
        if not self._large(rows):
            copy_runs(groups, runs, out)
            return
        first, second = halve(runs, rows // 2)
        self._both(lambda: copy_runs(groups, first, out), lambda: copy_runs(groups, second, out))

    def _large(self, rows: int) -> bool:
        """Whether ``rows`` tier rows are copied in two halves at once (``SPLIT_BYTES``)."""
        return self.split and rows > 1 and rows * self.row_bytes >= SPLIT_BYTES

    def _both(self, first: Callable[[], Any], second: Callable[[], Any]) -> None:
        """``first`` on the helper thread while this one runs ``second``."""
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="zkv-copy")
        done = self._helper.submit(first)
        try:
            second()
        finally:
            done.result()  # its error, if any, is the copy's

    def small_pages(self, groups: list[CpuGroup]) -> bool:
        """Whether a block at a time (``copy_runs``: a strided copy per group of at least
        SLICE_COPY_MIN_ROWS regions, else a ``memmove`` per page) would cost more than a staging
        pass: under ``STAGE_PAGE_BYTES`` per call (a call's 0.4-3 us is ~5% of 128 KiB's copy)."""
        calls = sum(1 if g.count >= SLICE_COPY_MIN_ROWS else g.count for g in groups)
        return self.row_bytes < STAGE_PAGE_BYTES * calls

    def copy(self, tier_ids: Sequence[int], engine_ids: Sequence[int], out: bool) -> None:
        """Engine blocks -> tier rows (``out``) or tier rows -> engine blocks, pairwise, each part
        by its strategy (``STRATEGIES``)."""
        groups: list[CpuGroup] = self.groups()
        if is_block_at_a_time(len(tier_ids), self.small_pages(groups)):  # Strategy.BLOCKS
            runs = coalesce(engine_ids, tier_ids) if out else coalesce(tier_ids, engine_ids)
            self._copy_runs(groups, runs, out, len(tier_ids))
            return
        p = plan(tier_ids, engine_ids)
        span = self._span() if p.indexed or len(p.loose[0]) or (p.slices and not out) else None
        for strategy, part in choose(p, span is not None, out):
            if strategy is Strategy.SLICES:
                self._copy_runs(groups, part, out, sum(n for _, _, n in part))
            elif strategy is Strategy.INDEXED:
                t0, run = part
                self._indexed(groups, t0, run, out)
            elif strategy is Strategy.SPAN:
                t0, run = part
                self._by_span(cast(Span, span), groups, t0, run, out)
            elif strategy is Strategy.STAGED:
                rows, blocks = part
                for at in range(0, len(rows), self.stage_rows):
                    chunk = rows[at : at + self.stage_rows], blocks[at : at + self.stage_rows]
                    if span is None or not self._staged_span(span, *chunk, out):
                        self._staged(groups, *chunk, out)
            else:  # Strategy.PAGES
                rows, blocks = part
                pairs = zip(blocks.tolist(), rows.tolist()) if out else zip(rows.tolist(), blocks.tolist())
                copy_runs(groups, [(s, d, 1) for s, d in pairs], out)

    def _by_span(self, span: Span, groups: list[CpuGroup], t0: int, blocks: np.ndarray, out: bool) -> None:
        """Tier rows ``[t0, t0 + n)`` <-> scattered engine ``blocks`` in one call through the span (in
        two halves when large); a swap-in whose tier rows lie among the regions goes ``_indexed``."""
        rows = self.tier.store[t0 : t0 + len(blocks)].view(-1, span.page)
        if out:
            self._halves(span.gather, blocks, rows, span.count)
            return
        pages = rows.numpy()
        if span.overlaps(pages):
            self._indexed(groups, t0, blocks, out)
        else:
            self._halves(span.scatter, blocks, pages, span.count)

    @staticmethod
    def _indexed(groups: list[CpuGroup], t0: int, blocks: np.ndarray, out: bool) -> None:
        """Tier rows ``[t0, t0 + n)`` <-> scattered engine ``blocks``.  Swap-out: one
        ``index_select`` per region (2-D, so torch takes its ``memcpy``-per-row loop; on a 3-D
        group it sets up a copy per row: 0.62x -> 0.75x of a plain copy for vLLM's K/V halves);
        swap-in: one numpy assignment per group."""
        n = len(blocks)
        if out:
            index = torch.from_numpy(blocks)
            for g in groups:
                for view, column in zip(g.views, g.columns):
                    torch.index_select(view, 0, index, out=column[t0 : t0 + n])
        else:
            for g in groups:
                g.engine_np[:, blocks] = g.tier_np[t0 : t0 + n].transpose(1, 0, 2)

    def _staging(self, groups: list[CpuGroup]) -> tuple[torch.Tensor, Any, list[torch.Tensor], list[Any]]:
        """The staging rows (allocated and faulted in once), each region's columns in them (torch)
        and each group's (numpy, ``[rows, count, page]``)."""
        if self._stage is None:
            stage = torch.zeros((self.stage_rows, self.row_bytes), dtype=torch.uint8)
            columns, group_views = [], []
            for g in groups:
                page = g.engine.shape[2]
                view = stage[:, g.column : g.column + g.count * page].view(self.stage_rows, g.count, page)
                columns += list(view.unbind(1))
                group_views.append(view.numpy())
            self._stage = (stage, stage.numpy(), columns, group_views)
        return self._stage

    def _span(self) -> Span | None:
        """The cache's span where this tier's rows fit it (decided once), else None."""
        span: Span | None = self.span() if self._fits is not False else None
        if span is not None and self._fits is None:
            self._fits = span.fits(self.tier.store, self.tier.columns)
        return span if self._fits else None

    def _staged_span(self, span: Span, rows: np.ndarray, blocks: np.ndarray, out: bool) -> bool:
        """``_staged`` with one call per side: swap-out gathers every page of the chunk into the
        staging rows (``Span.gather``) then scatters whole rows; swap-in the reverse.  False
        (nothing done) where the staging rows lie among the regions (``Span.scatter``)."""
        stage = self._staging(self.groups())[0]
        n = len(rows)
        if out:
            span.gather(blocks, stage[:n].view(-1, span.page))
            self.tier.store.numpy()[rows] = stage[:n].numpy()
            return True
        if np.may_share_memory(span.pages_np, stage.numpy()):
            return False
        torch.index_select(self.tier.store, 0, torch.from_numpy(rows), out=stage[:n])
        return span.scatter(blocks, stage[:n].view(-1, span.page).numpy())

    def _staged(self, groups: list[CpuGroup], rows: np.ndarray, blocks: np.ndarray, out: bool) -> None:
        """Pairs scattered on both sides, through staging rows laid out as tier rows: swap-out
        gathers pages per region (``index_select``) then scatters whole rows to the tier; swap-in
        gathers whole rows then scatters pages per group."""
        stage, stage_np, columns, group_views = self._staging(groups)
        n = len(rows)
        if out:
            index = torch.from_numpy(blocks)
            views = [v for g in groups for v in g.views]
            for view, column in zip(views, columns):
                torch.index_select(view, 0, index, out=column[:n])
            self.tier.store.numpy()[rows] = stage_np[:n]
        else:
            torch.index_select(self.tier.store, 0, torch.from_numpy(rows), out=stage[:n])
            for g, view_np in zip(groups, group_views):
                g.engine_np[:, blocks] = view_np[:n].transpose(1, 0, 2)
