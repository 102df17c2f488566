"""The distributed tier across hosts (network namespaces, zkv/testing/runner/netns.py):
a Redis server on a host of its own, a Curve-secured bus whose two ranks run on two
other hosts, each storing its own shard in the store and reading it back bit for bit
over the network; the store's host cut off, then plugged back: its tasks fail within
the store's timeout while the ranks keep copying, and serve again once it is back."""

import os
import time

import pytest
from redis_server import REDIS

from zkv.testing.runner import netns as H
from zkv.testing.runner.netns_bus import Bus

NS = "fleet0"
KEYS = [f"{i:02x}" * 16 for i in range(4)]


@pytest.fixture(scope="module")
def lab():
    reason = H.unavailable() or (None if REDIS else "redis-server is not installed (bash tests/redis_setup.sh)")
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the multi-host store tests, but: {reason}")
        pytest.skip(reason)
    with H.Lab(["store", "broker", "rank0", "rank1", "client"], subnet="10.78.0") as lab:
        yield lab
        print(lab.logs())


@pytest.fixture(scope="module")
def cli(lab):
    ip = lab.hosts["store"].ip
    redis_args = ["--bind", ip, "--port", "6379", "--save", "", "--appendonly", "no", "--protected-mode", "no"]
    redis_args += ["--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]
    lab.spawn("store", "redis", [str(REDIS), *redis_args])
    bus = Bus(lab, worker_args=["--store", f"redis://{ip}:6379/0?timeout=1.0"]).start()
    agent = bus.client()
    agent.call("status", within=65, timeout=60, wait_ranks=2)
    yield agent
    agent.close()


def until_ok(call, within: float, **task) -> dict:
    """Run ``task`` until it ends ok (the store's host may still be starting its server)."""
    end = time.monotonic() + within
    while True:
        out = call("run", **task)
        if out["outcome"] == "ok" or time.monotonic() > end:
            return out
        time.sleep(0.2)  # nothing to wait on: the server on another host answers when it is up


def digests(out: dict) -> dict:
    assert out["outcome"] == "ok", out
    return {rank: res["digests"] for rank, res in out["ranks"].items()}


def test_each_rank_puts_and_gets_its_own_shard_over_the_network_bit_for_bit(cli):
    run = cli.call
    assert run("run", op="fill", dst=[0, 1, 2, 3], tier="cpu", seed=9)["outcome"] == "ok"
    want = digests(run("run", op="checksum", src=[0, 1, 2, 3], tier="cpu"))
    assert want["0"] != want["1"], "each rank its own shard"
    put = until_ok(run, 30, op="put", src=[0, 1, 2, 3], keys=KEYS, ns=NS)
    assert put["outcome"] == "ok", put
    got = run("run", op="get", dst=[20, 21, 22, 23], keys=KEYS, ns=NS)
    assert digests(run("run", op="checksum", src=[20, 21, 22, 23], tier="cpu")) == want, got


def test_a_store_cut_off_fails_its_tasks_in_time_and_the_ranks_keep_copying(cli, lab):
    run = cli.call
    until_ok(run, 30, op="put", src=[0], keys=KEYS[:1], ns=NS)
    lab.link("store", False)
    try:
        started = time.monotonic()
        task = run("submit", op="get", dst=[30], keys=KEYS[:1], ns=NS, timeout=30)
        swap = run("run", op="swap_out", src=[1], dst=[31])
        assert swap["outcome"] == "ok", "a copy waited on a store cut off"
        out = run("wait", task=task)
        assert out["outcome"] == "failed" and "store_down" in out["reason"], out
        assert time.monotonic() - started < 20, "the store's timeout did not bound the get"
    finally:
        lab.link("store", True)
    back = until_ok(run, 30, op="get", dst=[30], keys=KEYS[:1], ns=NS)
    assert back["outcome"] == "ok", back
