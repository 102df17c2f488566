"""Deprecated: zkv 0.2 keeps what timed-out tasks may still write in the one book of
tier rows (``zkv.rows.book.RowBook``: rows held for a task until it settles).  This
class stays, unchanged, until zkv 0.3, for code that held entries of its own in it.

What timed-out tasks may still write, held by task id until the bus says
the task settled (every rank has reported since) or a drain or clear makes it
moot.  Sans-IO: it only keeps the books."""

from __future__ import annotations

import warnings
from collections.abc import Callable, ItemsView, Iterable, ValuesView
from typing import Generic, TypeVar

T = TypeVar("T")


class Quarantine(Generic[T]):
    """Held entries by task id; ``settle`` and ``release_all`` hand them back to be freed."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[int, T] = {}

    def hold(self, task: int, entry: T) -> None:
        self._held[task] = entry

    def settle(self, tasks: Iterable[int]) -> list[T]:
        """The entries of those ``tasks`` held here (others are ignored), no longer held."""
        out = []
        for task in tasks:
            entry = self._held.pop(task, None)
            if entry is not None:
                out.append(entry)
        return out

    def release_all(self) -> list[T]:
        """Every entry (no task runs any more: a drained or cleared bus), no longer held."""
        out = list(self._held.values())
        self._held.clear()
        return out

    def forget_where(self, pred: Callable[[T], bool]) -> int:
        """Stop holding the entries ``pred`` picks (their memory went with a generation); returns how many."""
        gone = [task for task, entry in self._held.items() if pred(entry)]
        for task in gone:
            del self._held[task]
        return len(gone)

    def __len__(self) -> int:
        return len(self._held)

    def items(self) -> ItemsView[int, T]:
        return self._held.items()

    def values(self) -> ValuesView[T]:
        return self._held.values()


warnings.warn(
    "zkv.prefix.quarantine is deprecated since zkv 0.2 (the rows timed-out tasks may still write are held in "
    "zkv.rows.book.RowBook); it stops working in zkv 0.3",
    DeprecationWarning,
    stacklevel=2,
)
