"""Recovery: seven event sequences with real processes (kill -9, SIGSTOP,
broker restarts), each asserting the rule it used to break:

1. clear before the ranks registered      -> every request is answered
2. failed resume with a new layout        -> one layout (rolled back)
3. generation split after broker restart  -> one generation, clients learn it
4. broker restart while paused            -> paused stays paused
5. rank restarted with fresh memory       -> lost memory is never silent
6. clear(keep_cpu=True)                   -> the CPU tier is kept bit for bit
7. an allocation that fails               -> the resume fails naming the rank; the rank stays usable
"""

import signal

import pytest
from waits import wait_for

from zkv import ZkvError
from zkv.client import StatusReply
from zkv.harness.bus.cluster import LocalCluster
from zkv.wire.layout import CacheLayout

LAYOUT = CacheLayout(layers=1, gpu_blocks=32, cpu_blocks=64, block_size=4, kv_heads=2, head_dim=16)
FAST = ["--heartbeat-ms", "100", "--liveness-ms", "1000", "--op-timeout-ms", "10000"]
RANK_FAST = ["--liveness-ms", "1000"]


@pytest.fixture
def cluster(tmp_path):
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=FAST, worker_args=RANK_FAST, directory=tmp_path / "c")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """One started cluster for the sequences that kill or restart nothing and
    leave the bus as they found it (running, on LAYOUT)."""
    c = LocalCluster(
        2,
        LAYOUT,
        quiet=True,
        broker_args=FAST,
        worker_args=RANK_FAST,
        directory=tmp_path_factory.mktemp("serving") / "c",
    )
    c.start(timeout=60)
    yield c
    c.stop()


def restart_broker(c: LocalCluster) -> None:
    c.broker.kill()
    c.broker.wait(timeout=10)
    c.start_broker()


def cache_bytes(layout: CacheLayout) -> int:
    return (layout.gpu_blocks + layout.cpu_blocks) * layout.block_bytes


def no_internal_errors(st: StatusReply) -> bool:
    return st.counters.get("internal_errors", 0) == 0


def test_1_pause_and_clear_before_any_rank_registered_are_answered_and_stay_true(cluster):
    cluster.start_broker()
    with cluster.client(request_timeout=10) as client:
        paused = client.pause(timeout=5)
        assert paused.state == "paused" and paused.ranks_acked == 0
        cleared = client.clear(timeout=5)  # used to raise AttributeError in the broker: no reply at all
        assert cleared.state == "cleared" and cleared.cancelled == 0
        for rank in range(2):
            cluster.start_worker(rank)
        st = client.status(wait_ranks=2, timeout=60)
        assert st.state == "cleared" and no_internal_errors(st)
        # the ranks joined a cleared bus: they free their caches (cleared stays cleared)
        wait_for(
            client,
            lambda s: all(r.stats.get("op") == "clear" and r.stats.get("cache_bytes") == 0 for r in s.ranks),
            "ranks to free their caches",
        )
        assert client.submit_raw(b"") and client.poll(5)[0].outcome == "rejected"
        assert client.resume(timeout=10).state == "running"
        assert client.run("fill", None, [0, 1], tier="gpu", seed=3, timeout=10).ok


def test_2_a_failed_resume_with_a_new_layout_rolls_back_and_no_rank_keeps_it(cluster):
    cluster.start(timeout=60)
    with cluster.client(request_timeout=15) as client:
        client.pause()
        client.clear()
        cluster.workers[1].send_signal(signal.SIGSTOP)  # rank 1 never acks: declared dead mid-resume
        try:
            with pytest.raises(ZkvError) as err:
                client.resume(layout={"gpu_blocks": 16}, timeout=8)
            assert err.value.code == "rank_dead" and "cleared again" in err.value.reason
            st = client.status()
            assert st.state == "cleared" and st.layout == LAYOUT
        finally:
            cluster.workers[1].send_signal(signal.SIGCONT)
        client.status(wait_ranks=2, timeout=30)  # rank 1 probes, is told to re-register
        reply = client.resume(timeout=10)
        assert reply.layout == LAYOUT
        # both ranks hold exactly the broker's layout (rank 0 had allocated the new one)
        st = wait_for(
            client,
            lambda s: (
                len(s.ranks) == 2
                and all(
                    r.stats.get("cache_bytes") == cache_bytes(LAYOUT) and r.stats.get("op") == "resume" for r in s.ranks
                )
            ),
            "both ranks on the broker's layout",
        )
        assert st.layout == LAYOUT and no_internal_errors(st)
        blocks = [0, 5, 31]  # block 31 exists only in the old (the broker's) layout
        assert client.run("fill", None, blocks, tier="gpu", seed=7, timeout=10).ok
        before = client.run("checksum", blocks, tier="gpu", timeout=10)
        assert before.ok
        # after a broker restart the layout and the blocks are the same
        restart_broker(cluster)
        st = client.status(wait_ranks=2, timeout=30)
        assert st.layout == LAYOUT
        wait_for(client, lambda s: s.state == "running", "running")
        after = client.run("checksum", blocks, tier="gpu", timeout=10)
        assert after.ok and all(after.per_rank[r]["digests"] == before.per_rank[r]["digests"] for r in (0, 1))


