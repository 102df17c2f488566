"""Sockets and where they live: endpoints, the runtime directory, one
``make_socket`` for every socket option, and CurveZMQ (``curve``)."""

from .curve import Curve, generate_keypair
from .endpoints import Endpoints, StopSignal, check_bind_address, make_socket, runtime_dir

__all__ = ["Curve", "Endpoints", "StopSignal", "check_bind_address", "generate_keypair", "make_socket", "runtime_dir"]
