"""One rank's shard of the KV cache and the block copies between its tiers.

Per layer a K and a V tensor ``[blocks, kv_heads, block_size, head_dim]`` on
the device (``cuda:R`` when CUDA exists, else CPU), all slices of one
``[2 * layers, blocks, ...]`` store, and a CPU swap space of the same blocks,
pinned when CUDA exists so copies can be asynchronous.

The cache describes itself as regions (``layouts.zkv_native``) and its swap
space is a block-major ``CpuTier`` (one contiguous row per block, holding
its page of every layer), so both engines share one copy engine
(``copier.CopyEngine``): on CPU coalesced runs become slice copies; on CUDA
a swap is gathered on the device into a staging buffer allocated once and
crosses the link in one contiguous transfer per chunk into or out of the
pinned rows, on streams ordered after the compute stream, and returns only
after a CUDA event behind the last copy completed.  ``cpu[i]`` is still
layer i's per-layer view ``[cpu_blocks, kv_heads, block_size, head_dim]``.
"""

from __future__ import annotations

import ctypes
import hashlib
from typing import Sequence

import torch

from ...wire.layout import CacheLayout
from ...wire.protocol import TaskBody
from . import layouts
from .backend import Freed, TaskInvalid, check_task
from .copier import CopyEngine, coalesce
from .regions import EngineCache
from .staging import STAGING_BYTES
from .tier import CpuTier

__all__ = ["KVCache", "TaskInvalid", "block_digests", "coalesce", "pick_device", "tensor_bytes"]

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_BITS_DTYPES = {"bf16": torch.int16, "fp16": torch.int16, "fp32": torch.int32}


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor (copied to host memory), without numpy,
    which torch does not depend on."""
    t = t.detach().to("cpu").contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def block_digests(tensors: Sequence[torch.Tensor], ids: Sequence[int]) -> list[bytes]:
    """A 16-byte BLAKE2b digest of every block: its slice of each tensor, in order.
    One rule for every backend, so a block and the row it was swapped to agree."""
    digests = []
    for b in ids:
        h = hashlib.blake2b(digest_size=16)
        for t in tensors:
            h.update(tensor_bytes(t[b]))
        digests.append(h.digest())
    return digests


def pick_device(rank: int) -> torch.device:
    """``cuda:R`` (modulo the visible GPUs) when CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


