"""The copy path as the GPU check drives it: a model's KV block size, one engine's cache, tier and
copy engine on a device (zkv's own or engine-attached), and the id patterns the swaps run over."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from ...rank.copies.copier import CopyEngine
from ...rank.copies.staging import STAGING_BYTES
from ...rank.memory import layouts
from ...rank.memory.regions import EngineCache
from ...rank.store import BlockStore, block_digests
from ...rank.tiers.cpu_tier import CpuTier
from ...wire.layout import CacheLayout
from ...wire.vocab import Dtype, Tier


@dataclass(frozen=True)
class Size:
    """A model's KV block: ``layers`` x K/V pages of ``tokens x heads x head_dim`` bf16."""

    layers: int
    tokens: int = 16
    heads: int = 8
    head_dim: int = 128

    @property
    def name(self) -> str:
        kib = self.block_bytes // 1024
        return f"{kib // 1024}MiB" if kib % 1024 == 0 else f"{kib}KiB"

    @property
    def page_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.tokens, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return 2 * self.layers * self.tokens * self.heads * self.head_dim * 2

    def layout(self, gpu_blocks: int, cpu_blocks: int) -> CacheLayout:
        return CacheLayout(
            layers=self.layers,
            gpu_blocks=gpu_blocks,
            cpu_blocks=cpu_blocks,
            block_size=self.tokens,
            kv_heads=self.heads,
            head_dim=self.head_dim,
            dtype=Dtype.BF16,
        )


class Rig:
    """One engine's cache and tier: ``out(blocks, rows)``, ``into(rows, blocks)`` and a byte check."""

    def __init__(
        self,
        engine: str,
        size: Size,
        blocks: int,
        rows: int,
        dev: torch.device,
        staging_bytes: int = STAGING_BYTES,
        compute_stream: Any = None,
    ):
        self.engine, self.dev = engine, dev
        if engine == "owned":
            self.kv = BlockStore.owned(size.layout(blocks, rows), dev, staging_bytes=staging_bytes)
            assert self.kv.copier is not None and self.kv.cache is not None and self.kv.tier is not None
            self.cache, self.tier, self.copier = self.kv.cache, self.kv.tier, self.kv.copier
        else:  # engine-attached: FastDeploy-style separate per-layer K and V tensors
            shape = (blocks, *size.page_shape)
            ks = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(size.layers)]
            vs = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(size.layers)]
            self.cache = EngineCache.from_tensors(layouts.zkv_native(ks, vs))
            self.tier = CpuTier.for_cache(self.cache.descriptor, rows, pin=dev.type == "cuda")
            self.copier = CopyEngine(self.cache, self.tier, compute_stream, staging_bytes)
        self.block_bytes = self.cache.descriptor.block_bytes

    def out(self, blocks: list[int], rows: list[int]) -> None:
        self.copier.swap_out(blocks, rows)

    def into(self, rows: list[int], blocks: list[int]) -> None:
        self.copier.swap_in(rows, blocks)

    def randomize(self, seed: int) -> None:
        gen = torch.Generator(device=self.dev).manual_seed(seed)
        for v in self.cache.views:
            v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, device=self.dev, generator=gen))

    def same(self, blocks: list[int], rows: list[int]) -> bool:
        """Engine blocks equal tier rows, byte for byte, in every region (compared on the device)."""
        b = torch.tensor(blocks, device=self.dev)
        r = torch.tensor(rows)
        return all(
            torch.equal(v.index_select(0, b), c.index_select(0, r).to(self.dev))
            for v, c in zip(self.cache.views, self.tier.columns)
        )

    def digests(self, tier: str, ids: list[int]) -> list[bytes]:
        return block_digests(self.cache.views if tier == Tier.GPU else self.tier.columns, ids)

    def close(self) -> None:
        self.copier.close()
        self.cache.release()
        if self.engine == "owned":
            self.kv.free()
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch.cuda.empty_cache()


def patterns(blocks: int, seed: int = 0) -> dict[str, tuple[list[int], list[int]]]:
    """Contiguous ids, and scattered engine blocks (of twice as many) into a shuffled run of tier rows."""
    rng = random.Random(seed)
    return {
        "contiguous": (list(range(blocks)), list(range(blocks))),
        "scattered": (rng.sample(range(2 * blocks), blocks), rng.sample(range(blocks), blocks)),
    }
