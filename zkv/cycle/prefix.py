"""The cycle's driver for a prefix cache manager and its bus client
(docs/architecture.md, "The clear / update cycle"), and the three steps a
trainer may also call one by one, in this order::

    info = drain_and_clear(client, manager)   # pause -> manager.on_bus_drained()
                                              # -> clear -> manager.set_cleared()
    update_weights()                          # elsewhere; the manager answers "no hit"
    resume(client, manager, layout)           # resume -> status layout -> manager.resume()

or in one call, ``pause_clear_resume(client, manager, layout, update=update_weights)``;
or as the one cycle, with its deadline, rollback and report::

    with EngineFleet([PrefixEngine("engine-0", client, manager)]) as fleet:
        report = fleet.cycle("step-42", lambda engine, timeout: update_weights())

Call these from the thread that drives the manager (it is single-threaded),
with no swap of the manager outstanding, which holds between its calls (a
cycle runs each engine's steps on a thread of its own while the caller waits).

Errors from the bus (``ZkvError``, or anything else the client raises)
propagate from the three steps, and the manager is consistent whichever step
failed:

* ``pause`` failed: nothing changed (the broker undoes a half-done pause).
* ``clear`` failed: the broker counts the caches as cleared (the generation
  moved on; ranks may or may not have freed them yet), so the manager is set
  cleared too: it answers "no hit" and refuses allocations.  Retrying
  ``drain_and_clear`` is safe (pause and clear of a cleared bus are no-ops).
* ``resume`` (or the status after it) failed: the manager stays cleared until
  a retried ``resume()`` succeeds (resuming a running bus is a no-op).

Cached KV is never kept across a clear, even with ``keep_cpu=True`` (which
only spares the ranks reallocating their CPU tensors): the weights change in
between, so what the blocks hold is stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..wire.errors import ZkvError
from .engine import Look, StepFailed
from .terms import PauseMode, Reach, Tiers


class ControlBus(Protocol):
    """What the cycle asks of a prefix manager's bus (``zkv.Client`` has it)."""

    def pause(self, timeout: float = ...) -> Any: ...

    def clear(self, keep_cpu: bool = ..., timeout: float = ..., weights: str | None = ...) -> Any: ...

    def resume(self, layout: dict | None = ..., timeout: float = ...) -> Any: ...

    def status(self, timeout: float | None = ...) -> Any: ...


class Manager(Protocol):
    """What the cycle asks of a prefix cache manager (``PrefixCacheManager`` has it)."""

    @property
    def cleared(self) -> bool: ...

    def on_bus_drained(self) -> int: ...

    def set_cleared(self) -> None: ...

    def resume(self, gpu_blocks: int, cpu_blocks: int, *, block_size: int | None = ...) -> None: ...


def drain_and_clear(
    client: ControlBus, manager: Manager, *, keep_cpu: bool = False, timeout: float = 30.0
) -> dict[str, Any]:
    """Pause every rank, free the manager's quarantine, clear the caches, reset the manager.

    Returns ``{"pause": reply, "clear": reply, "quarantine_freed": blocks}``.
    """
    paused, freed = _pause(client, manager, timeout)
    return {"pause": paused, "clear": _clear(client, manager, keep_cpu, timeout), "quarantine_freed": freed}


def _pause(client: ControlBus, manager: Manager, timeout: float) -> tuple[Any, int]:
    paused = client.pause(timeout=timeout)
    # Every rank finished what it received; what the broker still queues is
    # cancelled by the clear (or, if the clear fails, set_cleared forgets
    # those blocks with the rest).
    return paused, manager.on_bus_drained()


def _clear(client: ControlBus, manager: Manager, keep_cpu: bool, timeout: float, weights: str | None = None) -> Any:
    try:
        if weights is not None and not keep_cpu:
            return client.clear(keep_cpu=False, timeout=timeout, weights=weights)
        return client.clear(keep_cpu=keep_cpu, timeout=timeout)
    finally:
        manager.set_cleared()


