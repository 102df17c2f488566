"""The broker's recorder (``zkv broker --record FILE``): broker Record events
in, trace records appended to a file, the formatting done in a helper process."""

from __future__ import annotations

import base64
import collections
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterable, TextIO

import msgpack

from ..wire import protocol as P
from ..wire.ids import encode_ids
from ..wire.layout import CacheLayout
from ..wire.vocab import Op
from .format import _CONTROL_KEYS, LAYOUT_ENV, _now_iso, header_record


def _submit_fields(body: bytes) -> dict[str, Any]:
    try:
        b = P.decode_body(body)
    except P.ProtocolError as err:
        return {"body_b64": base64.b64encode(body).decode("ascii"), "note": f"undecodable body: {err.reason}"}
    fields: dict[str, Any] = {"op": b.op}
    if b.src:
        fields["src"] = encode_ids(b.src)
    if b.dst:
        fields["dst"] = encode_ids(b.dst)
    if b.op in (Op.FILL, Op.CHECKSUM):
        fields["tier"] = b.tier
    if b.op == Op.FILL:
        fields["seed"] = b.seed
    return fields


def encode_event(ev: dict[str, Any], t0: float) -> dict[str, Any]:
    """One broker Record event -> one trace record (times relative to ``t0``)."""
    kind = ev.get("ev")
    t = round(max(0.0, ev.get("t", t0) - t0), 6)
    if kind == "submit":
        return {
            "t": t,
            "ev": "submit",
            "client": ev.get("client"),
            "task": ev.get("task"),
            **_submit_fields(ev.get("body", b"")),
        }
    rest = {k: v for k, v in ev.items() if k not in ("ev", "t", "op", "body")}
    if kind == "request":
        return {"t": t, "ev": ev.get("op"), **{k: v for k, v in rest.items() if k in _CONTROL_KEYS}}
    if kind == "outcome":
        if not rest.get("reason"):
            rest.pop("reason", None)
        return {"t": t, "ev": "outcome", **rest}
    op = {"op": ev["op"]} if "op" in ev else {}
    if kind in ("control", "rank"):
        return {"t": t, "ev": kind, **op, **rest}
    return {"t": t, "ev": "note", "event": kind, **op, **rest}


def format_events(events: Iterable[dict[str, Any]], t0: float) -> tuple[str, int, int]:
    """JSON lines for a batch of events: (text, lines, events that failed to encode)."""
    lines = []
    errors = 0
    for ev in events:
        try:
            lines.append(json.dumps(encode_event(ev, t0), separators=(",", ":"), default=str))
        except Exception:  # a record must never take the broker down
            errors += 1
    return ("\n".join(lines) + "\n" if lines else ""), len(lines), errors


_HELPER = "import sys, zkv.trace.recorder as t; t._helper_main(sys.argv[1], float(sys.argv[2]))"
_ACK_TIMEOUT = 30.0


def _helper_main(path: str, t0: float) -> None:
    """The recorder's writer process: msgpack batches on stdin -> JSON lines in ``path``.

    It ignores SIGINT (a Ctrl-C in the terminal must not cut the recording
    short) and ends at end of input, after writing everything it was sent.
    """
    import msgpack

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 30)
    written = errors = 0
    with open(path, "a", encoding="utf-8") as out:
        while True:
            data = sys.stdin.buffer.read1(1 << 20)  # type: ignore[union-attr]  # a BufferedReader
            if not data:
                return
            unpacker.feed(data)
            for seq, batch in unpacker:
                text, n, bad = format_events(batch, t0)
                out.write(text)
                out.flush()
                written += n
                errors += bad
                sys.stdout.buffer.write(f"{seq} {written} {errors}\n".encode())
                sys.stdout.buffer.flush()


class TraceRecorder:
    """The ``zkv broker --record FILE`` sink: ``recorder(event)`` per broker Record.

    On the broker's thread a call only appends the event to a deque (thread
    safe, about 0.1 us).  Every ``flush_interval`` seconds (0.25), and on close, a
    writer thread hands the batch, packed with msgpack (under 1 us a task), to
    a helper process that decodes task bodies, formats JSON and appends to the
    file, so that work (some 15 us a task) never runs in the broker process.
    Without the helper (it cannot start, or dies) the writer thread does it.

    Times are seconds since the recorder started.  The file is appended to:
    each broker session adds its own header (a new segment when replayed).
    """

    def __init__(
        self,
        path: str,
        world: int,
        layout: CacheLayout | dict | None = None,
        *,
        flush_interval: float = 0.25,
        clock=time.monotonic,
        helper: bool = True,
    ):
        if layout is None and os.environ.get(LAYOUT_ENV):
            try:
                layout = CacheLayout.from_wire(json.loads(os.environ[LAYOUT_ENV]))
            except (ValueError, TypeError, P.ProtocolError):
                layout = None
        self.path = path
        self.t0 = clock()
        self.flush_interval = flush_interval
        self.written = 0
        self.errors = 0
        self._queue: collections.deque[dict] = collections.deque()
        self._io = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._seq = 0
        with open(path, "a", encoding="utf-8") as f:
            f.write(
                json.dumps(header_record(world, layout, source="record", created=_now_iso(), pid=os.getpid())) + "\n"
            )
        self._file: TextIO | None = None
        self._proc: subprocess.Popen | None = None
        if helper:
            try:
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # find zkv as we did
                self._proc = subprocess.Popen(
                    [sys.executable, "-c", _HELPER, path, repr(self.t0)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    bufsize=0,
                    start_new_session=True,
                    env=env,
                )
            except OSError:
                self._proc = None
        self._thread = threading.Thread(target=self._run, name="zkv-trace-writer", daemon=True)
        self._thread.start()

    @property
    def helper_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def __call__(self, event: dict[str, Any]) -> None:
        self._queue.append(event)

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval):
            self.flush()

    def flush(self) -> None:
        """Write everything queued so far; returns once it is in the file."""
        with self._io:
            q = self._queue
            batch = [q.popleft() for _ in range(len(q))]
            if batch:
                self._write(batch)

    def _write(self, batch: list[dict]) -> None:
        if self._proc is not None:
            try:
                self._seq += 1
                self._proc.stdin.write(msgpack.packb([self._seq, batch], use_bin_type=True, default=str))  # type: ignore[union-attr]
                self._proc.stdin.flush()  # type: ignore[union-attr]
                ack = self._read_ack()
                seq, self.written, self.errors = (int(x) for x in ack.split())
                if seq == self._seq:
                    return
            except (OSError, ValueError, TypeError):
                pass
            self._helper_failed()  # the batch goes through the fallback (it may repeat a few lines)
        if self._file is None:
            self._file = open(self.path, "a", encoding="utf-8")
        text, n, bad = format_events(batch, self.t0)
        self._file.write(text)
        self._file.flush()
        self.written += n
        self.errors += bad

    def _read_ack(self) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        data = b""
        deadline = time.monotonic() + _ACK_TIMEOUT
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise OSError("the trace writer process did not answer")
            chunk = os.read(fd, 256)
            if not chunk:
                raise OSError("the trace writer process exited")
            data += chunk
        return data.decode()

    def _helper_failed(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            self.errors += 1
            proc.kill()
            proc.wait(timeout=5)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def close(self) -> None:
        """Write what is queued, stop the writer thread and the helper (bounded)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=_ACK_TIMEOUT)
        self.flush()
        with self._io:
            proc, self._proc = self._proc, None
            if proc is not None:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.close()
                try:
                    proc.wait(timeout=_ACK_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
                proc.stdout.close()
            if self._file is not None:
                self._file.close()
