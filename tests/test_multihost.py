"""A broker, two ranks and clients on separate hosts (network namespaces),
over tcp:// with CurveZMQ: what loopback hides.

Hosts: broker 10.77.0.10, rank0 .11, rank1 .12, client .13, on a bridge in a
namespace of its own (zkv/testing/runner/netns.py).  The processes are the real CLI
(zkv/testing/runner/netns_bus.py).
Figures (link-down -> tasks failed, link-up -> serving, broker restart) are
printed; run with ``-s`` to see them.
"""

import os
import time

import pytest

from zkv.testing.runner import netns as H
from zkv.testing.runner.netns_bus import Bus

FIGURES: dict[str, float] = {}
LIVENESS_S = 2.0  # the broker's and the ranks' default --liveness-ms


def figure(name: str, seconds: float) -> None:
    FIGURES[name] = round(seconds, 3)
    print(f"multihost: {name} = {seconds:.3f} s")


def wait_until(check, timeout: float, what: str, every: float = 0.1):
    """Poll a remote condition (a status reply) until it holds, bounded."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


@pytest.fixture(scope="module")
def lab():
    reason = H.unavailable()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the multi-host tests, but network namespaces are unavailable: {reason}")
        pytest.skip(f"network namespaces unavailable: {reason}")
    with H.Lab(["broker", "rank0", "rank1", "client"]) as lab:
        yield lab
        print(lab.logs())  # shown by pytest only when something failed
        print("multihost figures:", FIGURES)


@pytest.fixture(scope="module")
def bus(lab):
    return Bus(lab).start()


@pytest.fixture(scope="module")
def cli(bus):
    agent = bus.client()
    agent.call("status", within=65, timeout=60, wait_ranks=2)
    yield agent
    agent.close()


@pytest.fixture
def serving(cli):
    """Every test starts on a running bus with both ranks alive."""
    st = cli.call("status", within=35, timeout=30, wait_ranks=2)
    assert st["state"] == "running", st
    return cli


def ok(out: dict) -> dict:
    assert out["outcome"] == "ok", out
    return out


def digests(out: dict) -> dict:
    return {rank: res["digests"] for rank, res in ok(out)["ranks"].items()}


BLOCK_BYTES = 2 * 2 * 2 * 4 * 16 * 4  # layers x (K, V) x kv_heads x block_size x head_dim x fp32


def test_client_advertises_its_own_host_address(serving, lab):
    assert serving.reply_to.startswith(f"tcp://{lab.hosts['client'].ip}:"), serving.reply_to


def test_swap_round_trip_is_bit_exact_on_both_ranks(serving):
    run = serving.call
    ok(run("run", op="fill", dst=[0, 1, 2, 3], tier="gpu", seed=7))
    before = digests(run("run", op="checksum", src=[0, 1, 2, 3], tier="gpu"))
    assert set(before) == {"0", "1"} and before["0"] != before["1"]  # each rank its own shard
    assert len(set(before["0"])) == 4
    out = ok(run("run", op="swap_out", src=[0, 1, 2, 3], dst=[10, 11, 12, 13]))
    assert out["bytes"] == 2 * 4 * BLOCK_BYTES
    assert digests(run("run", op="checksum", src=[10, 11, 12, 13], tier="cpu")) == before
    ok(run("run", op="fill", dst=[0, 1, 2, 3], tier="gpu", seed=8))  # the sources are gone now
    assert digests(run("run", op="checksum", src=[0, 1, 2, 3], tier="gpu")) != before
    ok(run("run", op="swap_in", src=[10, 11, 12, 13], dst=[20, 21, 22, 23]))
    assert digests(run("run", op="checksum", src=[20, 21, 22, 23], tier="gpu")) == before


def test_pause_clear_resume_across_hosts(serving):
    run = serving.call
    paused = run("pause")
    assert paused["state"] == "paused" and paused["ranks_acked"] == 2
    held = run("submit", op="fill", dst=[1], tier="gpu", seed=1, timeout=20)  # waits in the queue
    cleared = run("clear")
    assert cleared["state"] == "cleared" and cleared["cancelled"] == 1 and cleared["freed"] > 0
    assert run("wait", task=held)["outcome"] == "cancelled"
    assert run("run", op="checksum", src=[0], tier="gpu")["outcome"] == "rejected"
    resumed = run("resume")
    assert resumed["state"] == "running" and resumed["gen"] == cleared["gen"]
    ok(run("run", op="fill", dst=[5], tier="gpu", seed=5))
    assert len(digests(run("run", op="checksum", src=[5], tier="gpu"))) == 2


def test_unreachable_result_address_times_out_and_no_rank_hangs(serving, bus, lab):
    lab.add_address("client", "10.78.0.13")  # the ranks have no route to 10.78.0.0/24
    ghosts = [
        bus.client(name="unrouted", reply_to="tcp://10.78.0.13:*"),
        bus.client(name="loopback", reply_to="tcp://127.0.0.1:*"),
    ]  # the old default
    try:
        before = {r["rank"]: r["stats"].get("tasks_ok", 0) for r in serving.call("status")["ranks"]}
        start = time.monotonic()
        tasks = [g.call("submit", op="fill", dst=[3], tier="gpu", seed=3, timeout=3.0) for g in ghosts]
        outs = [g.call("wait", within=10, task=t) for g, t in zip(ghosts, tasks)]
        elapsed = time.monotonic() - start
        for out in outs:
            assert out["outcome"] == "timeout" and "no rank answered" in out["reason"], out
        assert elapsed < 6.0
        # The ranks ran the tasks and keep serving everyone else at once.
        t0 = time.monotonic()
        ok(serving.call("run", op="fill", dst=[4], tier="gpu", seed=4, timeout=5))
        figure("task latency right after unreachable results", time.monotonic() - t0)

        # Both ranks ran the ghosts' tasks (their results queue towards addresses
        # that never answer; the PUSH sends are NOBLOCK, bounded by its HWM).
        def counted():
            ranks = serving.call("status")["ranks"]
            return all(r["stats"].get("tasks_ok", 0) >= before[r["rank"]] + 3 for r in ranks)

        wait_until(counted, 5, "both ranks report the ghosts' tasks and ours done")
    finally:
        for g in ghosts:
            g.close()


def test_a_client_restarted_on_a_fixed_result_address_never_takes_its_predecessors_results(serving, bus, lab):
    """ZKV_RESULT_ADDR with a fixed port (docs/deploy.md, for firewalls) means a
    restarted client binds the address its predecessor's results still travel
    to; results carry only the task id, so ids must not repeat across the two."""
    run = serving.call
    fixed = f"tcp://{lab.hosts['client'].ip}:6000"
    assert run("pause")["state"] == "paused"
    try:
        before = bus.client(name="before-restart", reply_to=fixed)
        before.call("submit", op="fill", dst=[999], tier="gpu", timeout=30)  # fails on every rank: out of range
        before.close()
        after = bus.client(name="after-restart", reply_to=fixed)
        task = after.call("submit", op="fill", dst=[16], tier="gpu", seed=16, timeout=10)
    finally:
        run("resume")
    try:
        ok(after.call("wait", within=15, task=task))
    finally:
        after.close()


def test_rank_link_down_fails_its_tasks_and_pause_then_it_comes_back(serving, lab):
    run = serving.call
    lab.link("rank1", up=False)
    down = time.monotonic()
    try:
        tasks = [run("submit", op="fill", dst=[6 + i], tier="gpu", seed=i, timeout=20) for i in range(3)]
        pause = run("send_request", kind="pause", timeout_ms=15000)
        outs = [run("wait", within=25, task=t) for t in tasks]
        figure("link down -> rank 1's tasks failed", time.monotonic() - down)
        for out in outs:
            assert out["outcome"] == "failed" and "rank 1" in out["reason"], out
        with pytest.raises(H.AgentError) as err:
            run("await_reply", within=20, req=pause, timeout=15)
        assert err.value.code == "rank_dead" and "rank 1" in err.value.reason
        assert time.monotonic() - down < LIVENESS_S + 1.5
        st = run("status")
        assert st["state"] == "running" and [r["alive"] for r in st["ranks"]] == [True, False]
    finally:
        lab.link("rank1", up=True)
    up = time.monotonic()
    run("status", within=35, timeout=30, wait_ranks=2)
    figure("link up -> rank 1 registered", time.monotonic() - up)
    ok(run("run", op="fill", dst=[9], tier="gpu", seed=9, timeout=10))
    figure("link up -> first task ok on both ranks", time.monotonic() - up)
    assert run("pause")["ranks_acked"] == 2 and run("resume")["state"] == "running"


def test_pause_while_a_rank_is_cut_off_completes_without_it_and_it_rejoins_paused(serving, lab):
    run = serving.call
    lab.link("rank1", up=False)
    try:
        wait_until(lambda: not run("status")["ranks"][1]["alive"], LIVENESS_S + 3, "rank 1 declared dead")
        paused = run("pause")  # completes on every *live* rank (docs/protocol.md 10.4)
        assert paused["state"] == "paused" and paused["ranks_acked"] == 1
    finally:
        lab.link("rank1", up=True)
    st = run("status", within=35, timeout=30, wait_ranks=2)
    assert st["state"] == "paused"  # the returning rank learned it from its welcome
    held = run("submit", op="fill", dst=[14], tier="gpu", seed=14, timeout=20)
    assert run("status")["queued"] == 1
    resumed = run("resume")
    assert resumed["state"] == "running" and resumed["ranks_acked"] == 2
    ok(run("wait", task=held))


def test_after_a_long_outage_the_first_task_succeeds(serving, lab):
    """The rank's READY gets through before the broker's welcome does (each TCP
    direction leaves retransmission backoff on its own); the rank repeats it
    with the same session meanwhile, so the broker never takes it for a
    restart (tests/test_reregister_race.py is the exact interleaving)."""
    run = serving.call
    lab.link("rank1", up=False)
    try:
        # The outage's length is what is under test: past two liveness windows
        # (two READYs queued) and short of the ZMTP heartbeat timeout (5 s),
        # which would drop the connection and the READYs queued on it.
        time.sleep(2.25 * LIVENESS_S)
    finally:
        lab.link("rank1", up=True)
    up = time.monotonic()
    run("status", within=35, timeout=30, wait_ranks=2)
    first = run("run", op="fill", dst=[15], tier="gpu", seed=15, timeout=10)
    figure("4.5 s outage: link up -> first task ended", time.monotonic() - up)
    ok(run("run", op="fill", dst=[15], tier="gpu", seed=15, timeout=10))  # the bus serves either way
    ok(first)


def test_broker_restart_ranks_reregister(serving, bus, lab):
    run = serving.call
    ok(run("run", op="fill", dst=[12], tier="gpu", seed=12))
    kept = digests(run("run", op="checksum", src=[12], tier="gpu"))
    assert lab.stop(bus.broker) == 0
    restart = time.monotonic()
    bus.start_broker()
    st = run("status", within=35, timeout=30, wait_ranks=2)
    figure("broker restart -> both ranks registered", time.monotonic() - restart)
    assert st["state"] == "running"
    assert digests(run("run", op="checksum", src=[12], tier="gpu", timeout=10)) == kept  # the ranks kept their caches
    figure("broker restart -> first task ok", time.monotonic() - restart)
