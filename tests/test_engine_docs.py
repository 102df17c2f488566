"""The Python snippets of docs/engines.md, docs/engine-transformers.md and docs/operations.md run
as written, each in a fresh interpreter (on the GPU when torch sees one, on
the CPU otherwise), and close what they open: before the snippet's process
exits, no ``ShmArena`` is still open and no thread but the main one still
runs (checked inside it, because an exit would close a forgotten arena)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("engines.md", "engine-transformers.md", "operations.md")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

#: (doc, snippet index) -> arguments: the benchmark on its smallest run (its table's sizes take minutes).
ARGS = {("engine-transformers.md", 0): ["fp32", "64"]}
#: (doc, snippet index) -> the module it needs, skipped with that reason when it is not installed.
NEEDS = {("engine-transformers.md", 0): "transformers", ("engines.md", 4): "transformers"}
#: (doc, snippet index) -> why it is not run.  None: every snippet runs.
SKIP: dict[tuple[str, int], str] = {}
#: (doc, snippet index) -> what it costs: run only with ZKV_DOCS_LONG=1, compiled otherwise.
LONG = {
    ("engine-transformers.md", 0): "a benchmark of prefill against swap-in on a transformers model (20-30 s)",
    ("engines.md", 4): "two transformers engines on two buses and a fleet update (15 s)",
}

EPILOGUE = """

# --- appended by tests/test_engine_docs.py: what the snippet opened is closed
import sys as _sys, threading as _threading
_shm = _sys.modules.get("zkv.rank.memory.shm")
assert _shm is None or not _shm._open, f"ShmArenas left open: {[a.tag for a in _shm._open.values()]}"
_running = [t.name for t in _threading.enumerate() if t is not _threading.main_thread() and t.is_alive()]
assert not _running, f"threads still running: {_running}"
print("zkv-doc-snippet-closed")
"""


def snippets() -> list[tuple[str, int, str]]:
    found = []
    for doc in DOCS:
        for i, body in enumerate(FENCE.findall((ROOT / "docs" / doc).read_text(encoding="utf-8"))):
            found.append((doc, i, body))
    return found


SNIPPETS = snippets()


def run_snippet(path: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env
    )


def test_the_snippets_are_found():
    per_doc = {doc: sum(1 for d, _, _ in SNIPPETS if d == doc) for doc in DOCS}
    assert per_doc["engines.md"] >= 3 and per_doc["engine-transformers.md"] >= 1, per_doc
    rules = set(SKIP) | set(ARGS) | set(NEEDS) | set(LONG)
    assert not rules - {(d, i) for d, i, _ in SNIPPETS}, "a rule for no snippet"


@pytest.mark.parametrize("doc,index,body", SNIPPETS, ids=[f"{d}#{i}" for d, i, _ in SNIPPETS])
def test_a_doc_snippet_runs_as_written_and_closes_what_it_opens(tmp_path, doc, index, body):
    if (doc, index) in SKIP:
        pytest.skip(SKIP[doc, index])
    if (doc, index) in LONG and not os.environ.get("ZKV_DOCS_LONG"):
        compile(body, f"docs/{doc} snippet {index}", "exec")  # it still parses as written
        pytest.skip(f"long ({LONG[doc, index]}): set ZKV_DOCS_LONG=1 to run it; compiled only")
    module = NEEDS.get((doc, index))
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module} (pip install 'zkv[{module}]')")
    script = tmp_path / "snippet.py"
    script.write_text(body + EPILOGUE, encoding="utf-8")
    out = run_snippet(script, ARGS.get((doc, index), []), tmp_path)
    assert out.returncode == 0, f"docs/{doc} snippet {index} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    assert out.stdout.rstrip().endswith("zkv-doc-snippet-closed"), out.stdout


def test_the_check_catches_an_arena_left_open(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(
        "import torch\nfrom zkv.rank.memory.shm import ShmArena\n"
        "arena = ShmArena()\nk = arena.tensor('k', (4, 8), torch.bfloat16)\n" + EPILOGUE,
        encoding="utf-8",
    )
    out = run_snippet(script, [], tmp_path)
    assert out.returncode != 0 and "ShmArenas left open" in out.stderr, out.stderr
