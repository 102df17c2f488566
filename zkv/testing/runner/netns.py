"""Many hosts on one machine: network namespaces for a broker, ranks and clients.

Loopback and ``ipc://`` hide what TCP between hosts does (a peer that is not
there yet, a link that goes down, an address that is not 127.0.0.1).  This
harness gives every role its own network stack: one namespace per host, each
with a veth ``eth0`` on a private subnet, plugged into a bridge that lives in
a namespace of its own, so nothing of it touches the machine's real network.
It runs processes in those namespaces with ``ip netns exec`` (``netns_bus``
lays the real CLI, ``python -m zkv broker`` / ``worker``, out on them), and
clients as a small agent process that drives ``zkv.Client`` and answers JSON
lines, so a test can talk to a client that lives on another "host".

It imports nothing from zkv: what runs in the namespaces is what a user runs.
Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2; ``unavailable()``
says why not.  Every name carries the creating pid; ``close()`` (and a later
run, for namespaces whose creator died) removes them, and every child
process gets SIGKILL if the harness process dies.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

PREFIX = "zkvmh"  # every namespace this harness makes: zkvmh<pid>-<role>


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` failed (needs root / CAP_SYS_ADMIN): {made.stderr.strip()}"
        veth = _ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1", check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair (kernel veth support): {veth.stderr.strip()}"
        bridge = _ip("-n", probe, "link", "add", "probebr", "type", "bridge", check=False)
        if bridge.returncode != 0:
            return f"cannot create a bridge (kernel bridge support): {bridge.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", probe, check=False)


def remove_stale() -> list[str]:
    """Delete namespaces left by harness processes that no longer exist."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the harness dies (PR_SET_PDEATHSIG
    survives the exec that ``ip netns exec`` does)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


@dataclass
class Host:
    """One simulated machine: a namespace with one address on the subnet."""

    role: str
    ns: str
    ip: str
    port: str  # its cable: the veth end on the bridge, in the switch namespace

    def tcp(self, port: int | str) -> str:
        return f"tcp://{self.ip}:{port}"


