"""One weight update over several vLLM engines, each offloading through its
own zkv bus: the sequence an RL trainer runs between steps
(docs/engine-vllm.md, "The RL cycle").

1. every engine stops scheduling (``sleep(level=0, mode="wait")``: the
   requests in flight finish first);
2. ``fleet.pause()``: every bus acks only when no copy is in flight in any
   worker of any engine (all or nothing: a failed pause resumes the buses it
   paused);
3. ``fleet.clear(keep_cpu=not weights_changed)``: a changed model moves every
   bus's CPU generation, so no block computed under the old weights is served
   again from any tier;
4. ``update(llm)`` for each engine (say ``llm.collective_rpc("reload_weights",
   kwargs={"weights_path": ...})``);
5. ``fleet.resume()``;
6. every engine: ``reset_prefix_cache(reset_connector=True)`` (zkv's manager
   forgets its keys unless the bus kept its CPU tier) and
   ``wake_up(["scheduling"])``.

Whatever fails, every engine is woken before the error is raised: an engine
whose bus is not running serves by recompute (lookups miss, stores are
skipped), so a failed update never hangs serving.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ...fleet.fleet import Fleet


def update_weights(
    engines: Sequence[Any],
    fleet: Fleet,
    update: Callable[[Any], None],
    *,
    weights_changed: bool = True,
) -> None:
    """Run the cycle above on ``engines`` (vLLM ``LLM`` s) and their buses in
    ``fleet``.  Raises ``FleetError`` (naming each bus and what became of it)
    or the update's own error, after waking every engine."""
    for llm in engines:
        llm.sleep(level=0, mode="wait")
    try:
        fleet.pause()
        fleet.clear(keep_cpu=not weights_changed)
        for llm in engines:
            update(llm)
        fleet.resume()
    finally:
        for llm in engines:
            # After a failed cycle whose weights changed, the tiers must not
            # be kept even if a bus still holds them: a reset with the bus not
            # cleared forgets every key (manager.py).
            llm.reset_prefix_cache(reset_connector=True)
            llm.wake_up(["scheduling"])
