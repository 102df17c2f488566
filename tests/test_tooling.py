"""ruff and mypy run clean on the tree, with the configuration in pyproject.toml
(mypy here only with ``ZKV_MYPY=1``: the README's test command runs it as a step of its own).

Where a tool is not installed the test is skipped, except under CI
(``CI=true``), where a missing tool is a failure: ``.ci/run`` installs the
``test`` extra, which pins both.
"""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name: str) -> list[str]:
    exe = shutil.which(name)
    if exe:
        return [exe]
    probe = subprocess.run([sys.executable, "-m", name, "--version"], capture_output=True, timeout=60)
    if probe.returncode == 0:
        return [sys.executable, "-m", name]
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{name} is not installed (pip install -e '.[test]')")
    pytest.skip(f"{name} is not installed")


def test_ruff_is_clean():
    res = subprocess.run(
        _tool("ruff") + ["check", "--no-cache", "zkv", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(
    not os.environ.get("ZKV_MYPY"),
    reason="mypy runs as a step of its own in the README's test command (.ci/run), before pytest (12-17 s of CPU"
    " cold): set ZKV_MYPY=1 to run it here",
)
def test_mypy_is_clean():
    res = subprocess.run(_tool("mypy"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
