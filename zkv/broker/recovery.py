"""How the broker keeps one layout and one generation across restarts and
failures (docs/architecture.md, "One layout, one generation"): its durable snapshot (written by ``state_file.py``
before any reply that reports a change), the restore of a restarted broker,
and the reconciliation of a registering rank with the bus, which may move the
generation or make the bus resume."""

from __future__ import annotations

import collections
from typing import Any

from ..wire import bounds
from ..wire.layout import CacheLayout
from ..wire.messages import Ready
from ..wire.vocab import Tier
from .actions import Action, Record, SaveState
from .control import ControlMachine
from .generation import Generation
from .ranks import RankTable
from .records import BrokerConfig
from .state import CACHES_CLEARED, BusState, stable
from .tasks import TaskTable


class Recovery:
    """The snapshot last saved, and the moves that bring ranks in line with it."""

    def __init__(
        self,
        cfg: BrokerConfig,
        counters: collections.Counter[str],
        recording: bool,
        ranks: RankTable,
        gens: Generation,
        control: ControlMachine,
        tasks: TaskTable,
    ):
        self.cfg = cfg
        self.counters = counters
        self.recording = recording
        self.ranks = ranks
        self.gens = gens
        self.control = control
        self.tasks = tasks
        self.saved_key: tuple | None = None

    def snapshot(self) -> dict[str, Any]:
        """What a restarted broker needs to keep the state a client set."""
        control, gens = self.control, self.gens
        began_from = control.pending.previous_state if control.pending is not None else None
        return {
            "state": stable(control.state, began_from).value,
            "epoch": control.epoch,
            "gen": gens.gen,
            "gen_used": gens.used,
            "layout": gens.layout.to_wire() if gens.layout else None,
            "keep_cpu": gens.keep_cpu,
            "world": self.cfg.world,
            "gen_reason": gens.reason,
            "cpu_gen": gens.cpu_gen,
            "cpu_used": gens.cpu_used,
            "weights": gens.weights,
        }

    def restore(self, snap: dict[str, Any]) -> None:
        if snap["world"] != self.cfg.world:
            raise ValueError(f"the state file is for world size {snap['world']}, this broker has {self.cfg.world}")
        state = BusState(snap["state"])
        self.gens.restore(snap, cleared=state == BusState.CLEARED)
        self.control.restore(state, snap["epoch"] + 1)  # a new epoch: every rank re-learns the state from it
        self.counters["restored"] += 1

    def save_if_changed(self, out: list[Action]) -> None:
        control, gens = self.control, self.gens
        key = (
            control.state,
            control.epoch,
            gens.gen,
            gens.used,
            gens.layout,
            gens.keep_cpu,
            gens.reason,
            gens.cpu_gen,
            gens.cpu_used,
            gens.weights,
            control.pending.previous_state if control.pending is not None else None,
        )
        if key != self.saved_key:
            self.saved_key = key
            out.insert(0, SaveState(self.snapshot()))  # durable before any reply says it happened

    def reconcile(self, rank: int, msg: Ready, layout: CacheLayout, now: float, out: list[Action]) -> None:
        """Bring a registering rank in line with the bus, never serve it as it is
        when its memory is not the bus's.

        Its memory is *lost* for the bus when the process is new (``fresh``),
        holds no cache, another layout, or another generation.  Then, if a task
        ever ran at the current generation (or the rank is ahead of a broker
        that lost its state), the bus moves to a new generation that every
        client learns; and a rank that must allocate does so only within a
        resume (one the broker starts itself when the bus is running).  Its
        CPU tier is judged apart (``_cpu_lost``): one that survived at the
        bus's ``cpu_gen`` keeps the CPU generation where it is."""
        gens = self.gens
        rank_gen = msg.gen
        # A generation above MAX_ADOPTED_GEN is never taken as the bus's (it is
        # only lost memory): 2^53 - 2^40 moves stay below MAX_GEN (bounds.py).
        ahead = gens.gen < rank_gen <= bounds.MAX_ADOPTED_GEN
        cpu_lost = self._cpu_lost(msg, layout)
        if self.control.state in CACHES_CLEARED:  # cleared stays cleared: the welcome frees it
            if cpu_lost:
                gens.cpu_not_kept(rank)  # a resume after a keep_cpu clear cannot say it kept
            if ahead:
                self._move_gen(
                    rank_gen + 1, f"rank {rank} reported generation {rank_gen}, above the broker's {gens.gen}", now, out
                )
            return
        has_cache = msg.has_cache is not False
        needs_alloc = not has_cache or layout != gens.layout
        fresh = bool(msg.fresh)
        lost = fresh or needs_alloc or rank_gen != gens.gen
        if not lost:
            return
        rank_cpu = msg.cpu_gen or 0
        cpu_ahead = gens.cpu_gen < rank_cpu <= bounds.MAX_ADOPTED_GEN
        if ahead and not gens.used and self.ranks.ready_count() == 1:
            # The first rank of a broker that lost its state: take its
            # generation, and count it as used (the old broker served it).
            gens.adopt(rank_gen, f"the broker had no state of this bus: it took generation {rank_gen} from rank {rank}")
            if cpu_ahead and not cpu_lost and not gens.cpu_used:
                gens.adopt_cpu(rank_cpu)
            cpu_lost = self._cpu_lost(msg, layout)
            self.counters["gen_adopted"] += 1
            lost = fresh or needs_alloc
            if not lost:
                return
            ahead = False
        cpu_move = cpu_lost and (gens.cpu_used or cpu_ahead)
        if cpu_move:
            gens.move_cpu(rank_cpu if cpu_ahead else None)
            self.counters["cpu_gen_moves"] += 1
        cpu = (
            f"; CPU blocks are gone too (CPU generation {gens.cpu_gen})"
            if cpu_move
            else f"; CPU blocks kept (CPU generation {gens.cpu_gen})"
        )
        if ahead:
            self._move_gen(
                rank_gen + 1,
                f"rank {rank} reported generation {rank_gen}, above the broker's {gens.gen}" + cpu,
                now,
                out,
            )
        elif gens.used or cpu_move:
            why = (
                "restarted with fresh memory"
                if fresh
                else (
                    "holds no cache"
                    if not has_cache
                    else "holds another layout"
                    if layout != gens.layout
                    else f"held generation {rank_gen}"
                )
            )
            self._move_gen(
                gens.gen + 1, f"rank {rank} {why}: GPU blocks of generation {gens.gen} are gone" + cpu, now, out
            )
        elif needs_alloc:
            self.control.restate(now, out)

    def _cpu_lost(self, msg: Ready, layout: CacheLayout) -> bool:
        """Whether a registering rank's CPU tier is not the bus's: it kept none
        (``kept_tiers``), of another CPU generation, or of another layout (its
        resume allocates a new one).  A disk tier follows it: its blocks belong
        to the same ``cpu_gen`` and the rank drops them itself at a task of
        another one, so ``disk`` in ``kept_tiers`` never keeps a ``cpu_gen``."""
        kept = Tier.CPU in (msg.kept_tiers or ()) and msg.cpu_gen is not None
        return not (kept and msg.cpu_gen == self.gens.cpu_gen and layout == self.gens.layout)

    def _move_gen(self, gen: int, reason: str, now: float, out: list[Action]) -> None:
        """The bus's cache content is gone: a new generation, queued tasks
        (submitted against the old one) cancelled, every rank told at a new epoch."""
        self.gens.move(gen, reason)
        self.counters["gen_moves"] += 1
        if self.recording:
            out.append(Record({"ev": "gen", "t": now, "gen": gen, "reason": reason}))
        self.tasks.cancel_queued(f"cache generation moved to {gen}: {reason}", now, out)
        self.control.restate(now, out)
