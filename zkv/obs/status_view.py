"""``zkv status`` for people: the broker's status reply as a table, and a
``--watch`` loop that redraws it until Ctrl-C.

``render_status`` takes the map ``Client.status().as_dict()`` returns (the same one
``zkv status --json`` prints), so it works on a saved JSON file too.  The
layout is shown as what each tier holds: blocks, bytes per block and in all,
because a rank on engine memory announces the engine's block count and
bytes per block while its model fields may only count bytes
(docs/engines.md, "The layout a rank announces").
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, TextIO

from ..wire.errors import ZkvError
from ..wire.layout import CacheLayout
from ..wire.vocab import Tier

_CLEAR_SCREEN = "\x1b[H\x1b[2J"


def human_bytes(n: Any) -> str:
    if type(n) is not int or n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # pragma: no cover


def counted(n: int, noun: str) -> str:
    """``1 bus``, ``2 buses``, ``1 rank``, ``3 ranks``: a count and its noun, agreeing."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun}es" if noun.endswith(("s", "sh", "ch", "x")) else f"{n} {noun}s"


def human_age(ms: Any) -> str:
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or ms < 0:
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms ago"
    if ms < 120_000:
        return f"{ms / 1000:.1f} s ago"
    return f"{ms / 60_000:.0f} min ago"


def _count(n: Any) -> str:
    return str(n) if type(n) is int and n >= 0 else "-"


def _layout_lines(layout: dict[str, Any]) -> list[str]:
    """The tiers' blocks and bytes per block, then the model fields they multiply out of."""
    try:
        block_bytes: int | None = CacheLayout.from_wire(layout).block_bytes
    except (ZkvError, TypeError, ValueError):
        block_bytes = None  # a saved reply zkv cannot read as a layout: show what it says
    per_block = "-" if block_bytes is None else str(block_bytes)
    if block_bytes is not None and block_bytes >= 1024:
        per_block += f" ({human_bytes(block_bytes)})"
    rows = []
    for tier in (Tier.GPU, Tier.CPU):
        blocks = layout.get(f"{tier}_blocks")
        total = blocks * block_bytes if block_bytes is not None and type(blocks) is int else None
        rows.append([tier, _count(blocks), per_block, human_bytes(total)])
    field = {k: layout.get(k, "-") for k in ("layers", "kv_heads", "block_size", "head_dim", "dtype")}
    if field["layers"] == field["kv_heads"] == field["block_size"] == 1:
        # what a rank derives from an engine's memory: only the product is the engine's (geometry.derive)
        model = (
            f"model fields: not announced (a rank on an engine's memory knows only its bytes per block; "
            f"{field['dtype']}; zkv worker --attach with the layout options names them)"
        )
    else:
        model = (
            f"model fields: {field['layers']} layers, {field['kv_heads']} kv heads, "
            f"{field['block_size']} tokens per block, head_dim {field['head_dim']}, {field['dtype']}"
        )
    return ["", *table(["layout", "blocks", "bytes per block", "per rank"], rows), model]


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns under a header and a rule (the fleet view uses it too)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]


def _printable(text: Any) -> str:
    """A path a rank sent, without what a terminal would act on."""
    return "".join(ch for ch in text if ch.isprintable()) if isinstance(text, str) and text else "-"


def _tier_line(rank: Any, tier: str, got: dict[str, Any]) -> str:
    blocks, used = _count(got.get("blocks")), got.get("used")
    held = f"{_count(used)}/{blocks}" if type(used) is int else blocks
    if tier == Tier.CPU:
        start = "kept from an earlier process" if got.get("kept") else "fresh"
        where = f"file {_printable(got.get('file'))}" if got.get("file") else "in process memory"
        where += ", digests" if got.get("digests") else ""
    else:
        start = "reopened" if got.get("kept") else "fresh"
        where = "O_DIRECT" if got.get("direct") else "buffered"
    failures, size = _count(got.get("digest_failures")), human_bytes(got.get("bytes"))
    return f"rank {rank} {tier}: {held} blocks ({size}, {start}, {where}, {failures} digest failures)"


def _tier_lines(ranks: list) -> list[str]:
    """Per rank, its CPU tier and disk tier: blocks used of blocks, bytes, kept from
    an earlier process or fresh, where they are kept (a tier file, O_DIRECT or
    buffered), digest failures."""
    out = []
    for r in sorted(ranks, key=lambda r: r.get("rank") if type(r.get("rank")) is int else -1):
        stats = r.get("stats") or {}
        for tier, key in ((Tier.CPU, "cpu_tier"), (Tier.DISK, "disk")):
            got = stats.get(key)
            if isinstance(got, dict):
                out.append(_tier_line(r.get("rank", "?"), tier, got))
    return ["", *out] if out else []


