"""A stand-in inference engine process: it owns its KV tensors (CPU: in
shared-memory files; CUDA: on the GPU), exports a manifest, and answers line
commands on stdin until ``quit``:

- ``digest IDS``: a short sha256 of each block (comma-separated ids) as the
  engine itself indexes it;
- ``scribble SEED``: overwrite every byte of every tensor (synchronized);
- ``realloc GENERATION [BLOCKS]``: what an engine does after a clear: drop
  its tensors and files, allocate new ones (optionally another block count),
  scribble them, and export the manifest again, at the same path, as
  ``GENERATION``;
- ``quit``: drop the tensors, unlink the files, print ``bye`` and exit.

Used by the cross-process tests, ``ipc_check`` and ``zkv up --demo --attach``;
not for production.
Usage: ``python -m zkv.harness.bus.demo_engine LAYOUT MANIFEST GENERATION [DEVICE]
[--blocks N --layers L --block-size B --kv-heads H --head-dim D --dtype bf16]``
with LAYOUT ``fastdeploy`` or ``vllm_flash``."""

from __future__ import annotations

import ctypes
import hashlib
import sys

import torch

from ...rank.memory import layouts
from ...rank.memory.dtypes import TORCH_DTYPES
from ...rank.memory.manifest import ShmArena, export_manifest
from ...wire.vocab import Dtype

NB, BS, H, D, L = 16, 4, 2, 8, 2


class Shape:
    """The engine's cache dimensions (defaults: a small test cache)."""

    def __init__(
        self,
        blocks: int = NB,
        layers: int = L,
        block_size: int = BS,
        kv_heads: int = H,
        head_dim: int = D,
        dtype: str = "",
    ):
        self.blocks, self.layers, self.block_size, self.kv_heads, self.head_dim = (
            blocks,
            layers,
            block_size,
            kv_heads,
            head_dim,
        )
        self.dtype = TORCH_DTYPES[Dtype(dtype)] if dtype else None  # none named: each layout its own default

    @classmethod
    def parse(cls, args: list[str]) -> "Shape":
        names = {
            "--blocks": "blocks",
            "--layers": "layers",
            "--block-size": "block_size",
            "--kv-heads": "kv_heads",
            "--head-dim": "head_dim",
            "--dtype": "dtype",
        }
        kw: dict = {}
        for flag, value in zip(args[::2], args[1::2]):
            if flag not in names:
                raise SystemExit(f"unknown option {flag!r}")
            kw[names[flag]] = value if flag == "--dtype" else int(value)
        return cls(**kw)


def _allocator(arena: ShmArena, device: str):
    if device == "cpu":
        return arena.tensor
    return lambda name, shape, dtype: torch.zeros(shape, dtype=dtype, device=device)


def make(arena: ShmArena, layout: str, device: str, shape: Shape | None = None):
    """(tensors, entries, block(b) -> the engine's own slices of block b)."""
    new = _allocator(arena, device)
    s = shape or Shape()
    nb, h, bs, d = s.blocks, s.kv_heads, s.block_size, s.head_dim
    if layout == "fastdeploy":
        dtype = s.dtype or torch.bfloat16
        ks = [new(f"key_caches_{i}", (nb, h, bs, d), dtype) for i in range(s.layers)]
        vs = [new(f"value_caches_{i}", (nb, h, bs, d), dtype) for i in range(s.layers)]
        return (
            ks + vs,
            layouts.per_layer(
                {f"key_caches_{i}": k for i, k in enumerate(ks)} | {f"value_caches_{i}": v for i, v in enumerate(vs)}
            ),
            lambda b: [t[b] for t in ks + vs],
        )
    if layout == "vllm_flash":
        dtype = s.dtype or torch.float16
        kv = {f"layer.{i}": new(f"layer.{i}", (2, nb, bs, h, d), dtype) for i in range(s.layers)}
        return (
            list(kv.values()),
            layouts.per_layer({f"{n}.{half}": t[j] for n, t in kv.items() for j, half in enumerate("kv")}),
            lambda b: [t[:, b] for t in kv.values()],
        )
    raise SystemExit(f"unknown layout {layout!r}")


def scribble(tensors, seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=rng).to(flat.device))
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
    rest, device = argv[3:], "cpu"
    if rest and not rest[0].startswith("--"):
        device, rest = rest[0], rest[1:]
    shape = Shape.parse(rest)
    arena = ShmArena()
    tensors, entries, block = make(arena, layout, device, shape)
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
        elif cmd == "realloc":
            del tensors, block
            arena.close()  # the engine frees: the workers dropped their mappings at the clear
            if len(args) > 1:
                shape.blocks = int(args[1])
            arena = ShmArena()
            tensors, entries, block = make(arena, layout, device, shape)
            scribble(tensors, int(args[0]))
            export_manifest(manifest_path, entries, int(args[0]), arena)
            del entries
            print("ok", arena.tag, flush=True)
        elif cmd == "quit":
            break
        else:
            print(f"error unknown command {cmd!r}", flush=True)
    del tensors, block
    arena.close()
    print("bye", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
