"""Chaos for the tiers: a real bus of two rank processes, each with its CPU tier
in a file and a disk tier, driven by a seeded random sequence of fills,
``swap_out``, ``spill``, ``load``, ``swap_in`` and checksums, and kill -9 of a
random rank while a batch of spills and loads is in flight, then a restart of
that rank on the same tier and disk directories (docs/protocol.md §6.3, §8.2).

A model tracks, per row of each tier, each rank's digest of the bytes the
last ``ok`` write put there (a checksum right after a fill, then carried by
every copy that ended ``ok``); any other outcome makes the destination rows
unknown.  After every restart and at the end every row the model knows is
read back, and three counts must stay 0: rows served ``ok`` with other bytes
(**wrong bytes**), disk rows whose last spill ended ``ok`` that read back lost
(**acked spills lost**: no clear happens here), and CPU rows the model knows
that read back lost (**CPU rows lost**: a restart keeps the CPU tier).  The
destination rows of the tasks that did not end ``ok`` are read back too:
whatever a rank serves of them is their old bytes or their new ones.

    PYTHONPATH=. python tests/tier_chaos.py --rounds 5 --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

from zkv.client.client import Client
from zkv.harness.bus.cluster import LocalCluster
from zkv.wire.layout import CacheLayout
from zkv.wire.outcome import TaskOutcome

RANKS = 2
LAYOUT = CacheLayout(layers=2, gpu_blocks=64, cpu_blocks=256, block_size=16, kv_heads=4, head_dim=64)  # 32 KiB blocks
DISK_BLOCKS = 1024
SIZE = {"gpu": LAYOUT.gpu_blocks, "cpu": LAYOUT.cpu_blocks, "disk": DISK_BLOCKS}
BROKER = ["--heartbeat-ms", "100", "--liveness-ms", "1000", "--op-timeout-ms", "10000"]
WORKER = ["--liveness-ms", "1000", "--disk-blocks", str(DISK_BLOCKS)]
TASK_S = 30.0  # one task's bound
SERVE_S = 90.0  # a restarted rank serving again, on a loaded machine
OPS = {"swap_out": ("gpu", "cpu"), "swap_in": ("cpu", "gpu"), "spill": ("cpu", "disk"), "load": ("disk", "cpu")}
BATCH_OPS = ("spill", "spill", "load", "load", "swap_out", "swap_in")  # what is in flight at a kill
Digests = tuple[bytes, ...]  # one per rank


class TierModel:
    """What the bus must serve: per tier and row, each rank's digest of the bytes the last ``ok`` write put there."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, Digests]] = {"gpu": {}, "cpu": {}, "disk": {}}

    def known(self, tier: str) -> list[int]:
        return sorted(self.rows[tier])

    def learn(self, tier: str, rows: Sequence[int], out: TaskOutcome) -> None:
        """A checksum that ended ok: its digests are what the rows hold."""
        for i, row in enumerate(rows):
            self.rows[tier][row] = tuple(out.per_rank[r]["digests"][i] for r in range(RANKS))

    def forget(self, tier: str, rows: Sequence[int]) -> None:
        for row in rows:
            self.rows[tier].pop(row, None)

    def copied(self, op: str, src: Sequence[int], dst: Sequence[int], ok: bool) -> None:
        """A copy's outcome: ``ok`` gives the destinations the sources' digests, anything else makes them unknown."""
        a, b = OPS[op]
        for s, d in zip(src, dst):
            if ok and s in self.rows[a]:
                self.rows[b][d] = self.rows[a][s]
            else:
                self.rows[b].pop(d, None)


