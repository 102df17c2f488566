"""How many domain words zkv still spells as strings outside ``wire/``.

``python -m zkv.harness.vocab_count [PKGDIR]`` prints, per package under
``zkv/`` (``wire/`` excluded: the words are defined there), how many string
literals are a *domain word*, and how many uses of the vocabulary enums there
are, then the totals; ``--where PACKAGE`` lists that package's literals
(file, line, word).

A domain word is the value of a member of a ``str`` enum defined in
``zkv/wire/vocab.py`` (``ControlOp``, ``Outcome``, ``Op``, ``Tier``,
``Dtype``, and any added there), read from that module's AST, so the set
follows the vocabulary.  A string literal counts when it is an
``ast.Constant`` whose value is exactly such a word, except:

- a docstring (the first statement of a module, class or function);
- a part of an f-string (its text is prose, not a value).

Everything else counts, dict keys included: ``{"gpu": n}`` spells a tier as
much as ``tier == "gpu"`` does.  The count is therefore an upper bound on the
words to replace: a few literals are the same letters meaning something else
(torch's ``"cpu"`` device, a ``"timeout"`` option name, a ``"run"`` of rows).

An enum use is an attribute ``E.M`` whose ``E`` is one of those enum names
and ``M`` one of its members (``Op.SWAP_OUT``, ``Tier.GPU``).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]


def vocabulary(vocab: Path) -> dict[str, dict[str, str]]:
    """The str enums of ``vocab.py``: class name -> {member name: value}."""
    enums: dict[str, dict[str, str]] = {}
    for node in ast.parse(vocab.read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
            continue
        members = {}
        for item in node.body:
            if (
                isinstance(item, ast.Assign)
                and len(item.targets) == 1
                and isinstance(item.targets[0], ast.Name)
                and isinstance(item.value, ast.Constant)
                and isinstance(item.value.value, str)
            ):
                members[item.targets[0].id] = item.value.value
        if members:
            enums[node.name] = members
    return enums


def _skipped(tree: ast.AST) -> set[int]:
    """ids of the constants that do not count: docstrings and f-string parts."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                skip.add(id(body[0].value))
        elif isinstance(node, ast.JoinedStr):
            skip.update(id(part) for part in ast.walk(node) if isinstance(part, ast.Constant))
    return skip


def literals(source: str, enums: dict[str, dict[str, str]]) -> list[tuple[int, str]]:
    """(line, word) of every string domain word in one module's source."""
    words = {value for members in enums.values() for value in members.values()}
    tree = ast.parse(source)
    skip = _skipped(tree)
    return sorted(
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in words and id(node) not in skip
    )


def count_file(source: str, enums: dict[str, dict[str, str]]) -> tuple[int, int]:
    """(string domain words, enum uses) in one module's source."""
    strings = len(literals(source, enums))
    uses = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in enums and node.attr in enums[node.value.id]:
                uses += 1
    return strings, uses


def count(pkg: Path = PKG) -> dict[str, tuple[int, int]]:
    """Per package under ``pkg`` (``wire`` excluded): (string domain words, enum uses)."""
    enums = vocabulary(pkg / "wire" / "vocab.py")
    strings: Counter[str] = Counter()
    uses: Counter[str] = Counter()
    for path in sorted(pkg.rglob("*.py")):
        parts = path.relative_to(pkg).parts
        package = parts[0] if len(parts) > 1 else "(top)"
        if package == "wire":
            continue
        s, u = count_file(path.read_text(encoding="utf-8"), enums)
        strings[package] += s
        uses[package] += u
    return {p: (strings[p], uses[p]) for p in sorted(set(strings) | set(uses))}


def main(argv: list[str] | None = None) -> int:
    """``[PKGDIR]``: the table; ``--where PACKAGE``: every literal of that package, one a line."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--where"]:
        enums = vocabulary(PKG / "wire" / "vocab.py")
        for path in sorted((PKG / args[1]).rglob("*.py")):
            for line, word in literals(path.read_text(encoding="utf-8"), enums):
                print(f"{path.relative_to(PKG.parent)}:{line}: {word}")
        return 0
    counts = count(Path(args[0]) if args else PKG)
    print(f"{'package':<10} {'strings':>8} {'enum uses':>10}")
    for package, (s, u) in counts.items():
        print(f"{package:<10} {s:>8} {u:>10}")
    print(f"{'total':<10} {sum(s for s, _ in counts.values()):>8} {sum(u for _, u in counts.values()):>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
