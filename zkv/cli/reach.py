"""Whether a broker can answer a client command, and what to tell the operator
when it did not: a bad address is a usage error (exit 2), a broker that is
certainly absent fails at once instead of after ``--timeout``, and every hint
fits the address and the Curve settings (docs/operations.md, "When a command
cannot reach the broker")."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ..net.endpoints import Endpoints, certainly_absent, check_connect_address
from .options import fail


def usage_error(message: str) -> None:
    """One line and exit 2: the command line itself is wrong."""
    click.echo(f"zkv: error: {message}", err=True)
    sys.exit(2)


def _is_loopback(address: str) -> bool:
    host = address[len("tcp://") :].rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def start_hint(address: str) -> str:
    """How to get a broker to answer at ``address``."""
    if address.startswith("ipc://"):
        path = address[len("ipc://") :]
        if address == Endpoints.default().frontend:
            return "start one with: zkv up, or point --broker / ZKV_BROKER at yours"
        if path.endswith("/frontend.sock"):
            return f"start one there with: zkv up --runtime-dir {path[: -len('/frontend.sock')]}"
        return (
            f"start one with: zkv broker --frontend {address} (zkv up listens on DIR/frontend.sock), "
            "or point --broker / ZKV_BROKER at yours"
        )
    if _is_loopback(address):
        return f"start one with: zkv broker --frontend {address}, or point --broker / ZKV_BROKER at yours"
    return "check that its host is up, that a broker serves that port, and that the network lets you reach it"


def curve_hint(address: str, curve: Any) -> str:
    """What to check about CurveZMQ when a tcp broker does not answer."""
    if not address.startswith("tcp://"):
        return ""
    if curve is not None:
        return (
            "with CurveZMQ, a wrong key is silence: check that --curve-server is the broker's broker.key "
            "and that this client's public key is in the broker's --curve-clients directory"
        )
    if not _is_loopback(address):
        return "a broker reachable from other hosts speaks CurveZMQ: pass --curve-secret, --curve-server, --curve-ranks"
    return ""


def check_broker(address: str, curve: Any = None, probe: bool = True, as_json: bool = False) -> None:
    """Exit 2 for an address no client can use; with ``probe``, exit 1 at once
    for a broker that certainly is not there (``certainly_absent``).  With
    ``as_json`` that failure is also one JSON object on stdout, as every
    other failure of a ``--json`` command is."""
    try:
        check_connect_address(address)
    except ValueError as err:
        usage_error(f"--broker {err}")
    why = certainly_absent(address) if probe else None
    if why is not None:
        reason = f"no broker answers at {address}: {why}"
        if as_json:
            click.echo(json.dumps({"ok": False, "code": "unreachable", "reason": reason}))
        fail(reason, start_hint(address))


def hint(code: str, address: str, curve: Any, reason: str = "") -> str:
    """The hint for an error a client command got (``ZkvError.code``, its ``reason``).  A
    broker that did not reply because the two ends' security differs is told apart first
    (libzmq says so in the handshake; the client says it at once when it saw it): starting
    a broker that is running would not help."""
    if code in ("no_reply", "unreachable"):
        from ..net.handshakes import mismatch_reason

        seen = mismatch_reason(curve is not None) in reason
        why = None
        if not seen and address.startswith("tcp://"):
            from ..net.curve import security_mismatch

            why = security_mismatch(address, curve)
        if seen or why is not None:
            said = "" if seen else f"{why}: "
            if curve is None:
                return (
                    f"{said}pass --curve-secret (this client's key), --curve-server (the broker's broker.key) and "
                    "--curve-ranks, and put this client's public key in the broker's --curve-clients directory"
                )
            return f"{said}drop the --curve-* options (and ZKV_CURVE_*) for this broker"
        return "; ".join(h for h in (curve_hint(address, curve), start_hint(address)) if h)
    # not_paused and not_cleared: the broker's reason names what to run (broker/admission.py)
    return {"busy": "wait for the running operation, then retry"}.get(code, "")