@dataclass
class Figures:
    """What a run counted; ``wrong_bytes``, ``lost_acked_spills`` and ``cpu_rows_lost`` must be 0.
    Rows count per rank (a row read on two ranks counts twice).  A kill is *mid-spill*
    (mid-load, mid-swap) when the first task of its batch that the killed rank had been
    sent and never reported is a spill (a load, a swap): a rank runs its tasks in order,
    so that is the one it was in; *idle* when the rank had reported every task sent."""

    rounds: int = 0
    seed: int = 0
    tasks: int = 0
    tasks_ok: int = 0
    kills: int = 0
    kills_at: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("mid_spill", "mid_load", "mid_swap", "idle"), 0)
    )
    interrupted_tasks: int = 0  # sent to the killed rank and never reported by it
    restarts: int = 0
    rows_checked: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("gpu", "cpu", "disk"), 0))
    wrong_bytes: int = 0
    lost_acked_spills: int = 0
    cpu_rows_lost: int = 0
    # Rows of tasks that did not end ok, read back: with their new bytes, their old ones, in a checksum
    # the rank failed (one of the task's rows lost), or with bytes the model cannot judge (old ones unknown).
    unfinished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("new", "old", "lost", "unjudged"), 0))
    restart_to_serving_s: list[float] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)  # "op outcome": tasks
    notes: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.wrong_bytes == self.lost_acked_spills == self.cpu_rows_lost == 0

    @property
    def kills_mid_task(self) -> int:
        return self.kills - self.kills_at["idle"]

    def lines(self) -> list[str]:
        t, each = self.restart_to_serving_s, lambda d: ", ".join(f"{k} {v}" for k, v in d.items())
        times = f"min {min(t):.2f} s, median {statistics.median(t):.2f} s, max {max(t):.2f} s" if t else "none"
        return [
            f"tier chaos: {self.rounds} rounds, seed {self.seed}; tasks {self.tasks} ({self.tasks_ok} ok)",
            f"kills {self.kills}: {each(self.kills_at)} ({self.interrupted_tasks} tasks cut); restarts {self.restarts}",
            f"rows checked: {each(self.rows_checked)}; rows of unfinished tasks: {each(self.unfinished)}",
            f"wrong bytes served {self.wrong_bytes}, acked spills lost {self.lost_acked_spills}, "
            f"CPU rows lost {self.cpu_rows_lost}: {'PASS' if self.clean else 'FAIL'}",
            f"restart to serving: {times}",
            f"outcomes: {each(dict(sorted(self.outcomes.items())))}",
            *(f"note: {n}" for n in self.notes),
        ]


