"""What the vLLM scheduler knows of its zkv bus (docs/engine-vllm.md, "What
holds"): running or not, and its generations.  No vLLM import: tested on its own.

vLLM's scheduler thread asks at every step, so the view must not make it
wait on the bus.  It hears the broker's control broadcasts (the PUB every
rank hears, docs/protocol.md §8): a pause or clear stops serving at once,
with no round trip.  A broadcast resume of a new epoch is the one moment
it asks ``status`` and waits for the answer (bounded by ``timeout``: the
bus just spoke, and the new generations must be known before a lookup
hits), and so is the first look at a bus it never heard from (an engine's
first request; a bus that does not answer then costs ``timeout`` every
``backoff``).  Otherwise ``status`` is only the fallback that heals a lost
broadcast and notices ranks that died: sent every ``interval`` seconds and
read at a later step, never waited for; one not answered within
``timeout`` stops serving, and the next is asked only after ``backoff``."""

from __future__ import annotations

import logging

import zmq

from ...client.client import Client
from ...net.endpoints import make_socket
from ...net.frames import ready_messages
from ...wire import protocol as P
from ...wire.errors import ZkvError
from ...wire.fast import decoder
from ...wire.replies import StatusReply
from ...wire.sockets import RANK_SUB
from ...wire.vocab import BusState, ControlOp

log = logging.getLogger("zkv.vllm")
_decode_control = decoder(RANK_SUB)  # the SUB's one decoder (wire/sockets.py)


class BusView:
    """What the manager knows of its bus (see the module docstring).
    ``control``: the broker's PUB address (None: the status poll alone)."""

    def __init__(
        self,
        client: Client,
        world: int,
        interval: float,
        timeout: float = 0.25,
        backoff: float = 2.0,
        control: str | None = None,
    ):
        self.client = client
        self.world = world
        self.interval = interval
        self.timeout = timeout
        self.backoff = backoff
        self.next_check = -float("inf")
        self.serving = False
        self.gen: int | None = None
        self.cpu_gen: int | None = None
        self.weights: str | None = None  # the name the bus's last clear gave the weights (status's ``weights``)
        self.epoch: int | None = None  # of the last control broadcast heard
        self.heard = 0  # control broadcasts that changed what the view knew
        self._pending: tuple[int, float] | None = None  # (req, sent at) of a status not answered yet
        self.sub: zmq.Socket | None = None
        if control is not None:
            self.sub = make_socket(zmq.Context.instance(), zmq.SUB)
            self.sub.setsockopt(zmq.SUBSCRIBE, b"")
            self.sub.connect(control)

    def refresh(self, now: float, force: bool = False) -> bool:
        """True when the generations moved since the last look.  ``force``: ask and wait
        (bounded) now, for a caller whose decision needs the bus's state of this moment."""
        moved = self._hear(now)
        if force:
            self._pending = None
            return self._ask_and_wait(now) or moved
        if self._pending is not None:
            req, sent = self._pending
            try:
                reply = self.client.take_reply(req)
            except ZkvError as err:
                return self._unanswered(now, str(err)) or moved
            if reply is None:
                if now - sent > self.timeout:
                    return self._unanswered(now, f"no status reply within {self.timeout:.3g} s") or moved
                return moved
            self._pending = None
            assert isinstance(reply, StatusReply), reply
            return self._take(reply) or moved
        if now >= self.next_check:
            if self.gen is None:  # never heard from the bus: know it before a lookup answers (bounded)
                return self._ask_and_wait(now) or moved
            self.next_check = now + self.interval
            try:
                self._pending = (self.client.send_request("status"), now)
            except ZkvError as err:
                return self._unanswered(now, str(err)) or moved
        return moved

    def _hear(self, now: float) -> bool:
        """The control broadcasts queued since the last look (never waits)."""
        if self.sub is None:
            return False
        moved = False
        for frames in ready_messages(self.sub, 64):
            try:
                msg = _decode_control(frames[0])
            except P.ProtocolError:
                continue
            if msg.epoch == self.epoch:
                continue  # the broker repeats its state: only news counts
            self.epoch = msg.epoch
            self.heard += 1
            if msg.op is not ControlOp.RESUME:
                self.serving = False  # paused or cleared: not one more lookup hits
                self._pending = None  # a status asked before it would say running: older news
            else:
                self._pending = None
                moved = self._ask_and_wait(now) or moved
        return moved

    def _ask_and_wait(self, now: float) -> bool:
        self.next_check = now + self.interval
        try:
            return self._take(self.client.status(timeout=self.timeout))
        except ZkvError as err:
            return self._unanswered(now, str(err))

    def _take(self, st: StatusReply) -> bool:
        self.serving = st.state == BusState.RUNNING and len(st.alive_ranks) >= self.world
        moved = (st.gen, st.cpu_gen) != (self.gen, self.cpu_gen)
        self.gen, self.cpu_gen = st.gen, st.cpu_gen
        self.weights = st.weights
        return moved

    def _unanswered(self, now: float, why: str) -> bool:
        if self.serving:
            log.warning("zkv bus not answering (%s): offload off until it does", why)
        self.serving = False
        self._pending = None
        self.next_check = now + self.backoff  # not ``interval``: one slow answer must not turn offload off for a minute
        return False

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close(linger=0)
            self.sub = None
