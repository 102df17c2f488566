"""(c) of the GPU check (``zkv.harness.copies.gpu_check``): zkv's connector
in a real vLLM engine on the device, where a vLLM is installed.

- ``tokens``: a returning chat served through zkv gives the tokens of the
  same engine recomputing (its bus paused), with blocks counted as served;
- ``sleep level 1``: ``LLM.sleep(level=1)`` then ``wake_up()``; the bus is
  paused while the KV memory is away (vLLM 0.34 tells the connector), and the
  chat's tokens after the wake equal those before;
- ``ttft``: ``zkv bench vllm --quick`` (zkv beside recompute and beside an
  in-process copy floor), and on CUDA beside vLLM's own CPU offloading
  (``OffloadingConnector`` with ``CPUOffloadingSpec``) in the same run;
- ``groups <family>``, one per model family with several KV cache groups
  (``models.py``: Gemma 3 and gpt-oss, sliding window and full attention;
  Mistral, a sliding window on every layer; Qwen3-Next, linear-attention
  state beside attention; a dense DeepSeek-V2, MLA): a returning chat gives
  the recompute's tokens with every group served from zkv, counted per group
  (on CUDA that is Mamba state offload and MLA with vLLM's prefix cache on,
  which the CPU platform runs without).

Each check says ``n/a`` and why where it cannot run: no vLLM in this
environment (a GPU machine here reaches no package registry, so a CUDA vLLM
must be installed beforehand), the CPU platform (no sleep mode, and vLLM's
CPU offloading needs CUDA), a model family this vLLM or transformers does
not have."""

from __future__ import annotations

import gc
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import Any, Callable


def _na(check: str, why: str) -> dict[str, Any]:
    return {"check": check, "ok": None, "skipped": why}


