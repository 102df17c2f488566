"""Block-id lists as people write them: JSON arrays or range strings like ``"0-3,8"``.

The one range parser (the trace format and ``zkv submit`` use the same syntax).
"""

from __future__ import annotations

from typing import Any, Sequence

from .protocol import MAX_IDS


def encode_ids(ids: Sequence[int]) -> list[int] | str:
    """``[0,1,2,3,8]`` -> ``"0-3,8"`` when runs make it shorter, else the list."""
    n = len(ids)
    if n < 3:
        return list(ids)
    first, last = ids[0], ids[-1]
    if last - first == n - 1 and first >= 0 and list(ids) == list(range(first, last + 1)):
        return f"{first}-{last}"  # the common case: one run
    starts = [0] + [i for i in range(1, n) if ids[i] != ids[i - 1] + 1]
    ends = starts[1:] + [n]
    if max(e - s for s, e in zip(starts, ends)) < 3 or min(ids) < 0:
        return list(ids)  # no run worth a range ("-" would be ambiguous for negatives)
    parts: list[str] = []
    for s, e in zip(starts, ends):
        if e - s >= 3:
            parts.append(f"{ids[s]}-{ids[e - 1]}")
        else:
            parts.extend(str(x) for x in ids[s:e])
    return ",".join(parts)


def decode_ids(value: Any, what: str = "ids") -> list[int]:
    """A JSON array of integers, or a string like ``"0-3,8,10-11"``."""
    if isinstance(value, list):
        for x in value:
            if not isinstance(x, int) or isinstance(x, bool) or not -(2**31) <= x < 2**31:
                raise ValueError(f"{what}: {x!r} is not a block id (an int32)")
        return value
    if isinstance(value, str):
        ids: list[int] = []
        for part in filter(None, (p.strip() for p in value.split(","))):
            try:
                if "-" in part:
                    lo, hi = part.split("-", 1)
                    a, b = int(lo), int(hi)
                    if b < a:
                        raise ValueError
                    ids.extend(range(a, b + 1))
                else:
                    ids.append(int(part))
            except ValueError:
                raise ValueError(f"{what}: {part!r} is not an id or a range like 4-7") from None
        if len(ids) > MAX_IDS:
            raise ValueError(f"{what}: more than {MAX_IDS} ids")
        return ids
    raise ValueError(f'{what} must be a list of ids or a range string like "0-3,8", got {type(value).__name__}')
