"""One vLLM OpenAI-compatible server's RL routes, as calls with a bound
(docs/engine-vllm.md, "A fleet of vLLM servers"): ``/health``, ``/pause``, ``/resume``,
``/is_paused``, ``/sleep``, ``/wake_up``, ``/is_sleeping``,
``/reset_prefix_cache``, ``/collective_rpc``, ``/update_weight_version``,
``/weight_info``, ``/weight_checker`` and ``/v1/models``.  Every call ends within its
``timeout`` (connect and read) on a connection kept between calls, and
answers or raises ``ServerError``
saying which route failed and why: a refused connection (the server is
down), a timeout (it hangs), an HTTP error with the server's own words, or
an answer that is not the JSON the route promises.  No vLLM import: the
trainer's process need not have vLLM."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from typing import Any


class ServerError(Exception):
    """A route of one server did not answer as it should; ``down``: nothing
    listens (refused), ``hung``: it did not answer in time."""

    def __init__(self, url: str, route: str, why: str, down: bool = False, hung: bool = False):
        super().__init__(f"{url}{route}: {why}")
        self.url, self.route, self.why, self.down, self.hung = url, route, why, down, hung


PAUSE_MODES = ("abort", "wait", "keep")


class VllmServer:
    """The RL routes of the server at ``url`` (``http://host:port``)."""

    def __init__(self, url: str, timeout: float = 10.0):
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"a vLLM server is an http(s)://host:port URL, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout
        self._parsed = parsed
        self._local = threading.local()  # one kept-alive connection per thread that calls

    def _connection(self, bound: float) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to the server (made anew: ``True``)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, False
        make = http.client.HTTPSConnection if self._parsed.scheme == "https" else http.client.HTTPConnection
        conn = make(self._parsed.netloc, timeout=bound)
        self._local.conn = conn
        return conn, True

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def call(
        self,
        method: str,
        route: str,
        query: dict[str, Any] | None = None,
        body: Any = None,
        timeout: float | None = None,
    ) -> Any:
        """The route's JSON answer (None for an empty body).  The connection is kept between calls
        (a server that closed an idle one is asked again on a new one, once); a call that fails drops it."""
        bound = self.timeout if timeout is None else timeout
        if bound <= 0:
            raise ServerError(self.url, route, "no time left before the deadline", hung=True)
        q = "?" + urllib.parse.urlencode({k: _q(v) for k, v in query.items()}, doseq=True) if query else ""
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        while True:
            conn, fresh = self._connection(bound)
            try:
                if conn.sock is not None:
                    conn.sock.settimeout(bound)
                else:
                    conn.timeout = bound
                conn.request(method, self._parsed.path.rstrip("/") + route + q, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                status = resp.status
                break
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as err:
                self._drop()
                if fresh:  # a new connection the server dropped: it went away
                    raise ServerError(self.url, route, f"connection lost: {err}", down=True) from None
                # an idle connection the server had closed: once more on a new one
            except (TimeoutError, socket.timeout):
                self._drop()
                raise ServerError(self.url, route, f"no answer within {bound:.1f} s", hung=True) from None
            except ConnectionRefusedError as err:
                self._drop()
                raise ServerError(self.url, route, f"unreachable: {err}", down=True) from None
            except (OSError, http.client.HTTPException) as err:
                self._drop()
                raise ServerError(self.url, route, f"connection lost: {err}", down=True) from None
        if status >= 400:
            said = raw[:500].decode(errors="replace")
            raise ServerError(self.url, route, f"HTTP {status}: {said}")
        if not raw:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(self.url, route, f"not JSON: {raw[:200]!r}") from None

    # --- the routes -------------------------------------------------------------------

    def health(self, timeout: float | None = None) -> None:
        self.call("GET", "/health", timeout=timeout)

    def pause(self, mode: str = "wait", timeout: float | None = None) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.call("POST", "/pause", {"mode": mode, "clear_cache": False}, timeout=timeout)

    def resume(self, timeout: float | None = None) -> None:
        self.call("POST", "/resume", timeout=timeout)

    def is_paused(self, timeout: float | None = None) -> bool:
        return bool(_field(self, "/is_paused", self.call("GET", "/is_paused", timeout=timeout), "is_paused"))

    def sleep(self, level: int = 0, mode: str = "wait", timeout: float | None = None) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"sleep mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.call("POST", "/sleep", {"level": level, "mode": mode}, timeout=timeout)

    def wake_up(self, tags: list[str] | None = None, timeout: float | None = None) -> None:
        self.call("POST", "/wake_up", {"tags": tags} if tags else None, timeout=timeout)  # tags=a&tags=b

    def is_sleeping(self, timeout: float | None = None) -> bool:
        return bool(_field(self, "/is_sleeping", self.call("GET", "/is_sleeping", timeout=timeout), "is_sleeping"))

    def reset_prefix_cache(self, running: bool = False, timeout: float | None = None, external: bool = True) -> bool:
        """vLLM's cache and (``external``) the connector's; False while blocks are held (the
        caller may retry).  ``running``: also the running requests' blocks (they are recomputed)."""
        query = {"reset_external": external, "reset_running_requests": running}
        said = self.call("POST", "/reset_prefix_cache", query, timeout=timeout)
        return bool(_field(self, "/reset_prefix_cache", said, "success"))

    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        return self.call("POST", "/collective_rpc", body={"method": method, "kwargs": kwargs or {}}, timeout=timeout)

    def reload_weights(self, path: str, timeout: float | None = None) -> None:
        self.collective_rpc("reload_weights", {"weights_path": path}, timeout=timeout)

    def weight_version(self, timeout: float | None = None) -> str | None:
        said = _field(self, "/weight_info", self.call("GET", "/weight_info", timeout=timeout), "weight_version")
        return None if said is None else str(said)

    def set_weight_version(self, version: str, timeout: float | None = None) -> None:
        self.call("POST", "/update_weight_version", body={"new_version": version}, timeout=timeout)

    def model_root(self, timeout: float | None = None) -> str | None:
        """Where the server loaded its model from (``/v1/models``: its first model's ``root``)."""
        said = _field(self, "/v1/models", self.call("GET", "/v1/models", timeout=timeout), "data")
        if not isinstance(said, list) or not said or not isinstance(said[0], dict):
            raise ServerError(self.url, "/v1/models", f"no model listed: {said!r}")
        root = said[0].get("root") or said[0].get("id")
        return None if root is None else str(root)

    def weight_checksums(self, timeout: float | None = None) -> dict[str, str]:
        """vLLM's own checksum of every weight on every worker (``/weight_checker``)."""
        said = self.call("POST", "/weight_checker", body={"action": "checksum"}, timeout=timeout)
        sums = _field(self, "/weight_checker", said, "checksums")
        if not isinstance(sums, dict):
            raise ServerError(self.url, "/weight_checker", f"checksums is not a map: {sums!r}")
        return {str(k): str(v) for k, v in sums.items()}


def _q(value: Any) -> Any:
    if isinstance(value, list):
        return [_q(v) for v in value]
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _field(server: VllmServer, route: str, said: Any, name: str) -> Any:
    if not isinstance(said, dict) or name not in said:
        raise ServerError(server.url, route, f"the answer has no {name!r}: {said!r}")
    return said[name]
