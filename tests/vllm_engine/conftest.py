"""The vLLM tests run where vLLM is installed (its own environment in CI:
tests/vllm_setup.sh, README); elsewhere they are not collected."""

import importlib.util


def _vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # a directory named vllm on sys.path is not vLLM


collect_ignore_glob = [] if _vllm_installed() else ["test_*.py"]
