"""Pause / clear / resume races with real processes: a broker and 2 ranks
started through the CLI, real sockets, real copies."""

import random
import signal
import time

import pytest
import zmq
from click.testing import CliRunner
from waits import wait_for

from zkv import ZkvError
from zkv.cli import main
from zkv.harness.bus.cluster import LocalCluster
from zkv.wire import protocol as P
from zkv.wire.layout import CacheLayout
from zkv.wire.messages import Submit

LAYOUT = CacheLayout(layers=2, gpu_blocks=128, cpu_blocks=256, block_size=16, kv_heads=4, head_dim=64)
FAST = ["--heartbeat-ms", "100", "--liveness-ms", "1000", "--op-timeout-ms", "10000"]


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=FAST, worker_args=["--liveness-ms", "1000"]).start(timeout=60)
    yield c
    c.stop()


@pytest.fixture
def client(cluster):
    with cluster.client(request_timeout=15) as c:
        yield c
        # leave the bus running for the next test
        try:
            st = c.status()
            if st.state != "running":
                c.resume()
        except ZkvError:
            pass


def rank_stats(client, want_tasks: int | None = None, timeout: float = 10.0) -> list[dict]:
    """Ranks' stats from their heartbeats; with ``want_tasks``, wait (bounded)
    until both ranks reported at least that many finished tasks."""
    deadline = time.monotonic() + timeout
    while True:
        stats = [r.stats for r in client.status().ranks]
        done = [s.get("tasks_ok", 0) + s.get("tasks_failed", 0) for s in stats]
        if want_tasks is None or min(done) >= want_tasks:
            return stats
        assert time.monotonic() < deadline, f"ranks reported {done} tasks, wanted {want_tasks}"
        client.poll(0.1)  # the next heartbeat (100 ms) brings fresh stats


def big_swap(client, rng, k=128):
    return client.submit("swap_out", rng.sample(range(LAYOUT.gpu_blocks), k), rng.sample(range(LAYOUT.cpu_blocks), k))


def test_1_pause_acks_after_every_inflight_task_and_no_copy_starts_after(client):
    rng = random.Random(1)
    base = sum(s.get("tasks_ok", 0) + s.get("tasks_failed", 0) for s in rank_stats(client)[:1])
    tasks = [big_swap(client, rng) for _ in range(24)]
    reply = client.pause()
    assert reply.state == "paused" and reply.elapsed_ms > 0
    st = client.status()
    assert st.inflight == 0 and all(r.inflight == 0 for r in st.ranks)
    outs = [client.wait(t, timeout=10) for t in tasks]
    assert all(o.ok for o in outs), "every task dispatched before the pause ran to the end"
    stats = rank_stats(client, want_tasks=base + 24)
    assert all(s["copies_after_ack"] == 0 for s in stats)
    client.resume()


def test_3_tasks_submitted_while_paused_are_held_then_run_once_after_resume(client):
    client.pause()
    held = [client.submit("swap_out", [i], [i]) for i in range(5)]
    st = client.status()
    deadline = time.monotonic() + 5
    while st.queued < 5 and time.monotonic() < deadline:  # submits are in flight to the broker
        client.poll(0.01)
        st = client.status()
    assert st.state == "paused" and st.queued == 5 and st.inflight == 0
    assert client.poll(0.2) == [], "nothing runs while paused"
    client.resume()
    outs = [client.wait(t, timeout=10) for t in held]
    assert [o.outcome for o in outs] == ["ok"] * 5
    assert all(len(o.per_rank) == 2 for o in outs)


def test_4_clear_cancels_every_held_task_and_rejects_until_resume(client):
    client.pause()
    held = [client.submit("swap_out", [i], [i]) for i in range(6)]
    reply = client.clear()
    assert reply.gen >= 1 and reply.freed > 0
    outs = [client.wait(t, timeout=10) for t in held]
    assert [o.outcome for o in outs] == ["cancelled"] * 6
    late = client.wait(client.submit("swap_out", [0], [0]), timeout=10)
    assert late.outcome == "rejected" and "cleared" in late.reason
    assert client.status().state == "cleared"
    resumed = client.resume(layout={"gpu_blocks": 64})
    assert resumed.state == "running"
    assert client.status().layout.gpu_blocks == 64
    bad = client.run("swap_out", [100], [0], timeout=10)
    assert bad.outcome == "failed" and "out of range" in bad.reason, "ranks really use the new layout"
    assert client.run("swap_out", [63], [0], timeout=10).ok
    client.pause()
    client.clear()
    client.resume(layout={"gpu_blocks": LAYOUT.gpu_blocks})


