"""Waiting on the bus from a test: poll status until a condition holds, within a bound."""

from __future__ import annotations

import time

from zkv.client import StatusReply


def wait_for(client, predicate, what: str, timeout: float = 20.0, every: float = 0.05) -> StatusReply:
    """Poll status (each call is one bounded round trip) until ``predicate`` holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        st = client.status()
        if predicate(st):
            return st
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {st.state} gen {st.gen}; {st}"
        client.poll(every)
