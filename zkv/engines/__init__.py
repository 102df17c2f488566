"""Adapters that attach zkv to real engines' own KV memory.

Each engine gets one module that wraps every private name of that engine zkv
touches, so an engine upgrade touches one file:

- ``zkv.engines.transformers_cb``: Hugging Face transformers' continuous
  batching (``model.init_continuous_batching``, its ``PagedAttentionCache``).

Nothing is imported here: importing an adapter pulls its engine in.
"""
