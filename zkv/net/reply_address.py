"""Where a client's result PULL listens, and the address it tells ranks to push to.

Ranks connect to the ``reply_to`` a client sends, from their own hosts, so
``127.0.0.1`` only works when every rank runs on the client's host.  For a
``tcp://`` broker the default is therefore the local address of the interface
that routes to the broker (found by connecting a UDP socket, which sends no
packet): a loopback broker keeps a loopback PULL, a remote broker gets a PULL
on the network it is reached through.  ``ZKV_RESULT_ADDR`` (the bind address)
and ``ZKV_RESULT_ADVERTISE`` (what goes into tasks, for NAT or a wildcard
bind) override that when the ranks reach clients over another network.
"""

from __future__ import annotations

import logging
import os
import socket

import zmq

log = logging.getLogger("zkv.client")

_WILDCARDS = ("0.0.0.0", "::", "*")


def split_tcp(address: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` -> (HOST without brackets, PORT); ValueError otherwise."""
    if not address.startswith("tcp://") or ":" not in address[len("tcp://") :]:
        raise ValueError(f"{address!r} is not a tcp://HOST:PORT address")
    host, port = address[len("tcp://") :].rsplit(":", 1)
    return host.strip("[]"), port


def join_tcp(host: str, port: str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def route_source(broker: str) -> str:
    """The local IP address the kernel would use to reach ``broker``'s host
    (a UDP ``connect`` only looks up the route); loopback if there is none."""
    host, port = split_tcp(broker)
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, int(port) if port.isdigit() else 9, type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return probe.getsockname()[0]
    except OSError as err:
        log.warning("no route to the broker host %s (%s); results bind on loopback (set ZKV_RESULT_ADDR)", host, err)
        return "127.0.0.1"


def default_bind(broker: str) -> str | None:
    """The PULL bind address when the caller gives none: ``ZKV_RESULT_ADDR``,
    else for a tcp:// broker the routed local address on any port; None
    (the caller picks an ipc:// path) for an ipc:// broker."""
    env = os.environ.get("ZKV_RESULT_ADDR")
    if env:
        return env
    if broker.startswith("tcp://"):
        return join_tcp(route_source(broker), "*")
    return None


def advertised(bound: str, broker: str, advertise: str | None = None) -> str:
    """The ``reply_to`` for tasks: ``advertise`` (``ZKV_RESULT_ADVERTISE``) if
    set, with a ``*`` port taken from the bound endpoint; else the bound
    endpoint, with a wildcard host replaced by the address routing to the broker."""
    advertise = advertise or os.environ.get("ZKV_RESULT_ADVERTISE") or None
    if not bound.startswith("tcp://"):
        return advertise or bound
    host, port = split_tcp(bound)
    if advertise:
        a_host, a_port = split_tcp(advertise)
        return join_tcp(a_host, port if a_port == "*" else a_port)
    if host in _WILDCARDS and broker.startswith("tcp://"):
        return join_tcp(route_source(broker), port)
    return bound


def connect_result(sock: zmq.Socket, address: str) -> None:
    """Connect a rank's result PUSH to a client's ``reply_to``.  An IPv6
    address (``tcp://[IP]:PORT``, docs/protocol.md §2.1) needs ``ZMQ_IPV6``:
    without it libzmq takes the connect and never delivers a message."""
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(address)
