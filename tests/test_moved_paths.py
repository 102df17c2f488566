"""The import paths zkv 0.1 documented and 0.2 moved keep working until 0.3, each with a
``DeprecationWarning`` naming the new path and the release that removes the old one
(docs/versions.md, "How an interface goes away"); ``python -m`` of an old path runs the
new command after a note; the CHANGELOG names every one.

The lists are what 0.1's docs showed: every module path and every ``from X import Y`` in
docs/ and README.md as 0.1 last stood before the 0.2 round (commit edd24af, ``git show
edd24af:docs/architecture.md``), less what still imports as it did."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: every module of 0.1's docs that 0.2 moved -> where it is now
MOVED = {
    "zkv.harness.attached_cluster": "zkv.harness.bus.attached_cluster",
    "zkv.harness.bench": "zkv.harness.bus.bench",
    "zkv.harness.bench_copy": "zkv.harness.copies.bench",
    "zkv.harness.cluster": "zkv.harness.bus.cluster",
    "zkv.harness.codec_bench": "zkv.harness.bus.codec_bench",
    "zkv.harness.copy_rig": "zkv.harness.copies.rig",
    "zkv.harness.demo": "zkv.harness.prefix.demo",
    "zkv.harness.demo_engine": "zkv.harness.bus.demo_engine",
    "zkv.harness.disk_bench": "zkv.harness.bus.disk_bench",
    "zkv.harness.engine_bench": "zkv.harness.transformers.bench",
    "zkv.harness.engine_demo": "zkv.harness.transformers.demo",
    "zkv.harness.engine_rig": "zkv.harness.transformers.rig",
    "zkv.harness.fleet_bench": "zkv.harness.fleet.bench",
    "zkv.harness.fleet_rig": "zkv.harness.fleet.rig",
    "zkv.harness.gpu_check": "zkv.harness.copies.gpu_check",
    "zkv.harness.ipc_check": "zkv.harness.bus.ipc_check",
    "zkv.harness.lifeline": "zkv.harness.bus.lifeline",
    "zkv.harness.local_replay": "zkv.harness.bus.local_replay",
    "zkv.harness.metrics_bench": "zkv.harness.bus.metrics_bench",
    "zkv.harness.pause_cpu": "zkv.harness.bus.pause_cpu",
    "zkv.harness.prefix_bench": "zkv.harness.prefix.bench",
    "zkv.harness.restart_bench": "zkv.harness.bus.restart_bench",
    "zkv.harness.vllm_bench": "zkv.harness.vllm.bench",
    "zkv.harness.vllm_demo": "zkv.harness.vllm.demo",
    "zkv.harness.vllm_floor": "zkv.harness.vllm.floor",
    "zkv.harness.vllm_rig": "zkv.harness.vllm.rig",
    "zkv.harness.workload": "zkv.harness.prefix.workload",
    "zkv.prefix.generations": "zkv.rows.loss",
    "zkv.rank.cache.copier": "zkv.rank.copies.copier",
    "zkv.rank.cache.cpu_copy": "zkv.rank.copies.cpu_copy",
    "zkv.rank.cache.cpu_tier": "zkv.rank.tiers.cpu_tier",
    "zkv.rank.cache.descriptor": "zkv.rank.memory.descriptor",
    "zkv.rank.cache.disk_io": "zkv.rank.tiers.disk_io",
    "zkv.rank.cache.disk_link": "zkv.rank.tiers.disk_link",
    "zkv.rank.cache.disk_tier": "zkv.rank.tiers.disk_tier",
    "zkv.rank.cache.dtypes": "zkv.rank.memory.dtypes",
    "zkv.rank.cache.errors": "zkv.rank.errors",
    "zkv.rank.cache.geometry": "zkv.rank.memory.geometry",
    "zkv.rank.cache.handover": "zkv.rank.memory.handover",
    "zkv.rank.cache.layouts": "zkv.rank.memory.layouts",
    "zkv.rank.cache.manifest": "zkv.rank.memory.manifest",
    "zkv.rank.cache.memory": "zkv.rank.sources",
    "zkv.rank.cache.regions": "zkv.rank.memory.regions",
    "zkv.rank.cache.shm": "zkv.rank.memory.shm",
    "zkv.rank.cache.staging": "zkv.rank.copies.staging",
    "zkv.rank.cache.store": "zkv.rank.store",
    "zkv.rank.rank_lock": "zkv.rank.tiers.rank_lock",
    "zkv.rank.shm_files": "zkv.rank.memory.shm_files",
    "zkv.rank.tier_file": "zkv.rank.tiers.tier_file",
    "zkv.testing.netns": "zkv.testing.runner.netns",
    "zkv.testing.netns_bus": "zkv.testing.runner.netns_bus",
    "zkv.testing.zygote": "zkv.testing.runner.zygote",
}
#: modules whose names changed too, or whose package re-exported them: old name -> new ``module.name``
RENAMED = {
    "zkv.prefix.allocator.BlockAllocator": "zkv.rows.pool.RowPool",
    "zkv.prefix.allocator.BlockAllocatorError": "zkv.rows.pool.RowPoolError",
    "zkv.prefix.allocator.DoubleFreeError": "zkv.rows.pool.DoubleFreeError",
    "zkv.prefix.BlockAllocator": "zkv.rows.pool.RowPool",
    "zkv.prefix.BlockAllocatorError": "zkv.rows.pool.RowPoolError",
    "zkv.rank.cache.BlockStore": "zkv.rank.store.BlockStore",
    "zkv.rank.cache.CacheError": "zkv.rank.errors.CacheError",
    "zkv.rank.cache.CacheDescriptor": "zkv.rank.memory.descriptor.CacheDescriptor",
    "zkv.rank.cache.CopyEngine": "zkv.rank.copies.copier.CopyEngine",
    "zkv.rank.cache.CpuTier": "zkv.rank.tiers.cpu_tier.CpuTier",
    "zkv.rank.cache.EngineCache": "zkv.rank.memory.regions.EngineCache",
    "zkv.rank.cache.EngineMemory": "zkv.rank.sources.EngineMemory",
    "zkv.rank.cache.MemorySource": "zkv.rank.sources.MemorySource",
    "zkv.rank.cache.OwnedMemory": "zkv.rank.sources.OwnedMemory",
    "zkv.rank.cache.RegionSpec": "zkv.rank.memory.descriptor.RegionSpec",
    "zkv.rank.cache.TaskInvalid": "zkv.rank.store.TaskInvalid",
}
#: the names 0.1's docs imported from the moved modules
DOC_NAMES = [
    ("zkv.harness.engine_rig", "EngineRig"),
    ("zkv.harness.prefix_bench", "bench_manager"),
    ("zkv.rank.cache.copier", "CopyEngine"),
    ("zkv.rank.cache.cpu_tier", "CpuTier"),
    ("zkv.rank.cache.errors", "CacheError"),
    ("zkv.rank.cache.manifest", "PROCESS_INSTANCE"),
    ("zkv.rank.cache.manifest", "ShmArena"),
    ("zkv.rank.cache.manifest", "attach"),
    ("zkv.rank.cache.manifest", "export_manifest"),
    ("zkv.rank.cache.regions", "EngineCache"),
]
#: a module of zkv 0.2 that needs vLLM to import (the default test environment has none)
NEEDS_VLLM = {"zkv.harness.vllm.floor"}

# Run in a fresh interpreter: an old path warns when it is first imported.
_PROBE = r"""
import importlib, json, sys, warnings
moved, renamed, names = json.loads(sys.argv[1])
out = {}
for old, new in moved.items():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            exec(f"import {old}")  # an import statement, as a user writes it
            module = sys.modules[old]
        except ModuleNotFoundError as err:
            out[old] = {"missing": err.name}
            continue
    said = [(str(w.message), w.filename, w.category.__name__) for w in seen if w.category is DeprecationWarning]
    out[old] = {"same": module is importlib.import_module(new), "said": said}
