"""The vLLM tests run where vLLM is installed (its own environment in CI:
tests/vllm_setup.sh, README); elsewhere they are not collected."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
