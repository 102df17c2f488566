"""Pictures of what the bus did: a trace's task latencies over time, and a
benchmark report beside its same-run baselines.

matplotlib is an optional extra (``pip install -e '.[plot]'`` in the checkout), imported only
when a plot is drawn.  Figures are drawn on matplotlib's Agg canvas directly
(no pyplot), so plotting never changes the backend of a process that has
its own (an engine, a notebook).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..wire.vocab import BusState, ControlOp, Outcome

OUTCOME_COLOURS: dict[str, str] = {
    Outcome.OK: "#2b7bba",
    Outcome.FAILED: "#d62728",
    Outcome.CANCELLED: "#ff7f0e",
    Outcome.REJECTED: "#9467bd",
    Outcome.TIMEOUT: "#111111",
}
OP_COLOURS: dict[str, str] = {ControlOp.PAUSE: "#f2c744", ControlOp.CLEAR: "#e8645a", ControlOp.RESUME: "#7cc47c"}
#: the bus state a control op leaves behind
AFTER: dict[str, BusState] = {
    ControlOp.PAUSE: BusState.PAUSED,
    ControlOp.CLEAR: BusState.CLEARED,
    ControlOp.RESUME: BusState.RUNNING,
}
STATE_COLOURS = {BusState.PAUSED: "#eeeeee", BusState.CLEARED: "#f7d9d6"}


MISSING = "plots need matplotlib: pip install -e '.[plot]' in the zkv checkout (the README's install)"


class MatplotlibMissing(ImportError):
    """No matplotlib (the optional extra ``plot``)."""


def require_matplotlib() -> None:
    """Raise :class:`MatplotlibMissing` now, so a command can refuse before the work a plot would show."""
    try:
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise MatplotlibMissing(MISSING) from None


def _figure(width: float, height: float, rows: int = 1, cols: int = 1) -> tuple[Any, Any]:
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


# --- traces ------------------------------------------------------------------------------


@dataclass
class TraceTimeline:
    """What a trace (a recording) says happened, in seconds from its start."""

    tasks: list[tuple[float, float, str]] = field(default_factory=list)  # (submitted, latency s, outcome)
    ops: list[tuple[str, float, float, bool]] = field(default_factory=list)  # (op, start, end, ok)
    requests: list[tuple[str, float]] = field(default_factory=list)  # control requests with no recorded end
    rank_lost: list[tuple[float, int]] = field(default_factory=list)
    end: float = 0.0


_DURATION: dict[str, str] = {ControlOp.PAUSE: "drain_ms", ControlOp.CLEAR: "clear_ms", ControlOp.RESUME: "resume_ms"}


def read_timeline(path: str) -> TraceTimeline:
    """Read the records a plot needs; appended sessions continue in time, as
    ``zkv.trace.parse_trace`` does (run ``zkv trace check`` to validate)."""
    tl = TraceTimeline()
    submits: dict[tuple[int, Any, Any], float] = {}
    open_requests: dict[str, list[float]] = {}
    session, offset, last = -1, 0.0, 0.0
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            text = raw.strip()
            if not text or text.startswith("#"):
                continue
            try:
                rec = json.loads(text)
            except ValueError as err:
                raise ValueError(f"{path}, line {lineno}: not valid JSON: {err}") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}, line {lineno}: a record must be a JSON object")
            if "zkv_trace" in rec:
                session, offset = session + 1, last
                continue
            t_rel = rec.get("t")
            t = offset + float(t_rel) if isinstance(t_rel, (int, float)) and not isinstance(t_rel, bool) else last
            last = max(last, t)
            ev = rec.get("ev")
            if ev == "submit":
                submits[(session, rec.get("client"), rec.get("task"))] = t
            elif ev == "outcome":
                latency_ms = rec.get("latency_ms")
                if isinstance(latency_ms, (int, float)) and not isinstance(latency_ms, bool) and latency_ms >= 0:
                    latency = latency_ms / 1000
                else:
                    sub = submits.get((session, rec.get("client"), rec.get("task")))
                    if sub is None:
                        continue
                    latency = t - sub
                tl.tasks.append((t - latency, latency, str(rec.get("outcome"))))
            elif ev in _DURATION:
                open_requests.setdefault(ev, []).append(t)
            elif ev == "control" and rec.get("op") in _DURATION:
                op = rec["op"]
                started = open_requests.get(op) or []
                start = started.pop(0) if started else None
                ms = rec.get(_DURATION[op])
                if isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms >= 0:
                    start = t - ms / 1000
                tl.ops.append((op, t if start is None else min(start, t), t, bool(rec.get("ok"))))
            elif ev == "rank" and rec.get("up") is False and isinstance(rec.get("rank"), int):
                tl.rank_lost.append((t, rec["rank"]))
    tl.requests = [(op, t) for op, ts in open_requests.items() for t in ts]
    tl.end = last
    return tl


def plot_trace(trace_path: str, out_png: str, title: str | None = None) -> str:
    """Task latency over time (one dot per task, coloured by outcome) with
    pause / clear / resume shaded; write ``out_png`` and return its path."""
    tl = read_timeline(trace_path)
    if not tl.tasks:
        raise ValueError(
            f"{trace_path} has no outcome records to plot: record one with zkv broker --record, or zkv replay --record"
        )
    fig, axes = _figure(11, 4.8)
    ax = axes[0][0]
    # The bus state between ops: paused (pause done .. resume done), cleared (clear done .. resume done).
    state, since = BusState.RUNNING, 0.0
    for op, _start, end, ok in sorted(tl.ops, key=lambda o: o[2]):
        if not ok:
            continue
        new = AFTER[op]
        if state in STATE_COLOURS and end > since:
            ax.axvspan(since, end, color=STATE_COLOURS[state], zorder=0, lw=0)
        state, since = new, end
    if state in STATE_COLOURS:
        ax.axvspan(since, max(tl.end, since), color=STATE_COLOURS[state], zorder=0, lw=0)
    for op, start, end, ok in tl.ops:
        ax.axvspan(
            start,
            max(end, start + tl.end * 1e-3),
            color=OP_COLOURS[op],
            alpha=0.8 if ok else 0.35,
            hatch=None if ok else "//",
            zorder=1,
            lw=0,
        )
    for op, t in tl.requests:
        ax.axvline(t, color=OP_COLOURS[op], lw=1.5, zorder=1)
    for t, rank in tl.rank_lost:
        ax.axvline(t, color="#d62728", ls="--", lw=1, zorder=2)
        ax.annotate(
            f"rank {rank} lost",
            (t, 1),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=8,
            color="#d62728",
        )
    latencies = [lat * 1000 for _, lat, _ in tl.tasks]
    positive = [x for x in latencies if x > 0]
    if positive and max(positive) / min(positive) > 50:
        ax.set_yscale("log")
    floor = min(positive) / 2 if positive else 0.001
    for outcome in sorted({o for _, _, o in tl.tasks}, key=lambda o: (o != Outcome.OK, o)):
        pts = [(s, max(lat * 1000, floor)) for s, lat, o in tl.tasks if o == outcome]
        ax.scatter(
            [p[0] for p in pts],
            [p[1] for p in pts],
            s=14,
            color=OUTCOME_COLOURS.get(outcome, "#7f7f7f"),
            label=f"{outcome} ({len(pts)})",
            zorder=3,
            edgecolors="none",
        )
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [
        Patch(color=c, label=f"{op} in progress") for op, c in OP_COLOURS.items() if any(o[0] == op for o in tl.ops)
    ]
    handles += [Patch(color=c, label=f"bus {s}") for s, c in STATE_COLOURS.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    ax.set_xlabel("time since the trace started (s), by task submission")
    ax.set_ylabel("task latency, submit to outcome (ms)")
    first = min([s for s, _, _ in tl.tasks] + [o[1] for o in tl.ops] + [t for _, t in tl.requests])
    span = max(tl.end - first, 1e-3)
    ax.set_xlim(max(0.0, first - 0.02 * span), tl.end + 0.02 * span)  # a recording starts when the broker does
    ax.grid(True, axis="y", alpha=0.3)
    ok_ms = sorted(lat * 1000 for _, lat, o in tl.tasks if o == Outcome.OK)
    summary = f"{len(tl.tasks)} tasks" + (
        f", ok p50 {ok_ms[len(ok_ms) // 2]:.2f} ms, p99 {ok_ms[min(len(ok_ms) - 1, int(0.99 * len(ok_ms)))]:.2f} ms"
        if ok_ms
        else ""
    )
    ax.set_title(title or f"{trace_path}: {summary}", fontsize=10)
    fig.savefig(out_png)
    return out_png


# --- benchmarks ----------------------------------------------------------------------------


def _short(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _bars(ax: Any, labels: list[str], groups: dict[str, list[float]], ylabel: str, title: str) -> None:
    colours = ["#2b7bba", "#aaaaaa", "#7cc47c", "#f2c744"]
    width = 0.8 / max(1, len(groups))
    for i, (name, values) in enumerate(groups.items()):
        xs = [x + (i - (len(groups) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name, color=colours[i % len(colours)])
        ax.bar_label(bars, labels=[_short(v) for v in values], fontsize=7, padding=1)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, frameon=False)
    ax.margins(y=0.15)


def plot_bench(results: dict[str, Any], out_png: str, title: str = "zkv bench (baselines from the same run)") -> str:
    """Draw a ``zkv bench --json`` report: each zkv figure beside its baseline."""
    panels = []
    bus = [k for k in ("bus_1_blocks", "bus_256_blocks") if k in results]
    if bus:
        names = [k.split("_")[1] + "-block tasks" for k in bus]
        short = [k.split("_")[1] + "-block" for k in bus]
        panels.append(
            lambda ax: _bars(
                ax,
                names,
                {
                    "zkv": [results[k]["zkv"]["tasks_per_s"] for k in bus],
                    "raw pyzmq relay": [results[k]["raw_pyzmq_relay"]["tasks_per_s"] for k in bus],
                },
                "tasks/s",
                "bus throughput (pipelined)",
            )
        )
        labels = [f"{n}\n{q}" for n in short for q in ("p50", "p99")]
        panels.append(
            lambda ax: _bars(
                ax,
                labels,
                {
                    "zkv": [results[k]["zkv"]["rtt_us"][q] for k in bus for q in ("p50", "p99")],
                    "raw pyzmq relay": [
                        results[k]["raw_pyzmq_relay"]["rtt_us"][q] for k in bus for q in ("p50", "p99")
                    ],
                },
                "µs",
                "task round trip (one in flight)",
            )
        )
    if "copy_256_blocks" in results:
        c = results["copy_256_blocks"]
        panels.append(
            lambda ax: _bars(
                ax,
                ["contiguous ids", "scattered ids"],
                {
                    "zkv copy engine": [c["zkv_contiguous_ids_GBps"], c["zkv_scattered_ids_GBps"]],
                    "plain copy_ / index_select": [
                        c["baseline_plain_contiguous_copy_GBps"],
                        c["baseline_index_select_copy_GBps"],
                    ],
                },
                "GB/s",
                f"block copies ({c['bytes'] / 2**20:.3g} MiB per copy)",
            )
        )
    if "pause" in results:
        p = results["pause"]
        panels.append(
            lambda ax: _bars(
                ax,
                ["p50", "p99"],
                {
                    "pause, idle": [p["idle_pause_ms"]["p50"], p["idle_pause_ms"]["p99"]],
                    "resume, idle": [p["idle_resume_ms"]["p50"], p["idle_resume_ms"]["p99"]],
                    f"pause, {p['inflight_tasks']} in flight": [p["busy_pause_ms"]["p50"], p["busy_pause_ms"]["p99"]],
                    "of which drain": [p["busy_drain_ms"]["p50"], p["busy_drain_ms"]["p99"]],
                },
                "ms",
                "pause / resume",
            )
        )
    if "manager" in results:
        w = results["manager"]["cluster"]
        panels.append(
            lambda ax: _bars(
                ax,
                ["chat workload"],
                {"prefix cache manager": [w["requests_per_s"]], "no cache": [w["baseline_no_cache_requests_per_s"]]},
                "requests/s",
                "prefix cache manager",
            )
        )
    if "metrics_cost" in results:
        m = results["metrics_cost"]["bus"]
        panels.append(
            lambda ax: _bars(
                ax,
                ["median of rounds"],
                {"with metrics (scraped)": [m["median_metered"]], "no-op books, no exporter": [m["median_plain"]]},
                "tasks/s",
                "bus throughput with and without metrics",
            )
        )
    if not panels:
        raise ValueError(
            "nothing to plot: the results have none of bus_*_blocks, copy_256_blocks, pause, manager, metrics_cost"
            " (zkv bench --json)"
        )
    cols = min(3, len(panels))
    rows = (len(panels) + cols - 1) // cols
    fig, axes = _figure(4.2 * cols, 3.4 * rows, rows, cols)
    flat = [ax for row in axes for ax in row]
    for draw, ax in zip(panels, flat):
        draw(ax)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=10)
    fig.savefig(out_png)
    return out_png