def render_status(st: dict[str, Any]) -> str:
    """A readable multi-line view of one status reply."""
    pending = st.get("pending_op")
    lines = [
        f"bus {str(st.get('state', '?')).upper()}"
        + (f" ({pending} in progress)" if pending else "")
        + f"   epoch {st.get('epoch', '-')}   generation {st.get('gen', '-')}   world {st.get('world', '-')}",
        f"queued {st.get('queued', '-')}   inflight {st.get('inflight', '-')}"
        + (f" (max {st['max_inflight_per_rank']} per rank)" if st.get("max_inflight_per_rank") else ""),
    ]
    if st.get("gen_reason"):
        lines.append(f"generation {st.get('gen')} because {st['gen_reason']}")
    layout = st.get("layout") or {}
    if isinstance(layout, dict) and layout:
        lines += _layout_lines(layout)
    lines.append("")
    rows = []
    seen = set()
    for r in st.get("ranks") or []:
        stats = r.get("stats") or {}
        seen.add(r.get("rank"))
        rows.append(
            [
                str(r.get("rank", "?")),
                "yes" if r.get("alive") else "DEAD",
                human_age(r.get("last_seen_ms")),
                str(r.get("inflight", "-")),
                str(stats.get("tasks_ok", "-")),
                str(stats.get("tasks_failed", "-")),
                human_bytes(stats.get("bytes_moved")),
                human_bytes(stats.get("cache_bytes_gpu")),
                human_bytes(stats.get("cache_bytes_cpu")),
                str(stats.get("undeliverable", "-")),
                str(r.get("pid", "-")),
            ]
        )
    world = st.get("world")
    if isinstance(world, int):
        for rank in range(world):
            if rank not in seen:
                rows.append([str(rank), "never registered", *["-"] * 9])
        rows.sort(key=lambda row: int(row[0]) if row[0].isdigit() else -1)
    header = ["rank", "alive", "last seen", "inflight", "tasks ok", "failed", "bytes moved", "gpu cache", "cpu cache"]
    lines += table([*header, "undeliv.", "pid"], rows)
    lines += _tier_lines(st.get("ranks") or [])
    after_ack = [str(r.get("rank")) for r in st.get("ranks") or [] if (r.get("stats") or {}).get("copies_after_ack")]
    if after_ack:
        lines.append(
            f"WARNING: ranks {', '.join(after_ack)} started copies after acking a pause (copies_after_ack > 0)"
        )
    counters = st.get("counters") or {}
    if counters:
        shown = ", ".join(f"{k} {counters[k]}" for k in sorted(counters, key=_counter_rank))
        lines += ["", f"broker counters: {shown}"]
    return "\n".join(lines)


#: what an operator reads first: the tasks' flow and outcomes, in that order
_TASK_COUNTERS = ("submitted", "dispatched", "ok", "failed", "cancelled", "rejected", "timeout", "undeliverable")
_CONTROL_OPS = ("pause", "clear", "resume")


def _counter_rank(name: str) -> tuple[int, int, str]:
    """The order of the counters line: tasks, then pause / clear / resume, then the rest
    (ranks, generations, refusals) by name, and the broker loop's own (wakeups,
    messages read) last."""
    if name in _TASK_COUNTERS:
        return 0, _TASK_COUNTERS.index(name), name
    op = name.partition("_")[0]
    if op in _CONTROL_OPS:
        return 1, _CONTROL_OPS.index(op), name
    if name.endswith(("_wakeups", "_msgs")):
        return 3, 0, name
    return 2, 0, name


def watch_status(
    fetch: Callable[[], Any],
    out: TextIO,
    interval: float = 1.0,
    *,
    stop: threading.Event | None = None,
    iterations: int | None = None,
    clear: bool | None = None,
    render: Callable[[Any], str] = render_status,
) -> int:
    """Redraw ``render(fetch())`` every ``interval`` seconds until Ctrl-C,
    ``stop`` is set, or ``iterations`` redraws; return the redraws
    (``render``: a fleet's table, ``fleet_view.render_fleet_status``).

    ``fetch`` is a bounded request (``client.status(timeout=...)``); a broker
    that does not answer is shown as such and the watch goes on.  Between
    redraws it blocks in ``Event.wait(interval)`` (no polling; Ctrl-C ends it).
    """
    stop = stop or threading.Event()
    clear = out.isatty() if clear is None else clear
    n = 0
    try:
        while not stop.is_set():
            try:
                body = render(fetch())
            except Exception as err:  # noqa: BLE001 — a watch outlives a broker restart
                body = f"broker not answering: {getattr(err, 'reason', None) or err}"
            stamp = time.strftime("%H:%M:%S")
            out.write(
                (_CLEAR_SCREEN if clear else ("" if n == 0 else "\n"))
                + f"zkv status at {stamp} (every {interval:g} s, Ctrl-C to stop)\n{body}\n"
            )
            out.flush()
            n += 1
            if iterations is not None and n >= iterations:
                break
            stop.wait(interval)
    except KeyboardInterrupt:
        pass
    return n
