"""The tests' real ``redis-server`` (``zkv.testing.redis_server``): skipped saying why where
it is not installed, and failed instead with ``CI=true`` (tests/redis_setup.sh installs it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zkv.testing.redis_server import REDIS
from zkv.testing.redis_server import RedisServer as _Server


def require_redis() -> None:
    if REDIS is None:
        why = "redis-server is not installed (bash tests/redis_setup.sh)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


def RedisServer(directory: Path, maxmemory: str = "256mb", timeout: float = 1.0) -> _Server:  # noqa: N802 - a class to its callers
    require_redis()
    return _Server(directory, maxmemory, timeout)
