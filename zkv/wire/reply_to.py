"""The result addresses a client may name (``reply_to``, docs/protocol.md
§2.1): the one check the broker makes at submit and a rank makes again
before it connects."""

from __future__ import annotations

import functools
import ipaddress
from typing import Any

from .bounds import MAX_ADDRESS


def is_result_address(address: Any) -> bool:
    """``result_address_ok``, remembered for the last few strings: every task
    names its client's address, and a tcp:// one costs an ``ipaddress`` parse
    (~2 us) at the broker and again at each rank."""
    if not isinstance(address, str):
        return False  # nothing else to remember (a list would not hash)
    return _remembered(address)


def result_address_ok(address: Any) -> bool:
    """A ``reply_to`` a rank may connect to (docs/protocol.md §2.1): ``ipc://PATH``
    or ``tcp://IP:PORT`` with a numeric address (IPv6 in brackets), bounded.
    An inproc:// name would resolve inside the rank's own Context (its stop
    and report sockets), and a host name would make the rank run name lookups
    a client chose, on the libzmq I/O thread that also carries its broker
    connection (retried at every reconnect), so both are refused at the broker
    and again at the rank.  Only the one spelling libzmq reports as
    ``ZMQ_LAST_ENDPOINT`` passes: no leading zeros, no wildcard or multicast
    host, no IPv6 zone, IPv6 only in brackets (unbracketed, ``::1:5555`` reads
    as an address and a port, or as an address alone)."""
    if not isinstance(address, str) or len(address) > MAX_ADDRESS or "\x00" in address:
        return False
    if address.startswith("ipc://"):
        return len(address) > len("ipc://")
    if not address.startswith("tcp://"):
        return False
    host, _, port = address[len("tcp://") :].rpartition(":")
    if not (port.isascii() and port.isdigit() and port[0] != "0" and int(port) < 65536):
        return False
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.IPv6Address(host[1:-1]) if bracketed else ipaddress.IPv4Address(host)
    except ValueError:  # an IPv4 part with a leading zero too (Python >= 3.9.5)
        return False
    return not (ip.is_unspecified or ip.is_multicast or "%" in host)


_remembered = functools.lru_cache(maxsize=256)(result_address_ok)  # a pure check of a str: safe to remember
