"""Every GPU check and figure of the copy path in one run.

``python -m zkv.harness.copies.gpu_check`` on a machine with a GPU (about a
minute; ``--quick`` fewer repeats) prints:

1. correctness: zkv's own cache (``BlockStore.owned``) and the engine-attached copy
   engine swap blocks out and back in bit-identical (BLAKE2b block digests,
   the bus's ``checksum``), through several staging chunks; the copies are
   ordered after the engine's stream (a kernel writes the blocks on the
   compute stream right before the swap, behind a GPU sleep: the swapped-out
   bytes must be the written ones); CUDA IPC attach (``ipc_check``);
2. bandwidth: 256 blocks of 2 MiB (32 layers x K/V x 16 tokens x 8 heads x
   128 x bf16) and of 256 KiB, contiguous and scattered ids, swap_out and
   swap_in, for both engines, each beside a torch pinned contiguous
   ``copy_`` of the same bytes (host pinned <-> device, non_blocking +
   synchronize), interleaved, median of the repeats; GB/s, the ratio and
   PASS/FAIL against the targets (>= 0.9x of the pinned copy, >= 40 GB/s
   one way).  Each configuration is also checked byte for byte at full size;
3. vLLM, where one is installed (``zkv/harness/vllm/gpu_vllm.py``): zkv's
   connector in a real engine (identical tokens, a sleep level 1 cycle, time
   to first token beside vLLM's own CPU offloading); each says ``n/a`` and
   why where it cannot run.

``--device cpu`` rehearses the same flow with small sizes (seconds; what CI
runs): it checks no GPU, so nothing there is a PASS (a check that ran is
``ok``, one that needs CUDA ``n/a``) and it ends ``CPU REHEARSAL``, never
``ALL PASS``.  Without a CUDA device torch can see, the default run is
refused (exit 2): a CPU-only torch on a GPU host must not pass.  ``--json
PATH`` writes every figure.  Exit status 0 when every check (and on CUDA
every target) passed."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch

from ...rank.copies.staging import STAGING_BYTES
from ...wire.vocab import Op, Tier
from .bench import _paired, _timed
from .rig import Rig, Size, patterns

TARGET_RATIO = 0.9
TARGET_GBPS = 40.0
BLOCKS = 256

GPU_SIZES = (Size(32), Size(4))  # 2 MiB and 256 KiB blocks
CPU_SIZES = (Size(4, tokens=8, heads=2, head_dim=64), Size(2, tokens=4, heads=2, head_dim=32))  # 16 KiB, 2 KiB


def say(line: str) -> None:
    print(line, flush=True)


# --- (a) correctness -----------------------------------------------------------------


def check_round_trip(engine: str, size: Size, dev: torch.device) -> dict[str, Any]:
    """Swap out and back in through 8-row staging chunks; digests must match."""
    rig = Rig(engine, size, 64, 96, dev, staging_bytes=2 * 8 * size.block_bytes)
    try:
        rig.randomize(1)
        rng = random.Random(2)
        src = list(range(4, 24)) + rng.sample(range(24, 64), 30)  # a run and scattered ids
        rows = list(range(50, 70)) + rng.sample(range(50), 30)
        before = rig.digests(Tier.GPU, src)
        rig.out(src, rows)
        out_ok = rig.digests(Tier.CPU, rows) == before
        dst = rng.sample(range(64), len(src))
        for v in rig.cache.views:
            v.zero_()
        rig.into(rows, dst)
        in_ok = rig.digests(Tier.GPU, dst) == before
        return {
            "check": f"{engine} round trip",
            "ok": out_ok and in_ok,
            "swap_out_bit_identical": out_ok,
            "swap_in_bit_identical": in_ok,
            "blocks": len(src),
            "chunks": -(-len(src) // 8),
        }
    finally:
        rig.close()


def check_ordering(engine: str, size: Size, dev: torch.device) -> dict[str, Any]:
    """A kernel on the engine's stream writes the blocks (behind a GPU sleep) right before the
    swap_out, without a sync: the tier must hold the written bytes.  ``unordered_copy_saw_stale``
    is a control: the same copy on a stream that does not wait (True shows the check can fail)."""
    if dev.type != "cuda":
        return {
            "check": f"{engine} copy stream after the engine stream",
            "ok": None,  # not run: never a PASS
            "skipped": "no CUDA streams on cpu",
        }
    engine_stream = torch.cuda.Stream(device=dev) if engine == "attached" else torch.cuda.current_stream(dev)
    rig = Rig(engine, size, 64, 64, dev, compute_stream=engine_stream if engine == "attached" else None)
    try:
        blocks, rows = random.Random(3).sample(range(64), 32), list(range(32))
        torch.cuda.synchronize(dev)
        with torch.cuda.stream(engine_stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write lands
            for v in rig.cache.views:
                v.fill_(0xA5)
        rig.out(blocks, rows)  # no sync before: the copy stream must wait for the engine's
        ok = all(bool((c[rows] == 0xA5).all()) for c in rig.tier.columns)
        torch.cuda.synchronize(dev)
        side, stale = torch.cuda.Stream(device=dev), torch.empty_like(rig.cache.views[0])
        with torch.cuda.stream(engine_stream):
            torch.cuda._sleep(200_000_000)
            rig.cache.views[0].fill_(0x5A)
        with torch.cuda.stream(side):
            stale.copy_(rig.cache.views[0])  # no wait for the engine's stream
        torch.cuda.synchronize(dev)
        return {
            "check": f"{engine} copy stream after the engine stream",
            "ok": ok,
            "unordered_copy_saw_stale": bool((stale != 0x5A).any()),
        }
    finally:
        rig.close()


def check_ipc(device: str) -> dict[str, Any]:
    """``ipc_check`` in a child process (attach an engine's tensors across processes)."""
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "zkv.harness.bus.ipc_check", "--device", device],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    ok = proc.returncode == 0 and bool(lines) and all(r.get("ok") for r in lines)
    return {
        "check": f"ipc attach ({'CUDA IPC' if device == 'cuda' else 'shared memory'})",
        "ok": ok,
        "layouts": {r.get("layout"): r.get("ok") for r in lines},
        **({} if ok else {"stderr": proc.stderr[-2000:]}),
    }


