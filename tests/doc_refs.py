"""Every file and module a text names exists: a ``zkv/...py`` path (or one
relative to the package, ``rank/core.py``, or a bare ``core.py``), a dotted
``zkv.x.y`` module and the name it reaches into (``zkv.rank.agent.RankAgent``),
a ``docs/...md`` file.  Read from README.md and docs/*.md, and from every
docstring and comment under zkv/: a module that moves leaves its old name
behind there, where nothing else looks.

Where a relative path resolves: from the checkout's root, from zkv/, from the
naming module's own package or one above it; in a doc, as the tail of any file
under zkv/ or tests/.  A path under an engine's own tree (``vllm/v1/...``)
that resolves to nothing here is that project's, not checked.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from doc_blocks import ROOT, doc_files

PKG = ROOT / "zkv"
PY_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.py)(?![\w/])")
MODULE = re.compile(r"(?<![\w./-])(zkv(?:\.[A-Za-z_]\w*)+)")
DOC_PATH = re.compile(r"(?<![\w./-])(docs/[\w./-]*?\.md)(?![\w/])")
UPSTREAM = ("vllm/", "torch/", "transformers/", "sglang/", "fastdeploy/", "lmcache/", "msgspec/", "zmq/", "h11/")


@lru_cache(maxsize=None)
def _file_names() -> frozenset[str]:
    trees = [PKG.rglob("*.py"), (ROOT / "tests").rglob("*.py"), ROOT.glob("*.py"), (ROOT / "bin").glob("*")]
    return frozenset(p.name for tree in trees for p in tree if "node_modules" not in p.parts)


@lru_cache(maxsize=None)
def _tails() -> frozenset[str]:
    """Every file under zkv/ and tests/ by each of its path's tails (``rank/core.py``, ``core.py``)."""
    out = set()
    for tree in (PKG, ROOT / "tests"):
        for p in tree.rglob("*.py"):
            parts = p.relative_to(ROOT).parts
            out.update("/".join(parts[i:]) for i in range(len(parts)))
    return frozenset(out)


def path_exists(path: str, near: Path | None) -> bool:
    """``path`` names a file of the checkout, seen from ``near`` (a module; None: a doc)."""
    if "/" not in path:
        return path in _file_names()
    if (ROOT / path).is_file() or (PKG / path).is_file():
        return True
    if near is None:
        return path in _tails()
    here = near.parent
    while here != ROOT and ROOT in here.parents:
        if (here / path).is_file():
            return True
        here = here.parent
    return False


@lru_cache(maxsize=None)
def _names(module: Path) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """What ``module`` defines at its top (a lazy ``__getattr__`` adds every str
    constant it holds), and each of its classes' members."""
    tree = ast.parse(module.read_text(encoding="utf-8"))
    names: set[str] = set()
    classes: dict[str, frozenset[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.Name) and isinstance(item.ctx, ast.Store):
                    members.add(item.id)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                    members.add(item.attr)
            classes[node.name] = frozenset(members)
    if "__getattr__" in names:
        names.update(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return frozenset(names), classes


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_problem(dotted: str) -> str | None:
    """Why ``zkv.x.y[.Name[.member]]`` names nothing here, or None."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        found = _module_file(parts[:i])
        if found is not None:
            break
    else:  # pragma: no cover - zkv itself always resolves
        return "no such module"
    rest = parts[i:]
    if not rest:
        return None
    names, classes = _names(found)
    module = ".".join(parts[:i])
    if rest[0] not in names:
        return f"{module} has no module or name {rest[0]!r}"
    if len(rest) > 1 and rest[0] in classes and rest[1] not in classes[rest[0]]:
        return f"{module}.{rest[0]} has no member {rest[1]!r}"
    return None


def dangling(text: str, near: Path | None = None) -> Iterator[tuple[int, str]]:
    """(offset in ``text``, what is wrong) for each reference that resolves to nothing."""
    for m in PY_PATH.finditer(text):
        path = m.group(1)
        if not path_exists(path, near) and not path.startswith(UPSTREAM):
            yield m.start(), f"``{path}`` names no file of the checkout"
    for m in MODULE.finditer(text):
        why = module_problem(m.group(1))
        if why is not None:
            yield m.start(), f"``{m.group(1)}``: {why}"
    for m in DOC_PATH.finditer(text):
        if not (ROOT / m.group(1)).is_file():
            yield m.start(), f"``{m.group(1)}`` names no doc of the checkout"


def module_texts(path: Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of each docstring and each comment of a module."""
    source = path.read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    yield first.lineno, first.value.value
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


def dangling_in_code() -> list[str]:
    """``path:line: what`` for every reference of a docstring or comment under zkv/ that names nothing."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        for line, text in module_texts(path):
            for offset, why in dangling(text, near=path):
                found.append(f"{path.relative_to(ROOT)}:{line + text.count(chr(10), 0, offset)}: {why}")
    return found


def dangling_in_docs() -> list[str]:
    """``doc:line: what`` for every reference of README.md and docs/*.md that names nothing."""
    found = []
    for path in doc_files():
        text = path.read_text(encoding="utf-8")
        for offset, why in dangling(text):
            found.append(f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, offset) + 1}: {why}")
    return found
