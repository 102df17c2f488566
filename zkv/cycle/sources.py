"""Where an engine's new (or old) weights come from, for a cycle's update and
rollback steps: a checkpoint directory vLLM reloads (``ReloadWeights``, the
one that can be staged: checked before anything pauses), or the caller's own
function (``Update``: staged by nobody, its failures its own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import checkpoint
from .engine import Staged, StepFailed
from .terms import Reach


@dataclass(frozen=True)
class ReloadWeights:
    """vLLM's ``reload_weights`` from a checkpoint directory on the engine's host.

    Staged: the directory is read where this process runs (the trainer's host shares
    it with the engines', or is theirs): every file complete, the tensors' names,
    shapes and dtypes the model's own, its digest known; a path this process cannot
    read fails the stage (``stage=False`` in the plan skips it)."""

    path: str

    def apply(self, engine: Any, timeout: float) -> None:
        engine.reload_weights(self.path, timeout)

    def stage(self, engine: Any, timeout: float) -> Staged:
        model = engine.model_path(timeout)
        try:
            found = checkpoint.check(self.path, model)
        except (checkpoint.CheckpointError, OSError) as err:
            raise StepFailed(str(err), Reach.ANSWERED, sent=False) from None
        return Staged(found.digest, len(found.tensors))

    def __call__(self, server: Any, timeout: float) -> None:
        """The update of zkv 0.2's ``ServerFleet.cycle``: called with the server."""
        server.reload_weights(self.path, timeout=timeout)

    def __str__(self) -> str:
        return f"reload_weights {self.path}"


@dataclass(frozen=True)
class Update:
    """The caller's own update: ``fn(engine, timeout)``, where ``engine`` is the driver
    (``ServerEngine.server``, ``LlmEngine.llm``, the prefix manager's bus...)."""

    fn: Callable[[Any, float], None]

    def apply(self, engine: Any, timeout: float) -> None:
        self.fn(engine, timeout)

    def stage(self, engine: Any, timeout: float) -> None:
        return None


def of(update: Any, unwrap: Callable[[Any], Any] = lambda e: e) -> Any:
    """A weight source from what a caller passed: a source as it is, or a plain function
    called with ``unwrap(engine)`` and the timeout."""
    if hasattr(update, "apply") and hasattr(update, "stage"):
        return update
    return Update(lambda engine, timeout: update(unwrap(engine), timeout))