# --- (b) bandwidth -------------------------------------------------------------------


def bandwidth(engine: str, size: Size, dev: torch.device, reps: int) -> dict[str, Any]:
    """swap_out / swap_in of BLOCKS blocks per id pattern beside a pinned contiguous copy_ of the same bytes."""
    blocks = BLOCKS
    rig = Rig(engine, size, 2 * blocks, blocks, dev)
    nbytes = blocks * rig.block_bytes
    cuda = dev.type == "cuda"
    dev_buf = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    result: dict[str, Any] = {
        "engine": engine,
        "size": size.name,
        "block_bytes": rig.block_bytes,
        "blocks": blocks,
        "mib": nbytes / 2**20,
        "regions": len(rig.cache.descriptor.regions),
    }
    try:
        for name, (ids, rows) in patterns(blocks).items():
            rig.randomize(7)
            rig.out(ids, rows)
            out_ok = rig.same(ids, rows)
            dst = (
                random.Random(8).sample(range(2 * blocks), blocks) if name == "scattered" else [b + blocks for b in ids]
            )
            rig.into(rows, dst)
            in_ok = rig.same(dst, rows)
            fns: list[Callable[[], Any]] = [
                partial(host_buf.copy_, dev_buf, non_blocking=cuda),
                partial(rig.out, ids, rows),
                partial(dev_buf.copy_, host_buf, non_blocking=cuda),
                partial(rig.into, rows, ids),
            ]
            base_out, t_out, base_in, t_in = _timed(fns, reps, dev)
            row: dict[str, Any] = {}
            for op, base, ours in ((Op.SWAP_OUT, base_out, t_out), (Op.SWAP_IN, base_in, t_in)):
                gbps, pinned = nbytes / statistics.median(ours) / 1e9, nbytes / statistics.median(base) / 1e9
                ratio = _paired(base, ours)
                row[op] = {
                    "gbps": gbps,
                    "pinned_copy_gbps": pinned,
                    "ratio": ratio,
                    "pass": (ratio >= TARGET_RATIO and gbps >= TARGET_GBPS) if cuda else None,
                }
            row["bytes_ok"] = out_ok and in_ok
            result[name] = row
    finally:
        rig.close()
    return result


def verdict(ok: bool | None, cuda: bool = True) -> str:
    """PASS only for a check that ran on a GPU; on cpu a check that ran is ``ok``, one that could not ``n/a``."""
    if ok is None:
        return "n/a"
    if not ok:
        return "FAIL"
    return "PASS" if cuda else "ok"


def environment(dev: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "device": str(dev), "staging_mib": STAGING_BYTES / 2**20}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        env.update(gpu=props.name, cuda=torch.version.cuda, memory_gib=round(props.total_memory / 2**30, 1))
        try:
            q = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current",
                    "--format=csv,noheader",
                    f"--id={dev.index or 0}",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            env["pcie_gen_now_max_width"] = q.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["pcie_gen_now_max_width"] = "unknown (no nvidia-smi)"
    return env


def failures(report: dict[str, Any]) -> list[str]:
    """Every check that failed, every configuration whose bytes differed or that missed its target."""
    failed = [c["check"] for c in report["checks"] if c["ok"] is False]
    for r in report["bandwidth"]:
        if "error" in r:
            failed.append(f"bandwidth {r['engine']} {r['size']}")
            continue
        for name in ("contiguous", "scattered"):
            failed += [f"{r['engine']} {r['size']} {name} bytes"] if not r[name]["bytes_ok"] else []
            failed += [
                f"{r['engine']} {r['size']} {name} {op}"
                for op in (Op.SWAP_OUT, Op.SWAP_IN)
                if r[name][op]["pass"] is False
            ]
    return failed