class TierChaos:
    """One chaos run on a bus of its own: ``with TierChaos(...) as c: c.round() ...; c.verify()``, or ``run()``."""

    def __init__(self, seed: int = 0, *, batch: int = 12, per_task: int = 16, steps: int = 10, directory=None):
        self.batch, self.per, self.steps = batch, per_task, steps
        self.rng, self.model, self.fig = random.Random(seed), TierModel(), Figures(seed=seed)
        self.base = tempfile.mkdtemp(prefix="zkv-chaos-", dir=directory or "/tmp")
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else self.base  # where a CPU tier lives by default
        self.tiers = tempfile.mkdtemp(prefix="zkv-chaos-tiers-", dir=shm)
        self.disk_dir = os.path.join(self.base, "disk")
        args = [*WORKER, "--tier-dir", self.tiers, "--disk-dir", self.disk_dir]
        c = os.path.join(self.base, "c")
        self.cluster = LocalCluster(RANKS, LAYOUT, quiet=True, broker_args=BROKER, worker_args=args, directory=c)
        self.cluster.tier_dir = self.tiers
        self.client: Client
        self.done: dict[int, TaskOutcome] = {}  # outcomes of submitted tasks that a poll returned

    def __enter__(self) -> "TierChaos":
        try:
            self.cluster.start(timeout=SERVE_S)
            self.client = self.cluster.client(request_timeout=TASK_S)
        except BaseException:
            self.close()
            raise
        rows = range(SIZE["gpu"])  # a fresh device tier holds zeros
        if (out := self._task("checksum", rows, None, tier="gpu")).ok:
            self.model.learn("gpu", rows, out)
        self._fill("cpu", list(range(SIZE["cpu"])))  # a fresh CPU tier holds nothing (lost_block) until written
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        self.cluster.stop()
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.tiers, ignore_errors=True)

    def run(self, rounds: int) -> Figures:
        with self:
            for _ in range(rounds):
                self.round()
            self.verify()
        return self.fig

    def round(self) -> None:
        """Known rows on every tier, random tasks one at a time, then a batch with a kill and a restart."""
        self._stock()
        for _ in range(self.steps):
            self._step()
        self._chaos()
        self.fig.rounds += 1
        self.verify(("cpu", "disk"))

    # --- tasks one at a time ----------------------------------------------------------

    def _task(self, op: str, src: Sequence[int] | None, dst: Sequence[int] | None, **extra) -> TaskOutcome:
        out = self.client.run(op, src, dst, timeout=TASK_S, **extra)
        self._count(op, out)
        if op in OPS:
            assert src is not None and dst is not None
            self.model.copied(op, src, dst, out.ok)
        return out

    def _count(self, op: str, out: TaskOutcome) -> None:
        self.fig.tasks += 1
        self.fig.tasks_ok += out.ok
        key = f"{op} {out.outcome}"
        self.fig.outcomes[key] = self.fig.outcomes.get(key, 0) + 1

    def _fill(self, tier: str, rows: list[int]) -> None:
        """Known bytes: a fill, then a checksum of what it wrote."""
        self.model.forget(tier, rows)
        if self._task("fill", None, rows, tier=tier, seed=self.rng.randrange(2**40)).ok:
            if (out := self._task("checksum", rows, None, tier=tier)).ok:
                self.model.learn(tier, rows, out)

    def _sample(self, rows: Sequence[int], k: int) -> list[int]:
        return self.rng.sample(list(rows), min(k, len(rows)))

    def _stock(self) -> None:
        """GPU rows filled, swapped out, spilled and loaded back: every tier holds rows of this round."""
        gpu = self._sample(range(SIZE["gpu"]), self.per)
        self._fill("gpu", gpu)
        cpu = self._sample(range(SIZE["cpu"]), len(gpu))
        self._task("swap_out", gpu, cpu)
        disk = self._sample(range(SIZE["disk"]), len(cpu))
        self._task("spill", cpu, disk)
        self._task("load", disk, self._sample(range(SIZE["cpu"]), len(disk)))

    def _step(self) -> None:
        """One random task, run to its outcome before the next (the model stays exact)."""
        k = self.rng.randint(1, self.per)
        op = self.rng.choice(["fill", "check"] + [op for op, (a, _) in OPS.items() if self.model.rows[a]])
        if op == "fill":
            tier = self.rng.choice(["gpu", "cpu"])
            self._fill(tier, self._sample(range(SIZE[tier]), k))
        elif op == "check":
            self.verify([self.rng.choice(["gpu", "cpu", "disk"])], k)
        else:
            a, b = OPS[op]
            src = self._sample(self.model.known(a), k)
            self._task(op, src, self._sample(range(SIZE[b]), len(src)))

    # --- a batch in flight, and a kill among it ---------------------------------------

    def _plan(self) -> list[tuple[str, list[int], list[int]]]:
        """Tasks whose destinations are disjoint and never a source of the batch, so
        their outcomes apply to the model in any order.  Spills and loads move
        ``per_task`` blocks each; a rank runs them back to back."""
        src = {t: self._sample(self.model.known(t), self.per) for t in SIZE}  # read, never written, by the batch
        free = {t: [r for r in range(SIZE[t]) if r not in set(src[t])] for t in SIZE}
        for rows in free.values():
            self.rng.shuffle(rows)
        plan = []
        for _ in range(self.batch):
            op = self.rng.choice(BATCH_OPS)
            a, b = OPS[op]
            take = self._sample(src[a], self.per)
            if take and len(free[b]) >= len(take):
                plan.append((op, take, free[b][: len(take)]))
                del free[b][: len(take)]
        return plan

    def _poll(self, timeout: float) -> None:
        self.done.update((o.task, o) for o in self.client.poll(timeout))

    def _chaos(self) -> None:
        """Submit a batch, kill -9 a random rank once some of it ended, restart it, apply every outcome."""
        plan, victim, rows = self._plan(), self.rng.randrange(RANKS), self.model.rows
        old = {(OPS[op][1], d): rows[OPS[op][1]].get(d) for op, _, dst in plan for d in dst}
        new = {(OPS[op][1], d): rows[OPS[op][0]].get(s) for op, src, dst in plan for s, d in zip(src, dst)}
        ids = [self.client.submit(op, src, dst, timeout=TASK_S) for op, src, dst in plan]
        want, deadline = self.rng.randint(1, max(1, len(ids) // 3)), time.monotonic() + TASK_S
        while sum(i in self.done for i in ids) < want and time.monotonic() < deadline:
            self._poll(0.5)
        open_at_kill = {i for i in ids if i not in self.done}
        self.cluster.kill_worker(victim)
        self.fig.kills += 1
        self._restart(victim)
        outs = [self.done.pop(i) if i in self.done else self.client.wait(i, timeout=TASK_S) for i in ids]
        for (op, src, dst), out in zip(plan, outs):
            self._count(op, out)
            self.model.copied(op, src, dst, out.ok)
        rows["gpu"].clear()  # the bus moved its gen: GPU blocks of the old one are gone, whatever a rank holds
        cut = [k for k, i in enumerate(ids) if i in open_at_kill and self._cut(outs[k], victim)]
        self.fig.interrupted_tasks += len(cut)
        at = {"spill": "mid_spill", "load": "mid_load"}.get(plan[cut[0]][0], "mid_swap") if cut else "idle"
        self.fig.kills_at[at] += 1
        self._judge_unfinished([p for p, o in zip(plan, outs) if not o.ok], old, new)

    @staticmethod
    def _cut(out: TaskOutcome, victim: int) -> bool:
        """Sent to the killed rank (dispatched) and never reported by it."""
        return not out.ok and not out.never_ran and victim not in out.per_rank

    def _restart(self, rank: int) -> None:
        """Start the rank again on the same directories; wait (bounded) until the bus serves with it."""
        started = time.monotonic()
        pid = self.cluster.start_worker(rank).pid
        while True:
            st = self.client.status(wait_ranks=RANKS, timeout=TASK_S)
            at_gen = [r.alive and r.stats.get("gen") == st.gen for r in st.ranks]
            if st.state == "running" and st.ranks[rank].pid == pid and at_gen == [True] * RANKS:
                break
            if time.monotonic() > started + SERVE_S:
                raise TimeoutError(f"rank {rank} not serving {SERVE_S:.0f} s after its restart: {st}")
            self._poll(0.05)  # the next heartbeat brings the ranks' stats
        self.fig.restart_to_serving_s.append(round(time.monotonic() - started, 3))
        self.fig.restarts += 1
        if "CPU blocks kept" not in st.gen_reason:
            self.fig.notes.append(f"restart of rank {rank}: {st.gen_reason}")

    def _judge_unfinished(self, tasks: list, old: dict, new: dict) -> None:
        """The CPU and disk rows each task that did not end ok wrote, read back in one checksum
        per task: what a rank serves of them is their old bytes or their new ones, never others."""
        for op, _, dst in tasks:
            tier = OPS[op][1]
            if tier == "gpu":
                continue  # of the generation the restart ended
            got = self._digests(self._task("checksum", dst, None, tier=tier), len(dst))
            for r in range(RANKS):
                if got[r][0] is None:
                    self.fig.unfinished["lost"] += len(dst)
                    continue
                for row, d in zip(dst, got[r]):
                    was, fresh = old[(tier, row)], new[(tier, row)]
                    if fresh is not None and d == fresh[r]:
                        self.fig.unfinished["new"] += 1
                    elif was is not None and d == was[r]:
                        self.fig.unfinished["old"] += 1
                    elif was is None or fresh is None:
                        self.fig.unfinished["unjudged"] += 1
                    else:
                        self._wrong(f"{tier} row {row} on rank {r}: an unfinished {op} served other bytes")

    # --- reading rows back ------------------------------------------------------------

    def _digests(self, out: TaskOutcome, n: int) -> list[list[bytes | None]]:
        """Each rank's digests from a checksum's outcome, None for a rank that failed it."""
        got: list[list[bytes | None]] = []
        for r in range(RANKS):
            res = out.per_rank.get(r, {})
            got.append(list(res["digests"]) if res.get("outcome") == "ok" else [None] * n)
            if res.get("outcome") != "ok" and "lost" not in res.get("reason", "") and len(self.fig.notes) < 20:
                self.fig.notes.append(f"a checksum on rank {r}: {out.outcome} {out.reason}")  # not a lost block
        return got

    def read(self, tier: str, rows: Sequence[int]) -> list[list[bytes | None]]:
        """Each rank's digest of each row, None where it failed it (lost): one checksum
        of them all, then one per row where a rank failed it."""
        got = self._digests(self._task("checksum", rows, None, tier=tier), len(rows))
        again = [r for r in range(RANKS) if got[r][0] is None]
        for i, row in enumerate(rows if again and len(rows) > 1 else ()):
            one = self._digests(self._task("checksum", [row], None, tier=tier), 1)
            for r in again:
                got[r][i] = one[r][0]
        return got

    def verify(self, tiers: Sequence[str] = ("gpu", "cpu", "disk"), k: int | None = None) -> None:
        """Read back every row the model knows (or ``k`` of them) and count what differs."""
        for tier in tiers:
            rows = self.model.known(tier) if k is None else self._sample(self.model.known(tier), k)
            if not rows:
                continue
            got = self.read(tier, rows)
            self.fig.rows_checked[tier] += len(rows) * RANKS
            lost = []
            for i, row in enumerate(rows):
                for r in range(RANKS):
                    if got[r][i] is None:
                        lost.append(row)
                        self.fig.lost_acked_spills += tier == "disk"
                        self.fig.cpu_rows_lost += tier == "cpu"
                        self.fig.notes.append(f"{tier} row {row} on rank {r}: known to the model, read back lost")
                    elif got[r][i] != self.model.rows[tier][row][r]:
                        self._wrong(f"{tier} row {row} on rank {r}: other bytes than its last ok write")
            self.model.forget(tier, lost)

    def _wrong(self, note: str) -> None:
        self.fig.wrong_bytes += 1
        self.fig.notes.append(note)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds: each ends with a kill -9 and a restart")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=12, help="tasks in flight at each kill")
    parser.add_argument("--per-task", type=int, default=16, help="blocks per task")
    parser.add_argument("--steps", type=int, default=10, help="random tasks before each batch")
    parser.add_argument("--dir", default=None, help="where the disk tier lives (default /tmp)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    chaos = TierChaos(args.seed, batch=args.batch, per_task=args.per_task, steps=args.steps, directory=args.dir)
    fig = chaos.run(args.rounds)
    print(json.dumps(asdict(fig), indent=1) if args.json else "\n".join(fig.lines()))
    return 0 if fig.clean else 1


if __name__ == "__main__":
    sys.exit(main())
