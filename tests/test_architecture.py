"""The import rules of docs/architecture.md, checked on every module's imports.

Every ``import`` and ``from ... import`` in zkv/ (at the top of a module or
inside a function: a lazy import is still a dependency) is resolved to the
zkv module it names and checked against the layer rules below.  A new
subpackage needs a rule here before it can import anything, and no imports
may run in a circle, inside a folder included.
"""

from __future__ import annotations

import ast
import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "zkv"

#: layer -> the layers its modules may import (its own included).
ALLOWED: dict[str, set[str]] = {
    "wire": {"wire"},
    "net": {"wire", "net"},
    "obs": {"wire", "obs"},  # metric books, Prometheus export, status table, plots
    "broker": {"wire", "net", "obs", "broker"},
    "rank": {"wire", "net", "obs", "rank"},
    "client": {"wire", "net", "client"},
    "fleet": {"wire", "net", "client", "fleet"},  # many buses driven as one, over one client per bus
    "rows": {"wire", "rows"},  # the one book of tier rows every engine path keeps (sans-IO)
    "engines": {
        "wire",
        "net",
        "obs",
        "broker",
        "rank",
        "client",
        "rows",
        "trace",
        "engines",
    },  # adapters for real engines' KV caches, nothing of the control plane; rows: the book of their rows
    # and the Bus it drives tasks through; broker, obs and trace: the bus a vLLM scheduler process hosts,
    # its metrics exporter and its recorder
    # RL cycles over engines and their buses (the control plane): over the fleet's bus links; the
    # engines are driven duck-typed (HTTP routes, an LLM object), never imported
    "cycle": {"wire", "net", "client", "fleet", "cycle"},
    "prefix": {"wire", "rows", "prefix"},  # it reaches the bus only through rows.bus.Bus
    "trace": {"wire", "trace"},
    "replay": {"wire", "net", "obs", "client", "trace", "replay"},
    # the product's tools: benchmarks, demos, checks, and what zkv up and zkv replay start
    "harness": {
        "wire",
        "net",
        "obs",
        "engines",
        "broker",
        "rank",
        "client",
        "fleet",
        "cycle",
        "prefix",
        "rows",
        "trace",
        "replay",
        "testing",
        "harness",
    },
    "testing": {"wire", "net", "broker", "rank", "client", "prefix", "rows", "testing"},
    "cli": {
        "wire",
        "net",
        "obs",
        "engines",
        "broker",
        "rank",
        "client",
        "fleet",
        "cycle",
        "prefix",
        "rows",
        "trace",
        "replay",
        "harness",
        "cli",
    },
    # zkv/__init__.py: Client, Fleet, FleetError, ZkvError, CacheLayout, TaskOutcome
    "api": {"wire", "client", "fleet"},
}

#: (importer, imported) pairs that break a rule today, each with what removes it.  The names the
#: control plane had under engines/ and prefix/ warn and go in zkv 0.3 (docs/versions.md).
KNOWN_EXCEPTIONS: set[tuple[str, str]] = {
    ("zkv.engines.vllm.server", "zkv.cycle.http"),
    ("zkv.engines.vllm.server_cycle", "zkv.cycle.label"),
    ("zkv.engines.vllm.server_cycle", "zkv.cycle.engine"),
    ("zkv.engines.vllm.server_cycle", "zkv.cycle.report"),
    ("zkv.engines.vllm.server_cycle", "zkv.cycle.servers"),
}

