"""Check a documented command line without running it: a ``zkv`` command names a
real subcommand and only options and choices it has (parsed by the CLI's own
click parser, in this process), ``python -m MOD`` names a module that exists
and options its parser defines, ``bash FILE`` a file of the checkout, and
``pip install`` only extras setup.cfg declares."""

from __future__ import annotations

import configparser
import importlib.util
import re
from functools import lru_cache

import click
from click.testing import CliRunner
from doc_blocks import ROOT, Command, simple_commands

ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _main() -> click.Group:
    from zkv.cli.commands import main

    return main


@lru_cache(maxsize=None)
def _help_works(path: tuple[str, ...]) -> str:
    """The ``--help`` text of ``zkv PATH...`` (raises when it fails)."""
    result = CliRunner().invoke(_main(), [*path, "--help"])
    if result.exit_code != 0:
        raise AssertionError(f"`zkv {' '.join(path)} --help` exited {result.exit_code}: {result.output}")
    return result.output


def check_zkv(args: list[str]) -> None:
    """Raise AssertionError naming what in ``zkv ARGS`` does not exist."""
    cmd: click.Command = _main()
    name, parent, path = "zkv", None, []
    shown = "zkv " + " ".join(args)
    while True:
        ctx = click.Context(cmd, info_name=name, parent=parent)
        try:
            opts, rest, _ = cmd.make_parser(ctx).parse_args(list(args))
        except click.UsageError as err:
            raise AssertionError(f"`{shown}`: {err.format_message()}") from None
        if isinstance(cmd, click.Group):
            if not rest:
                raise AssertionError(f"`{shown}`: no subcommand after `{' '.join(['zkv', *path])}`")
            sub = cmd.get_command(ctx, rest[0])
            if sub is None:
                raise AssertionError(f"`{shown}`: `{' '.join(['zkv', *path])}` has no command {rest[0]!r}")
            cmd, name, parent, args = sub, rest[0], ctx, rest[1:]
            path.append(rest[0])
            continue
        break
    _help_works(tuple(path))
    if rest:
        raise AssertionError(f"`{shown}`: unexpected extra arguments {rest}")
    for param in cmd.params:
        value = opts.get(param.name) if param.name else None
        if isinstance(param, click.Argument) and param.required and not isinstance(value, (str, list, tuple)):
            raise AssertionError(f"`{shown}`: missing argument {param.human_readable_name}")
        if isinstance(param.type, click.Choice) and isinstance(value, str):
            try:
                param.type.convert(value, param, ctx)
            except click.BadParameter as err:
                raise AssertionError(f"`{shown}`: {param.human_readable_name}: {err.format_message()}") from None


def check_python_module(args: list[str]) -> None:
    """``python -m MOD [--opt ...]``: MOD exists and defines every --opt named."""
    if len(args) < 2 or args[0] != "-m":
        return
    module = args[1]
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise AssertionError(f"`python -m {module}`: no such module")
    if module == "pytest" or not module.startswith("zkv"):
        return
    source = open(spec.origin, encoding="utf-8").read()
    for word in args[2:]:
        opt = word.split("=", 1)[0]
        if opt.startswith("--") and f'"{opt}"' not in source:
            raise AssertionError(f"`python -m {module}`: its parser has no option {opt}")


@lru_cache(maxsize=None)
def declared_extras() -> frozenset[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return frozenset(cfg["options.extras_require"])


def check_pip(args: list[str]) -> None:
    for word in args:
        found = re.fullmatch(r"\.\[([\w,-]+)\]", word)
        if found:
            for extra in found.group(1).split(","):
                if extra not in declared_extras():
                    raise AssertionError(f"`pip install {word}`: setup.cfg has no extra {extra!r}")


def check_command(command: Command) -> list[str]:
    """Check every simple command of one documented line; returns what was checked."""
    checked = []
    for words in simple_commands(command.text):
        words = [w for w in words if w not in {"…", "..."}]
        while words and ENV_WORD.match(words[0]):
            words = words[1:]  # VAR=value before the program
        if not words:
            continue
        prog, args = words[0], words[1:]
        if prog == "zkv" or prog.endswith("/zkv"):
            check_zkv(args)
        elif prog in {"python", "python3"}:
            check_python_module(args)
        elif prog in {"bash", "sh"} and args and not args[0].startswith("-"):
            if not (ROOT / args[0]).is_file():
                raise AssertionError(f"`{prog} {args[0]}`: no such file in the checkout")
        elif prog == "pip" and args[:1] == ["install"]:
            check_pip(args[1:])
        else:
            continue
        checked.append(" ".join(words))
    return checked


INLINE = re.compile(r"`(zkv [^`]+)`")


def inline_commands(markdown: str) -> list[str]:
    """The ``zkv ...`` code spans of a Markdown text's prose (fenced blocks left out)."""
    prose = re.sub(r"^(```|~~~).*?^\1", "", markdown, flags=re.S | re.M)
    return [m.group(1) for m in INLINE.finditer(prose.replace("\n", " "))]


def check_inline(span: str) -> None:
    """A ``zkv ...`` the prose names: its subcommands exist (``a/b`` for
    alternatives) and so does every ``--option`` it mentions.  Placeholders
    and missing values are fine in prose."""
    words = span.split()[1:]
    if words and words[0].endswith(":"):
        return  # `zkv broker: restoring …`: a line zkv prints
    commands: list[click.Command] = [_main()]
    while words and not words[0].startswith("-") and all(isinstance(c, click.Group) for c in commands):
        names = words[0].split("/")
        subs = [c.commands.get(n) for c in commands for n in names if isinstance(c, click.Group)]
        if any(s is None for s in subs):
            if words[0].isupper():  # `zkv COMMAND --help`
                return
            raise AssertionError(f"`{span}`: no command {words[0]!r}")
        commands = [s for s in subs if s is not None]
        words = words[1:]
    for cmd in commands:
        opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        for word in words:
            opt = word.strip("[](),.;|").split("=", 1)[0]
            if opt.startswith("--") and opt not in opts:
                raise AssertionError(f"`{span}`: `zkv {cmd.name}` has no option {opt}")
