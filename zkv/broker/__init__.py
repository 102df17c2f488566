"""The broker: ``core`` is its state machine (events in, actions out, no
sockets), ``loop`` the ZMQ loop that moves frames for it."""

from .core import BrokerConfig, BrokerCore
from .loop import Broker

__all__ = ["Broker", "BrokerConfig", "BrokerCore"]
