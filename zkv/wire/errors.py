"""The one error base of zkv: every error a peer, the bus or a cache reports
carries a ``code`` (a wire error code, or the name of the refusal) and a
``reason`` (what happened and what to do).

``ZkvError(code, reason)`` is raised by the client for an error reply (or no
reply), and is the base of :class:`ProtocolError` (a message that breaks the
protocol, here so that every wire module can raise it), the
rank cache's ``CacheError``, the copy engine's ``TaskInvalid`` and the prefix
cache's errors.  Catch ``ZkvError`` to catch any of them.
"""

from __future__ import annotations

import re
from typing import Any

from .bounds import MAX_ECHO


class ZkvError(Exception):
    """An error with a ``code`` and a ``reason``; ``str()`` is ``"code: reason"``."""

    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class ReasonError(ZkvError):
    """A ``ZkvError`` raised with its reason alone: the class names the code
    (``CODE``, by default the class name in snake case), and ``str()`` is the
    reason, as it was before these errors shared a base."""

    CODE = "error"

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "CODE" not in cls.__dict__:
            cls.CODE = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower()

    def __init__(self, reason: str = ""):
        Exception.__init__(self, reason)
        self.code = self.CODE
        self.reason = reason


class ProtocolError(ZkvError):
    """A message that breaks the protocol; ``code`` is the wire error code."""


class LayoutError(ProtocolError):
    """A message whose ``layout`` breaks the protocol (``bad_field``); ``kind`` names the
    message: a ``ready`` with one is refused (docs/protocol.md §4.8, §10.1)."""

    def __init__(self, reason: str, kind: str):
        super().__init__("bad_field", reason)
        self.kind = kind


def shown(value: Any) -> str:
    """A peer's value as an error reason quotes it: its repr, cut to
    MAX_ECHO characters with an ellipsis, so that no reply grows with what a
    peer sent (docs/protocol.md §9); a map or list only by its size (a repr
    of a deep one would recurse)."""
    if isinstance(value, dict):
        return f"a map of {len(value)} entries"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} entries"
    text = repr(value[: MAX_ECHO + 1] if isinstance(value, (str, bytes, bytearray)) else value)
    return text if len(text) <= MAX_ECHO else text[: MAX_ECHO - 1] + "\u2026"
