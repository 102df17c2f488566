"""One rank's shard of the KV cache and the block copies between its tiers.

Per layer a K and a V tensor ``[blocks, kv_heads, block_size, head_dim]`` on
the device (``cuda:R`` when CUDA exists, else CPU) and a CPU swap space of the
same per-block shape, pinned when CUDA exists so copies can be asynchronous.

Copies are coalesced: id pairs are sorted and runs of consecutive (src, dst)
become one slice ``copy_`` per tensor, which approaches the contiguous-copy
ceiling (FIELD-NOTES: index_select/index_copy_ reach 0.13-0.3x of it).  On
CUDA the copies go on a dedicated stream that first waits for the compute
stream, and completion is awaited on a CUDA event, never by polling.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from .layout import CacheLayout
from .protocol import TaskBody

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_BITS_DTYPES = {"bf16": torch.int16, "fp16": torch.int16, "fp32": torch.int32}


class TaskInvalid(ValueError):
    """A task that cannot run on this layout; the message is the reason."""


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Merge id pairs into runs ``(src_start, dst_start, length)``."""
    pairs = sorted(zip(src, dst))
    runs: list[tuple[int, int, int]] = []
    s0 = d0 = length = 0
    for s, d in pairs:
        if length and s == s0 + length and d == d0 + length:
            length += 1
            continue
        if length:
            runs.append((s0, d0, length))
        s0, d0, length = s, d, 1
    if length:
        runs.append((s0, d0, length))
    return runs


def pick_device(rank: int) -> torch.device:
    """``cuda:R`` (modulo the visible GPUs) when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class KVCache:
    """The tensors of one rank and the operations the executor runs on them."""

    def __init__(self, layout: CacheLayout, device: torch.device | str = "cpu", rank: int = 0):
        self.device = torch.device(device)
        self.rank = rank
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.layout = layout
        self.gpu: list[torch.Tensor] = []
        self.cpu: list[torch.Tensor] = []
        self.allocate(layout)

    # --- memory ------------------------------------------------------------------

    @property
    def allocated(self) -> bool:
        return bool(self.gpu)

    def allocate(self, layout: CacheLayout) -> int:
        """(Re)allocate both tiers for ``layout``; return bytes allocated."""
        self.free(keep_cpu=False)
        self.layout = layout
        dtype = TORCH_DTYPES[layout.dtype]
        shape = (layout.kv_heads, layout.block_size, layout.head_dim)
        self.gpu = [torch.zeros((layout.gpu_blocks, *shape), dtype=dtype, device=self.device) for _ in range(2 * layout.layers)]
        self.cpu = [torch.zeros((layout.cpu_blocks, *shape), dtype=dtype, pin_memory=self.cuda) for _ in range(2 * layout.layers)]
        return self.nbytes()

    def free(self, keep_cpu: bool = False) -> int:
        """Drop the device tensors (and the swap space unless kept); return bytes freed."""
        freed = sum(t.numel() * t.element_size() for t in self.gpu)
        self.gpu = []
        if not keep_cpu:
            freed += sum(t.numel() * t.element_size() for t in self.cpu)
            self.cpu = []
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # really return the memory to the driver
        return freed

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.gpu + self.cpu)

    # --- validation ----------------------------------------------------------------

    def _tier_blocks(self, tier: str) -> int:
        return self.layout.gpu_blocks if tier == "gpu" else self.layout.cpu_blocks

    def _check_ids(self, name: str, ids: Sequence[int], tier: str, unique: bool) -> None:
        limit = self._tier_blocks(tier)
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise TaskInvalid(f"{name} block id {bad} is out of range for the {tier} tier (0..{limit - 1})")
        if unique and len(set(ids)) != len(ids):
            raise TaskInvalid(f"{name} has duplicate block ids (two copies would race into one block)")

    def validate(self, body: TaskBody) -> None:
        """Raise TaskInvalid with the reason if ``body`` cannot run here."""
        if not self.allocated:
            raise TaskInvalid("caches are cleared on this rank")
        if body.op == "swap_out":
            self._check_ids("src", body.src, "gpu", unique=False)
            self._check_ids("dst", body.dst, "cpu", unique=True)
        elif body.op == "swap_in":
            self._check_ids("src", body.src, "cpu", unique=False)
            self._check_ids("dst", body.dst, "gpu", unique=True)
        elif body.op == "fill":
            self._check_ids("dst", body.dst, body.tier, unique=True)
        elif body.op == "checksum":
            self._check_ids("src", body.src, body.tier, unique=False)

    # --- operations ----------------------------------------------------------------

    def _tier(self, tier: str) -> list[torch.Tensor]:
        return self.gpu if tier == "gpu" else self.cpu

    def swap(self, op: str, src: Sequence[int], dst: Sequence[int]) -> int:
        """Copy blocks between tiers; return bytes moved."""
        src_tier, dst_tier = (self.gpu, self.cpu) if op == "swap_out" else (self.cpu, self.gpu)
        runs = coalesce(src, dst)
        if self.cuda:
            assert self.copy_stream is not None
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                self._copy_runs(src_tier, dst_tier, runs, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            done.synchronize()
        else:
            self._copy_runs(src_tier, dst_tier, runs, non_blocking=False)
        return len(src) * self.layout.block_bytes

    @staticmethod
    def _copy_runs(src_tier: list[torch.Tensor], dst_tier: list[torch.Tensor], runs: list[tuple[int, int, int]], non_blocking: bool) -> None:
        for src_t, dst_t in zip(src_tier, dst_tier):
            for s, d, n in runs:
                dst_t[d:d + n].copy_(src_t[s:s + n], non_blocking=non_blocking)

    def fill(self, tier: str, ids: Sequence[int], seed: int) -> int:
        """Write deterministic random bits (per seed, rank and id order) into blocks."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + self.rank)
        bits = _BITS_DTYPES[self.layout.dtype]
        info = torch.iinfo(bits)
        index = torch.tensor(list(ids), dtype=torch.long)
        for t in self._tier(tier):
            values = torch.randint(info.min, info.max, (len(ids), *t.shape[1:]), dtype=bits, generator=gen)
            t.view(bits).index_copy_(0, index.to(t.device), values.to(t.device))
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return len(ids) * self.layout.block_bytes

    def checksum(self, tier: str, ids: Sequence[int]) -> list[bytes]:
        """A 16-byte BLAKE2b digest of every block (K and V of all layers)."""
        tensors = self._tier(tier)
        digests = []
        for b in ids:
            h = hashlib.blake2b(digest_size=16)
            for t in tensors:
                h.update(t[b].cpu().contiguous().view(torch.uint8).numpy().tobytes())
            digests.append(h.digest())
        return digests
