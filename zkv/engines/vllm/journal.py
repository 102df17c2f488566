"""The tier journal moved to ``zkv.rows.journal`` (every engine's tiers keep one);
importing it from here warns until 0.3."""

from __future__ import annotations

import warnings

from ...rows.journal import DISK_JOURNAL, Header, Journal, JournalError, Replay, encode, encode_header, replay

__all__ = ["DISK_JOURNAL", "Header", "Journal", "JournalError", "Replay", "encode", "encode_header", "replay"]

warnings.warn(
    "zkv.engines.vllm.journal moved to zkv.rows.journal; the old path goes in 0.3",
    DeprecationWarning,
    stacklevel=2,
)
