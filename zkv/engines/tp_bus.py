"""The bus as every tensor-parallel rank of one engine sees it.

With TP, every rank process runs the same ``SwapController`` in lockstep on
its own shard (same requests, same block ids), but only TP rank 0 talks to
the broker: one task moves every rank's shard.  ``TPBus`` gives each rank
the ``Bus`` the controller needs: on rank 0 it forwards to a real
``zkv.Client`` and broadcasts each outcome over the engine's own process
group; on the other ranks it returns what rank 0 broadcast.  Every call is
a collective, which holds because the controllers make the same calls in
the same order.  The broadcast carries msgpack bytes in a uint8 tensor.

Every op passes through (swaps, and the disk tier's ``spill`` / ``load``).
``gen`` and ``cpu_gen`` are the client's generations as rank 0 broadcast them
with the last outcome (or settled list), the same on every rank, so a prefix
cache manager on each rank follows the same moves at the same call
(``zkv.rows.loss``); None until the first broadcast.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
import torch.distributed as dist

from ..client.client import Client
from ..wire.outcome import TaskOutcome
from ..wire.vocab import Outcome


class TPBus:
    """``client`` on TP rank 0, None on the others."""

    def __init__(self, client: Client | None, group: Any = None):
        self.rank = dist.get_rank(group)
        if (client is None) != (self.rank != 0):
            raise ValueError("TP rank 0 (and only it) needs the client")
        self.client = client
        self.group = group
        self._next = 0  # task ids on ranks without a client
        self._local: dict[int, int] = {}  # rank 0's task id -> ours (for settled)
        self.gen: int | None = None
        self.cpu_gen: int | None = None

    def submit(self, op: str, src: Any = None, dst: Any = None, timeout: float = 30.0) -> int:
        if self.client is not None:
            task = self.client.submit(op, src, dst, timeout)
        else:
            self._next += 1
            task = self._next
        return task

    def wait(self, task: int, timeout: float | None = None) -> TaskOutcome:
        if self.client is not None:
            out = self.client.wait(task, timeout)
            self._share(
                {
                    "task": out.task,
                    "outcome": out.outcome,
                    "reason": out.reason,
                    "bytes": out.bytes,
                    "ranks": sorted(out.per_rank),
                    "never_ran": out.never_ran,
                    "reported": out.every_rank_reported,
                    **self._gens(),
                }
            )
            return out
        got = self._take_gens(self._share(None))
        out = TaskOutcome(
            task,
            got["outcome"],
            got["reason"],
            got["bytes"],
            0.0,
            {r: {} for r in got["ranks"]},
            never_ran=got.get("never_ran", False),
            every_rank_reported=got.get("reported", got["outcome"] == Outcome.OK),
        )
        if not out.copies_over:  # rank 0's client watches it until it settles
            self._local[got["task"]] = task
        return out

    def settled(self, timeout: float = 0.0) -> list[int]:
        """Rank 0's settled tasks, under each rank's own task ids."""
        if self.client is not None:
            done = self.client.settled(timeout)
            self._share({"tasks": done, **self._gens()})
            return done
        return [self._local.pop(t) for t in self._take_gens(self._share(None))["tasks"] if t in self._local]

    def _gens(self) -> dict:
        """Rank 0: the client's generations now, kept as ours too (every rank reads the same)."""
        assert self.client is not None
        self.gen, self.cpu_gen = self.client.gen, self.client.cpu_gen
        return {"gen": self.gen, "cpu_gen": self.cpu_gen}

    def _take_gens(self, got: dict) -> dict:
        self.gen, self.cpu_gen = got.get("gen"), got.get("cpu_gen")
        return got

    def _share(self, value: dict | None) -> dict:
        size = torch.zeros(1, dtype=torch.int64)
        payload = msgpack.packb(value) if value is not None else b""
        if value is not None:
            size[0] = len(payload)
        dist.broadcast(size, 0, group=self.group)
        buf = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if value is not None
            else torch.empty(int(size[0]), dtype=torch.uint8)
        )
        dist.broadcast(buf, 0, group=self.group)
        return value if value is not None else msgpack.unpackb(buf.numpy().tobytes())
