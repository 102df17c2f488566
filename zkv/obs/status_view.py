"""``zkv status`` for people: the broker's status reply as a table, and a
``--watch`` loop that redraws it until Ctrl-C.

``render_status`` takes the dict ``Client.status()`` returns (the same one
``zkv status --json`` prints), so it works on a saved JSON file too.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, TextIO

_CLEAR_SCREEN = "\x1b[H\x1b[2J"


def human_bytes(n: Any) -> str:
    if type(n) is not int or n < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # pragma: no cover


def human_age(ms: Any) -> str:
    if not isinstance(ms, (int, float)) or isinstance(ms, bool) or ms < 0:
        return "-"
    if ms < 1000:
        return f"{ms:.0f} ms ago"
    if ms < 120_000:
        return f"{ms / 1000:.1f} s ago"
    return f"{ms / 60_000:.0f} min ago"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda row: "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]


def _tier_lines(ranks: list) -> list[str]:
    """Per rank, what each tier holds: GPU and CPU bytes, and the disk tier's blocks used."""
    out = []
    for r in ranks:
        stats = r.get("stats") or {}
        if "cache_bytes_gpu" not in stats:
            continue
        line = (
            f"rank {r.get('rank', '?')} tiers: gpu {human_bytes(stats.get('cache_bytes_gpu'))},"
            f" cpu {human_bytes(stats.get('cache_bytes_cpu'))}"
        )
        disk = stats.get("disk")
        if isinstance(disk, dict):
            line += (
                f", disk {disk.get('used', '-')}/{disk.get('blocks', '-')} blocks"
                f" ({human_bytes(disk.get('bytes'))}, {'O_DIRECT' if disk.get('direct') else 'buffered'},"
                f" {disk.get('digest_failures', 0)} digest failures)"
            )
        out.append(line)
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
    if layout:
        lines.append(
            f"layout {layout.get('layers')} layers x {layout.get('gpu_blocks')} GPU / "
            f"{layout.get('cpu_blocks')} CPU blocks, block {layout.get('block_size')} tokens, "
            f"{layout.get('kv_heads')} kv heads x {layout.get('head_dim')}, {layout.get('dtype')}"
        )
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
                human_bytes(stats.get("cache_bytes")),
                str(stats.get("undeliverable", "-")),
                str(r.get("pid", "-")),
            ]
        )
    world = st.get("world")
    if isinstance(world, int):
        for rank in range(world):
            if rank not in seen:
                rows.append([str(rank), "never registered", "-", "-", "-", "-", "-", "-", "-", "-"])
        rows.sort(key=lambda row: int(row[0]) if row[0].isdigit() else -1)
    lines += _table(
        ["rank", "alive", "last seen", "inflight", "tasks ok", "failed", "bytes moved", "cache", "undeliv.", "pid"],
        rows,
    )
    lines += _tier_lines(st.get("ranks") or [])
    after_ack = [str(r.get("rank")) for r in st.get("ranks") or [] if (r.get("stats") or {}).get("copies_after_ack")]
    if after_ack:
        lines.append(
            f"WARNING: ranks {', '.join(after_ack)} started copies after acking a pause (copies_after_ack > 0)"
        )
    counters = st.get("counters") or {}
    if counters:
        shown = ", ".join(f"{k} {v}" for k, v in sorted(counters.items()))
        lines += ["", f"broker counters: {shown}"]
    return "\n".join(lines)


def watch_status(
    fetch: Callable[[], dict[str, Any]],
    out: TextIO,
    interval: float = 1.0,
    *,
    stop: threading.Event | None = None,
    iterations: int | None = None,
    clear: bool | None = None,
) -> int:
    """Redraw ``render_status(fetch())`` every ``interval`` seconds until Ctrl-C,
    ``stop`` is set, or ``iterations`` redraws; return the redraws.

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
                body = render_status(fetch())
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
