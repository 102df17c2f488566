"""Synthetic traces (``zkv trace gen``): steady, bursty and the RL pause / clear / resume cycle."""

from __future__ import annotations

import random
from typing import Any, Iterator

from ..wire.ids import encode_ids
from ..wire.layout import CacheLayout
from ..wire.vocab import BusState, ControlOp, Op, Outcome
from .format import DEFAULT_CONTROL_CLIENT, header_record

SHAPES = ("steady", "bursty", "rl-cycle")


def _task_fields(rng: random.Random, layout: CacheLayout, i: int, max_blocks: int, written: set[int]) -> dict[str, Any]:
    """Every other task a swap_out, else a swap_in of CPU rows ``written`` (by this
    client's earlier swap_outs, in this CPU generation: a row never written is
    lost, never ``ok``, docs/protocol.md §6.2); a swap_out while none is."""
    k = rng.randint(1, max(1, min(max_blocks, layout.gpu_blocks, layout.cpu_blocks)))
    if i % 2 == 0 or not written:
        gpu = sorted(rng.sample(range(layout.gpu_blocks), k))
        cpu = sorted(rng.sample(range(layout.cpu_blocks), k))
        written.update(cpu)
        return {"op": Op.SWAP_OUT, "src": encode_ids(gpu), "dst": encode_ids(cpu)}
    k = min(k, len(written))
    gpu = sorted(rng.sample(range(layout.gpu_blocks), k))
    cpu = sorted(rng.sample(sorted(written), k))
    return {"op": Op.SWAP_IN, "src": encode_ids(cpu), "dst": encode_ids(gpu)}


def generate(
    shape: str,
    tasks: int = 100,
    seed: int = 0,
    *,
    world: int = 2,
    layout: CacheLayout | None = None,
    rate: float = 200.0,
    clients: int | None = None,
    burst: int = 16,
    gap: float = 0.05,
    every: int = 20,
    held: int = 2,
    max_blocks: int = 8,
) -> Iterator[dict[str, Any]]:
    """Records of a synthetic trace (header first), with the outcome each task should get.

    - ``steady``: tasks at ``rate`` per second, round-robin over ``clients`` (1).
    - ``bursty``: bursts of ``burst`` tasks at one instant, ``gap`` s apart, over ``clients`` (2).
    - ``rl-cycle``: tasks at ``rate`` throughout; after every ``every`` tasks a
      ``ctl`` client pauses, ``held`` tasks arrive (held, then cancelled by the
      clear), it clears, ``held`` tasks arrive (rejected), and it resumes.
      Tasks before a pause may be ``ok`` or, if still queued when it came,
      ``cancelled`` (the checker's FIFO rule keeps that honest).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
    if tasks < 0 or rate <= 0 or burst < 1 or every < 1 or held < 0 or max_blocks < 1:
        raise ValueError("tasks, held must be >= 0; rate, burst, every, max_blocks must be positive")
    layout = layout or CacheLayout()
    rng = random.Random(seed)
    n_clients = clients or (2 if shape == "bursty" else 1)
    yield header_record(world, layout, source="gen", shape=shape, seed=seed, tasks=tasks)
    counters = [0] * n_clients
    # CPU rows each client's swap_outs wrote (one client's tasks reach the broker
    # in order; a clear without keep_cpu drops them all)
    written: list[set[int]] = [set() for _ in range(n_clients)]

    def task(i: int, t: float, expect: str | list[str]) -> dict[str, Any]:
        c = i % n_clients
        counters[c] += 1
        return {
            "t": round(t, 6),
            "ev": "submit",
            "client": f"c{c}",
            "task": counters[c],
            # a task that cannot end ok (held then cancelled, or rejected) writes nothing
            **_task_fields(
                rng, layout, i // n_clients, max_blocks, written[c] if Outcome.OK in expect else set(written[c])
            ),
            "expect": expect,
        }

    if shape == "steady":
        for i in range(tasks):
            yield task(i, i / rate, Outcome.OK)
        return
    if shape == "bursty":
        for i in range(tasks):
            yield task(i, (i // burst) * gap, Outcome.OK)
        return
    # rl-cycle
    dt = 1.0 / rate
    t = 0.0
    i = 0
    running = 0
    phase = BusState.RUNNING
    phase_start = 0
    phase_left = 0
    while i < tasks or phase != BusState.RUNNING:
        if phase == BusState.RUNNING and running == every and i < tasks:
            yield {"t": round(t, 6), "ev": ControlOp.PAUSE, "client": DEFAULT_CONTROL_CLIENT, "expect": Outcome.OK}
            phase, phase_left, running = BusState.PAUSED, held, 0
            continue
        if phase == BusState.PAUSED and (phase_left == 0 or i >= tasks):
            yield {"t": round(t, 6), "ev": ControlOp.CLEAR, "client": DEFAULT_CONTROL_CLIENT, "expect": Outcome.OK}
            phase, phase_left = BusState.CLEARED, held
            for rows in written:
                rows.clear()
            continue
        if phase == BusState.CLEARED and (phase_left == 0 or i >= tasks):
            yield {"t": round(t, 6), "ev": ControlOp.RESUME, "client": DEFAULT_CONTROL_CLIENT, "expect": Outcome.OK}
            phase, phase_start = BusState.RUNNING, i
            continue
        expect: Any = {
            BusState.RUNNING: Outcome.OK,
            BusState.PAUSED: Outcome.CANCELLED,
            BusState.CLEARED: Outcome.REJECTED,
        }[phase]
        if phase is BusState.RUNNING and phase_start + every < tasks:
            # A pause and a clear follow: a task still queued behind the ranks'
            # credits when the pause comes is held, then cancelled by the clear.
            expect = [Outcome.OK, Outcome.CANCELLED]
        yield task(i, t, expect)
        i += 1
        t += dt
        if phase is BusState.RUNNING:
            running += 1
        else:
            phase_left -= 1
