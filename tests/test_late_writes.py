"""A task failed by a rank's death while another rank still copies into its
destination: on the real bus (a broker and two rank loops on threads of this
process, ipc sockets, real tensors), through the prefix cache manager.

Rank 1 dies before it reports a swap-in; rank 0 is still copying it (held at a
gate inside its copy, on its executor thread, while its I/O thread keeps
heartbeating).  The broker declares rank 1 dead and fails the task before any
rank reported.  What may the manager do with the swap-in's destination GPU
blocks?

- Another *task* into those blocks cannot be overtaken by the late copy: the
  bus dispatches nothing while a rank is dead, and each rank runs its tasks in
  order, so a later task runs after the late copy on rank 0.
- But the engine writes its GPU blocks itself (a prefill computes into the
  blocks ``allocate`` hands out), outside the bus's order.  Were the blocks
  handed out at once, rank 0's late copy would overwrite the engine's KV: the
  first test shows the late copy landing and that the manager never handed
  those blocks out; the book holds them until the task settles or the bus
  drains (docs/architecture.md, "One book of rows")."""

from __future__ import annotations

import threading

import pytest
import torch
from waits import wait_for

from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.client.client import Client
from zkv.net.endpoints import Endpoints
from zkv.prefix import PrefixCacheManager
from zkv.rank.batching import INLINE_MAX_BYTES
from zkv.rank.store import BlockStore
from zkv.rank.worker import RankWorker
from zkv.wire.layout import CacheLayout
from zkv.wire.vocab import Op, Outcome

# 256 KiB blocks: a swap of more than 32 of them runs on a rank's executor thread, not its
# I/O thread, so a rank held inside that copy still heartbeats (it is slow, not dead).
LAYOUT = CacheLayout(layers=4, gpu_blocks=48, cpu_blocks=48, block_size=16, kv_heads=4, head_dim=256)
BS = LAYOUT.block_size
RUN = 36
assert RUN * LAYOUT.block_bytes > INLINE_MAX_BYTES


class GatedStore(BlockStore):
    """A rank's real store whose next swap-in waits at a gate inside the copy."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.armed = False
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.copied = threading.Event()

    def move(self, op, src, dst):
        if self.armed and op == Op.SWAP_IN:
            self.armed = False
            self.entered.set()
            assert self.opened.wait(60), "the test never opened the gate"
            nbytes = super().move(op, src, dst)
            self.copied.set()
            return nbytes
        return super().move(op, src, dst)


class Bus:
    """A broker and two ranks on threads; rank 0 on a ``GatedStore``; a rank can die and come back."""

    def __init__(self, directory) -> None:
        self.endpoints = Endpoints.in_dir(directory)
        self.broker = Broker(self.endpoints, BrokerConfig(world=2, heartbeat_ms=50, liveness_ms=800))
        self.store = GatedStore.owned(LAYOUT, "cpu", 0)
        self.threads: list[threading.Thread] = []
        self.ranks: dict[int, RankWorker] = {}
        self._run(self.broker)
        self.start_rank(0, cache=self.store)
        self.start_rank(1)

    def _run(self, loop) -> None:
        thread = threading.Thread(target=loop.serve, daemon=True)
        thread.start()
        self.threads.append(thread)

    def start_rank(self, rank: int, cache: BlockStore | None = None) -> RankWorker:
        worker = RankWorker(
            rank,
            2,
            self.endpoints.backend,
            self.endpoints.control,
            LAYOUT,
            device="cpu",
            cache=cache,
            liveness_ms=10_000,
        )
        self.ranks[rank] = worker
        self._run(worker)
        return worker

    def kill(self, rank: int) -> None:
        """The rank's loop stops without a word to the broker (its heartbeats end)."""
        self.ranks[rank].stop()

    def close(self) -> None:
        self.store.opened.set()
        for loop in (*self.ranks.values(), self.broker):
            loop.stop()
        for thread in self.threads:
            thread.join(timeout=15)


@pytest.fixture
def bus(tmp_path):
    b = Bus(tmp_path)
    yield b
    b.close()


def fill(client: Client, ids: list[int], seed: int) -> None:
    out = client.run("fill", None, ids, timeout=30, tier="gpu", seed=seed)
    assert out.ok, out


def test_a_swap_in_failed_by_a_dead_rank_never_has_its_blocks_handed_out_while_a_rank_still_copies(bus):
    with Client(bus.endpoints.frontend, request_timeout=30) as client:
        client.status(timeout=30, wait_ranks=2)
        manager = PrefixCacheManager(client, BS, LAYOUT.gpu_blocks, LAYOUT.cpu_blocks, swap_timeout=30.0)
        tokens = list(range(RUN * BS))
        lease = manager.allocate(RUN)
        fill(client, lease.block_ids, seed=7)
        manager.insert(tokens, lease.block_ids)
        manager.release(lease)
        assert manager.evict(RUN) == RUN  # swapped out to the CPU tier, both ranks alive: ok
        assert manager.locate(tokens) == ["cpu"] * RUN

        bus.store.armed = True
        bus.kill(1)  # dead before the swap-in reaches it: it will never report
        cached = manager.match(tokens)  # swap-in: rank 0 copies behind the gate, the broker fails it
        assert bus.store.entered.is_set(), "rank 0 never started the copy"
        assert cached.num_blocks == 0 and manager.locate(tokens) == ["cpu"] * RUN
        assert manager.stats()["swaps"][Op.SWAP_IN][Outcome.FAILED] == 1
        manager.release(cached)
        manager.check_invariants()

        # What the engine does next: take blocks for a new request and compute into them.
        fresh = manager.allocate(LAYOUT.gpu_blocks - RUN)
        gpu = bus.store.views("gpu")
        for view in gpu:
            view[fresh.block_ids] = 0x5A  # the engine's own KV, written in place
        before = [v[fresh.block_ids].clone() for v in gpu]

        bus.store.opened.set()  # rank 0's copy lands at last
        assert bus.store.copied.wait(30)
        for view, was in zip(gpu, before):
            assert torch.equal(view[fresh.block_ids], was), "the late copy overwrote the engine's blocks"
        assert manager.stats()["quarantined_blocks"]["gpu"] == RUN
        dst = sorted(set(range(LAYOUT.gpu_blocks)) - set(fresh.block_ids))  # the swap-in's: held
        assert all(int(v[dst].sum()) for v in gpu), "the late copy did land, in the held blocks"
        manager.release(fresh)

        # Rank 1 comes back on fresh memory: the bus moves to a new generation; the
        # held blocks stay out of reach (rank 0 kept its memory) until the bus drains.
        bus.start_rank(1)
        client.status(timeout=30, wait_ranks=2)
        wait_for(client, lambda st: st.state == "running", "the bus runs again", timeout=30)
        assert len(manager.allocate(1).block_ids) == 1  # follows the generation move
        assert manager.stats()["quarantined_blocks"]["gpu"] == RUN
        client.pause(timeout=30)
        assert manager.on_bus_drained() == RUN
        assert manager.stats()["quarantined_blocks"]["gpu"] == 0
        manager.check_invariants()
