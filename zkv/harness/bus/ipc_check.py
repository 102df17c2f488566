"""End-to-end check of cross-process attach: a separate engine process
(``demo_engine``) owns the tensors, this process maps its manifest, swaps
blocks out to zkv's tier and back into other ids, and the engine confirms
the bytes; then release must leave nothing mapped here.

``python -m zkv.harness.bus.ipc_check --device cuda`` is the GPU check of
the cross-process attach (CUDA IPC handles, device by UUID); ``--device cpu`` runs the same
flow over shared-memory files.  Prints one JSON line per layout; exit
status 0 when every check passed."""

from __future__ import annotations

import argparse
import gc
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from ...rank.copies.copier import CopyEngine
from ...rank.memory.manifest import attach
from ...rank.tiers.cpu_tier import CpuTier

REPLY_TIMEOUT_S = 60.0


class EngineProcess:
    """The demo engine as a child process, driven by line commands with a bounded wait per reply."""

    def __init__(self, layout: str, manifest: str, generation: int, device: str = "cpu", shape: Sequence[str] = ()):
        root = str(Path(__file__).resolve().parents[3])  # the tree this zkv was imported from
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zkv.harness.bus.demo_engine", layout, manifest, str(generation), device, *shape],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            self.tag = self.reply(120).split()[1]
        except BaseException:
            self.kill()
            raise

    def reply(self, timeout: float = REPLY_TIMEOUT_S) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("the engine process did not answer in time")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine process exited (status {self.proc.wait(timeout=10)})")
        return line.strip()

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def realloc(self, generation: int, blocks: int | None = None) -> str:
        """Free, reallocate and re-export as ``generation``; return the new file tag."""
        reply = self.ask(f"realloc {generation}" + (f" {blocks}" if blocks is not None else ""))
        if not reply.startswith("ok "):
            raise RuntimeError(f"the engine could not reallocate: {reply}")
        self.tag = reply.split()[1]
        return self.tag

    def digest(self, ids: list[int]) -> list[str]:
        return self.ask("digest " + ",".join(map(str, ids))).split()

    def close(self) -> None:
        """Ask it to quit (it unlinks its files); kill it if it does not."""
        if self.proc.poll() is None:
            try:
                if self.ask("quit") == "bye":
                    self.proc.wait(timeout=30)
            finally:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def mapped(tag: str, pid: int | str = "self") -> int:
    """How many mappings of ``/proc/PID/maps`` name a file with ``tag``."""
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for line in f if tag in line)


def check(layout: str, device: str = "cpu", workdir: str | None = None) -> dict[str, Any]:
    """Run the flow once; return what was observed (``ok`` is the verdict)."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = os.path.join(tmp, "manifest")
        engine = EngineProcess(layout, path, generation=5, device=device)
        try:
            cache = attach(path, expect_generation=5)
            refs = cache.storage_refs()
            out: dict[str, Any] = {
                "layout": layout,
                "device": str(cache.device),
                "regions": len(cache.descriptor.regions),
                "mapped_attached": mapped(engine.tag),
            }
            copier = CopyEngine(cache, CpuTier.for_cache(cache.descriptor, rows=8))
            src, rows, dst = [3, 4, 5, 9], [0, 1, 2, 7], [12, 13, 14, 0]
            before = engine.digest(src)
            copier.swap_out(src, rows)
            engine.ask("scribble 2")
            overwritten = engine.digest(dst)
            copier.swap_in(rows, dst)
            out["bytes_ok"] = engine.digest(dst) == before and before != overwritten
            copier.close()
            cache.release()
            del copier, cache
            gc.collect()
            out["released"] = all(r.expired() for r in refs)
            out["mapped_after_release"] = mapped(engine.tag)
            out["engine_still_maps"] = mapped(engine.tag, engine.proc.pid) if device == "cpu" else None
        finally:
            engine.close()
        out["files_left"] = [p for p in os.listdir("/dev/shm") if engine.tag in p]
    out["ok"] = bool(
        out["bytes_ok"]
        and out["released"]
        and out["mapped_after_release"] == 0
        and not out["files_left"]
        and (device != "cpu" or (out["mapped_attached"] > 0 and out["engine_still_maps"]))
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (CUDA IPC) or cpu (shared-memory files)")
    parser.add_argument("--layout", action="append", choices=["fastdeploy", "vllm_flash"])
    args = parser.parse_args()
    ok = True
    for layout in args.layout or ["fastdeploy", "vllm_flash"]:
        try:
            result = check(layout, args.device)
        except Exception as exc:  # report and go on: this is a diagnostic
            result = {"layout": layout, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        ok = ok and result["ok"]
        print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
