"""``zkv up --demo --engine transformers``: a multi-turn chat on a real
transformers model whose idle conversations zkv swaps out to CPU and back,
through a real broker and 2 in-process ranks (one engine replica each), with
an RL pause -> clear -> weight update -> resume in the middle.

What it prints, all measured in this run: tokens per second, how returning
turns found their KV (still resident, swapped in instead of a prefill, or
recomputed), a swap-in against a recompute of the same conversation, the
prefill time the swap-ins saved, a swap round trip checked on the block
bytes, and the cycle's timings.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from ...engines.idle_policy import IdlePolicy
from ...rank.store import block_digests
from ...testing.models import load_weights, random_llama, random_tokens, set_threads
from ...wire.vocab import Dtype
from .rig import EngineRig, hold_ids


@dataclass(frozen=True)
class ChatPlan:
    """A small chat: more conversations than the cache holds, Zipf-popular, a few turns at a time."""

    conversations: int = 8
    rounds: int = 14
    per_round: int = 3  # conversations that take a turn in one round (one batch)
    prompt: tuple[int, int] = (40, 80)  # first-turn prompt length range (tokens)
    user: tuple[int, int] = (8, 16)  # later user messages
    reply: int = 8  # tokens generated per turn
    seed: int = 1

    def schedule(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        weights = [1 / (i + 1) for i in range(self.conversations)]
        rounds = []
        for _ in range(self.rounds):
            picked: list[int] = []
            while len(picked) < min(self.per_round, self.conversations):
                c = rng.choices(range(self.conversations), weights)[0]
                if c not in picked:
                    picked.append(c)
            rounds.append(picked)
        return rounds


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def serve_chat(
    rig: EngineRig, plan: ChatPlan, cycle_at: int | None, weights_seed: int, echo: Callable[[str], None]
) -> dict:
    """Serve ``plan`` through ``rig``'s controller; run the RL cycle before round ``cycle_at``."""
    ctrl = rig.controller
    rng = random.Random(plan.seed + 1)
    started: set[str] = set()
    turns: Counter[str] = Counter()
    generated, busy_s, cycle = 0, 0.0, None
    cleared: set[str] = set()  # conversations whose KV the RL cycle's clear dropped, until their next turn
    for index, picked in enumerate(plan.schedule()):
        if index == cycle_at:
            cycle = rig.rl_cycle(lambda: load_weights(rig.model, weights_seed))
            cleared = set(started)
            echo(
                f"  RL cycle before round {index}: pause {_ms(cycle['pause_s'])}, clear {_ms(cycle['clear_s'])} "
                f"(bus) + engine free {_ms(cycle['engine_free_s'])} "
                f"(cache storage expired: {cycle['storage_expired']}), "
                f"weight update {_ms(cycle['update_s'])}, new cache {_ms(cycle['rebuild_s'])}, "
                f"resume {_ms(cycle['resume_s'])} (generation {cycle['generation']})"
            )
        start = time.perf_counter()
        for c in picked:
            name = f"chat{c}"
            if name not in started:
                started.add(name)
                ctrl.submit(name, random_tokens(1000 + c, rng.randint(*plan.prompt)), plan.reply)
                turns["first"] += 1
            else:
                how = ctrl.continue_turn(name, random_tokens(rng.randrange(2**31), rng.randint(*plan.user)), plan.reply)
                turns[how] += 1
                if how == "recomputed" and name in cleared:
                    turns["recomputed_after_cycle"] += 1
                cleared.discard(name)
        ctrl.run_until_idle()
        for c in picked:
            generated += len(ctrl.result(f"chat{c}").generated_tokens)
        ctrl.end_tick()
        busy_s += time.perf_counter() - start
    return {"turns": turns, "generated": generated, "busy_s": busy_s, "cycle": cycle}


def probe(rig: EngineRig) -> dict:
    """The largest parked conversation: a swap round trip checked on the bytes, then swap-in vs recompute of it."""
    ctrl, engines = rig.controller, rig.replicas
    parked = [c for c in engines[0].parked() if c not in ctrl.swapped and engines[0].conversation(c).resident]
    name = max(parked, key=lambda c: engines[0].conversation(c).kv_len)
    conv = engines[0].conversation(name)
    before = [block_digests([e.block_rows()], e.block_table(name)) for e in engines]
    old = engines[0].block_table(name)
    if not ctrl.swap_out(name):
        raise RuntimeError(f"probe: the swap-out of {name} failed")
    hold = hold_ids(engines, old)  # so the swap-in lands in other ids
    start = time.perf_counter()
    swapped_in = ctrl.swap_in(name)
    swap_in_s = time.perf_counter() - start
    for e, blocks in zip(engines, hold):
        e.return_blocks(blocks)
    new = engines[0].block_table(name)
    after = [block_digests([e.block_rows()], e.block_table(name)) for e in engines]
    recompute_s = []
    for e in engines:
        start = time.perf_counter()
        e.submit("probe", list(conv.tokens[: conv.kv_len]), max_new_tokens=1, keep=False)
        e.run_until_idle()
        recompute_s.append(time.perf_counter() - start)
        e.result("probe")
    return {
        "name": name,
        "tokens": conv.kv_len,
        "blocks": len(old),
        "moved": not set(old) & set(new),
        "identical": swapped_in and before == after,
        "swap_in_s": swap_in_s,
        "recompute_s": recompute_s[0],
    }


