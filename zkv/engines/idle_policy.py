"""Which parked conversations to swap out to CPU, and when (sans-IO).

An idle-conversation policy, not zkv's prefix manager: transformers owns its
block ids, its allocator and its own prefix cache, so a second radix tree and
GPU allocator in zkv would disagree with it.  What the engine lacks is the
conversation level: a parked conversation (between two turns of a chat)
holds blocks transformers cannot reclaim (docs/engine-transformers.md,
pitfall 11).  So the unit of a swap is one conversation's block table.

Two triggers, both "early" (before the engine runs out and stops):

- **idle**: a conversation untouched for ``idle_after`` ticks (the caller's
  clock: turns served) goes to CPU whatever the pool holds;
- **watermark**: while the engine's free blocks are under ``min_free``, the
  least recently used parked conversations go, oldest first.

The policy only decides; the controller moves the bytes and tells it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IdlePolicy:
    """LRU over resident parked conversations; ``victims`` says which to swap out now."""

    min_free: int = 0  # keep at least this many engine blocks free
    idle_after: int | None = None  # ticks untouched before a conversation is swapped out anyway
    _last_used: dict[str, int] = field(default_factory=dict)  # resident parked conversations only

    def __post_init__(self) -> None:
        if type(self.min_free) is not int or self.min_free < 0:
            raise ValueError(f"min_free must be an int >= 0, got {self.min_free!r}")
        if self.idle_after is not None and (type(self.idle_after) is not int or self.idle_after < 0):
            raise ValueError(f"idle_after must be None or an int >= 0, got {self.idle_after!r}")

    def parked(self, conversation: str, tick: int) -> None:
        """The conversation finished a turn and holds resident blocks."""
        self._last_used.pop(conversation, None)
        self._last_used[conversation] = tick  # re-inserted: dict order is LRU order

    def gone(self, conversation: str) -> None:
        """Its blocks left the engine (swapped out, continued, forgotten, cleared)."""
        self._last_used.pop(conversation, None)

    def reset(self) -> None:
        self._last_used.clear()

    @property
    def resident(self) -> list[str]:
        return list(self._last_used)

    def victims(self, tick: int, free_blocks: int, blocks_of: dict[str, int]) -> list[str]:
        """Conversations to swap out, oldest first: the idle ones, then LRU ones until ``min_free`` holds.

        ``blocks_of`` maps a resident parked conversation to the blocks its release frees."""
        chosen: list[str] = []
        for conv, used in self._last_used.items():
            if conv not in blocks_of:
                continue
            if self.idle_after is not None and tick - used >= self.idle_after:
                chosen.append(conv)
                free_blocks += blocks_of[conv]
        for conv in self._last_used:
            if free_blocks >= self.min_free:
                break
            if conv in blocks_of and conv not in chosen:
                chosen.append(conv)
                free_blocks += blocks_of[conv]
        return chosen
