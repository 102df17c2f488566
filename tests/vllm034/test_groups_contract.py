"""The contract tests of models with several KV cache groups (tests/groups_contract.py)
on vLLM 0.34's own offload classes, without an engine."""

import pytest
from groups_contract import *  # noqa: F403  (the shared tests and their rig)

pytestmark = pytest.mark.timeout(300)
