"""Where an offloaded block lives in zkv, as vLLM's scheduler hands it to
its workers: rows of zkv's CPU tier (one per vLLM block, same order)."""

from __future__ import annotations

from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec


class ZkvRows(BlockIDsLoadStoreSpec):
    """CPU tier rows of zkv (``block_ids``), as vLLM's ``LoadStoreSpec``."""

    @property
    def rows(self) -> list[int]:
        return [int(r) for r in self.block_ids]