def test_3_broker_and_rank_0_killed_while_rank_1_is_frozen_converge_on_one_new_generation(cluster):
    cluster.start(timeout=60)
    with cluster.client(request_timeout=15) as client:
        for _ in range(2):
            client.pause()
            client.clear()
            client.resume()
        assert client.gen == 2
        assert client.run("fill", None, [1, 2], tier="gpu", seed=5, timeout=10).ok
        cluster.workers[1].send_signal(signal.SIGSTOP)
        try:
            cluster.kill_worker(0)
            restart_broker(cluster)
            cluster.start_worker(0)  # registers first, fresh memory, generation 0
            client.status(wait_ranks=1, timeout=60)
        finally:
            cluster.workers[1].send_signal(signal.SIGCONT)  # comes back holding generation 2
        st = client.status(wait_ranks=2, timeout=30)
        st = wait_for(
            client,
            lambda s: (
                s.state == "running"
                and len(s.ranks) == 2
                and all(r.alive for r in s.ranks)
                and all(r.stats.get("gen") == s.gen for r in s.ranks)
            ),
            "one generation on both ranks",
        )
        assert st.gen == 3 and "rank 0" in st.gen_reason and "fresh memory" in st.gen_reason
        assert client.gen == 3, "status told the client"
        out = client.run("checksum", [1, 2], tier="gpu", timeout=10)
        assert out.ok, f"tasks run at one generation on every rank: {out.reason}"
        assert no_internal_errors(client.status())


def test_4_a_broker_restart_keeps_a_paused_bus_paused(cluster):
    cluster.start(timeout=60)
    with cluster.client(request_timeout=15) as client:
        client.pause()
        restart_broker(cluster)
        st = client.status(wait_ranks=2, timeout=30)
        assert st.state == "paused"
        held = client.submit("swap_out", [0], [0], timeout=20)
        assert client.poll(0.5) == [], "nothing runs on a paused bus"
        st = wait_for(client, lambda s: all(r.stats.get("op") == "pause" for r in s.ranks), "ranks paused")
        assert all(r.stats["copies_after_ack"] == 0 for r in st.ranks) and st.queued == 1
        cleared = client.clear()  # used to fail with not_paused: the restart had un-paused the bus
        assert cleared.cancelled == 1
        assert client.wait(held).outcome == "cancelled"
        assert client.resume().state == "running"
        assert client.run("swap_out", [0], [0], timeout=10).ok


def test_5_a_rank_restarted_with_fresh_memory_moves_the_bus_to_a_generation_every_client_learns(cluster):
    cluster.start(timeout=60)
    with cluster.client(request_timeout=15) as client, cluster.client(request_timeout=15) as other:
        blocks = [3, 4]
        assert client.run("fill", None, blocks, tier="gpu", seed=9, timeout=10).ok
        before = client.run("checksum", blocks, tier="gpu", timeout=10)
        assert before.ok and other.run("checksum", blocks, tier="gpu", timeout=10).ok
        cluster.kill_worker(1)
        cluster.start_worker(1)
        st = wait_for(
            client,
            lambda s: s.gen == 1 and s.state == "running" and all(r.alive for r in s.ranks),
            "the new generation",
        )
        assert "rank 1" in st.gen_reason and "fresh memory" in st.gen_reason
        # a client that did not ask for status learns it from its next result; that task ran
        # at the new generation, so it ends with what it found there (docs/protocol.md §8.2)
        out = other.run("checksum", blocks, tier="gpu", timeout=10)
        assert out.ok and other.gen == 1 and [res["gen"] for res in out.per_rank.values()] == [1, 1]
        assert out.per_rank[1]["digests"] != before.per_rank[1]["digests"], "rank 1's old blocks are gone"


def test_6_clear_keep_cpu_keeps_the_cpu_tier_bit_for_bit_and_says_when_it_cannot(serving):
    with serving.client(request_timeout=15) as client:
        blocks = [0, 17, 63]
        assert client.run("fill", None, blocks, tier="cpu", seed=21, timeout=10).ok
        before = client.run("checksum", blocks, tier="cpu", timeout=10)
        client.pause()
        client.clear(keep_cpu=True)
        reply = client.resume()
        assert reply.cpu_kept is True
        after = client.run("checksum", blocks, tier="cpu", timeout=10)
        assert after.ok and all(after.per_rank[r]["digests"] == before.per_rank[r]["digests"] for r in (0, 1))
        client.pause()
        client.clear(keep_cpu=True)
        reply = client.resume(layout={"cpu_blocks": 32})
        assert reply.cpu_kept is False and "could not be kept" in reply.note
        client.pause()
        client.clear()
        client.resume(layout={"cpu_blocks": LAYOUT.cpu_blocks})  # as found


def test_7_a_failed_allocation_fails_the_resume_naming_the_rank_and_the_rank_stays_usable(serving):
    with serving.client(request_timeout=15) as client:
        client.pause()
        client.clear()
        with pytest.raises(ZkvError) as err:  # a value past the bound is refused where it enters
            client.resume(layout={"gpu_blocks": 1099511627776}, timeout=10)
        assert err.value.code == "bad_field" and "gpu_blocks" in err.value.reason
        with pytest.raises(ZkvError) as err:  # in range, but no allocator can satisfy it
            client.resume(layout={"gpu_blocks": 2**31 - 1, "kv_heads": 65536, "head_dim": 65536}, timeout=10)
        assert err.value.code == "alloc_failed" and "could not allocate" in err.value.reason
        assert "rank " in err.value.reason and "cleared again" in err.value.reason
        st = client.status()
        assert st.state == "cleared" and st.layout == LAYOUT
        reply = client.resume(timeout=10)  # used to time out for good: the executor thread had died
        assert reply.state == "running" and reply.layout == LAYOUT
        assert client.run("fill", None, [0, 1], tier="gpu", seed=1, timeout=10).ok
        st = client.status()
        assert no_internal_errors(st) and st.counters.get("alloc_failed", 0) >= 1