def run_engine_demo(
    ranks: int = 2, plan: ChatPlan | None = None, dtype: str = Dtype.FP32, echo: Callable[[str], None] = print
) -> bool:
    plan = plan or ChatPlan()
    old_threads = set_threads(1)
    try:
        model = random_llama(0, dtype)
        # ~3 conversations' worth of blocks: the rest must live on CPU between their turns
        with EngineRig(
            model,
            ranks=ranks,
            num_blocks=48,
            block_size=16,
            cpu_rows=256,
            prefix_sharing=False,
            policy=IdlePolicy(min_free=12, idle_after=2),
        ) as rig:
            ctrl = rig.controller
            echo(
                f"transformers {rig.version}: random Llama ({rig.parameters / 1e6:.1f} M parameters, {dtype}), "
                f"{ranks} engine replicas, each with a zkv rank attached in-process to its cache "
                f"({rig.replicas[0].layout.num_blocks} blocks of {rig.replicas[0].layout.block_size} tokens); "
                f"broker at {rig.frontend}"
            )
            echo(
                f"chat: {plan.conversations} conversations, {plan.rounds} rounds of {plan.per_round} turns, "
                f"{plan.reply} tokens per reply; policy: swap out after {ctrl.policy.idle_after} idle rounds "
                f"or when fewer than {ctrl.policy.min_free} blocks are free"
            )
            report = serve_chat(rig, plan, plan.rounds // 2, weights_seed=1, echo=echo)
            p = probe(rig)
        turns, s = report["turns"], ctrl.stats
        returning = sum(turns[k] for k in ("resident", "swapped_in", "recomputed"))
        echo(
            f"  {report['generated']} tokens generated in {report['busy_s']:.2f} s: "
            f"{report['generated'] / report['busy_s']:.1f} tokens/s per replica (swaps included)"
        )
        echo(
            f"  {returning} returning turns: {turns['resident']} still resident, {turns['swapped_in']} swapped in "
            f"instead of a prefill, {turns['recomputed']} recomputed ({turns['recomputed_after_cycle']} of them "
            f"the first turn after the RL clear dropped all KV of the old weights; "
            f"hit rate {(turns['resident'] + turns['swapped_in']) / max(1, returning):.0%}, before the cycle "
            f"{turns['swapped_in']} of {turns['swapped_in'] + turns['recomputed'] - turns['recomputed_after_cycle']} "
            f"not resident were swapped in)"
        )
        echo(
            f"  swaps: {s.swap_outs} out ({s.blocks_out} blocks), {s.swap_ins} in ({s.blocks_in} blocks), "
            f"failed {dict(s.failed) or 'none'}"
        )
        rate = p["recompute_s"] / max(1, p["tokens"])
        saved = rate * s.tokens_swapped_in - sum(s.swap_in_s)
        echo(
            f"  {p['name']} ({p['tokens']} tokens, {p['blocks']} blocks): swap-in {_ms(p['swap_in_s'])} vs recompute "
            f"of its prefill {_ms(p['recompute_s'])} ({p['recompute_s'] / max(p['swap_in_s'], 1e-9):.1f}x); "
            "round trip into other block ids: "
            f"{'bit-identical on every rank' if p['identical'] and p['moved'] else 'MISMATCH'}"
        )
        echo(
            f"  prefill time saved by the {s.swap_ins} swap-ins ({s.tokens_swapped_in} tokens): about "
            f"{saved:.2f} s (recompute at this run's {rate * 1e3:.2f} ms/token "
            f"minus {sum(s.swap_in_s):.2f} s of swap-ins)"
        )
        return bool(
            p["identical"]
            and p["moved"]
            and report["cycle"]
            and report["cycle"]["storage_expired"]
            and not s.failed
            and turns["swapped_in"] > 0
        )
    finally:
        set_threads(old_threads)
