"""A keyed tier below the CPU tier that outlives one engine: a CPU row stored
under a *name* in a store other engines read too (docs/engines.md, "KV that
outlives one engine").  Two backends behind one interface (``KeyedStore``):

- ``FileStore``: a directory, a file per block, written to a temporary name
  and renamed into place (a reader sees a whole value or none).  In a host's
  ``/dev/shm`` it is the **host tier** every zkv engine on the host shares;
  on a file system shared by hosts, a tier of them all.  One byte budget for
  the directory (``budget``), whoever writes: a put over it evicts the least
  recently used files first (a hit touches its file).  A reader holds what it
  reads (an open file outlives its unlink), so nothing is evicted under it and
  a killed engine holds nothing.
- ``RedisStore``: a Redis (or Valkey) server: the **distributed tier** of a
  fleet.  zkv expects its memory policy to bound it (``maxmemory`` with an
  ``allkeys-lru`` policy: any value may go at any time; a missing value is a
  miss, never an error); every call is bounded by ``timeout``.

A name is ``zkv:<namespace>:<rank>:<key>``: the namespace is the engine's
identity (model, KV layout, weights: ``EngineIdentity.namespace``), so another
model or other weights never find a value, and a fleet retires a namespace
whole (``retire``) when its weights change.  Each value is framed: a magic,
a header naming its namespace, rank, key, the layout of its row and the row's
digest, then the row.  A get checks every field and the digest before the row
counts as written (``check_value``): a value of another name, a torn,
truncated or corrupted one is the block lost, never served.

The store is the rank's (``BlockStore.keyed``); the moves to and from it are
``put`` (CPU rows -> the store) and ``get`` (the store -> CPU rows), on the
rank's store lane (``rank/executor.py``), so a slow store never delays a copy."""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import msgpack
import numpy as np

from ..errors import CacheError
from .disk_io import RowDigest

MAGIC = b"ZKVV"
VERSION = 1
_HEAD = struct.Struct("<4sBI")  # magic, version, header length
_MAX_HEADER = 4096
_DIGEST_SEED = 0x7A6B7653544F5245  # the same on every host: engines of a namespace check each other's rows
DEFAULT_TIMEOUT_S = 1.0


def name_of(ns: str, rank: int, key: bytes) -> str:
    """The name a block's row of TP rank ``rank`` is stored under."""
    return f"zkv:{ns}:{rank}:{key.hex()}"


@dataclass(frozen=True)
class Frame:
    """What a value says of its row: whose it is and what it holds."""

    ns: str
    rank: int
    key: bytes
    layout: bytes  # the row's layout digest (``tier_file.layout_digest``)
    nbytes: int
    digest: bytes


def encode_value(frame: Frame, row: memoryview) -> bytes:
    """The framed value: header, then the row's bytes (one copy, into the result)."""
    head = msgpack.packb([frame.ns, frame.rank, frame.key, frame.layout, frame.nbytes, frame.digest], use_bin_type=True)
    return _HEAD.pack(MAGIC, VERSION, len(head)) + head + bytes(row)


