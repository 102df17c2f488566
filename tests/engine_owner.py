"""A stand-in inference engine for cross-process tests: it owns its KV tensors
in shared memory, exports a manifest, and answers line commands on stdin:
``digest IDS`` (sha256 of each block as the engine indexes it), ``scribble
SEED`` (overwrite every tensor), ``quit`` (drop the tensors, unlink, exit).

Usage: python tests/engine_owner.py LAYOUT MANIFEST GENERATION"""

import ctypes
import hashlib
import sys

import torch

from zkv.rank.cache import layouts
from zkv.rank.cache.manifest import ShmArena, export_manifest

NB, BS, H, D, L = 16, 4, 2, 8, 2


def make(arena, layout):
    if layout == "fastdeploy":
        ks = [arena.tensor(f"key_caches_{i}", (NB, H, BS, D), torch.bfloat16) for i in range(L)]
        vs = [arena.tensor(f"value_caches_{i}", (NB, H, BS, D), torch.bfloat16) for i in range(L)]
        return ks + vs, layouts.fastdeploy(ks, vs), lambda b: [t[b] for t in ks + vs]
    if layout == "vllm_flash":
        kv = {f"layer.{i}": arena.tensor(f"layer.{i}", (2, NB, BS, H, D), torch.float16) for i in range(L)}
        return list(kv.values()), layouts.vllm_flash_attn(kv), lambda b: [t[:, b] for t in kv.values()]
    raise SystemExit(f"unknown layout {layout}")


def scribble(tensors, seed):
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def main():
    layout, manifest_path, generation = sys.argv[1], sys.argv[2], int(sys.argv[3])
    arena = ShmArena()
    tensors, entries, block = make(arena, layout)
    scribble(tensors, 1)
    export_manifest(manifest_path, entries, generation, arena)
    del entries
    print("ready", arena.tag, flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "digest":
            ids = [int(x) for x in args[0].split(",")]
            out = []
            for b in ids:
                h = hashlib.sha256()
                for t in block(b):
                    c = t.contiguous()
                    h.update(ctypes.string_at(c.data_ptr(), c.numel() * c.element_size()))
                out.append(h.hexdigest()[:16])
            print(" ".join(out), flush=True)
        elif cmd == "scribble":
            scribble(tensors, int(args[0]))
            print("ok", flush=True)
        elif cmd == "quit":
            break
    del tensors, block
    arena.close()
    print("bye", flush=True)


if __name__ == "__main__":
    main()
