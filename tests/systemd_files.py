"""systemd's reading of the files docs/deploy.md gives: ``EnvironmentFile=``
(systemd.exec(5), "EnvironmentFile=") and unit files (systemd.syntax(7)), so a
test sees the values a service really gets, not what a shell would make of
the same text.

The rules that matter here: a comment is a line whose first non-blank
character is ``#`` or ``;``; everything after the ``=`` is the value,
a ``# …`` on the same line included; surrounding whitespace is dropped;
a value may be single- or double-quoted (and span lines inside the quotes);
an unquoted value keeps a quote after its first character as it stands;
a backslash continues a line or keeps the character after it.
"""

from __future__ import annotations

import re

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
BLANK = " \t\r"


class EnvFileError(ValueError):
    pass


def parse_env_file(text: str) -> dict[str, str]:
    """The variables a service gets from an ``EnvironmentFile=`` with this text."""
    env: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i] in BLANK + "\n":
            i += 1
        if i >= n:
            break
        if text[i] in "#;":  # a comment line
            i = _line_end(text, i)
            continue
        start = i
        while i < n and text[i] not in "=\n":
            i += 1
        key = text[start:i].strip(BLANK)
        if i >= n or text[i] == "\n":
            continue  # a line without "=": ignored, as systemd does
        i += 1  # the "="
        value, i = _value(text, i)
        if not NAME.match(key):
            raise EnvFileError(f"invalid variable name {key!r}")
        env[key] = value
    return env


def _line_end(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end + 1


def _value(text: str, i: int) -> tuple[str, int]:
    n = len(text)
    while i < n and text[i] in BLANK:
        i += 1
    out: list[str] = []
    if i < n and text[i] in "'\"":
        quote = text[i]
        i += 1
        while i < n and text[i] != quote:
            if quote == '"' and text[i] == "\\" and i + 1 < n:
                nxt = text[i + 1]
                if nxt == "\n":
                    i += 2
                    continue
                if nxt in '"\\`$':
                    out.append(nxt)
                    i += 2
                    continue
                out.append(text[i : i + 2])  # any other escape stays as written
                i += 2
                continue
            out.append(text[i])
            i += 1
        if i >= n:
            raise EnvFileError(f"unterminated {quote} quote")
        i += 1
    tail: list[str] = []  # unquoted text: trailing blanks are dropped
    while i < n and text[i] != "\n":
        if text[i] == "\\" and i + 1 < n:
            if text[i + 1] == "\n":
                i += 2
                continue
            tail.append(text[i + 1])
            i += 2
            continue
        tail.append(text[i])
        i += 1
    return "".join(out) + "".join(tail).rstrip(BLANK), i + 1


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections, each its (key, value) settings in order (a key
    may repeat, as ``Environment=`` does)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        if current is None or "=" not in line:
            raise EnvFileError(f"not a setting of a section: {line!r}")
        key, value = line.split("=", 1)
        current.append((key.strip(), value.strip()))
    return sections


def setting(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def unit_environment(unit: dict[str, list[tuple[str, str]]], instance: str = "") -> dict[str, str]:
    """``Environment=`` assignments (``%i`` filled in); ``EnvironmentFile=`` values override them."""
    env: dict[str, str] = {}
    for value in setting(unit, "Service", "Environment"):
        for word in value.split():
            key, _, val = word.partition("=")
            env[key] = val.replace("%i", instance)
    return env
