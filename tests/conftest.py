"""Collection order for the parallel default run (``-n 3 --dist loadfile`` in
pyproject.toml): a file is one unit of work, handed out in collection order,
so the files that take longest go first and the short ones fill the gaps at
the end instead of one worker finishing a long file alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zkv.testing.runner import zygote

# Rank workers of the test clusters fork from one process that imported torch
# once (zkv/testing/runner/zygote.py): a worker start costs milliseconds, not seconds of CPU.
os.environ[zygote.ENV] = str(os.getpid())

# Longest first, as measured by ``--durations=0`` (summed per file) on a 2-core
# machine; files not named keep their alphabetical order after these.  A long
# file left to the end runs alone while the other workers have finished.
LONGEST_FIRST = (
    "test_up_lifecycle.py",
    "test_docs_exec.py",
    "test_gpu_check.py",
    "test_observability_cli.py",
    "test_operator_paths.py",
    "test_exact_or_lost.py",
    "test_engine_manifest.py",
    "test_engine_docs.py",
    "test_tooling.py",  # mypy over the package
    "test_recovery_e2e.py",
    "test_worker_paths.py",
    "test_engine_e2e.py",
    "test_cycle_standin.py",
    "test_races_e2e.py",
    "test_moved_paths.py",
    "test_vllm_index.py",
    "test_multihost.py",
    "test_engine_geometry.py",
    "test_row_book.py",
    "test_protocol.py",
    "test_tier_model.py",
    "test_fleet_e2e.py",
    "test_deploy_files.py",
    "test_architecture.py",
    "test_curve_roles.py",
    "test_engine_attach_e2e.py",
    "test_cpu_tier_restart_e2e.py",
    "test_shm_cleanup.py",
    "test_fuzz_strangers.py",
    "test_rank_standby.py",
    "test_bus_model.py",
    "test_fleet_decision.py",
    "test_fast_codec.py",
    "test_cycle_model.py",
    "test_prefix_manager.py",
    "test_replay.py",
    "test_rank_claims.py",
    "test_engine_transformers.py",
    "test_engine_layouts.py",
    "test_cluster_lifeline.py",
    "test_multihost_store.py",
    "test_strangers.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


@pytest.fixture(scope="session", autouse=True)
def rank_locks_of_killed_workers_removed():
    """Tests kill rank workers with SIGKILL on purpose; the lock file a killed worker held in
    /dev/shm (zkv/rank/tiers/rank_lock.py) stays, as it does for an operator until
    ``zkv shm clean``.  At the end of the session those this run made and no live worker holds
    go, the way that command removes them (a held one stays: a worker still serves)."""
    from zkv.rank.tiers.rank_lock import PREFIX
    from zkv.rank.tiers.tier_file import DEFAULT_DIR, remove_tier

    def locks() -> set[str]:
        try:
            return {n for n in os.listdir(DEFAULT_DIR) if n.startswith(PREFIX) and n.endswith(".lock")}
        except FileNotFoundError:
            return set()

    before = locks()
    yield
    for name in sorted(locks() - before):
        try:
            remove_tier(Path(DEFAULT_DIR) / name)
        except OSError:
            continue  # gone already (another worker of this run removed it)
