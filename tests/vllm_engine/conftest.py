"""The vLLM tests run where vLLM is installed (its own environment in CI:
tests/vllm_setup.sh, README); elsewhere they are not collected.

A run leaves ``/dev/shm`` as it found it: vLLM's shared-memory rings
(``psm_*``) and semaphores (``sem.mp-*``) are removed by whatever stops or
kills an engine or a server (``zkv/harness/vllm/leftovers.py``), and the
session checks at its end that none its engines held is still there."""

import importlib.util
import os

import pytest


def _vllm_installed() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # a directory named vllm on sys.path is not vLLM


collect_ignore_glob = [] if _vllm_installed() else ["test_*.py"]


@pytest.fixture(autouse=True)
def _note_what_engines_hold():
    """After each test: what this process and its children hold in /dev/shm (an engine a
    test keeps for the next), so that the session's check knows it as this run's."""
    yield
    from zkv.harness.vllm import leftovers

    leftovers.held_by([os.getpid(), *leftovers.descendants(os.getpid())])


@pytest.fixture(scope="session", autouse=True)
def dev_shm_as_found():
    from zkv.harness.vllm import leftovers

    before = set(leftovers.SHM.iterdir())
    yield
    mine = [path for path in leftovers.seen() if path.exists() and path not in before]
    removed = leftovers.remove_unheld(mine)  # whatever a test left: gone for the next run either way
    assert not removed, f"this run's vLLM engines left in /dev/shm (removed now): {sorted(map(str, removed))}"
