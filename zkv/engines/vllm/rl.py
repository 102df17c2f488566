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
5. ``fleet.resume()``.  A keep is checked, never taken on the caller's word:
   when the caller says the weights did not change, each engine's weights are
   measured before and after the update (``weights_digest``: vLLM's own
   checksum of every weight on every worker, once per cycle); if any differ,
   the buses go through one more pause, clear (without the keep) and resume,
   so the CPU generation moves and nothing of the old weights is served;
6. every engine: ``reset_prefix_cache(reset_connector=True)`` (zkv's manager
   forgets its keys unless the bus kept its CPU tier) and
   ``wake_up(["scheduling"])``.

Whatever fails, every engine is woken before the error is raised: an engine
whose bus is not running serves by recompute (lookups miss, stores are
skipped), so a failed update never hangs serving.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ...fleet.fleet import Fleet

log = logging.getLogger("zkv.vllm")


@dataclass(frozen=True)
class CycleReport:
    """What one update did to the tiers: ``kept`` whether they survived (the caller
    said the weights did not change, and the measurement agreed); ``weights_changed``
    per engine, as measured (None: not measured, the caller said they changed);
    ``checksum_s`` the time the measurements took."""

    kept: bool
    weights_changed: tuple[bool | None, ...]
    checksum_s: float = 0.0


def weights_digest(llm: Any) -> str:
    """An engine's weights, measured: one digest over vLLM's own checksum of every
    weight on every worker (``compute_weight_checksums``, SHA-256 of each tensor's bytes)."""
    digest = hashlib.blake2b(digest_size=16)
    for checksums in llm.collective_rpc("compute_weight_checksums"):
        for name in sorted(checksums):
            digest.update(f"{name}={checksums[name]};".encode())
    return digest.hexdigest()


def update_weights(
    engines: Sequence[Any],
    fleet: Fleet,
    update: Callable[[Any], None],
    *,
    weights_changed: bool = True,
) -> CycleReport:
    """Run the cycle above on ``engines`` (vLLM ``LLM`` s) and their buses in
    ``fleet``; the report says whether the tiers were kept.  Raises ``FleetError``
    (naming each bus and what became of it) or the update's own error, after
    waking every engine."""
    keep = not weights_changed
    checksum_s = 0.0
    measured: tuple[bool | None, ...] = (None,) * len(engines)
    if keep:
        started = time.perf_counter()
        before = [weights_digest(llm) for llm in engines]
        checksum_s += time.perf_counter() - started
    for llm in engines:
        llm.sleep(level=0, mode="wait")
    try:
        fleet.pause()
        fleet.clear(keep_cpu=keep)
        for llm in engines:
            update(llm)
        if keep:
            started = time.perf_counter()
            measured = tuple(weights_digest(llm) != was for llm, was in zip(engines, before))
            checksum_s += time.perf_counter() - started
            if any(measured):
                keep = False
                log.warning("zkv: the weights changed although the caller said not: the tiers are dropped")
                fleet.resume()  # the buses are cleared; one more cycle moves their CPU generation
                fleet.pause()
                fleet.clear(keep_cpu=False)
        fleet.resume()
    finally:
        for llm in engines:
            # After a failed cycle whose weights changed, the tiers must not
            # be kept even if a bus still holds them: a reset with the bus not
            # cleared forgets every key (manager.py).
            llm.reset_prefix_cache(reset_connector=True)
            llm.wake_up(["scheduling"])
    return CycleReport(kept=keep, weights_changed=measured, checksum_s=checksum_s)
