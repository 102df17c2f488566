"""The one error base of zkv: every error a peer, the bus or a cache reports
carries a ``code`` (a wire error code, or the name of the refusal) and a
``reason`` (what happened and what to do).

``ZkvError(code, reason)`` is raised by the client for an error reply (or no
reply), and is the base of :class:`~zkv.wire.protocol.ProtocolError`, the
rank cache's ``CacheError``, the copy engine's ``TaskInvalid`` and the prefix
cache's errors.  Catch ``ZkvError`` to catch any of them.
"""

from __future__ import annotations

import re


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
