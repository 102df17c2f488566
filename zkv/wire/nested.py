"""The quick verdict on a map / list field from a peer (a rank's ``stats``,
on every ack and heartbeat): whether ``protocol.check_nested`` takes it.

Rule: it says True only where ``check_nested`` takes the value, and False
for anything it does not decide cheaply; ``check_nested`` then walks the
value itself and names what is wrong.  ``tests/test_protocol.py`` holds the
two to one verdict on random values."""

from __future__ import annotations

from typing import Any

from .bounds import MAX_NEST_DEPTH, MAX_NEST_ITEMS, MAX_SAFE_INT, MAX_STR

_SCALARS = (float, bool, type(None), bytes)


def nested_ok(value: Any) -> bool:
    """Whether ``check_nested`` would take ``value``, decided without building
    an error: an iterative walk whose loops over a container's integers run in
    C (``map``, ``min``, ``max``).  False also for anything unusual:
    ``check_nested`` then decides, and names what is wrong."""
    stack, total = [(value, 0)], 0
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if t is dict or t is list:
            total += len(v)
            if total > MAX_NEST_ITEMS or (v and depth >= MAX_NEST_DEPTH):
                return False
            if t is dict:
                if set(map(type, v)) - {str} or (v and max(map(len, v)) > MAX_STR):
                    return False
                v = list(v.values())
            ints = [x for x in v if type(x) is int]
            if ints and (min(ints) < -MAX_SAFE_INT or max(ints) > MAX_SAFE_INT):
                return False
            if len(ints) < len(v):
                stack += [(x, depth + 1) for x in v if type(x) is not int]
        elif t is str:
            if len(v) > MAX_STR:
                return False
        elif t is int:
            if not -MAX_SAFE_INT <= v <= MAX_SAFE_INT:
                return False
        elif t not in _SCALARS:
            return False
    return True
