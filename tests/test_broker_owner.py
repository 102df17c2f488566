"""One broker per place: a second broker on the same ipc paths is refused
and touches nothing of the first; a killed broker's place can be taken again."""

import os
import signal
import subprocess
import sys

import pytest

from zkv import Client
from zkv.broker.core import BrokerConfig
from zkv.broker.loop import Broker
from zkv.broker.owner_lock import BrokerInUse
from zkv.net.endpoints import Endpoints


def _files(directory):
    return sorted(p.name for p in directory.iterdir())


def test_a_second_broker_in_the_same_place_is_refused_and_the_first_keeps_its_files(tmp_path):
    ep = Endpoints.in_dir(tmp_path)
    first = Broker(ep, BrokerConfig(world=1))
    try:
        before = _files(tmp_path)
        assert {"frontend.sock", "backend.sock", "control.sock", "broker.lock"} <= set(before)
        with pytest.raises(BrokerInUse, match=f"pid {os.getpid()}"):
            Broker(ep, BrokerConfig(world=1))
        assert _files(tmp_path) == before  # nothing unlinked, nothing overwritten
    finally:
        first.close()
    assert "broker.lock" not in _files(tmp_path) and "frontend.sock" not in _files(tmp_path)
    Broker(ep, BrokerConfig(world=1)).close()  # released: the place is free again


def test_the_cli_broker_refuses_a_live_bus_and_the_bus_stays_reachable(tmp_path):
    env = dict(os.environ, ZKV_RUNTIME_DIR=str(tmp_path))
    first = subprocess.Popen(
        [sys.executable, "-m", "zkv", "broker", "--world-size", "1"], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert "zkv broker: clients" in first.stderr.readline()  # bound and serving
        second = subprocess.run(
            [sys.executable, "-m", "zkv", "broker", "--world-size", "2"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 1, second.stderr
        assert f"another broker (pid {first.pid})" in second.stderr
        assert "Traceback" not in second.stderr
        with Client(Endpoints.in_dir(tmp_path).frontend, request_timeout=10) as c:
            assert c.ping().op == "ping"  # the first bus still answers on its own paths
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        first.stderr.close()
    # kill -9 leaves the files but not the lock: a new broker takes the place
    Broker(Endpoints.in_dir(tmp_path), BrokerConfig(world=1)).close()