for old, new in renamed.items():
    package, _, name = old.rpartition(".")
    where, _, attribute = new.rpartition(".")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = getattr(importlib.import_module(package), name)
    said = [str(w.message) for w in seen if w.category is DeprecationWarning]
    out[old] = {"same": value is getattr(importlib.import_module(where), attribute), "said": said}
for module, name in names:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = getattr(importlib.import_module(module), name, None)
    out[f"{module}.{name}"] = {"found": found is not None}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probed() -> dict:
    arg = json.dumps([MOVED, RENAMED, DOC_NAMES])
    run = subprocess.run([sys.executable, "-c", _PROBE, arg], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module_and_warns_naming_it_and_0_3(probed, old):
    got = probed[old]
    if "missing" in got:
        assert MOVED[old] in NEEDS_VLLM and got["missing"].startswith("vllm"), got
        pytest.skip(f"{MOVED[old]} needs vLLM")
    assert got["same"], f"import {old} gives {MOVED[old]} itself"
    assert len(got["said"]) >= 1, f"import {old} warns"
    message, filename, _ = got["said"][0]
    assert MOVED[old] in message and "0.3" in message, message
    assert filename == "<string>", "the warning points at the import that named the old path"


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_an_old_name_is_the_new_one_and_warns(probed, old):
    got = probed[old]
    assert got["same"], f"{old} is {RENAMED[old]}"
    if not old.startswith("zkv.prefix.allocator."):  # the module's import warned already
        assert any(RENAMED[old] in said and "0.3" in said for said in got["said"]), got


@pytest.mark.parametrize("module,name", DOC_NAMES)
def test_every_name_the_docs_of_0_1_imported_still_imports(probed, module, name):
    assert probed[f"{module}.{name}"]["found"]


def test_python_m_of_an_old_path_runs_the_new_command_after_a_note():
    run = subprocess.run(
        [sys.executable, "-m", "zkv.harness.gpu_check", "--help"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout and "--device" in run.stdout
    assert run.stderr.startswith("zkv: note: zkv.harness.gpu_check moved to zkv.harness.copies.gpu_check"), run.stderr
    assert "run python -m zkv.harness.copies.gpu_check" in run.stderr and "0.3" in run.stderr


def test_the_changelog_lists_every_moved_path_under_deprecated():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    release = text.split("\n## ")[1]
    assert release.startswith("0.2.0"), "the first release section is 0.2.0's"
    deprecated = release.split("### Deprecated", 1)[1].split("\n### ", 1)[0]
    packages = {old.rpartition(".")[0] for old in RENAMED}
    missing = [
        old for old in [*MOVED, "zkv.prefix.allocator", "zkv.prefix.quarantine", *packages] if old not in deprecated
    ]
    assert not missing, f"CHANGELOG 0.2.0 Deprecated does not name: {missing}"


def test_the_old_quarantine_still_holds_and_settles_with_a_warning():
    sys.modules.pop("zkv.prefix.quarantine", None)
    with pytest.warns(DeprecationWarning, match="0.3"):
        from zkv.prefix.quarantine import Quarantine
    q: Quarantine[str] = Quarantine()
    q.hold(1, "a")
    q.hold(2, "b")
    assert q.settle([2, 9]) == ["b"] and len(q) == 1 and q.release_all() == ["a"]


def test_nothing_of_zkv_or_its_tests_imports_an_old_path():
    """So 0.3 removes the stubs and nothing else: only this test names the old paths."""
    old = {*MOVED, "zkv.prefix.allocator", "zkv.prefix.quarantine", "zkv.rank.cache"}
    stubs = {ROOT / (name.replace(".", "/") + ".py") for name in old} | {ROOT / "zkv/rank/cache/__init__.py"}
    found = []
    for path in sorted([*ROOT.joinpath("zkv").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py")]):
        if path in stubs or path == Path(__file__).resolve():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            hit = [n for n in names if n in old or n.startswith("zkv.rank.cache.")]
            if hit:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {hit[0]}")
    assert not found, "\n".join(found)