def vllm_checks(device: str, quick: bool) -> list[dict[str, Any]]:
    """(c): zkv in a vLLM engine on this device, where a vLLM is installed (``gpu_vllm.py``)."""
    from ..vllm.gpu_vllm import check_vllm

    say("(c) vLLM with zkv as its offload backend")
    found = check_vllm(device, quick, say)
    for r in found:
        if r["ok"] is None:
            say(f"  n/a  {r['check']}: {r['skipped']}")
    return found


def run(device: str, quick: bool, ipc: bool = True, vllm: bool = True) -> dict[str, Any]:
    dev = torch.device(device if device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    sizes = GPU_SIZES if dev.type == "cuda" else CPU_SIZES
    reps = (4 if quick else 10) if dev.type == "cuda" else 3
    t0 = time.perf_counter()
    cuda = dev.type == "cuda"
    report: dict[str, Any] = {"environment": environment(dev), "checks": [], "bandwidth": []}
    say("environment: " + ", ".join(f"{k}={v}" for k, v in report["environment"].items()))
    say("(a) correctness")
    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    for e in ("owned", "attached"):
        checks.append((f"{e} round trip", lambda e=e: check_round_trip(e, sizes[-1], dev)))  # type: ignore[misc]
        checks.append((f"{e} ordering", lambda e=e: check_ordering(e, sizes[-1], dev)))  # type: ignore[misc]
    if ipc:
        checks.append(("ipc attach", lambda: check_ipc(dev.type)))
    for name, check in checks:
        try:
            r = check()
        except Exception as exc:  # report and go on: a diagnostic prints every figure it can
            r = {"check": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        report["checks"].append(r)
        extra = {k: v for k, v in r.items() if k not in ("check", "ok")}
        say(f"  {verdict(r['ok'], cuda)}  {r['check']}  {json.dumps(extra)}")
    say(
        f"(b) bandwidth: {BLOCKS} blocks, GB/s beside a pinned contiguous copy_ of the same bytes (median of {reps},"
        f" interleaved); targets >= {TARGET_RATIO}x and >= {TARGET_GBPS:.0f} GB/s one way"
        f"{'' if dev.type == 'cuda' else ' (n/a on cpu)'}"
    )
    say(
        f"  {'engine':9} {'block':7} {'regions':>7} {'MiB':>5}  {'ids':10} {'op':8}"
        f" {'GB/s':>7} {'pinned':>7} {'ratio':>6}  verdict"
    )
    for size in sizes:
        for engine in ("owned", "attached"):
            try:
                r = bandwidth(engine, size, dev, reps)
            except Exception as exc:
                r = {"engine": engine, "size": size.name, "error": f"{type(exc).__name__}: {exc}"}
                say(f"  {engine:9} {size.name:7} FAIL {r['error']}")
                report["bandwidth"].append(r)
                continue
            report["bandwidth"].append(r)
            for name in ("contiguous", "scattered"):
                for op in (Op.SWAP_OUT, Op.SWAP_IN):
                    c = r[name][op]
                    say(
                        f"  {engine:9} {size.name:7} {r['regions']:>7} {r['mib']:>5.1f}  {name:10} {op:8}"
                        f" {c['gbps']:>7.2f} {c['pinned_copy_gbps']:>7.2f} {c['ratio']:>5.2f}x  {verdict(c['pass'])}"
                        f"{'' if r[name]['bytes_ok'] else '  BYTES DIFFER'}"
                    )
    if vllm:
        report["checks"] += vllm_checks(dev.type, quick)
    report["seconds"] = time.perf_counter() - t0
    report["failed"] = failures(report)
    if report["failed"]:
        last = "FAILED: " + "; ".join(report["failed"])
    elif cuda:
        last = "ALL PASS"
    else:  # a rehearsal of the flow: nothing about a GPU was checked
        last = "CPU REHEARSAL ok: every step ran and the bytes matched; no GPU was checked, nothing PASSed"
    say(f"{last}  ({report['seconds']:.0f} s)")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device",
        default="cuda",
        help="cuda (the default; refused where torch sees no GPU) or cpu (a rehearsal of the flow that checks no GPU)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--no-ipc", action="store_true", help="skip the cross-process attach check")
    parser.add_argument("--no-vllm", action="store_true", help="skip (c), the vLLM engine checks")
    parser.add_argument("--json", dest="json_path", default=None, help="also write every figure to this file")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu_check: no CUDA device visible to torch {torch.__version__} ({build}): nothing checked, nothing "
            "PASSes; on a GPU host install the torch build for its CUDA; --device cpu rehearses the flow only",
            file=sys.stderr,
        )
        return 2
    report = run(args.device, args.quick, ipc=not args.no_ipc, vllm=not args.no_vllm)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=1))
    return 0 if not report["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
