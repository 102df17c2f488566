"""Adapters that attach zkv to real engines' own KV memory, one module per
engine: what that engine's KV tensors look like as zkv regions, and its door
(whatever entry point zkv has for it), so an engine upgrade touches one place:

- ``fastdeploy``: ``key_caches_{i}`` / ``value_caches_{i}`` (+ fp8 scales);
- ``vllm``: FlashAttention and FlashInfer per-layer caches;
- ``sglang``: MHA token pools;
- ``transformers``: continuous batching (``model.init_continuous_batching``, its
  ``PagedAttentionCache``), the in-process integration from attach to the RL cycle.

On top of the transformers door: ``swap_controller`` (conversations swapped
through the bus), ``idle_policy`` (which go), ``tp_bus`` (the bus for every
TP rank).  Nothing is imported here: importing an adapter pulls its engine in.
"""
