"""What measuring an engine's weights costs (``zkv.cycle.weights_digest``: vLLM's own
``compute_tensor_digests``, SHA-256 of every weight's bytes), per GiB of weights,
beside a plain copy of the same bytes in the same run.

``python -m zkv.harness.vllm.checksum [GIB]`` (the vLLM environment): the
weights are bf16 tensors of a 4096-wide model's shapes, GIB in all (default 1).
A GPU engine first copies each weight to the host (``.cpu()``), which this CPU
run does not pay."""

from __future__ import annotations

import sys
import time
from typing import Any


def bench_checksum(gib: float = 1.0, repeats: int = 3) -> dict[str, Any]:
    import torch
    from torch import nn
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    per = 4096 * 4096  # one 4096 x 4096 bf16 weight: 32 MiB
    count = max(1, int(gib * 2**30 / (2 * per)))
    model = nn.Module()
    for i in range(count):
        model.register_parameter(f"w{i}", nn.Parameter(torch.randn(4096, 4096, dtype=torch.bfloat16)))
    nbytes = count * per * 2
    into = torch.zeros(4096, 4096, dtype=torch.bfloat16)
    digest_s, copy_s = [], []
    for _ in range(repeats):  # in turns: a burst of load hits both alike
        t0 = time.perf_counter()
        compute_tensor_digests(model)
        digest_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for p in model.parameters():
            into.copy_(p.detach())  # one buffer, faulted in once: a copy, not an allocation
        copy_s.append(time.perf_counter() - t0)
    gb = nbytes / 1e9
    return {
        "weights_gib": round(nbytes / 2**30, 2),
        "checksum_s_per_gib": round(min(digest_s) / (nbytes / 2**30), 3),
        "checksum_gb_per_s": round(gb / min(digest_s), 2),
        "plain_copy_gb_per_s": round(gb / min(copy_s), 2),
    }


if __name__ == "__main__":
    print(bench_checksum(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0))
