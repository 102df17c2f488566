"""Collection order for the parallel default run (``-n 3 --dist loadfile`` in
pyproject.toml): a file is one unit of work, handed out in collection order,
so the files that take longest go first and the short ones fill the gaps at
the end instead of one worker finishing a long file alone."""

from __future__ import annotations

import os

import pytest

from zkv.testing.runner import zygote

# Rank workers of the test clusters fork from one process that imported torch
# once (zkv/testing/runner/zygote.py): a worker start costs milliseconds, not seconds of CPU.
os.environ[zygote.ENV] = str(os.getpid())

# Longest first, as measured by ``--durations`` on a 2-core machine; files not
# named keep their alphabetical order after these.
LONGEST_FIRST = (
    "test_tooling.py",  # mypy over the package
    "test_races_e2e.py",
    "test_fleet_e2e.py",
    "test_recovery_e2e.py",
    "test_observability_cli.py",
    "test_gpu_check.py",
    "test_strangers.py",
    "test_operator_paths.py",
    "test_engine_manifest.py",
    "test_engine_e2e.py",
    "test_engine_attach_e2e.py",
    "test_cpu_tier_restart_e2e.py",
    "test_tier_chaos.py",
    "test_multihost.py",
    "test_engine_docs.py",
    "test_rank_claims.py",
    "test_deploy_files.py",
    "test_shm_cleanup.py",
    "test_fuzz_strangers.py",
    "test_docs_exec.py",
    "test_disk_tier.py",
    "test_replay.py",
    "test_status_view.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order