def test_cli_prints_what_happened(cluster):
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, ZKV_BROKER=cluster.endpoints.frontend)

    def cli(*args):
        res = subprocess.run([sys.executable, "-m", "zkv", *args], capture_output=True, text=True, timeout=60, env=env)
        return res.returncode, res.stdout, res.stderr

    rc, out, _ = cli("clear")
    assert rc == 1
    rc, out, err = cli("clear")
    assert "zkv pause" in err
    rc, out, _ = cli("pause")
    assert rc == 0 and "paused: epoch" in out and "drained in" in out
    rc, out, _ = cli("pause", "--json")
    assert json.loads(out)["noop"] is True
    rc, out, _ = cli("clear", "--json")
    data = json.loads(out)
    assert rc == 0 and data["state"] == "cleared" and data["freed"] > 0 and "cancelled" in data
    rc, out, _ = cli("resume")
    assert rc == 0 and "running: epoch" in out


def test_7_rank_joining_while_paused_learns_it_and_takes_no_tasks(tmp_path):
    c = LocalCluster(2, LAYOUT, quiet=True, broker_args=FAST, directory=tmp_path / "late")
    c.start_broker()
    c.start_worker(0)
    try:
        c.wait_ready(ranks=1, timeout=60)
        with c.client(request_timeout=15) as client:
            client.pause()
            t = client.submit("swap_out", [1], [1])
            c.start_worker(1)
            st = client.status(wait_ranks=2, timeout=60)
            assert st.state == "paused"
            # the late rank acknowledges the pause it learned from its welcome
            deadline = time.monotonic() + 10
            while not all(r.acked_epoch == st.epoch for r in st.ranks):
                assert time.monotonic() < deadline, st.ranks
                client.poll(0.05)
                st = client.status()
            assert st.queued == 1 and st.inflight == 0
            client.resume()
            assert client.wait(t, timeout=10).ok
    finally:
        c.stop()


def test_9a_rank_that_never_acks_fails_the_pause_naming_it_within_the_timeout(cluster, client):
    proc = cluster.workers[1]
    proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(ZkvError) as err:
            client.pause(timeout=0.5)
        elapsed = time.monotonic() - t0
        assert err.value.code == "pause_timeout" and "[1]" in err.value.reason
        assert elapsed < 3.0
    finally:
        proc.send_signal(signal.SIGCONT)
    assert client.status().state == "running"
    assert client.run("swap_out", [0], [0], timeout=10).ok


def test_9b_rank_killed_during_the_pause_fails_it_naming_the_rank_then_a_restart_serves(cluster, client):
    rng = random.Random(9)
    proc = cluster.workers[1]
    proc.send_signal(signal.SIGSTOP)  # it cannot ack, then it dies
    tasks = [big_swap(client, rng, 8) for _ in range(4)]
    req = client.send_request("pause", timeout_ms=20_000)
    proc.kill()
    proc.wait(timeout=10)
    with pytest.raises(ZkvError) as err:
        client.await_reply(req, timeout=10)  # well before the pause's own 20 s bound
    assert err.value.code == "rank_dead" and "rank 1" in err.value.reason
    outs = [client.wait(t, timeout=10) for t in tasks]
    assert all(o.outcome == "failed" and "rank 1" in o.reason for o in outs), outs
    cluster.start_worker(1)
    cluster.wait_ready(timeout=60)
    # its memory is fresh: the bus moved to a new generation, and status tells the client
    assert "rank 1 restarted with fresh memory" in client.status().gen_reason
    assert client.run("swap_out", [0], [0], timeout=10).ok


