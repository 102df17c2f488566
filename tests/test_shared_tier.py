"""What the vLLM scheduler knows of the shared store (zkv/engines/vllm/shared.py): asked
at once where that is a system call (the host tier), in the background where it is a
round trip (Redis), never waited on; a store that does not answer is taken as empty
for a while; a namespace whose weights moved is retired."""

from __future__ import annotations

import time

from redis_server import RedisServer

from zkv.engines.vllm.shared import Known, SharedTier
from zkv.rank.tiers.store_tier import FileStore, name_of, open_store


def test_a_host_tier_is_asked_at_once(tmp_path):
    store = FileStore(tmp_path, budget=1 << 20)
    store.put([name_of("ns", 0, b"there")], [b"v"])
    shared = SharedTier(FileStore(tmp_path, budget=1 << 20), "ns")
    try:
        assert shared.known(b"there") is Known.PRESENT
        assert shared.known(b"absent") is Known.ABSENT
    finally:
        shared.close()


def _until(shared: SharedTier, key: bytes, want: Known, within: float = 10.0) -> Known:
    """Ask as the scheduler does, a step at a time, until the prober learned it (bounded)."""
    end = time.monotonic() + within
    got = shared.known(key)
    while got is not want and time.monotonic() < end:
        time.sleep(0.01)  # a scheduler step: the prober answers on its own thread, telling nobody
        got = shared.known(key)
    return got


def test_a_redis_store_is_asked_in_the_background_and_a_silent_one_is_taken_as_empty(tmp_path):
    server = RedisServer(tmp_path / "redis", timeout=0.5).start()
    try:
        store = open_store(server.url)
        store.put([name_of("ns", 0, b"there")], [b"v"])
        shared = SharedTier(open_store(server.url), "ns", backoff_s=30.0)
        try:
            assert shared.known(b"there") is Known.UNKNOWN, "a round trip is never made on the scheduler's thread"
            assert _until(shared, b"there", Known.PRESENT) is Known.PRESENT
            assert _until(shared, b"absent", Known.ABSENT) is Known.ABSENT
            server.freeze()
            assert shared.known(b"other") is Known.UNKNOWN
            assert _until(shared, b"other", Known.ABSENT) is Known.ABSENT
            assert shared.known(b"there") is Known.ABSENT, "a store that did not answer is taken as empty"
            assert shared.counts["store_down"] >= 1
        finally:
            server.thaw()
            shared.close()
    finally:
        server.stop()


def test_a_namespace_whose_weights_moved_is_retired_and_nothing_learned_of_it_holds(tmp_path):
    store = FileStore(tmp_path, budget=1 << 20)
    store.put([name_of("old", 0, b"k"), name_of("old", 1, b"k")], [b"v", b"v"])
    shared = SharedTier(FileStore(tmp_path, budget=1 << 20), "old")
    try:
        assert shared.known(b"k") is Known.PRESENT
        shared.use("new", retire_old=True)
        assert shared.known(b"k") is Known.ABSENT
    finally:
        shared.close()  # the prober ends after the work queued before it: the retirement
    assert store.namespaces() == {}