#: Layers whose modules may import torch.
TORCH_LAYERS = {"rank", "engines"}
#: Modules outside them that may: the copy benchmarks time plain torch copies
#: as the baseline for the rank's copy engine; the GPU check and its rig drive
#: it on real tensors; the stand-in engine process owns tensors of its own; the random
#: test models are torch modules, and so are the random Llama and the random models of several
#: KV cache groups a vLLM engine serves; the
#: vLLM benchmark's floor copies with plain torch, and the checksum benchmark times vLLM's
#: checksum of torch weights beside a plain copy.
TORCH_EXCEPTIONS = {
    "zkv.harness.vllm.rig",
    "zkv.harness.vllm.models",
    "zkv.harness.vllm.floor",
    "zkv.harness.vllm.checksum",
    "zkv.harness.bus.bench",
    "zkv.harness.copies.bench",
    "zkv.harness.copies.gpu_check",
    "zkv.harness.copies.rig",
    "zkv.harness.bus.demo_engine",
    "zkv.testing.models",
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    if parts[1] == "__main__":
        return "cli"
    return parts[1]


@functools.lru_cache(maxsize=None)
def parsed(source: str) -> ast.Module:
    """One parse per source: the checks here walk every module of zkv/ several times
    (read only, so the trees are shared)."""
    return ast.parse(source)


def imports_of(module: str, source: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``source``; ``from X import name``
    yields ``X.name`` when that is a zkv module, else ``X``."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(parsed(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((node.lineno, sub if module_exists(sub) else target))
    return out


def module_exists(module: str) -> bool:
    if not module.startswith("zkv"):
        return False
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    found = []
    layer = layer_of(module)
    if layer not in ALLOWED:
        return [f"{module}: layer {layer!r} has no import rule (add one to ALLOWED and to docs/architecture.md)"]
    for line, target in imports_of(module, source, is_package):
        top = target.split(".")[0]
        if top == "torch" and layer not in TORCH_LAYERS and module not in TORCH_EXCEPTIONS:
            found.append(f"{module}:{line} imports torch; only {sorted(TORCH_LAYERS)} may")
        if top != "zkv":
            continue
        if not module_exists(target):
            found.append(f"{module}:{line} imports {target}, which does not exist")
            continue
        to = layer_of(target)
        if to not in ALLOWED[layer] and (module, target) not in KNOWN_EXCEPTIONS:
            found.append(
                f"{module}:{line} ({layer}) imports {target} ({to}); {layer} may import only {sorted(ALLOWED[layer])}"
            )
    return found


def all_modules() -> list[pathlib.Path]:
    return sorted(PKG.rglob("*.py"))


def test_every_module_follows_the_import_rules():
    problems = []
    for path in all_modules():
        problems += violations(module_name(path), path.read_text(encoding="utf-8"), path.name == "__init__.py")
    assert not problems, "\n".join(problems)


def test_only_the_commands_import_the_tools():
    """Benchmarks, demos and checks (harness/) ship as commands: the library floors,
    the replay and the test tools never import them; only the CLI and harness do."""
    assert {layer for layer, allowed in ALLOWED.items() if "harness" in allowed} == {"harness", "cli"}


def test_every_package_has_an_init():
    missing = [
        str(d.relative_to(ROOT))
        for d in [PKG, *PKG.rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").is_file()
    ]
    assert not missing, f"setup.cfg finds packages by their __init__.py; these have none: {missing}"


def test_known_exceptions_are_still_needed():
    """An exception that no module needs any more is deleted, not kept."""
    used = set()
    for path in all_modules():
        module = module_name(path)
        used |= {
            (module, t) for _, t in imports_of(module, path.read_text(encoding="utf-8"), path.name == "__init__.py")
        }
    assert KNOWN_EXCEPTIONS <= used, KNOWN_EXCEPTIONS - used


@pytest.mark.parametrize(
    "module,source,complaint",
    [
        ("zkv.broker.core", "from ..rank import core\n", "broker may import only"),
        ("zkv.client.client", "def f():\n    from ..broker.loop import Broker\n", "client may import only"),
        ("zkv.wire.layout", "from ..net.endpoints import Endpoints\n", "wire may import only"),
        ("zkv.prefix.manager", "import torch\n", "imports torch"),
        ("zkv.trace.parse", "from ..wire.nothing_here import x\n", "does not exist"),
        ("zkv.engines2.x", "import os\n", "has no import rule"),
    ],
)
def test_the_checker_catches_a_crossing(module, source, complaint):
    found = violations(module, source)
    assert found and complaint in found[0], found


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the zkv modules it imports, from ``{module: (source, is_package)}``.
    A module importing a package it lives in is no edge: the package is already
    being imported when the module runs."""
    graph: dict[str, set[str]] = {}
    for module, (source, is_package) in sources.items():
        graph[module] = {
            target
            for _, target in imports_of(module, source, is_package)
            if target.startswith("zkv") and target != module and not module.startswith(target + ".")
        }
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other, directly or round a circle
    (the strongly connected components of more than one module, Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_even_inside_a_folder():
    """A circle of imports is two concepts tangled: split them by concept (a module
    that needs its owner belongs to it, or both need a third, lower one), never by
    deferring an import."""
    sources = {
        module_name(path): (path.read_text(encoding="utf-8"), path.name == "__init__.py") for path in all_modules()
    }
    cycles = import_cycles(import_graph(sources))
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize(
    "sources,cycle",
    [
        (  # inside one folder, one side lazy
            {
                "zkv.wire.messages": ("def f():\n    from .protocol import decode\n", False),
                "zkv.wire.protocol": ("from .messages import MESSAGES\n", False),
            },
            ["zkv.wire.messages", "zkv.wire.protocol"],
        ),
        (  # round a circle of three, one import only for the type checker
            {
                "zkv.prefix.swaps": ("from . import tiers\n", False),
                "zkv.prefix.tiers": ("from .radix import RadixNode\n", False),
                "zkv.prefix.radix": ("if TYPE_CHECKING:\n    from .swaps import SwapRunner\n", False),
            },
            ["zkv.prefix.radix", "zkv.prefix.swaps", "zkv.prefix.tiers"],
        ),
    ],
)
def test_the_checker_catches_an_import_cycle(sources, cycle):
    assert import_cycles(import_graph(sources)) == [cycle]
    package = {
        "zkv.prefix": ("from .swaps import SwapRunner\n", True),
        "zkv.prefix.swaps": ("from . import x\n", False),
    }
    assert import_cycles(import_graph(package)) == []  # a module under its package's __init__ is no circle


#: The floors the product is built of; the tools (harness, testing, cli, replay) stand on them.
LIBRARY_FLOORS = {"wire", "net", "obs", "broker", "rank", "client", "fleet", "cycle", "prefix", "engines", "trace"}
#: Module names that say "a tool": checks, benchmarks and demos live in harness/.
TOOL_MODULE = re.compile(r"(_check|^bench.*|.*_bench|^demo.*|.*_demo)$")
#: A guard, not a target: a module is one concept, and one that grows past this holds a
#: second concept to find and give its own object and state (never a helper module that
#: takes its owner as a parameter: those make import circles).
MAX_MODULE_LINES = 800


def _zkv_classes() -> dict[str, list[str]]:
    """Every class defined in zkv/: name -> its bases as written."""
    out: dict[str, list[str]] = {}
    for path in all_modules():
        for node in ast.walk(parsed(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).extend(ast.unparse(b).split(".")[-1] for b in node.bases)
    return out


def _is_exception(name: str, classes: dict[str, list[str]], seen: frozenset = frozenset()) -> bool:
    if name.endswith(("Error", "Exception")):
        return True
    return name not in seen and any(_is_exception(b, classes, seen | {name}) for b in classes.get(name, []))


def class_violations(module: str, source: str, classes: dict[str, list[str]]) -> list[str]:
    """A core composes parts that own their fields: no class is built from two
    or more zkv classes (mixins), and a ``*Core`` or ``*Manager`` inherits from
    none (exceptions aside)."""
    found = []
    for node in ast.walk(parsed(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = [ast.unparse(b).split(".")[-1] for b in node.bases]
        mixins = [b for b in bases if b in classes and not _is_exception(b, classes)]
        if len(mixins) > 1 or (mixins and node.name.endswith(("Core", "Manager"))):
            found.append(
                f"{module}:{node.lineno} class {node.name} inherits from {', '.join(mixins)}: "
                "compose parts that own their fields instead"
            )
    return found


def floor_violations(module: str, lines: int) -> list[str]:
    """Tools stay out of the library floors, and a module stays one concept."""
    found = []
    if layer_of(module) in LIBRARY_FLOORS and TOOL_MODULE.search(module.rpartition(".")[2]):
        found.append(f"{module} is a check, benchmark or demo: it belongs in zkv/harness/")
    if lines > MAX_MODULE_LINES:
        found.append(
            f"{module} has {lines} lines (over {MAX_MODULE_LINES}): it holds more than one concept; "
            "split it by concept, each part with its own object and state, not by line count"
        )
    return found


def test_no_core_is_built_from_mixins():
    classes = _zkv_classes()
    problems = []
    for path in all_modules():
        problems += class_violations(module_name(path), path.read_text(encoding="utf-8"), classes)
    assert not problems, "\n".join(problems)


def test_tools_live_in_harness_and_modules_stay_small():
    problems = []
    for path in all_modules():
        problems += floor_violations(module_name(path), len(path.read_text(encoding="utf-8").splitlines()))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "class BrokerCore(Tasks, Control):\n    pass\n",
        "class PrefixCacheManager(SwapRunner):\n    pass\n",
    ],
)
def test_the_checker_catches_a_mixin_core(source):
    classes = {
        "Tasks": [],
        "Control": [],
        "SwapRunner": [],
        "BrokerCore": ["Tasks", "Control"],
        "PrefixCacheManager": ["SwapRunner"],
        "ReasonError": ["ZkvError"],
    }
    assert class_violations("zkv.broker.core", source, classes)
    assert not class_violations("zkv.prefix.errors", "class E(ReasonError, ValueError):\n    pass\n", classes)


@pytest.mark.parametrize(
    "module,lines,complaint",
    [
        ("zkv.rank.copies.gpu_check", 10, "belongs in zkv/harness"),
        ("zkv.rank.copies.bench_copy", 10, "belongs in zkv/harness"),
        ("zkv.engines.demo_engine", 10, "belongs in zkv/harness"),
        ("zkv.broker.core", 801, "split it by concept"),
    ],
)
def test_the_checker_catches_a_tool_or_a_long_module(module, lines, complaint):
    found = floor_violations(module, lines)
    assert found and complaint in found[0], found
    assert not floor_violations("zkv.harness.copies.gpu_check", 10)
    assert not floor_violations("zkv.broker.core", 800)


ARCHITECTURE_DOC = ROOT / "docs" / "architecture.md"
#: A file path in backticks (``zkv/rank/core.py``, ``rank/core.py``, ``tests/conftest.py``), or
#: in parentheses in the component tree (``(tasks.py)``).
_DOC_PATH = re.compile(r"`([\w./]+\.py)`|\((\w+\.py)\)")
_DOC_COMMAND = re.compile(r"python\s+-m\s+(zkv(?:\.\w+)+)")
#: A class's member in backticks (``Recovery.reconcile``, ``BrokerCore.on_client``).
_DOC_MEMBER = re.compile(r"`([A-Z]\w*)\.(\w+)`")


@functools.cache
def _zkv_members() -> dict[str, set[str]]:
    """Every class defined in zkv/: name -> what it defines (methods, class
    attributes, ``self.x`` assignments in its methods)."""
    out: dict[str, set[str]] = {}
    for path in all_modules():
        for node in ast.walk(parsed(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            members = out.setdefault(node.name, set())
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                    members.add(item.id)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                    members.add(item.attr)
    return out


def doc_drift(text: str) -> list[str]:
    """What docs/architecture.md says of the code and the code does not bear out: a
    module path it names that does not exist, a ``python -m`` module that does not,
    a package under zkv/ it never names (by a path inside it), a member it names
    of a zkv class that does not define it (a method that moved)."""
    found = []
    modules = [p.relative_to(ROOT).as_posix() for p in all_modules()]
    names = {p.rpartition("/")[2] for p in modules}
    named = {a or b for a, b in _DOC_PATH.findall(text)}
    for path in sorted(named):
        if "/" not in path:
            exists = path in names
        elif path.startswith(("zkv/", "tests/")):
            exists = (ROOT / path).is_file()
        else:
            exists = (PKG / path).is_file()
        if not exists:
            found.append(f"docs/architecture.md names {path}, which does not exist")
    for command in sorted(set(_DOC_COMMAND.findall(text))):
        if not module_exists(command):
            found.append(f"docs/architecture.md runs python -m {command}, which does not exist")
    members = _zkv_members()
    for cls, member in sorted(set(_DOC_MEMBER.findall(text))):
        if cls in members and member not in members[cls]:
            found.append(f"docs/architecture.md names {cls}.{member}, which {cls} does not define")
    full = {p if p.startswith(("zkv/", "tests/")) else f"zkv/{p}" for p in named if "/" in p}
    for init in sorted(PKG.rglob("__init__.py")):
        package = init.parent.relative_to(ROOT).as_posix() + "/"
        if package != "zkv/" and not any(p.startswith(package) for p in full):
            found.append(f"docs/architecture.md never names the package {package} (add its modules to the table)")
    return found


def test_the_architecture_doc_names_the_code_as_it_is():
    problems = doc_drift(ARCHITECTURE_DOC.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)


_RULE_ROW = re.compile(r"^\| `(\w+)`(?: \(the package root\))? \| ([^|]*) \|", re.M)


def doc_rules(text: str) -> dict[str, set[str]]:
    """The import rules table of docs/architecture.md: layer -> what it may import, itself included."""
    section = text[text.index("## Import rules") :]
    section = section[: section.index("\n## ", 3)] if "\n## " in section[3:] else section
    rules = {}
    for layer, allowed in _RULE_ROW.findall(section):
        name = "api" if layer == "zkv" else layer
        rules[name] = set(re.findall(r"`(\w+)`", allowed)) | ({name} if name != "api" else set())
    return rules


def test_the_import_rules_are_the_docs():
    """docs/architecture.md and this test say the same thing about every layer (what engines/ may
    import, where the control plane lives): the doc's table is read back and compared."""
    assert doc_rules(ARCHITECTURE_DOC.read_text(encoding="utf-8")) == ALLOWED


def test_the_rules_check_catches_a_doc_that_differs():
    text = ARCHITECTURE_DOC.read_text(encoding="utf-8")
    drifted = text.replace("| `cycle` | `wire`, `net`, `client`, `fleet` |", "| `cycle` | `wire`, `net`, `engines` |")
    assert doc_rules(drifted)["cycle"] != ALLOWED["cycle"]


def test_the_doc_check_catches_drift():
    text = ARCHITECTURE_DOC.read_text(encoding="utf-8")
    assert any("zkv/broker/gone.py, which does not exist" in p for p in doc_drift(text + "\n`zkv/broker/gone.py`\n"))
    assert any("rank/gone.py" in p for p in doc_drift(text + "\nsee `rank/gone.py`\n"))
    assert any("python -m zkv.harness.gone" in p for p in doc_drift(text + "\n(`python -m\nzkv.harness.gone`)\n"))
    assert any("BrokerCore._reconcile" in p for p in doc_drift(text + "\n`BrokerCore._reconcile`\n"))
    assert any("package zkv/fleet/" in p for p in doc_drift(text.replace("zkv/fleet/", "zkv/elsewhere/")))


def test_the_lower_layers_load_without_torch():
    """Measured, not parsed: a fresh interpreter imports them and torch stays out."""
    code = (
        "import sys, zkv, zkv.wire, zkv.net, zkv.broker, zkv.client, zkv.fleet, zkv.cycle, zkv.prefix, zkv.rank, "
        "zkv.rank.core, "
        "zkv.trace, zkv.replay, zkv.testing; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_import_zkv_leaves_the_process_alone():
    """No warning filters, no signal handlers, no torch settings on import."""
    code = (
        "import signal, warnings; "
        "state = lambda: (list(warnings.filters), signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)); "
        "before = state(); import zkv, zkv.cli; print(before == state())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
