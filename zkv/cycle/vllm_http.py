"""The cycle's driver for a vLLM server over HTTP and its zkv bus
(docs/engine-vllm.md, "A fleet of vLLM servers"): each call one of the
server's RL routes (``http.py``), bounded; no vLLM import, so a trainer's
process (and ``zkv cycle``) needs neither vLLM nor torch."""

from __future__ import annotations

import hashlib
import time
from typing import Any

from ..fleet.spec import BusSpec
from .bus import LinkedBus, WithBus
from .engine import Look, StepFailed
from .http import ServerError, VllmServer
from .terms import PauseMode, Reach


def checksum_digest(checksums: dict[str, str]) -> str:
    """One digest over vLLM's checksum of every weight (``/weight_checker``, ``compute_weight_checksums``)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(checksums):
        h.update(f"{name}={checksums[name]};".encode())
    return h.hexdigest()


def _failed(err: ServerError) -> StepFailed:
    reach = Reach.DOWN if err.down else Reach.HUNG if err.hung else Reach.ANSWERED
    return StepFailed(err.why, reach, sent=not err.down)


class ServerEngine(WithBus):
    """A vLLM server at ``url`` (``http://host:port``) with its bus at ``bus``
    (None: a server without zkv, its bus steps skipped)."""

    clears_before_update = False  # vLLM owns its KV memory: its bus is only paused until the commit

    def __init__(self, name: str, url: str, bus: BusSpec | str | dict[str, Any] | None, call_timeout: float = 30.0):
        self.name = name
        self.server = VllmServer(url, call_timeout)
        self.bus = LinkedBus(name, bus) if bus is not None else None

    @property
    def url(self) -> str:
        return self.server.url

    def _do(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ServerError as err:
            raise _failed(err) from None

    def look(self, sleep: bool, timeout: float) -> Look:
        """``/health``, then ``/is_paused`` (or ``/is_sleeping``) and its label, within ``timeout`` in all."""
        s = self.server
        end = time.monotonic() + timeout
        self._do(s.health, timeout)
        paused = self._do(s.is_sleeping if sleep else s.is_paused, end - time.monotonic())
        return Look(bool(paused), self._do(s.weight_version, end - time.monotonic()))

    def model_path(self, timeout: float) -> str | None:
        return self._do(self.server.model_root, timeout)

    def set_label(self, label: str, timeout: float) -> None:
        self._do(self.server.set_weight_version, label, timeout)

    def stop(self, mode: PauseMode, sleep: bool, timeout: float) -> None:
        if sleep:
            self._do(self.server.sleep, 0, str(mode), timeout)
        else:
            self._do(self.server.pause, str(mode), timeout)

    def start(self, sleep: bool, timeout: float) -> None:
        if sleep:
            self._do(self.server.wake_up, None, timeout)
        else:
            self._do(self.server.resume, timeout)

    def reload_weights(self, path: str, timeout: float) -> None:
        self._do(self.server.reload_weights, path, timeout)

    def weights(self, timeout: float) -> str:
        return checksum_digest(self._do(self.server.weight_checksums, timeout))

    def reset(self, running: bool, external: bool, timeout: float) -> bool:
        return bool(self._do(self.server.reset_prefix_cache, running, timeout, external))