def native_cpu_offload(cpu_blocks: int, block_bytes: int) -> dict[str, Any]:
    """vLLM's own CPU offloading: 0.34 sizes it in bytes, 0.32 in blocks (both keys given)."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_blocks * block_bytes, "num_cpu_blocks": cpu_blocks},
    }


def check_vllm(device: str, quick: bool = True, say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The vLLM checks, each a dict like gpu_check's (``ok`` None: could not run, ``skipped`` says why)."""
    if importlib.util.find_spec("vllm") is None:
        why = "vLLM is not installed in this environment (install a CUDA vLLM and zkv into it first)"
        return [_na(c, why) for c in ("vllm tokens", "vllm sleep level 1", "vllm ttft", *GROUP_CHECKS)]
    from ...client.client import Client
    from .bench import bench_vllm
    from .rig import BusProbe, Chat, ModelShape, greedy, start_engine, stop_engine, write_llama, zkv_transfer

    cuda = device.startswith("cuda")
    out: list[dict[str, Any]] = []
    shape = ModelShape()
    with tempfile.TemporaryDirectory(prefix="zkv-gpu-vllm-") as tmp:
        root = Path(tmp)
        model = write_llama(root / "w0", shape, seed=0)
        transfer = zkv_transfer(root / "bus", cpu_blocks=64, tier_dir=tmp, status_interval_s=0.0)

        def chat() -> Chat:
            return Chat(conversations=4, turns=2, first_tokens=300, turn_tokens=32, reply_tokens=8, vocab=shape.vocab)

        llm = None
        try:
            llm = start_engine(model, transfer, 40, max_model_len=1024)  # a chat of 4 conversations outgrows it
            probe = BusProbe(root / "bus")
            probe.status(wait_ranks=1)
            served = chat().run(llm)
            ops = probe.blocks_by_op(shape.block_bytes())
            with Client(probe.frontend, request_timeout=30) as c:
                c.pause(timeout=30)
                llm.reset_prefix_cache()
                again = chat().run(llm)  # recompute: every lookup misses on a paused bus
                c.resume(timeout=30)
            ok = served == again and ops.get("swap_in", 0) > 0
            out.append({"check": "vllm tokens", "ok": ok, "swap_in_blocks": ops.get("swap_in", 0)})
            n = ops.get("swap_in", 0)
            say(f"  {'ok' if ok else 'FAIL'}  vllm tokens: same as recompute: {served == again}, {n} blocks served")
            if not cuda:
                out.append(_na("vllm sleep level 1", "the CPU platform has no sleep mode"))
            else:
                prompt = chat().history[0]
                before = greedy(llm, prompt)[0]
                llm.sleep(level=1)
                llm.wake_up()
                after = greedy(llm, prompt)[0]
                state = probe.status().state
                ok = before == after and state == "running"
                out.append({"check": "vllm sleep level 1", "ok": ok, "bus_after_wake": str(state)})
        except Exception as exc:  # a diagnostic: report and go on
            out.append({"check": "vllm tokens", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            if llm is not None:
                stop_engine(llm)
            del llm
            gc.collect()
    try:
        # On CUDA the floor is vLLM's own CPU offloading; its spec needs CUDA, so on cpu the torch copy.
        res = bench_vllm(quick=quick, say=say, floor=native_cpu_offload if cuda else None)
        floor = "vllm_cpu_offloading_ms" if cuda else "torch_copy_floor_ms"
        entry: dict[str, Any] = {
            "check": "vllm ttft",
            "ok": res["tokens_identical"],
            "zkv_ms": round(res["zkv"]["ttft_ms_p50"], 1),
            "recompute_ms": round(res["recompute"]["ttft_ms_p50"], 1),
            floor: round(res["torch_copy_floor"]["ttft_ms_p50"], 1),
            "restart_ms": round(res["zkv_restarted"]["ttft_ms_p50"], 1),
        }
        if not cuda:
            entry["vllm_cpu_offloading"] = "n/a: vLLM's CPU offloading needs CUDA"
        say(f"  {'ok' if entry['ok'] else 'FAIL'}  vllm ttft: {json.dumps(entry)}")
        out.append(entry)
    except Exception as exc:
        out.append({"check": "vllm ttft", "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    for family in FAMILY_NAMES:
        entry = check_family(family, cuda)
        if entry["ok"] is not None:
            say(f"  {'ok' if entry['ok'] else 'FAIL'}  {entry['check']}: {json.dumps(entry)}")
        out.append(entry)
    return out


FAMILY_NAMES = ("gemma3", "gpt-oss", "mistral-swa", "qwen3-next", "deepseek-mla")
GROUP_CHECKS = tuple(f"vllm groups {f}" for f in FAMILY_NAMES)
ARCHITECTURES = {
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "mistral-swa": "MistralForCausalLM",
    "qwen3-next": "Qwen3NextForCausalLM",
    "deepseek-mla": "DeepseekV2ForCausalLM",
}


def check_family(family: str, cuda: bool) -> dict[str, Any]:
    """One model family with several KV cache groups through zkv (``group_rig.py``): the
    recompute's tokens, every group served, blocks counted per group."""
    import transformers
    from vllm import ModelRegistry

    from .group_rig import GroupEngine
    from .models import FAMILIES
    from .rig import Chat

    check = f"vllm groups {family}"
    arch = ARCHITECTURES[family]
    if arch not in ModelRegistry.get_supported_archs():
        return _na(check, f"this vLLM has no {arch}")
    if not hasattr(transformers, arch):
        return _na(check, f"this transformers cannot write a {arch} (needed to make the random model)")
    small = family in ("qwen3-next", "deepseek-mla")  # their CPU kernels are slow; a GPU does not care

    def chat() -> Chat:
        return Chat(conversations=3, turns=2, first_tokens=300 if small else 700, turn_tokens=64, reply_tokens=8)

    with tempfile.TemporaryDirectory(prefix=f"zkv-gpu-{family}-") as tmp:
        root = Path(tmp)
        engine = None
        try:
            model = FAMILIES[family].write(root / "w0", seed=0)
            dtype = "float32" if family == "gpt-oss" else "auto"  # its random weights vary in float32
            engine = GroupEngine(model, root, gpu_blocks=128, settings={"cpu_blocks": 256}, dtype=dtype).start()
            want = engine.reference(chat().run)
            chat().run(engine.llm)  # stored
            engine.llm.reset_prefix_cache()  # vLLM's own cache: every return is zkv's
            got, moved = engine.counted(chat().run)
            served = {g: ev["served"] for g, ev in moved.items()}
            ok = got == want and len(served) == len(FAMILIES[family].groups) and all(served.values())
            entry: dict[str, Any] = {"check": check, "ok": ok, "tokens_identical": got == want, "served": served}
            if not cuda and family == "deepseek-mla":
                entry["note"] = "vLLM's CPU platform runs MLA without its own prefix cache: zkv's is the only one"
            return entry
        except Exception as exc:  # a diagnostic: report and go on
            return {"check": check, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        finally:
            if engine is not None:
                engine.stop()
            gc.collect()
