"""The clear / update cycle (docs/architecture.md) for a prefix cache manager and its bus client.

What an RL trainer does between steps, in this order::

    info = drain_and_clear(client, manager)   # pause -> manager.on_bus_drained()
                                              # -> clear -> manager.set_cleared()
    update_weights()                          # elsewhere; the manager answers "no hit"
    resume(client, manager, layout)           # resume -> status layout -> manager.resume()

or in one call, ``pause_clear_resume(client, manager, layout, update=update_weights)``.

Call these from the thread that drives the manager (it is single-threaded),
with no swap of the manager outstanding, which holds between its calls.

Errors from the bus (``zkv.client.ZkvError``, or anything else the client
raises) propagate, and the manager is consistent whichever step failed:

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
from typing import Any

from .bus import ControlBus
from .manager import PrefixCacheManager


def drain_and_clear(
    client: ControlBus, manager: PrefixCacheManager, *, keep_cpu: bool = False, timeout: float = 30.0
) -> dict[str, Any]:
    """Pause every rank, free the manager's quarantine, clear the caches, reset the manager.

    Returns ``{"pause": reply, "clear": reply, "quarantine_freed": blocks}``.
    """
    paused = client.pause(timeout=timeout)
    # Every rank finished what it received; what the broker still queues is
    # cancelled by the clear below (or, if the clear fails, set_cleared forgets
    # those blocks with the rest).
    freed = manager.on_bus_drained()
    try:
        cleared = client.clear(keep_cpu=keep_cpu, timeout=timeout)
    except BaseException:
        manager.set_cleared()
        raise
    manager.set_cleared()
    return {"pause": paused, "clear": cleared, "quarantine_freed": freed}


def resume(
    client: ControlBus, manager: PrefixCacheManager, layout: dict | None = None, *, timeout: float = 30.0
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
    manager: PrefixCacheManager,
    layout: dict | None = None,
    *,
    keep_cpu: bool = False,
    update: Callable[[], Any] | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """The whole cycle: ``drain_and_clear``, then ``update()`` (new weights), then ``resume``.

    If ``update`` raises, the bus and the manager stay cleared (consistent) and
    the error propagates; call ``resume`` when ready.
    """
    info = drain_and_clear(client, manager, keep_cpu=keep_cpu, timeout=timeout)
    if update is not None:
        update()
    info.update(resume(client, manager, layout, timeout=timeout))
    return info
