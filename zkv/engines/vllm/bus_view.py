"""What the vLLM scheduler knows of its zkv bus (docs/engine-vllm.md, "What
holds"): running or not, and its generations, from ``status`` at most every
``interval`` seconds.  No vLLM import: tested on its own."""

from __future__ import annotations

import logging

from ...client.client import Client
from ...wire.errors import ZkvError
from ...wire.vocab import BusState

log = logging.getLogger("zkv.vllm")


class BusView:
    """What the manager knows of its bus, refreshed by ``status`` when older
    than ``interval`` seconds.  ``serving``: running with every rank alive.

    The scheduler's thread asks, so a bus that does not answer must cost it
    little: a short timeout, then no new question for ``backoff`` seconds."""

    def __init__(self, client: Client, world: int, interval: float, timeout: float = 0.25, backoff: float = 2.0):
        self.client = client
        self.world = world
        self.interval = interval
        self.timeout = timeout
        self.backoff = backoff
        self.next_check = -float("inf")
        self.serving = False
        self.gen: int | None = None
        self.cpu_gen: int | None = None

    def refresh(self, now: float, force: bool = False) -> bool:
        """True when the generations moved since the last look."""
        if not force and now < self.next_check:
            return False
        self.next_check = now + self.interval
        try:
            st = self.client.status(timeout=self.timeout)
        except ZkvError as err:
            if self.serving:
                log.warning("zkv bus not answering (%s): offload off until it does", err)
            self.serving = False
            self.next_check = now + max(self.interval, self.backoff)
            return False
        self.serving = st.state == BusState.RUNNING and len(st.alive_ranks) >= self.world
        moved = (st.gen, st.cpu_gen) != (self.gen, self.cpu_gen)
        self.gen, self.cpu_gen = st.gen, st.cpu_gen
        return moved
