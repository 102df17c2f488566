"""The long test profiles: what the default run leaves out, and the variable that runs it.

The default run stays under a few minutes on 2 cores; these add what repeats
a behaviour another default test already covers on real processes, at a
cost of tens of seconds each (each skip names its cost and the default test
that covers it).  ``ZKV_LONG_E2E=1`` runs them (2-3 minutes more of test
time; in the vLLM suite, tests/vllm_engine, about 10 minutes more), beside
``ZKV_DOCS_LONG`` (the docs' long command blocks and snippets),
``ZKV_TP_TEST`` (a tensor-parallel engine's two torch processes),
``ZKV_LONG_MODEL`` (the long profiles of the model-based tests),
``ZKV_LONG_FUZZ`` (the codec's properties and the strangers' fuzz, long) and
``ZKV_DISK_LONG`` (the disk tier's repetitions and its pause after spills on a
real rank); ``ZKV_MYPY`` runs mypy inside the suite (the README's test command
runs it as a step of its own)."""

from __future__ import annotations

import os

import pytest


def long_e2e(cost: str, covered_by: str) -> pytest.MarkDecorator:
    """Skip unless ZKV_LONG_E2E=1; the reason says what it costs and which default test covers it."""
    return pytest.mark.skipif(
        os.environ.get("ZKV_LONG_E2E") != "1",
        reason=f"long ({cost}; by default {covered_by} covers it): set ZKV_LONG_E2E=1",
    )
