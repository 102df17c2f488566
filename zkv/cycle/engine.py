"""The one engine protocol a cycle runs over (docs/engine-vllm.md, "The RL
cycle"): what a driver does for one engine and its bus, each call bounded by
the ``timeout`` it is given.  Drivers: a vLLM server over HTTP
(``vllm_http.py``), a vLLM ``LLM`` in this process (``vllm_inproc.py``),
a prefix cache manager and its bus (``prefix.py``).

A call that fails raises ``StepFailed`` saying how the engine was left: it
answered with an error, nothing listens (down), it did not answer in time
(hung), or its bus did not answer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .terms import PauseMode, Reach, Tiers


class StepFailed(Exception):
    """One call on one engine failed; ``reach``: how that left the engine; ``sent=False``:
    the call never reached it (nothing listened), so there is nothing to undo."""

    def __init__(self, why: str, reach: Reach = Reach.ANSWERED, sent: bool = True):
        super().__init__(why)
        self.why, self.reach, self.sent = why, reach, sent


@dataclass(frozen=True)
class Look:
    """What an engine answers now: ``paused`` (or asleep) and its ``label``."""

    paused: bool
    label: str | None


@dataclass(frozen=True)
class Staged:
    """A checkpoint checked where an engine will load it: its ``digest`` (what the
    weights are, measured from the files) and how many tensors it holds."""

    digest: str
    tensors: int
    note: str = ""


class WeightSource(Protocol):
    """The weights an engine gets: ``apply`` loads them (bounded by ``timeout``);
    ``stage`` checks them without touching what the engine serves, or returns None
    when it cannot be checked before (a custom update)."""

    def apply(self, engine: Any, timeout: float) -> None: ...

    def stage(self, engine: Any, timeout: float) -> Staged | None: ...


class Engine(Protocol):
    """One engine and its bus, as a cycle drives them."""

    name: str
    #: Whether the bus is cleared (keeping its CPU tier) before the update: zkv owns memory
    #: the update needs (a prefix manager's caches).  An engine that owns its KV memory
    #: (vLLM) is only paused, and cleared once the cycle commits.
    clears_before_update: bool

    def look(self, sleep: bool, timeout: float) -> Look: ...

    def model_path(self, timeout: float) -> str | None:
        """Where the weights it serves were loaded from at its start (None: not known)."""
        ...

    def reload_weights(self, path: str, timeout: float) -> None: ...

    def set_label(self, label: str, timeout: float) -> None: ...

    def stop(self, mode: PauseMode, sleep: bool, timeout: float) -> None: ...

    def start(self, sleep: bool, timeout: float) -> None: ...

    def pause_bus(self, timeout: float) -> None: ...

    def clear_bus(self, keep_cpu: bool, timeout: float, weights: str | None = None) -> Tiers:
        """What the clear did to the tiers (a prefix manager forgets every block at any clear).
        ``weights``: the name of the weights served after a clear without ``keep_cpu`` (the
        cycle's label), so that the engines of one cycle name their new KV alike."""
        ...

    def resume_bus(self, timeout: float) -> None: ...

    def weights(self, timeout: float) -> str:
        """The weights as the engine measures them (a digest of vLLM's checksums)."""
        ...

    def reset(self, running: bool, external: bool, timeout: float) -> bool:
        """The prefix cache reset (``external``: zkv's keys too, unless its bus kept them);
        False while blocks are held (the caller may retry)."""
        ...

    def close(self) -> None: ...
