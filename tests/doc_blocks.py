"""The fenced blocks of README.md and docs/*.md, and the markers that say how a
test runs them (tests/test_docs_exec.py), so that a documented command and the
behaviour cannot drift apart.

A block whose info string is ``sh``, ``bash``, ``shell`` or ``console`` is a
list of commands a user is told to run (in ``console``, the lines after a
``$ `` prompt).  Markers are HTML comments, invisible once rendered, on the
lines right above the fence, one directive each::

    <!-- zkv-doc: skip REASON -->          never run (its command lines are still parse-checked)
    <!-- zkv-doc: long REASON -->          run only with ZKV_DOCS_LONG=1 (parse-checked otherwise)
    <!-- zkv-doc: file PATH -->            the block is the content of the file PATH, not commands
    <!-- zkv-doc: expect "TEXT" -->        some output line of the block contains TEXT
    <!-- zkv-doc: given FILE "SHELL" -->   before a command that names FILE runs, SHELL makes it
    <!-- zkv-doc: background "SHELL" until "TEXT" -->  SHELL runs while the block does (started
                                           first, Ctrl-C'd at the end); commands wait for TEXT
    <!-- zkv-doc: sub "OLD" "NEW" -->      OLD is replaced by NEW before running ({port}: a free
                                           port, {port2}: another, {runtime}: the block's ZKV_RUNTIME_DIR,
                                           {root}: the checkout)
    <!-- zkv-doc: line "PREFIX" RULE -->   for the command lines starting with PREFIX (the longest
                                           matching PREFIX wins), RULE is one of: skip REASON,
                                           long REASON, expect "TEXT", serve "TEXT" (runs in the
                                           background once TEXT is printed, Ctrl-C'd at the end),
                                           interrupt "TEXT" (Ctrl-C'd once TEXT is printed)

Arguments are split like a shell line (quote anything with spaces).  Without
markers a shell block is run as it stands.  Whatever the markers say,
``pip install`` is never run (the test runs in the environment it installs)
and a line with an elision (``…`` or ``...`` as a word) is only parse-checked.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*zkv-doc:(.*?)-->\s*$")
ELISIONS = {"…", "..."}
LINE_RULES = {"skip", "long", "expect", "serve", "interrupt"}


class DocError(ValueError):
    """A marker that cannot be understood: a test fails rather than skip a check."""


@dataclass(frozen=True)
class Marker:
    name: str
    args: tuple[str, ...]
    line: int  # 1-based, in the doc


@dataclass(frozen=True)
class Command:
    """One command line of a block (``\\`` continuations joined)."""

    text: str  # as written, its trailing comment included
    line: int  # 1-based, in the doc

    @property
    def command(self) -> str:
        return " ".join(strip_comment(self.text).split())

    @property
    def elided(self) -> bool:
        return any(word in ELISIONS for cmd in simple_commands(self.text) for word in cmd)


@dataclass
class Block:
    doc: str  # relative to the repository root
    line: int  # the opening fence, 1-based
    lang: str
    body: list[str]
    markers: list[Marker] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    def named(self, name: str) -> list[Marker]:
        return [m for m in self.markers if m.name == name]

    def reason(self, name: str) -> str | None:
        """The reason of a ``skip`` / ``long`` marker, or None without one."""
        found = self.named(name)
        return " ".join(found[0].args) or name if found else None

    @property
    def file(self) -> str | None:
        found = self.named("file")
        return found[0].args[0] if found else None

    @property
    def is_shell(self) -> bool:
        return self.lang in SHELL_LANGS and self.file is None

    @property
    def text(self) -> str:
        return "\n".join(self.body) + "\n"

    def commands(self) -> list[Command]:
        out: list[Command] = []
        pending, start = "", 0
        for i, raw in enumerate(self.body):
            number = self.line + 1 + i
            if self.lang == "console":
                if pending:
                    raw = raw.strip()
                elif raw.startswith("$ "):
                    raw, start = raw[2:], number
                else:
                    continue  # output shown under a prompt
            elif not pending:
                start = number
            line = pending + raw
            if line.rstrip().endswith("\\"):
                pending = line.rstrip()[:-1] + " "
                continue
            pending = ""
            if strip_comment(line).strip():
                out.append(Command(line.strip(), start))
        return out

    def rules(self, command: Command) -> list[tuple[str, tuple[str, ...]]]:
        """The ``line`` rules of the longest PREFIX that matches ``command``."""
        best: list[tuple[str, tuple[str, ...]]] = []
        best_len = -1
        for m in self.named("line"):
            prefix = " ".join(m.args[0].split())
            text = command.command
            if text == prefix or text.startswith(prefix + " "):
                if len(prefix) > best_len:
                    best, best_len = [], len(prefix)
                if len(prefix) == best_len:
                    best.append((m.args[1], m.args[2:]))
        return best


def strip_comment(line: str) -> str:
    """``line`` without a shell comment (a ``#`` starting a word, outside quotes)."""
    quote = ""
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line


def split_and(line: str) -> list[str]:
    """The parts of ``line`` joined by ``&&`` (outside quotes), as written."""
    parts, quote, start, i = [], "", 0, 0
    while i < len(line):
        ch = line[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif line.startswith("&&", i):
            parts.append(line[start:i].strip())
            start, i = i + 2, i + 1
        i += 1
    parts.append(line[start:].strip())
    return [p for p in parts if p]


def simple_commands(line: str) -> list[list[str]]:
    """The words of each simple command of ``line`` (split at ``&&``, ``||``,
    ``;``, ``|``), redirections and their targets left out."""
    lexer = shlex.shlex(strip_comment(line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        words = list(lexer)
    except ValueError as err:
        raise DocError(f"cannot split {line!r}: {err}") from None
    out: list[list[str]] = [[]]
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
        elif word in {"&&", "||", ";", "|", "&"}:
            out.append([])
        elif word in {"<", ">", ">>", ">&", "2>"}:
            skip_next = True
        else:
            out[-1].append(word)
    return [c for c in out if c]


def _marker(text: str, line: int, where: str) -> Marker:
    try:
        words = shlex.split(text)
    except ValueError as err:
        raise DocError(f"{where}: bad marker {text!r}: {err}") from None
    if not words:
        raise DocError(f"{where}: empty zkv-doc marker")
    name, args = words[0], tuple(words[1:])
    arity = {"skip": (1, None), "long": (0, None), "file": (1, 1), "expect": (1, 1), "given": (2, 2)}
    arity.update({"background": (3, 3), "sub": (2, 2), "line": (2, None)})
    if name not in arity:
        raise DocError(f"{where}: unknown zkv-doc marker {name!r} (known: {', '.join(sorted(arity))})")
    low, high = arity[name]
    if len(args) < low or (high is not None and len(args) > high):
        raise DocError(f"{where}: zkv-doc {name} takes {low}..{high or 'any'} arguments, got {list(args)}")
    if name == "background" and args[1] != "until":
        raise DocError(f'{where}: write background "SHELL" until "TEXT"')
    if name == "line":
        rule = args[1]
        if rule not in LINE_RULES:
            raise DocError(f"{where}: unknown line rule {rule!r} (known: {', '.join(sorted(LINE_RULES))})")
        if rule in {"expect", "serve", "interrupt"} and len(args) != 3:
            raise DocError(f'{where}: write line "PREFIX" {rule} "TEXT"')
        if rule == "skip" and len(args) < 3:
            raise DocError(f'{where}: write line "PREFIX" skip REASON')
    return Marker(name, args, line)


def parse(text: str, doc: str) -> list[Block]:
    """Every fenced block of one Markdown file, with the markers above it."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: list[Marker] = []
    i = 0
    while i < len(lines):
        found = MARKER.match(lines[i])
        if found:
            pending.append(_marker(found.group(1).strip(), i + 1, f"{doc}:{i + 1}"))
            i += 1
            continue
        fence = FENCE.match(lines[i])
        if fence is None:
            if pending:
                raise DocError(f"{doc}:{pending[-1].line}: a zkv-doc marker must sit right above a fenced block")
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence.group(1)):
            end += 1
        block = Block(doc, i + 1, fence.group(2).lower(), lines[i + 1 : end], pending)
        _check_rules(block)
        blocks.append(block)
        pending = []
        i = end + 1
    if pending:
        raise DocError(f"{doc}:{pending[-1].line}: a zkv-doc marker must sit right above a fenced block")
    return blocks


def _check_rules(block: Block) -> None:
    """A ``line`` rule that matches no command is a typo or a drift: refuse it."""
    commands = [c.command for c in block.commands()] if block.is_shell else []
    for m in block.named("line"):
        prefix = " ".join(m.args[0].split())
        if not any(c == prefix or c.startswith(prefix + " ") for c in commands):
            raise DocError(f"{block.doc}:{m.line}: line rule {prefix!r} matches no command of the block below it")


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def all_blocks(root: Path = ROOT) -> list[Block]:
    return [b for path in doc_files(root) for b in parse(path.read_text(encoding="utf-8"), str(path.relative_to(root)))]


def shell_blocks(root: Path = ROOT) -> list[Block]:
    return [b for b in all_blocks(root) if b.is_shell]


def file_block(path: str, root: Path = ROOT) -> Block:
    """The block a doc marks as the content of ``path`` (exactly one)."""
    found = [b for b in all_blocks(root) if b.file == path]
    if len(found) != 1:
        raise DocError(f"{len(found)} blocks are marked as file {path} (want exactly one)")
    return found[0]
