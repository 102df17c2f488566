"""Stand-in vLLM servers for fleets larger than this machine runs (docs/engine-vllm.md,
"A fleet of vLLM servers"; docs/benchmarks.md): each answers the RL routes a real
server has (``zkv/cycle/http.py`` calls them) over real HTTP on 127.0.0.1, with
its own stand-in bus answering the zkv client protocol on a real ZMQ socket, and
each takes faults and latencies as told:

- ``apply_ms`` (+ ``jitter``): a weight reload's time; ``rtt_ms``: added to every
  request (a slow network); ``pause_ms``: what its pause takes (vLLM's own is 20 ms);
- ``hang()``: every route and its bus stop answering (SIGSTOP), ``unhang()`` answers
  what waited (SIGCONT); ``kill()``: nothing listens; ``restart()``: it comes back on
  its start checkpoint (the old weights), label ``default``, a bus at a new generation;
- ``reset_false``: its prefix cache reset answers ``success: false`` that many times.

Its weights are the checkpoint it loaded (``reload_weights`` of a path that is not a
checkpoint fails as vLLM's does, HTTP 500); ``/weight_checker`` says the checkpoint's
digest.  A completion (``/v1/completions``) makes one token every ``token_ms``, each a
function of the weights it runs under, and honours the pause modes as vLLM does:
``abort`` ends it (``finish_reason: abort``), ``wait`` lets it finish before the pause
answers, ``keep`` freezes it until the resume and recomputes it under the weights
served then (a reset with running requests).

``python -m zkv.harness.cycle.standin N DIR`` serves N of them in their own process
(what ``zkv bench cycle`` times) and prints one JSON line: each server's name, URL and
bus, and a control URL (``POST /hang?i=``, ``/unhang``, ``/kill``, ``/restart``,
``/set?i=&key=&value=``)."""

from __future__ import annotations

import hashlib
import heapq
import json
import random
import signal
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import zmq

from ...cycle import checkpoint
from ...net.endpoints import Endpoints
from ...wire import protocol as P
from ...wire.messages import Clear, Error, Pause, Resume, Status
from ...wire.replies import ControlReply, StatusReply
from ...wire.vocab import BusState, ControlOp


def weights_digest(path: str) -> str:
    """What a stand-in's ``/weight_checker`` says of the checkpoint at ``path``."""
    return checkpoint.read(path).digest