def test_10_random_cycles_with_real_processes(client):
    """1,000 random pause / clear / resume requests interleaved with
    submissions: every task gets exactly one outcome, no copy runs while
    paused, and data round trips stay bit-identical."""
    rng = random.Random(10)
    before_stats = rank_stats(client)
    base = [s.get("tasks_ok", 0) + s.get("tasks_failed", 0) for s in before_stats]
    submitted: list[int] = []
    outcomes: dict[int, str] = {}
    verified = 0

    def collect(timeout=0.0):
        for out in client.poll(timeout):
            assert out.task not in outcomes, f"task {out.task} reported twice"
            # a swap_in of a CPU row not written in this CPU generation is lost, never ok with zeros
            lost = out.outcome == "failed" and "lost_block: " in out.reason
            outcomes[out.task] = "lost" if lost else out.outcome

    for i in range(1000):
        for _ in range(rng.randint(0, 3)):
            k = rng.randint(1, 8)
            op = rng.choice(["swap_out", "swap_in"])
            g, c = rng.sample(range(LAYOUT.gpu_blocks), k), rng.sample(range(LAYOUT.cpu_blocks), k)
            submitted.append(client.submit(op, g if op == "swap_out" else c, c if op == "swap_out" else g, timeout=60))
        op = rng.choice(["pause", "pause", "clear", "resume", "resume"])
        try:
            getattr(client, op)()
        except ZkvError as err:
            assert err.code in ("not_paused",), err
        collect()
        if i % 100 == 99:  # a verified round trip on a running bus
            if client.status().state != "running":
                client.resume()
            ids = rng.sample(range(LAYOUT.gpu_blocks), 16)
            cpu = rng.sample(range(LAYOUT.cpu_blocks), 16)
            assert client.run("fill", None, ids, tier="gpu", seed=i).ok
            before = client.run("checksum", ids, tier="gpu")
            assert client.run("swap_out", ids, cpu).ok
            assert client.run("fill", None, ids, tier="gpu", seed=i + 1).ok
            assert client.run("swap_in", cpu, ids).ok
            after = client.run("checksum", ids, tier="gpu")
            assert all(before.per_rank[r]["digests"] == after.per_rank[r]["digests"] for r in (0, 1))
            verified += 1
    if client.status().state != "running":
        client.resume()
    deadline = time.monotonic() + 60
    while len(outcomes) < len(submitted) and time.monotonic() < deadline:
        collect(0.5)
    missing = [t for t in submitted if t not in outcomes]
    assert not missing, f"{len(missing)} tasks without an outcome, e.g. {missing[:5]}"
    kinds = set(outcomes.values())
    assert "ok" in kinds and "cancelled" in kinds | {"rejected"}, kinds
    assert kinds <= {"ok", "cancelled", "rejected", "lost"}, kinds
    assert verified == 10
    ran = sum(1 for o in outcomes.values() if o == "ok")
    stats = rank_stats(client, want_tasks=min(base) + ran)  # stats that cover every task that ran
    assert all(s["copies_after_ack"] == 0 for s in stats)
    assert client.status().counters.get("pause_ok", 0) > 100


def test_a_restarted_broker_picks_up_the_ranks_and_their_generation(tmp_path):
    c = LocalCluster(
        2, LAYOUT, quiet=True, broker_args=FAST, worker_args=["--liveness-ms", "1000"], directory=tmp_path / "rb"
    )
    c.start(timeout=60)
    try:
        with c.client(request_timeout=15) as client:
            client.pause()
            client.clear()
            assert client.resume().gen == 1
            c.broker.kill()
            c.broker.wait(timeout=10)
            c.start_broker()
            st = client.status(wait_ranks=2, timeout=30)  # the ranks notice the silence and register again
            assert st.gen == 1 and st.state == "running"
            out = client.run("swap_out", [0, 1], [2, 3], timeout=10)
            assert out.ok, "results of generation 1 are not ignored by a client that saw the clear"
    finally:
        c.stop()


