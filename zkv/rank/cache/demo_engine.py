"""A stand-in inference engine process: it owns its KV tensors (CPU: in
shared-memory files; CUDA: on the GPU), exports a manifest, and answers line
commands on stdin until ``quit``:

- ``digest IDS``: a short sha256 of each block (comma-separated ids) as the
  engine itself indexes it;
- ``scribble SEED``: overwrite every byte of every tensor (synchronized);
- ``quit``: drop the tensors, unlink the files, print ``bye`` and exit.

Used by the cross-process tests and by ``ipc_check``; not for production.
Usage: ``python -m zkv.rank.cache.demo_engine LAYOUT MANIFEST GENERATION [DEVICE]``
with LAYOUT ``fastdeploy`` or ``vllm_flash``."""

from __future__ import annotations

import ctypes
import hashlib
import sys

import torch

from . import layouts
from .manifest import ShmArena, export_manifest

NB, BS, H, D, L = 16, 4, 2, 8, 2


def _allocator(arena: ShmArena, device: str):
    if device == "cpu":
        return arena.tensor
    return lambda name, shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


def make(arena: ShmArena, layout: str, device: str):
    """(tensors, entries, block(b) -> the engine's own slices of block b)."""
    new = _allocator(arena, device)
    if layout == "fastdeploy":
        ks = [new(f"key_caches_{i}", (NB, H, BS, D), torch.bfloat16) for i in range(L)]
        vs = [new(f"value_caches_{i}", (NB, H, BS, D), torch.bfloat16) for i in range(L)]
        return ks + vs, layouts.fastdeploy(ks, vs), lambda b: [t[b] for t in ks + vs]
    if layout == "vllm_flash":
        kv = {f"layer.{i}": new(f"layer.{i}", (2, NB, BS, H, D), torch.float16) for i in range(L)}
        return list(kv.values()), layouts.vllm_flash_attn(kv), lambda b: [t[:, b] for t in kv.values()]
    raise SystemExit(f"unknown layout {layout!r}")


def scribble(tensors, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen).to(flat.device))
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize()


def digest(slices) -> str:
    h = hashlib.sha256()
    for t in slices:
        c = t.contiguous().cpu()
        h.update(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()))
    return h.hexdigest()[:16]


def main(argv: list[str]) -> None:
    layout, manifest_path, generation = argv[0], argv[1], int(argv[2])
    device = argv[3] if len(argv) > 3 else "cpu"
    arena = ShmArena()
    tensors, entries, block = make(arena, layout, device)
    scribble(tensors, 1)
    export_manifest(manifest_path, entries, generation, arena)
    del entries
    print("ready", arena.tag, flush=True)
    for line in sys.stdin:
        cmd, *args = line.split() or [""]
        if cmd == "digest":
            print(" ".join(digest(block(int(b))) for b in args[0].split(",")), flush=True)
        elif cmd == "scribble":
            scribble(tensors, int(args[0]))
            print("ok", flush=True)
        elif cmd == "quit":
            break
        else:
            print(f"error unknown command {cmd!r}", flush=True)
    del tensors, block
    arena.close()
    print("bye", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
