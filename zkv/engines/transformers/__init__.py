"""zkv's door into Hugging Face transformers' continuous batching (pinned
version: ``build.PINNED_VERSION``; docs/engine-transformers.md):

- ``layout``: ``KVLayout``, the cache's one region (``regions``) and the model
  fields a rank announces; torch only, importable without transformers;
- ``build``: ``build_manager``, the continuous-batching manager with explicit sizes;
- ``engine``: ``TransformersCBEngine``, every private transformers name zkv touches;
- ``attach``: a ``RankAgent`` on the engine's cache (``start_rank``, ``reattach``).

Nothing is imported here, so ``layout`` needs no transformers.
"""
