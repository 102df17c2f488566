"""zkv inside vLLM.

``layouts``: vLLM's KV caches as zkv regions (FlashAttention, FlashInfer,
block-major, and the canonical ``(num_blocks, page_bytes)`` tensors its
offloading spec hands a worker), for a rank attached to a vLLM worker's tensors.  The offload
backend that a vLLM user turns on with one ``--kv-transfer-config``
(docs/engine-vllm.md) lives in ``connector`` and the modules it names; only
those import vLLM itself.
"""

from .layouts import NULL_BLOCK, block_major, canonical_pages, flash_attn, flashinfer

__all__ = ["NULL_BLOCK", "block_major", "canonical_pages", "flash_attn", "flashinfer"]