def test_11_a_clear_on_another_connection_cancels_only_the_tasks_of_the_old_generation(cluster, client):
    """docs/protocol.md §8.2: a generation move cancels the tasks that ran (or
    were accepted) at an older generation, never the ones that ran at the new one."""
    with cluster.client(request_timeout=15) as engine:
        assert engine.run("swap_out", [0], [0], timeout=10).ok  # the engine knows the bus's generation
        old = engine.gen
        assert old is not None
        client.pause()
        held = [engine.submit("swap_out", [i], [i], timeout=10) for i in range(4)]  # queued at the broker
        deadline = time.monotonic() + 5
        while client.status().queued < 4:  # the engine's submits are on another connection
            assert time.monotonic() < deadline, "the engine's submits never reached the broker"
            engine.poll(0.01)
        assert client.clear().cancelled == 4
        new = client.resume().gen
        assert new > old
        after = [engine.submit("swap_out", [i], [i + 1], timeout=10) for i in range(20)]  # pipelined
        outs = [engine.wait(t, timeout=10) for t in held + after]
        held_outs, after_outs = outs[:4], outs[4:]
        assert [o.outcome for o in held_outs] == ["cancelled"] * 4, [o.reason for o in held_outs]
        assert [o.outcome for o in after_outs] == ["ok"] * 20, [o.reason for o in after_outs if not o.ok]
        assert all(res["gen"] == new for o in after_outs for res in o.per_rank.values())
        assert engine.gen == new, "the engine learned the new generation from its results"
        assert engine.run("swap_in", [1], [0], timeout=10).ok  # a row written at the new CPU generation


def test_a_resume_to_another_layout_is_busy_while_one_is_in_progress_and_the_same_one_joins(cluster, client):
    client.pause()
    client.clear()
    proc = cluster.workers[1]
    proc.send_signal(signal.SIGSTOP)  # it cannot ack: the resume stays in progress
    try:
        first = client.send_request("resume", layout={"gpu_blocks": 64}, timeout_ms=10_000)
        assert client.status().pending_op == "resume"  # same connection: read after the resume began
        with cluster.client(request_timeout=15) as other:
            with pytest.raises(ZkvError) as err:
                other.resume(layout={"gpu_blocks": 32}, timeout=5)
            assert err.value.code == "busy" and "'gpu_blocks': 64" in err.value.reason
            same = other.send_request("resume", layout={"gpu_blocks": 64}, timeout_ms=10_000)
            proc.send_signal(signal.SIGCONT)
            joined = other.await_reply(same, timeout=10)
        reply = client.await_reply(first, timeout=10)
    finally:
        proc.send_signal(signal.SIGCONT)
    assert reply.layout.gpu_blocks == joined.layout.gpu_blocks == 64
    assert client.status().layout.gpu_blocks == 64
    client.pause()  # back to the module's layout for the next test
    client.clear()
    assert client.resume(layout={"gpu_blocks": LAYOUT.gpu_blocks}).layout == LAYOUT


def test_a_queued_task_past_its_submit_timeout_ends_timeout_while_paused_and_never_runs(cluster, client):
    client.pause()
    dispatched = client.status().counters.get("dispatched", 0)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(cluster.endpoints.frontend)
    try:
        t0 = time.monotonic()
        dealer.send_multipart(
            [Submit(task=1, reply_to=client.reply_to, timeout_ms=300).to_wire(), P.encode_body("swap_out", [0], [0])]
        )
        assert dealer.poll(5_000), "no outcome while the bus stays paused"
        out = P.decode(dealer.recv())
        elapsed = time.monotonic() - t0
    finally:
        dealer.close(linger=0)
    assert out.kind == "outcome" and out.task == 1 and out.outcome == "timeout" and "never dispatched" in out.reason
    assert 0.29 <= elapsed < 2.0, f"ended after {elapsed:.3f} s, its timeout_ms was 300"
    st = client.status()
    assert st.state == "paused" and st.queued == 0
    client.resume()
    assert client.run("swap_out", [0], [0], timeout=10).ok
    assert client.status().counters["dispatched"] == dispatched + 1, "the expired task was dispatched"


