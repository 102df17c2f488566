"""The contract tests against vLLM 0.34's own offload classes run where that
vLLM is installed (its own environment: tests/vllm034_setup.sh); elsewhere
they are not collected."""

import importlib.metadata


def _vllm_034() -> bool:
    try:
        return importlib.metadata.version("vllm").startswith("0.34.")
    except importlib.metadata.PackageNotFoundError:
        return False


collect_ignore_glob = [] if _vllm_034() else ["test_*.py"]