class KVCache:
    """The tensors of one rank and the operations the executor runs on them
    (the zkv-owned ``CacheBackend``)."""

    def __init__(self, layout: CacheLayout, device: torch.device | str = "cpu", rank: int = 0,
                 staging_bytes: int = STAGING_BYTES):
        self.device = torch.device(device)
        self.rank = rank
        self.staging_bytes = staging_bytes  # device memory for the CUDA copy path's staging buffers
        self.cuda = self.device.type == "cuda"
        self.layout = layout
        self.gpu: list[torch.Tensor] = []
        self.cpu: list[torch.Tensor] = []
        self.gpu_store: torch.Tensor | None = None
        self.tier: CpuTier | None = None  # the swap space, block-major rows
        self.engine: EngineCache | None = None  # gpu_store as regions
        self.copier: CopyEngine | None = None
        self.cpu_kept = False
        self.allocate(layout)

    # --- memory ------------------------------------------------------------------

    @property
    def allocated(self) -> bool:
        return bool(self.gpu)

    @staticmethod
    def cpu_shape(layout: CacheLayout) -> tuple:
        """What decides whether a kept CPU tier fits a layout, bit for bit."""
        return (2 * layout.layers, layout.cpu_blocks, layout.kv_heads, layout.block_size, layout.head_dim, layout.dtype)

    def allocate(self, layout: CacheLayout) -> int:
        """(Re)allocate the device tier for ``layout``, and the CPU tier unless
        one kept by ``free(keep_cpu=True)`` has the same shape: that one stays,
        bit for bit (``cpu_kept`` says whether it did).  Returns the bytes held.
        On an error (out of memory) nothing stays allocated and it propagates."""
        kept = self.tier is not None and self.cpu_shape(self.layout) == self.cpu_shape(layout)
        self.free(keep_cpu=kept)
        self.layout = layout
        dtype = TORCH_DTYPES[layout.dtype]
        shape = (layout.kv_heads, layout.block_size, layout.head_dim)
        try:
            self.gpu_store = torch.zeros((2 * layout.layers, layout.gpu_blocks, *shape), dtype=dtype, device=self.device)
            gpu = list(self.gpu_store.unbind(0))  # K0, V0, K1, V1, ...
            self.engine = EngineCache.from_tensors(layouts.zkv_native(gpu[0::2], gpu[1::2]))
            if not kept:
                self.tier = CpuTier.for_cache(self.engine.descriptor, layout.cpu_blocks, pin=self.cuda)
            assert self.tier is not None
            self.copier = CopyEngine(self.engine, self.tier, staging_bytes=self.staging_bytes)
        except BaseException:
            self.free(keep_cpu=False)
            raise
        self.gpu = gpu
        self.cpu = [column.view(dtype).view(layout.cpu_blocks, *shape) for column in self.tier.columns]
        self.cpu_kept = kept
        return self.nbytes()

    def free(self, keep_cpu: bool = False) -> Freed:
        """Drop the device tensors (and the swap space unless kept); return bytes freed."""
        freed = sum(t.numel() * t.element_size() for t in self.gpu)
        if self.copier is not None:
            self.copier.close()
        if self.engine is not None:
            self.engine.release()
        self.gpu, self.gpu_store, self.engine, self.copier = [], None, None, None
        if not keep_cpu or self.tier is None:
            freed += self.tier.nbytes if self.tier is not None else 0
            self.cpu, self.tier = [], None
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # really return the memory to the driver
        return Freed(freed, self.tier is not None)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.gpu + self.cpu)

    def tier_nbytes(self) -> dict[str, int]:
        return {tier: sum(t.numel() * t.element_size() for t in tensors) for tier, tensors in (("gpu", self.gpu), ("cpu", self.cpu))}

    # --- validation ----------------------------------------------------------------

    def validate(self, body: TaskBody) -> None:
        """Raise TaskInvalid with the reason if ``body`` cannot run here."""
        if not self.allocated:
            raise TaskInvalid("caches are cleared on this rank")
        check_task(body, self.layout.gpu_blocks, self.layout.cpu_blocks)

    # --- operations ----------------------------------------------------------------

    def _tier(self, tier: str) -> list[torch.Tensor]:
        return self.gpu if tier == "gpu" else self.cpu

    def swap(self, op: str, src: Sequence[int], dst: Sequence[int]) -> int:
        """Copy blocks between tiers (all layers, K and V; ids validated); return bytes moved."""
        assert self.copier is not None, "swap on a freed cache"
        if op == "swap_out":
            return self.copier.copy_out(src, dst)
        return self.copier.copy_in(src, dst)

    def fill(self, tier: str, ids: Sequence[int], seed: int) -> int:
        """Write deterministic random bits (per seed, rank and id order) into blocks."""
        rng = torch.Generator().manual_seed((seed * 1_000_003 + self.rank) % 2**64)  # any uint seed (up to 2^53-1)
        bits = _BITS_DTYPES[self.layout.dtype]
        info = torch.iinfo(bits)
        index = torch.tensor(list(ids), dtype=torch.long)
        for t in self._tier(tier):
            values = torch.randint(info.min, info.max, (len(ids), *t.shape[1:]), dtype=bits, generator=rng)
            t.view(bits).index_copy_(0, index.to(t.device), values.to(t.device))
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return len(ids) * self.layout.block_bytes

    def checksum(self, tier: str, ids: Sequence[int]) -> list[bytes]:
        """A 16-byte BLAKE2b digest of every block (K and V of all layers)."""
        return block_digests(self._tier(tier), ids)