def read_head(head: bytes | memoryview, want: Frame) -> bytes:
    """The stored digest of a value whose header (``head``: the value's bytes before its row)
    names ``want``'s namespace, rank, key, layout and size; ``CacheError("lost_block")``
    naming what did not (``want.digest`` is not read: a reader cannot know it)."""
    view = memoryview(head)
    shown = f"store value of key {want.key.hex()[:16]}"
    if len(view) < _HEAD.size:
        raise CacheError("lost_block", f"{shown}: truncated")
    magic, version, size = _HEAD.unpack_from(view)
    if magic != MAGIC or version != VERSION or size > _MAX_HEADER or _HEAD.size + size != len(view):
        raise CacheError("lost_block", f"{shown}: not a zkv value")
    try:
        ns, rank, key, layout, nbytes, stored = msgpack.unpackb(view[_HEAD.size :], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise CacheError("lost_block", f"{shown}: its header does not decode") from None
    if (ns, rank, key, layout, nbytes) != (want.ns, want.rank, want.key, want.layout, want.nbytes):
        raise CacheError("lost_block", f"{shown}: the value names another block ({ns}, rank {rank})")
    return stored


def head_size(value: bytes | memoryview) -> int:
    """Where a value's row starts (0: not a zkv value's start)."""
    if len(value) < _HEAD.size:
        return 0
    magic, _, size = _HEAD.unpack_from(value)
    return _HEAD.size + size if magic == MAGIC and size <= _MAX_HEADER else 0


def check_value(value: bytes | memoryview, want: Frame, digest: RowDigest) -> memoryview:
    """The row of a whole ``value`` once its header names ``want`` (``read_head``) and the row
    checks against the digest it holds; ``CacheError("lost_block")`` naming what did not."""
    view = memoryview(value)
    at = head_size(view)
    stored = read_head(view[:at] if at else view[: min(len(view), _HEAD.size)], want)
    row = view[at:]
    if len(row) != want.nbytes:
        raise CacheError("lost_block", f"store value of key {want.key.hex()[:16]}: {len(row)} bytes, not {want.nbytes}")
    if digest.of([address_of_view(row)])[0] != stored:
        raise CacheError("lost_block", f"store value of key {want.key.hex()[:16]}: its row does not check (digest)")
    return row


def address_of_view(view: memoryview) -> int:
    """Where a (read-only) buffer's bytes are, for the digest's pass over them."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class StoreDown(CacheError):
    """The store did not answer (down, slow past its timeout, refusing): every block of the call is missed."""

    def __init__(self, reason: str):
        super().__init__("store_down", reason)


class KeyedStore(ABC):
    """Values by name (see the module docstring).  Every call is bounded; one the store
    cannot answer raises ``StoreDown``.  Safe to call from one thread at a time.
    ``local``: asking whether a name is there costs a system call, not a round trip."""

    url: str
    local = False

    @abstractmethod
    def put(self, names: Sequence[str], values: Sequence[bytes]) -> None: ...

    @abstractmethod
    def get(self, names: Sequence[str]) -> list[bytes | None]:
        """The values, None where a name has none (evicted, never stored, retired)."""

    def get_into(self, names: Sequence[str], rows: Sequence[memoryview]) -> list[bytes | None]:
        """Read each value's row into ``rows[i]`` and return its header (the value's bytes
        before the row; ``read_head`` checks it), None where a name holds no value.  A value
        whose row is not exactly ``len(rows[i])`` bytes returns ``b""`` (not a whole value).
        The default goes through ``get`` (one copy more); a store that can read into
        memory overrides it."""
        out: list[bytes | None] = []
        for value, row in zip(self.get(names), rows):
            if value is None:
                out.append(None)
                continue
            at = head_size(value)
            if not at or len(value) - at != len(row):
                out.append(b"")
                continue
            row[:] = memoryview(value)[at:]
            out.append(bytes(value[:at]))
        return out

    @abstractmethod
    def exists(self, names: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def retire(self, ns: str) -> int:
        """Drop every value of namespace ``ns``; returns how many went."""

    @abstractmethod
    def namespaces(self) -> dict[str, tuple[int, int]]:
        """Each namespace the store holds: (values, bytes) (an operator's look: scans it all)."""

    def close(self) -> None:
        return None


class FileStore(KeyedStore):
    """A directory of values, one file each, under one byte budget (see the module docstring)."""

    local = True

    def __init__(self, directory: str | Path, budget: int, url: str = ""):
        if budget < 1:
            raise ValueError(f"a file store needs a budget of at least one byte, got {budget}")
        self.root = Path(directory)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.budget = budget
        self.url = url or f"file://{self.root}?budget={budget}"
        self._lock_path = self.root / ".budget.lock"
        self._used: int | None = None  # this process's running estimate since its last scan

    def _path(self, name: str) -> Path:
        _, ns, rank, key = name.split(":", 3)
        return self.root / ns / f"{rank}-{key}"

    def put(self, names: Sequence[str], values: Sequence[bytes]) -> None:
        size = sum(len(v) for v in values)
        try:
            self._make_room(size)
            for name, value in zip(names, values):
                path = self._path(name)
                path.parent.mkdir(mode=0o700, exist_ok=True)
                tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
                with open(tmp, "wb") as f:
                    f.write(value)
                os.replace(tmp, path)
        except OSError as err:
            raise StoreDown(f"file store {self.root}: {err}") from None
        if self._used is not None:
            self._used += size

    def get(self, names: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for name in names:
            path = self._path(name)
            try:
                with open(path, "rb") as f:  # open: an eviction meanwhile cannot take what is read
                    out.append(f.read())
                os.utime(path)  # recently used: the last to be evicted
            except FileNotFoundError:
                out.append(None)
            except OSError as err:
                raise StoreDown(f"file store {self.root}: {err}") from None
        return out

    def get_into(self, names: Sequence[str], rows: Sequence[memoryview]) -> list[bytes | None]:
        """Each file's header, then its row read straight into ``rows[i]`` (one copy, from the
        page cache); the file stays open while it is read, whatever an eviction does."""
        out: list[bytes | None] = []
        for name, row in zip(names, rows):
            path = self._path(name)
            try:
                with open(path, "rb", buffering=0) as f:
                    first = f.read(_HEAD.size)
                    at = head_size(first)
                    head = first + f.read(at - len(first)) if at else b""
                    whole = bool(at) and len(head) == at and f.readinto(row) == len(row) and not f.read(1)
                out.append(head if whole else b"")
                os.utime(path)
            except FileNotFoundError:
                out.append(None)
            except OSError as err:
                raise StoreDown(f"file store {self.root}: {err}") from None
        return out

    def exists(self, names: Sequence[str]) -> list[bool]:
        return [self._path(name).is_file() for name in names]

    def retire(self, ns: str) -> int:
        gone = 0
        directory = self.root / ns
        for path in directory.glob("*"):
            try:
                path.unlink()
                gone += 1
            except FileNotFoundError:
                pass
        try:
            directory.rmdir()
        except OSError:
            pass
        return gone

    def namespaces(self) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for directory in sorted(p for p in self.root.iterdir() if p.is_dir()):
            sizes = []
            for path in directory.iterdir():
                try:
                    sizes.append(path.stat().st_size)
                except FileNotFoundError:
                    pass
            out[directory.name] = (len(sizes), sum(sizes))
        return out

    def _make_room(self, size: int) -> None:
        """Evict least recently used values until ``size`` more bytes fit the budget: under
        an exclusive lock shared by every process on the directory (one budget for all)."""
        if self._used is not None and self._used + size <= self.budget:
            return
        import fcntl

        with open(self._lock_path, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            files = []
            for path in self.root.glob("*/*"):
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                if path.name.startswith(".") and time.time() - st.st_mtime > 60:
                    path.unlink(missing_ok=True)  # a write a killed process left half done
                    continue
                files.append((st.st_mtime, st.st_size, path))
            used = sum(s for _, s, _ in files)
            goal = max(0, min(self.budget - size, self.budget * 9 // 10))
            for _, fsize, path in sorted(files):
                if used <= goal:
                    break
                path.unlink(missing_ok=True)
                used -= fsize
            self._used = used


class RedisStore(KeyedStore):
    """A Redis server (see the module docstring); ``timeout`` bounds each call, connect included."""

    def __init__(self, host: str, port: int, db: int = 0, timeout: float = DEFAULT_TIMEOUT_S, url: str = ""):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url = url or f"redis://{host}:{port}/{db}"
        self.timeout = timeout
        self._errors = (redis.RedisError, OSError)
        self.redis = redis.Redis(
            host=host,
            port=port,
            db=db,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # one try: ``timeout`` bounds the call
            health_check_interval=0,
        )

    def _down(self, err: BaseException) -> StoreDown:
        return StoreDown(f"redis store {self.url}: {type(err).__name__}: {err}")

    def put(self, names: Sequence[str], values: Sequence[bytes]) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            for name, value in zip(names, values):
                pipe.set(name, value)
            pipe.execute()
        except self._errors as err:
            raise self._down(err) from None

    def get(self, names: Sequence[str]) -> list[bytes | None]:
        try:
            got: list[Any] = list(self.redis.mget(list(names))) if names else []
            return got
        except self._errors as err:
            raise self._down(err) from None

    def exists(self, names: Sequence[str]) -> list[bool]:
        try:
            pipe = self.redis.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return [bool(n) for n in pipe.execute()]
        except self._errors as err:
            raise self._down(err) from None

    def retire(self, ns: str) -> int:
        gone = 0
        try:
            batch: list[bytes] = []
            for name in self.redis.scan_iter(match=f"zkv:{ns}:*", count=1000):
                batch.append(name)
                if len(batch) >= 1000:
                    gone += self.redis.unlink(*batch)
                    batch = []
            if batch:
                gone += self.redis.unlink(*batch)
        except self._errors as err:
            raise self._down(err) from None
        return gone

    def namespaces(self) -> dict[str, tuple[int, int]]:
        counts: dict[str, list[int]] = {}
        try:
            names = list(self.redis.scan_iter(match="zkv:*", count=1000))
            for at in range(0, len(names), 1000):
                chunk = names[at : at + 1000]
                pipe = self.redis.pipeline(transaction=False)
                for name in chunk:
                    pipe.strlen(name)
                for name, size in zip(chunk, pipe.execute()):
                    ns = name.decode().split(":", 2)[1]
                    got = counts.setdefault(ns, [0, 0])
                    got[0] += 1
                    got[1] += int(size)
        except self._errors as err:
            raise self._down(err) from None
        return {ns: (n, size) for ns, (n, size) in sorted(counts.items())}

    def close(self) -> None:
        self.redis.close()


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``8GiB``, ``512M``, ``4096``: bytes."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    number = t[:-1] if unit else t
    value = float(number) * _UNITS[unit]
    if not value >= 1 or value != value:
        raise ValueError(f"not a size in bytes: {text!r}")
    return int(value)


def open_store(url: str) -> KeyedStore:
    """The store a URL names: ``file:///dev/shm/zkv-host?budget=8GiB`` or
    ``redis://HOST:PORT/DB?timeout=1.0``; ``ValueError`` naming what is wrong."""
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))
    if parts.scheme == "file":
        if not parts.path or parts.netloc:
            raise ValueError(f"{url!r}: a file store is file:///ABSOLUTE/PATH?budget=SIZE")
        if "budget" not in query:
            raise ValueError(f"{url!r}: say how many bytes the directory may hold (?budget=8GiB)")
        return FileStore(parts.path, parse_bytes(query["budget"]), url)
    if parts.scheme == "redis":
        timeout = float(query.get("timeout", DEFAULT_TIMEOUT_S))
        if not 0.001 <= timeout <= 60:
            raise ValueError(f"{url!r}: timeout must be 0.001-60 seconds")
        db = int(parts.path.strip("/") or 0)
        return RedisStore(parts.hostname or "127.0.0.1", parts.port or 6379, db, timeout, url)
    raise ValueError(f"{url!r}: a store is file:///PATH?budget=SIZE or redis://HOST:PORT/DB")


def digest_for(row_bytes: int) -> RowDigest:
    """The digest every engine checks a stored row with (one seed for all: values are shared)."""
    return RowDigest(row_bytes, _DIGEST_SEED)


def layout_tag(page_shape: Any) -> bytes:
    """16 bytes naming a row's layout (the CPU tier's page shape)."""
    return hashlib.blake2b(repr(tuple(page_shape)).encode(), digest_size=16).digest()