def test_a_caller_s_timeout_is_the_task_s_deadline_the_cli_says_it_never_ran_and_resume_does_not_run_it(
    cluster, client
):
    """zkv pause; zkv submit fill --dst 5 --timeout 1; zkv resume: the block stays as it was."""
    env = {"ZKV_BROKER": cluster.endpoints.frontend}
    run = CliRunner()
    assert client.run("fill", dst=[5], tier="gpu", seed=1, timeout=10).ok
    before = client.run("checksum", src=[5], tier="gpu", timeout=10).per_rank
    dispatched = client.status().counters["dispatched"]
    assert run.invoke(main, ["pause"], env=env).exit_code == 0
    t0 = time.monotonic()
    gave_up = run.invoke(
        main, ["submit", "fill", "--tier", "gpu", "--dst", "5", "--seed", "2", "--timeout", "1"], env=env
    )
    elapsed = time.monotonic() - t0
    assert gave_up.exit_code == 1 and "timeout" in gave_up.stdout and "it never ran" in gave_up.stdout, gave_up.output
    assert 1.0 <= elapsed < 5.0, f"the CLI gave up after {elapsed:.2f} s"
    assert client.status().queued == 0, "the task the caller gave up on is still queued"
    assert run.invoke(main, ["resume"], env=env).exit_code == 0
    after = client.run("checksum", src=[5], tier="gpu", timeout=10).per_rank
    assert [after[r]["digests"] for r in (0, 1)] == [before[r]["digests"] for r in (0, 1)], "the fill ran after all"
    assert client.status().counters["dispatched"] == dispatched + 1, "only the checksum was dispatched"


def test_client_cancel_ends_a_queued_task_and_is_too_late_for_a_running_one(client):
    client.pause()
    task = client.submit("fill", dst=[6], tier="gpu", seed=3, timeout=10)
    answer = client.cancel(task)
    assert answer.cancelled is True and answer.state == "queued"
    out = client.wait(task, timeout=0)  # filed before cancel returned
    assert out.outcome == "cancelled" and out.ran is False and "by its client" in out.reason
    assert client.cancel(task).state == "done"
    client.resume()
    running = client.submit("checksum", src=[6], tier="gpu", timeout=10)
    assert client.wait(running).ok  # the ranks ran it: its cancel comes too late
    late = client.cancel(running)
    assert late.cancelled is False and late.state in ("dispatched", "done")  # the broker's fold may lag


def test_a_resume_no_rank_can_allocate_backs_off_logs_one_line_and_a_pause_stops_it(cluster, client, capfd):
    """The bus's layout is one no rank can allocate (a resume completed while
    no rank was registered): the broker's own resume fails on every rank that
    registers.  It is retried backed off, status says why and the way out,
    the rank logs one line per failure, and zkv pause, clear, resume gets out."""
    for r in (0, 1):
        cluster.kill_worker(r)
    wait_for(client, lambda st: not any(r.alive for r in st.ranks), "ranks declared dead")
    client.pause()
    client.clear()
    assert client.resume(layout={"gpu_blocks": 2**31 - 1}).ranks_acked == 0
    cluster.quiet = False  # the restarted ranks log to this test's stderr
    try:
        for r in (0, 1):
            cluster.start_worker(r, ["--adopt-layout"])  # the bus's layout, not their flags'
    finally:
        cluster.quiet = True
    st = wait_for(client, lambda st: st.restate_failures >= 2, "the broker's own resume failed twice", 60)
    assert "alloc_failed" in st.restate_error and "zkv pause" in st.restate_error
    t0 = time.monotonic()
    st = wait_for(client, lambda st: time.monotonic() - t0 >= 3.0, "three more seconds")
    assert st.restate_failures <= 7, f"{st['restate_failures']} tries: not backed off"
    assert st.state == "resuming"
    assert client.pause(timeout=5).state == "paused"
    assert client.status().restate_retry_in_s is None, "a retry is still due behind the pause"
    client.clear()
    assert client.resume(layout={"gpu_blocks": LAYOUT.gpu_blocks}).state == "running"
    assert client.run("fill", dst=[0], tier="gpu", timeout=10).ok
    err = capfd.readouterr().err
    assert "AllocateCache failed" in err and "Traceback" not in err, err[-3000:]
