"""The copy engine's CUDA path: one PCIe transfer per staging chunk, no host scatter.

A swap is *planned* in plain Python: its (tier row, engine block) pairs are
sorted by tier row and cut into chunks of at most one staging buffer's rows.
A chunk's tier rows form runs of consecutive rows, each one contiguous
``cudaMemcpyAsync`` to or from the pinned tier (one per chunk when the rows
are adjacent, as a row allocator hands them out); its engine blocks are
either one run (slice copies) or a gather / scatter by an index on the
device.  The host never touches the bytes.

*Executing* a plan uses two device staging buffers laid out like tier rows
and two streams: the copy stream (ordered after the engine's compute stream)
gathers chunk k into buffer k % 2 while the transfer stream moves chunk k-1
across the link, so the device-side gather hides behind the transfer.  The
regions a gather touches are grouped (``group_regions``): regions that are
equally spaced slices of one engine buffer with adjacent tier columns (zkv's
own ``[2*layers, blocks, ...]`` store, vLLM's K/V halves) are one strided 3-D
view, so a chunk costs one kernel per group, not one per region.  A cache
of one contiguous region whose page is a whole tier row copies a chunk whose
blocks and rows are both one run directly, without staging.

Everything is allocated once per (cache, tier) pair: the staging buffers,
the device index buffer and its pinned upload buffer, the events.  Views of
engine memory are never kept here: the grouped views live in the cache
(``EngineCache.derived``), so ``release()`` alone lets the engine free.  A
swap returns only after an event behind its last copy has completed.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..memory.regions import EngineCache

# Device memory for the two staging buffers together (the only device memory
# zkv allocates; dropped by close()).  A chunk is half of it.
STAGING_BYTES = 128 << 20


@dataclass(frozen=True)
class Chunk:
    """Pairs ``[pos, pos + n)`` of a row-sorted swap, moved through one staging buffer."""

    pos: int
    n: int
    block_start: int | None  # the first engine block when the chunk's blocks are one run, else None (indexed)
    row_runs: tuple[tuple[int, int, int], ...]  # (first tier row, offset in the chunk, rows)


def plan(pairs: Sequence[tuple[int, int]], limit: int) -> list[Chunk]:
    """Chunks of at most ``limit`` of ``pairs`` = (tier row, engine block), sorted by row."""
    chunks = []
    for pos in range(0, len(pairs), limit):
        part = pairs[pos : pos + limit]
        b0 = part[0][1]
        run = all(b == b0 + i for i, (_, b) in enumerate(part))
        row_runs, start = [], 0
        for i in range(1, len(part) + 1):
            if i == len(part) or part[i][0] != part[i - 1][0] + 1:
                row_runs.append((part[start][0], start, i - start))
                start = i
        chunks.append(Chunk(pos, len(part), b0 if run else None, tuple(row_runs)))
    return chunks


def word_bytes(*sizes: int) -> int:
    """The widest element (8, 4, 2 or 1 bytes) dividing every size, offset and stride given:
    the device copies and gathers then move words, not bytes."""
    for w in (8, 4, 2):
        if all(s % w == 0 for s in sizes):
            return w
    return 1


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class Group:
    """``count`` consecutive regions as one ``[count, num_blocks, page_words]`` view of engine memory,
    whose pages sit at ``column`` words of a tier row, one after the other."""

    source: torch.Tensor
    column: int
    count: int
    page: int  # words


def group_regions(views: Sequence[torch.Tensor], word: int) -> list[Group]:
    """Fold runs of regions that are equally spaced in one buffer, with the same page and row stride."""
    groups: list[Group] = []
    i, column = 0, 0
    while i < len(views):
        first, j = views[i], i + 1
        step = None
        while j < len(views):
            v = views[j]
            if (
                v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or v.shape != first.shape
                or v.stride() != first.stride()
            ):
                break
            gap = v.storage_offset() - views[j - 1].storage_offset()
            if gap <= 0 or (step is not None and gap != step):
                break
            step, j = gap, j + 1
        count, page = j - i, first.shape[1]
        grouped = first.as_strided(
            (count, first.shape[0], page), (step or page, first.stride(0), 1), first.storage_offset()
        )
        groups.append(Group(grouped.view(_WORDS[word]), column // word, count, page // word))
        column += count * page
        i = j
    return groups


class StagedCopier:
    """The CUDA path of one ``CopyEngine`` (see the module docstring); one thread drives it."""

    def __init__(
        self, cache: EngineCache, store: torch.Tensor, compute_stream: Any = None, staging_bytes: int = STAGING_BYTES
    ):
        self.cache = cache  # its views are engine memory: taken per swap, never kept here (release drops them)
        self.store = store  # the pinned tier, [rows, row_bytes] uint8
        self.device = cache.device
        self.compute_stream = compute_stream
        views, row_bytes = cache.views, store.shape[1]
        self.word = word_bytes(
            row_bytes,
            store.data_ptr(),
            *(
                int(x)
                for v in views
                for x in (v.shape[1], v.stride(0), v.storage_offset(), v.untyped_storage().data_ptr())
            ),
        )
        self.specs = [(g.column, g.count, g.page) for g in group_regions(views, self.word)]
        self.direct = len(views) == 1 and views[0].is_contiguous() and views[0].shape[1] == row_bytes
        self.chunk_rows = max(1, staging_bytes // 2 // row_bytes)
        self.index_capacity = max(store.shape[0], cache.num_blocks)
        self.copy_stream = torch.cuda.Stream(device=self.device)
        self.xfer_stream = torch.cuda.Stream(device=self.device)
        self._filled = [torch.cuda.Event(), torch.cuda.Event()]
        self._freed = [torch.cuda.Event(), torch.cuda.Event()]
        self._staging: torch.Tensor | None = None
        self._group_views: list[list[torch.Tensor]] = []  # [buffer][group]: its columns as [count, rows, page]
        self._index_host: torch.Tensor | None = None
        self._index_dev: torch.Tensor | None = None

    def close(self) -> None:
        """Drop the staging and index buffers (every swap has completed when it returned)."""
        self._staging = self._index_host = self._index_dev = None
        self._group_views = []

    # --- buffers, allocated once ---------------------------------------------------

    def _buffers(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(
                (2, self.chunk_rows, self.store.shape[1]), dtype=torch.uint8, device=self.device
            )
            self._group_views = [[self._group_view(buf, *spec) for spec in self.specs] for buf in self._staging]
        return self._staging

    def _upload_index(self, blocks: Sequence[int]) -> torch.Tensor:
        """The engine block of every pair, on the device (through a pinned buffer allocated once;
        the previous upload from it completed when the previous swap returned)."""
        if self._index_host is None or self._index_dev is None:
            self._index_host = torch.empty(self.index_capacity, dtype=torch.int64, pin_memory=True)
            self._index_dev = torch.empty(self.index_capacity, dtype=torch.int64, device=self.device)
        n = len(blocks)
        self._index_host[:n].copy_(torch.frombuffer(array("q", blocks), dtype=torch.int64))
        self._index_dev[:n].copy_(self._index_host[:n], non_blocking=True)
        return self._index_dev

    def _group_view(self, staging: torch.Tensor, column: int, count: int, page: int) -> torch.Tensor:
        """A staging buffer's columns of one group as ``[count, rows, page]`` words (built once: a
        chunk slices it, one view op instead of four per region and chunk)."""
        cols = staging.view(_WORDS[self.word])[:, column : column + count * page]
        return cols.view(self.chunk_rows, count, page).transpose(0, 1)

    def _sources(self) -> list[torch.Tensor]:
        """Each group's engine memory as ``[count, blocks, page]`` words (kept by the cache, not here)."""
        return self.cache.derived(
            ("groups", self.word), lambda views: [g.source for g in group_regions(views, self.word)]
        )

    # --- swaps -----------------------------------------------------------------------

    def _begin(self, pairs: list[tuple[int, int]], wait_event: Any) -> tuple[list[Chunk], torch.Tensor | None]:
        """Order both streams after the engine; plan; upload the index if a chunk needs it."""
        copy = self.copy_stream
        if wait_event is not None:
            copy.wait_event(wait_event)
        else:
            copy.wait_stream(self.compute_stream or torch.cuda.current_stream(self.device))
        self.xfer_stream.wait_stream(copy)
        chunks = plan(pairs, self.chunk_rows)
        index = None
        if any(c.block_start is None for c in chunks):
            with torch.cuda.stream(copy):
                index = self._upload_index([b for _, b in pairs])
        return chunks, index

    @staticmethod
    def _chunk_index(index: torch.Tensor | None, chunk: Chunk) -> torch.Tensor:
        assert index is not None, "an indexed chunk without an uploaded index"
        return index[chunk.pos : chunk.pos + chunk.n]

    def _is_direct(self, chunk: Chunk) -> bool:
        return self.direct and chunk.block_start is not None and len(chunk.row_runs) == 1

    def _finish(self) -> None:
        """Return once everything both streams were given has completed."""
        self.copy_stream.wait_stream(self.xfer_stream)
        done = torch.cuda.Event(blocking=True)  # the waiting thread sleeps instead of spinning a core
        done.record(self.copy_stream)
        done.synchronize()

    def swap_out(self, blocks: Sequence[int], rows: Sequence[int], wait_event: Any = None) -> None:
        """Engine blocks -> tier rows (ids already checked)."""
        self._swap(sorted(zip(rows, blocks)), wait_event, out=True)

    def swap_in(self, rows: Sequence[int], blocks: Sequence[int], wait_event: Any = None) -> None:
        """Tier rows -> engine blocks (ids already checked)."""
        self._swap(sorted(zip(rows, blocks)), wait_event, out=False)

    def _swap(self, pairs: list[tuple[int, int]], wait_event: Any, out: bool) -> None:
        """The pipeline: per chunk, one stream fills staging buffer k % 2 (swap-out: the copy
        stream gathers; swap-in: the transfer stream loads rows) and the other drains it; a
        stream refills a buffer only after the drain of chunk k - 2 from it."""
        chunks, index = self._begin(pairs, wait_event)
        sources, views = self._sources(), self.cache.views
        fill, drain = (self.copy_stream, self.xfer_stream) if out else (self.xfer_stream, self.copy_stream)
        staged = 0
        for c in chunks:
            if self._is_direct(c):
                b0, row = c.block_start or 0, c.row_runs[0][0]
                with torch.cuda.stream(self.xfer_stream):
                    if out:
                        self.store[row : row + c.n].copy_(views[0][b0 : b0 + c.n], non_blocking=True)
                    else:
                        views[0][b0 : b0 + c.n].copy_(self.store[row : row + c.n], non_blocking=True)
                continue
            h, buf = staged % 2, self._buffers()[staged % 2]
            with torch.cuda.stream(fill):
                if staged >= 2:
                    fill.wait_event(self._freed[h])  # chunk k-2 was drained from this buffer
                if out:
                    self._gather(c, sources, self._group_views[h], index)
                else:
                    for row, off, n in c.row_runs:
                        buf[off : off + n].copy_(self.store[row : row + n], non_blocking=True)
                self._filled[h].record(fill)
            with torch.cuda.stream(drain):
                drain.wait_event(self._filled[h])
                if out:
                    for row, off, n in c.row_runs:
                        self.store[row : row + n].copy_(buf[off : off + n], non_blocking=True)
                else:
                    self._scatter(c, sources, self._group_views[h], index)
                self._freed[h].record(drain)
            staged += 1
        self._finish()

    def _gather(
        self, c: Chunk, sources: list[torch.Tensor], staged: list[torch.Tensor], index: torch.Tensor | None
    ) -> None:
        """Engine blocks of chunk ``c`` -> staging rows, one kernel per group (on the current stream)."""
        b0, idx = c.block_start or 0, None if c.block_start is not None else self._chunk_index(index, c)
        for source, view in zip(sources, staged):
            if idx is None:
                view[:, : c.n].copy_(source[:, b0 : b0 + c.n], non_blocking=True)
            else:
                torch.index_select(source, 1, idx, out=view[:, : c.n])

    def _scatter(
        self, c: Chunk, sources: list[torch.Tensor], staged: list[torch.Tensor], index: torch.Tensor | None
    ) -> None:
        """Staging rows -> engine blocks of chunk ``c``, one kernel per group (on the current stream)."""
        b0, idx = c.block_start or 0, None if c.block_start is not None else self._chunk_index(index, c)
        for source, view in zip(sources, staged):
            if idx is None:
                source[:, b0 : b0 + c.n].copy_(view[:, : c.n], non_blocking=True)
            else:
                source.index_copy_(1, idx, view[:, : c.n])