def resume(
    client: ControlBus, manager: Manager, layout: dict | None = None, *, timeout: float = 30.0
) -> dict[str, Any]:
    """Resume the bus (optionally with a new layout) and serve again on its layout.

    ``layout`` holds only the fields that change (e.g. ``{"gpu_blocks": 512}``);
    the manager takes the block counts and block size from the broker's status,
    so it matches what the ranks allocated.  Returns ``{"resume": reply,
    "layout": the CacheLayout now in force}``.  If the manager was not cleared (a
    plain pause, no layout change) its cache is still valid and is kept.
    """
    reply = client.resume(layout, timeout=timeout)
    current = client.status(timeout=timeout).layout
    if manager.cleared or layout:
        if current is None:
            raise RuntimeError("the broker reports no cache layout after resume")
        manager.resume(current.gpu_blocks, current.cpu_blocks, block_size=current.block_size)
    return {"resume": reply, "layout": current}


def pause_clear_resume(
    client: ControlBus,
    manager: Manager,
    layout: dict | None = None,
    *,
    keep_cpu: bool = False,
    update: Callable[[], Any] | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """The three steps: ``drain_and_clear``, then ``update()`` (new weights), then ``resume``.

    If ``update`` raises, the bus and the manager stay cleared (consistent) and
    the error propagates; call ``resume`` when ready.  (The one cycle,
    ``EngineFleet([PrefixEngine(...)]).cycle``, rolls back instead.)
    """
    info = drain_and_clear(client, manager, keep_cpu=keep_cpu, timeout=timeout)
    if update is not None:
        update()
    info.update(resume(client, manager, layout, timeout=timeout))
    return info


def _bus_failed(err: Exception) -> StepFailed:
    if isinstance(err, ZkvError):
        return StepFailed(f"bus: {err.code}: {err.reason}", Reach.BUS, sent=err.code != "unreachable")
    return StepFailed(f"bus: {type(err).__name__}: {err}", Reach.BUS)


class PrefixEngine:
    """A prefix cache manager and its bus client, as one engine of a cycle: zkv owns the
    caches, so its bus is cleared before the update (freeing them) and the manager
    forgets every block; it has no weights of its own (the update is the caller's)."""

    clears_before_update = True

    def __init__(self, name: str, client: ControlBus, manager: Manager, layout: dict | None = None):
        self.name, self.client, self.manager, self.layout = name, client, manager, layout
        self.label: str | None = None  # the cycle's record: this process is where the manager lives
        self.freed = 0  # the quarantine the last pause freed

    def look(self, sleep: bool, timeout: float) -> Look:
        return Look(bool(self.manager.cleared), self.label)

    def model_path(self, timeout: float) -> str | None:
        return None

    def set_label(self, label: str, timeout: float) -> None:
        self.label = label

    def stop(self, mode: PauseMode, sleep: bool, timeout: float) -> None:
        return None  # the manager serves only the thread that waits for this cycle

    def start(self, sleep: bool, timeout: float) -> None:
        return None

    def reload_weights(self, path: str, timeout: float) -> None:
        raise StepFailed("a prefix cache manager loads no weights: give the cycle an update of your own")

    def weights(self, timeout: float) -> str:
        return ""  # no weights here to measure

    def reset(self, running: bool, external: bool, timeout: float) -> bool:
        return True  # a clear already made it forget every block

    def pause_bus(self, timeout: float) -> None:
        try:
            _, self.freed = _pause(self.client, self.manager, timeout)
        except Exception as err:
            raise _bus_failed(err) from None

    def clear_bus(self, keep_cpu: bool, timeout: float, weights: str | None = None) -> Tiers:
        try:
            _clear(self.client, self.manager, keep_cpu, timeout, weights)
        except Exception as err:
            raise _bus_failed(err) from None
        return Tiers.DROPPED  # the manager forgets every block at a clear

    def resume_bus(self, timeout: float) -> None:
        try:
            resume(self.client, self.manager, self.layout, timeout=timeout)
        except Exception as err:
            raise _bus_failed(err) from None

    def close(self) -> None:
        return None
