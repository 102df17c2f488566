"""The harness's zygote forks real worker processes: own pid, own exit code,
output where a Popen child's would go, and only for the process that asked."""

import os
import signal
import subprocess
import sys

import pytest

from zkv.testing.runner import zygote


def test_a_forked_command_is_a_process_of_its_own_with_its_exit_code_and_output(tmp_path):
    out = open(tmp_path / "out.txt", "w")
    proc = zygote.spawn(["--version"], dict(os.environ), stdout=out, stderr=out)
    assert proc.wait(timeout=60) == 0
    out.close()
    assert proc.pid != os.getpid() and "zkv" in (tmp_path / "out.txt").read_text()
    bad = zygote.spawn(["no-such-command"], dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert bad.wait(timeout=60) == 2  # click's usage error, as `python -m zkv no-such-command` exits


def test_kill_9_kills_the_forked_worker_alone_and_wait_is_bounded():
    proc = zygote.spawn(
        ["worker", "--rank", "0", "--world-size", "1", "--backend", "ipc:///nonexistent/zkv-b.sock"],
        dict(os.environ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)  # it keeps trying to reach a broker
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    again = zygote.spawn(["--version"], dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert again.wait(timeout=60) == 0  # the zygote lives on


def test_only_the_process_that_set_the_variable_uses_a_zygote():
    assert zygote.wanted()  # tests/conftest.py set it for this process
    code = "import zkv.testing.runner.zygote as z, sys; sys.exit(0 if not z.wanted() else 1)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