def write_weights(path: str | Path, seed: int, tensors: int = 4, size: int = 256) -> str:
    """A small random checkpoint (the same names and shapes for every seed)."""
    rng = random.Random(seed)
    return checkpoint.write(
        path, {f"layer.{i}.weight": ("F32", (size // 4,), rng.randbytes(size)) for i in range(tensors)}
    )


class _Gate:
    """What stops a stand-in answering: a hang (held until ``open``)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def wait(self, timeout: float = 3600.0) -> None:
        self._open.wait(timeout)

    @property
    def closed(self) -> bool:
        return not self._open.is_set()


class StandinBus:
    """A bus that answers pause, clear, resume and status as a broker does (noops,
    ``not_paused``, generations), after ``latency_s``."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.address = Endpoints.in_dir(str(directory)).frontend
        self.state = BusState.RUNNING
        self.epoch = self.gen = self.cpu_gen = 1
        self.latency_s = 0.001
        self.gate = _Gate()
        self.socket: zmq.Socket | None = None

    def answer(self, frame: bytes) -> bytes:
        try:
            msg = P.decode(frame)
        except P.ProtocolError as err:
            return Error(code=err.code, reason=err.reason).to_wire()
        if isinstance(msg, Status):
            return StatusReply(
                msg.req, state=self.state, epoch=self.epoch, gen=self.gen, cpu_gen=self.cpu_gen
            ).to_wire()
        if isinstance(msg, Pause):
            return self._control(msg.req, ControlOp.PAUSE, BusState.RUNNING, BusState.PAUSED)
        if isinstance(msg, Clear):
            if self.state == BusState.RUNNING:
                return Error(code="not_paused", reason="clear needs a paused bus", req=msg.req).to_wire()
            if self.state == BusState.PAUSED and not msg.keep_cpu:
                self.cpu_gen += 1
            return self._control(msg.req, ControlOp.CLEAR, BusState.PAUSED, BusState.CLEARED)
        if isinstance(msg, Resume):
            return self._control(msg.req, ControlOp.RESUME, None, BusState.RUNNING)
        return Error(
            code="bad_kind", reason=f"a stand-in bus answers control requests, not {type(msg).__name__}"
        ).to_wire()

    def _control(self, req: int, op: ControlOp, source: BusState | None, to: BusState) -> bytes:
        noop = self.state == to or (op is ControlOp.PAUSE and self.state == BusState.CLEARED)
        if not noop and (source is None or self.state == source):
            self.epoch += 1
            if op is ControlOp.CLEAR:
                self.gen += 1
            self.state = to
        reply = ControlReply(req, control=op, epoch=self.epoch, gen=self.gen, state=self.state, noop=noop)
        if not noop:
            reply = ControlReply(
                req, control=op, epoch=self.epoch, gen=self.gen, state=self.state, cpu_gen=self.cpu_gen,
                ranks_acked=1, world=1, elapsed_ms=self.latency_s * 1000,
            )  # fmt: skip
        return reply.to_wire()

    def restart(self) -> None:
        self.state, self.gen, self.cpu_gen = BusState.RUNNING, self.gen + 1, self.cpu_gen + 1


class BusHost:
    """Every stand-in bus of a fleet on one thread: a poller over their ROUTERs, and
    the replies due later in a heap (no sleeping: the poll waits for the next one)."""

    def __init__(self, buses: list[StandinBus]):
        self.buses = buses
        self.ctx = zmq.Context()
        self._wake = self.ctx.socket(zmq.PAIR)
        self._wake.bind(f"inproc://standin-wake-{id(self)}")
        self._poke = self.ctx.socket(zmq.PAIR)
        self._poke.connect(f"inproc://standin-wake-{id(self)}")
        self._lock = threading.Lock()
        self._due: list[tuple[float, int, zmq.Socket, list[bytes]]] = []
        self._held: list[tuple[StandinBus, list[bytes]]] = []
        self._closing: list[zmq.Socket] = []
        self._n = 0
        self._stop = False
        for bus in buses:
            self.open(bus)
        self._thread = threading.Thread(target=self._serve, name="zkv-standin-buses", daemon=True)
        self._thread.start()

    def open(self, bus: StandinBus) -> None:
        bus.directory.mkdir(parents=True, exist_ok=True)
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(bus.address)
        bus.socket = sock
        self._poke_loop()

    def close(self, bus: StandinBus) -> None:
        with self._lock:
            sock, bus.socket = bus.socket, None
        if sock is not None:
            with self._lock:
                self._closing.append(sock)
            self._poke_loop()

    def release(self, bus: StandinBus) -> None:
        bus.gate.open()
        self._poke_loop()

    def _poke_loop(self) -> None:
        with self._lock:
            self._poke.send(b"")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake, zmq.POLLIN)
        socks: dict[zmq.Socket, StandinBus] = {}
        while not self._stop:
            socks = self._follow(poller, socks)
            timeout = None if not self._due else max(0, int((self._due[0][0] - time.monotonic()) * 1000) + 1)
            events = dict(poller.poll(timeout))
            if self._wake in events:
                while self._wake.poll(0):
                    self._wake.recv()
                with self._lock:
                    closing, self._closing = self._closing, []
                for sock in closing:
                    if sock in socks:
                        poller.unregister(sock)
                        del socks[sock]
                    sock.close(linger=0)
            for sock, bus in socks.items():
                if sock in events:
                    while sock.poll(0):
                        ident, frame = sock.recv_multipart()[:2]
                        self._held.append((bus, [ident, frame]))
            self._take_held()
            now = time.monotonic()
            while self._due and self._due[0][0] <= now:
                _, _, sock, frames = heapq.heappop(self._due)
                try:
                    sock.send_multipart(frames, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # closed (killed) meanwhile
        for b in self.buses:
            if b.socket is not None:
                b.socket.close(linger=0)

    def _follow(self, poller: zmq.Poller, socks: dict[zmq.Socket, StandinBus]) -> dict[zmq.Socket, StandinBus]:
        """The poll set follows the buses killed and started again."""
        now_open = {b.socket: b for b in self.buses if b.socket is not None}
        if now_open.keys() != socks.keys():
            for sock in socks.keys() - now_open.keys():
                poller.unregister(sock)
            for sock in now_open.keys() - socks.keys():
                poller.register(sock, zmq.POLLIN)
        return now_open

    def _take_held(self) -> None:
        keep = []
        for bus, (ident, frame) in self._held:
            if bus.gate.closed or bus.socket is None:
                if bus.socket is not None:
                    keep.append((bus, [ident, frame]))
                continue
            self._n += 1
            heapq.heappush(
                self._due, (time.monotonic() + bus.latency_s, self._n, bus.socket, [ident, bus.answer(frame)])
            )
        self._held = keep

    def stop(self) -> None:
        self._stop = True
        self._poke_loop()
        self._thread.join(5)
        self._wake.close(linger=0)
        self._poke.close(linger=0)
        self.ctx.term()


class StandinServer:
    """One stand-in vLLM server (see the module docstring) and its bus."""

    def __init__(self, name: str, model: str, root: Path, **config: Any):
        self.name = name
        self.model = model  # the checkpoint it starts from (and comes back on after a restart)
        self.weights = model
        self.digest = weights_digest(model)
        self.label: str | None = "default"
        self.paused = self.sleeping = False
        self.mode = "wait"
        self.gate = _Gate()
        self.resumed = threading.Condition()
        self.inflight = 0
        self.generation = 0  # moves at each reset with running requests: frozen requests recompute
        self.bus = StandinBus(root / f"{name}-bus")
        self.apply_ms, self.jitter, self.rtt_ms, self.pause_ms, self.token_ms = 50.0, 0.0, 0.0, 1.0, 5.0
        self.reset_false = 0
        self.calls: dict[str, int] = {}
        self.set(**config)
        self._rng = random.Random(name)
        self.httpd: ThreadingHTTPServer | None = None
        self.port = 0

    def set(self, **config: Any) -> None:
        for key, value in config.items():
            if key == "bus_ms":
                self.bus.latency_s = float(value) / 1000
            elif key in ("apply_ms", "jitter", "rtt_ms", "pause_ms", "token_ms"):
                setattr(self, key, float(value))
            elif key == "reset_false":
                self.reset_false = int(value)
            else:
                raise ValueError(f"no stand-in setting {key!r}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int = 0) -> None:
        handler = type("Handler", (_Handler,), {"server_ref": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.httpd.daemon_threads = True
        self.httpd.request_queue_size = 128
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.25}, daemon=True).start()

    def stop(self) -> None:
        if self.httpd is not None:
            self.gate.open()
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    # --- the routes --------------------------------------------------------------------

    def route(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        self.calls[path] = self.calls.get(path, 0) + 1
        if path == "/health":
            return 200, None
        if path in ("/is_paused", "/is_sleeping"):
            return 200, {path[1:]: self.sleeping if path == "/is_sleeping" else self.paused}
        if path in ("/pause", "/sleep"):
            return self._pause(query.get("mode", "abort"), sleep=path == "/sleep")
        if path in ("/resume", "/wake_up"):
            with self.resumed:
                self.paused = self.sleeping = False
                self.resumed.notify_all()
            return 200, {"status": "resumed"}
        if path == "/reset_prefix_cache":
            if self.reset_false > 0:
                self.reset_false -= 1
                return 200, {"success": False}
            if query.get("reset_running_requests") == "true":
                with self.resumed:
                    self.generation += 1
            return 200, {"success": True}
        if path == "/collective_rpc":
            return self._rpc(body or {})
        if path == "/update_weight_version":
            self.label = str((body or {}).get("new_version"))
            return 200, {"success": True, "new_version": self.label}
        if path == "/weight_info":
            return 200, {"weight_version": self.label}
        if path == "/weight_checker":
            return 200, {"checksums": {"weights": self.digest}}
        if path == "/v1/models":
            return 200, {"data": [{"id": self.model, "root": self.model}]}
        if path == "/v1/completions":
            return self._complete(body or {})
        return 404, {"error": f"no route {path}"}

    def _pause(self, mode: str, sleep: bool) -> tuple[int, Any]:
        if mode not in ("abort", "wait", "keep"):
            return 400, {"error": f"mode {mode!r}"}
        time.sleep(self.pause_ms / 1000)
        with self.resumed:
            self.mode = mode
            self.paused, self.sleeping = True, sleep or self.sleeping
            self.resumed.notify_all()
            if mode == "wait":
                self.resumed.wait_for(lambda: self.inflight == 0, timeout=600)
        return 200, {"status": "paused"}

    def _rpc(self, body: dict[str, Any]) -> tuple[int, Any]:
        if body.get("method") != "reload_weights":
            return 400, {"error": f"a stand-in runs reload_weights only, not {body.get('method')!r}"}
        path = str((body.get("kwargs") or {}).get("weights_path"))
        time.sleep(max(0.0, self.apply_ms + self._rng.uniform(-self.jitter, self.jitter)) / 1000)
        try:
            digest = weights_digest(path)
        except checkpoint.CheckpointError as err:
            return 500, {"error": f"reload_weights failed: {err}"}
        self.weights, self.digest = path, digest
        return 200, [None]

    def _complete(self, body: dict[str, Any]) -> tuple[int, Any]:
        prompt, n = list(body.get("prompt") or []), int(body.get("max_tokens", 8))
        tokens: list[int] = []
        with self.resumed:
            if self.paused:
                self.resumed.wait_for(lambda: not self.paused, timeout=600)
            self.inflight += 1
        finish = "length"
        try:
            while len(tokens) < n:
                with self.resumed:
                    if self.paused and self.mode == "abort":
                        finish = "abort"
                        break
                    if self.paused and self.mode == "keep":
                        self.resumed.wait_for(lambda: not self.paused, timeout=600)
                    h = hashlib.blake2b(f"{self.digest}:{prompt}:{len(tokens)}".encode())
                tokens.append(int.from_bytes(h.digest()[:2], "little") % 1000)
                time.sleep(self.token_ms / 1000)
        finally:
            with self.resumed:
                self.inflight -= 1
                self.resumed.notify_all()
        return 200, {"choices": [{"token_ids": tokens, "finish_reason": finish, "weights": self.weights}]}


class _Handler(BaseHTTPRequestHandler):
    server_ref: StandinServer
    protocol_version = "HTTP/1.1"  # connections kept between calls, as vLLM's server keeps them
    disable_nagle_algorithm = True  # as uvicorn: a response's headers and body do not wait for an ack

    def _serve(self, method: str) -> None:
        s = self.server_ref
        s.gate.wait()
        if s.rtt_ms:
            time.sleep(s.rtt_ms / 1000)
        url = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
        size = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(size) if size else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        status, said = s.route(method, url.path, query, body)
        s.gate.wait()  # a server stopped in the middle answers once it runs again
        data = b"" if said is None else json.dumps(said).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the caller gave up

    def do_GET(self) -> None:  # noqa: N802
        self._serve("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._serve("POST")

    def log_message(self, *args: Any) -> None:
        pass


class StandinFleet:
    """``n`` stand-in servers, each with its bus, all on checkpoint ``model``."""

    def __init__(self, n: int, root: str | Path, model: str, **config: Any):
        self.root = Path(root)
        self.servers = [StandinServer(f"engine-{i}", model, self.root, **config) for i in range(n)]
        self.host: BusHost | None = None

    def start(self) -> "StandinFleet":
        for s in self.servers:
            s.start()
        self.host = BusHost([s.bus for s in self.servers])
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        if self.host is not None:
            self.host.stop()
            self.host = None

    def __enter__(self) -> "StandinFleet":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def specs(self) -> list[tuple[str, str, str]]:
        return [(s.name, s.url, s.bus.address) for s in self.servers]

    def hang(self, i: int) -> None:
        self.servers[i].gate.close()
        self.servers[i].bus.gate.close()

    def unhang(self, i: int) -> None:
        self.servers[i].gate.open()
        assert self.host is not None
        self.host.release(self.servers[i].bus)

    def kill(self, i: int) -> None:
        s = self.servers[i]
        port = s.port
        s.stop()
        s.port = port
        assert self.host is not None
        self.host.close(s.bus)

    def restart(self, i: int) -> None:
        """Back from its command line: its start checkpoint, no label, unpaused, a new bus generation."""
        s = self.servers[i]
        s.weights, s.digest, s.label, s.paused, s.sleeping = s.model, weights_digest(s.model), "default", False, False
        s.start(s.port)
        s.bus.restart()
        assert self.host is not None
        self.host.open(s.bus)


def _control(fleet: StandinFleet) -> ThreadingHTTPServer:
    class Control(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            url = urllib.parse.urlsplit(self.path)
            q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query).items()}
            i = int(q.get("i", "0"))
            op = url.path.strip("/")
            if op == "set":
                fleet.servers[i].set(**{q["key"]: q["value"]})
            elif op in ("hang", "unhang", "kill", "restart"):
                getattr(fleet, op)(i)
            else:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Control)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def main(argv: list[str]) -> None:
    n, root = int(argv[0]), Path(argv[1])
    config = dict(a.split("=", 1) for a in argv[2:])
    model = write_weights(root / "w0", 0)
    fleet = StandinFleet(n, root, model, **config).start()
    control = _control(fleet)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: done.set())
    print(
        json.dumps({"servers": fleet.specs(), "control": f"http://127.0.0.1:{control.server_address[1]}"}), flush=True
    )
    try:
        while not done.is_set() and sys.stdin.read(1):  # ends when the parent goes (stdin closes)
            pass
    finally:
        control.shutdown()
        fleet.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