@dataclass
class Proc:
    name: str
    host: Host
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Lab:
    """A switch namespace with a bridge and one namespace per host."""

    def __init__(self, roles: Sequence[str], subnet: str = "10.77.0", workdir: str | Path | None = None):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.subnet = subnet
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {
            role: Host(role, f"{self.tag}-{role}", f"{subnet}.{10 + i}", f"v{i}") for i, role in enumerate(roles)
        }
        self.procs: list[Proc] = []
        self._made: list[str] = []

    # --- the network -----------------------------------------------------------------

    def create(self) -> "Lab":
        remove_stale()
        try:
            self._add_ns(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts.values():
                self._add_ns(host.ns)
                _ip(
                    "-n",
                    self.switch,
                    "link",
                    "add",
                    host.port,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    host.ns,
                )
                _ip("-n", self.switch, "link", "set", host.port, "master", "br0")
                _ip("-n", self.switch, "link", "set", host.port, "up")
                _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
                _ip("-n", host.ns, "link", "set", "eth0", "up")
                _ip("-n", host.ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def link(self, role: str, up: bool) -> None:
        """Plug or pull ``role``'s cable (its port on the bridge): the host keeps
        its address and its processes, and its packets go nowhere."""
        _ip("-n", self.switch, "link", "set", self.hosts[role].port, "up" if up else "down")

    def add_address(self, role: str, address: str) -> None:
        """A second address on ``role`` (on its loopback device, off the
        subnet): the host can bind it, no other host has a route to it."""
        _ip("-n", self.hosts[role].ns, "addr", "add", f"{address}/32", "dev", "lo")

    # --- processes -------------------------------------------------------------------

    def spawn(
        self,
        role: str,
        name: str,
        argv: Sequence[str],
        *,
        stdin: Any = subprocess.DEVNULL,
        stdout: Any = None,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Run ``argv`` on ``role``'s host; its stderr (and stdout unless piped) go to a log."""
        host = self.hosts[role]
        log = self.dir / f"{name}.log"
        logf = open(log, "ab")
        shm = self.dir / f"shm-{role}"  # each host its own /dev/shm: tier files and rank locks are per host
        shm.mkdir(exist_ok=True)
        full_env = {"ZKV_TIER_DIR": str(shm), **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        popen = subprocess.Popen(
            ["ip", "netns", "exec", host.ns, *argv],
            stdin=stdin,
            stdout=logf if stdout is None else stdout,
            stderr=logf,
            env=full_env,
            preexec_fn=_die_with_parent,
            start_new_session=True,
        )
        logf.close()
        proc = Proc(name, host, popen, log)
        self.procs.append(proc)
        return proc

    def stop(self, proc: Proc, timeout: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
            try:
                proc.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(5)
        if proc in self.procs:
            self.procs.remove(proc)
        return proc.popen.returncode

    def logs(self) -> str:
        return "\n".join(f"--- {p.name} on {p.host.role} ({p.host.ip}) ---\n{p.tail()}" for p in self.procs)

    def close(self) -> None:
        """Stop every process and delete every namespace (and so every veth and the bridge)."""
        for proc in list(self.procs):
            try:
                self.stop(proc, timeout=3)
            except Exception:
                proc.popen.kill()
        for name in reversed(self._made):
            _ip("netns", "del", name, check=False)
        self._made.clear()
        if self._own_dir and not os.environ.get("ZKV_NETNS_KEEP"):
            shutil.rmtree(self.dir, ignore_errors=True)  # logs and secret keys

    def __enter__(self) -> "Lab":
        return self.create()

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- the client agent ------------------------------------------------------------------

AGENT = r"""
import json, sys, time
from zkv import Client, ZkvError
from zkv.net.curve import Curve

cfg = json.loads(sys.argv[1])
curve = Curve(**cfg["curve"]) if cfg.get("curve") else None
client = Client(cfg["broker"], curve=curve, reply_to=cfg.get("reply_to"), advertise=cfg.get("advertise"),
                request_timeout=cfg.get("request_timeout", 10.0))

def outcome(out):
    return {"task": out.task, "outcome": out.outcome, "reason": out.reason, "bytes": out.bytes,
            "ranks": {str(r): {"outcome": res.get("outcome"), "digests": [d.hex() for d in res.get("digests", [])]}
                      for r, res in out.per_rank.items()}}

def keyed(a):  # a put's or get's keys (hex in the JSON line) and namespace, for Client.submit
    return {"keys": [bytes.fromhex(k) for k in a["keys"]], "ns": a["ns"]} if a.get("keys") else {}

def call(method, a):
    op = method
    if op == "reply_to":
        return client.reply_to
    if op == "submit":
        return client.submit(a["op"], a.get("src"), a.get("dst"), a.get("timeout", 10.0),
                             tier=a.get("tier"), seed=a.get("seed"), **keyed(a))
    if op == "wait":
        return outcome(client.wait(a["task"], a.get("timeout")))
    if op == "run":
        return outcome(client.run(a["op"], a.get("src"), a.get("dst"), a.get("timeout", 10.0),
                                  tier=a.get("tier"), seed=a.get("seed"), **keyed(a)))
    if op == "send_request":
        return client.send_request(a.pop("kind"), **a)
    if op == "await_reply":
        return client.await_reply(a["req"], a.get("timeout")).as_dict()
    if op in ("pause", "clear", "resume", "status", "ping"):
        return getattr(client, op)(**a).as_dict()  # the reply's map: it travels back as JSON
    raise ValueError(f"unknown agent op {op!r}")

print(json.dumps({"ready": client.reply_to}), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    try:
        value = call(msg["method"], msg.get("args", {}))
        print(json.dumps({"ok": True, "value": value}, default=str), flush=True)
    except ZkvError as err:
        print(json.dumps({"ok": False, "code": err.code, "reason": err.reason}), flush=True)
    except Exception as err:
        print(json.dumps({"ok": False, "code": type(err).__name__, "reason": str(err)}), flush=True)
client.close()
"""


class AgentError(Exception):
    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


class ClientAgent:
    """A zkv.Client living on another host; each call is one JSON line each way,
    bounded by a timeout so a wedged client fails the test instead of hanging it."""

    def __init__(self, lab: Lab, role: str, name: str, config: dict, start_timeout: float = 20.0):
        self.lab = lab
        self.proc = lab.spawn(
            role, name, [sys.executable, "-c", AGENT, json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self._buf = b""
        self.reply_to = self._read(start_timeout)["ready"]

    def _read(self, timeout: float) -> dict:
        out = self.proc.popen.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"client agent {self.proc.name} did not answer within {timeout} s\n{self.proc.tail()}"
                )
            if select.select([out], [], [], left)[0]:
                chunk = os.read(out.fileno(), 65536)
                if not chunk:
                    raise EOFError(f"client agent {self.proc.name} exited\n{self.proc.tail()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def call(self, method: str, /, within: float = 30.0, **args: Any) -> Any:
        """Run ``method`` (a Client method, or submit/wait/run) in the agent; raises
        AgentError for a ZkvError there, TimeoutError if no answer ``within`` s."""
        stdin = self.proc.popen.stdin
        assert stdin is not None
        stdin.write((json.dumps({"method": method, "args": args}) + "\n").encode())
        stdin.flush()
        reply = self._read(within)
        if not reply["ok"]:
            raise AgentError(reply["code"], reply["reason"])
        return reply["value"]

    def close(self) -> None:
        if self.proc.popen.stdin:
            self.proc.popen.stdin.close()
        self.lab.stop(self.proc, timeout=5)
