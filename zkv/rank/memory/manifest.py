"""Cross-process attach: the engine exports its KV tensors as a manifest file,
a zkv worker maps them.

The engine keeps ownership.  On CPU it allocates its cache in shared-memory
files (``shm.ShmArena.tensor``: ``/dev/shm`` files mapped ``MAP_SHARED``)
that the worker maps too; on CUDA each buffer travels as a CUDA IPC handle
(torch's ``_share_cuda_``) with its device named by UUID, so a worker with
another ``CUDA_VISIBLE_DEVICES`` still finds it.  The worker's
``EngineCache.release()`` drops every view and mapping (CPU: the file is
really unmapped; CUDA: torch closes the IPC mapping once its storage is
gone); zkv never frees or unlinks engine memory.

A manifest is msgpack, written atomically: ``{"zkv_manifest": 1, instance,
generation, nonce, descriptor, handles[]}``.  ``instance`` and ``nonce`` are
uuid4 hex, so a manifest of an earlier generation (or a dead engine whose
PID was reused) is recognised as stale.  Everything read is range-checked;
a bad manifest is a ``CacheError`` with a code and nothing stays mapped.
"""

from __future__ import annotations

import os
import stat
import uuid
from dataclasses import dataclass
from typing import Any, Sequence, cast

import msgpack
import torch

from ..errors import CacheError
from .descriptor import MAX_INT, CacheDescriptor
from .regions import EngineCache, TensorEntry, _storage_bytes, canonicalize
from .shm import SHM_DIR, SHM_PREFIX, ShmArena

MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 16 << 20
PROCESS_INSTANCE = uuid.uuid4().hex  # this engine process, across generations (not its PID: PIDs are reused)


# --- engine side: export ---------------------------------------------------------


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` as this process numbers it."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _cuda_handle(storage: torch.UntypedStorage) -> dict[str, Any]:
    dev, handle, size, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
    return {
        "kind": "cuda_ipc",
        "device_uuid": device_uuid(storage.device.index if storage.device.index is not None else dev),
        "handle": bytes(handle),
        "size": size,
        "offset": offset,
        "ref_counter_handle": bytes(rc_handle),
        "ref_counter_offset": rc_offset,
        "event_handle": bytes(ev_handle or b""),
        "event_sync_required": bool(ev_sync),
    }


def export_manifest(
    path: str,
    entries: Sequence[TensorEntry],
    generation: int,
    arena: ShmArena | None = None,
    num_blocks: int | None = None,
    instance: str | None = None,
) -> dict[str, Any]:
    """Describe the engine's tensors, write the manifest to ``path`` atomically, return it.

    CPU tensors must come from ``arena``; CUDA tensors are shared by IPC handle.
    The engine must keep the tensors alive while any worker has them mapped."""
    descriptor, flats = canonicalize(entries, num_blocks)
    handles = []
    for spec, flat in zip(descriptor.buffers, flats):
        storage = flat.untyped_storage()
        if spec.device == "cuda":
            handles.append(_cuda_handle(storage))
            continue
        file = arena.path_of(storage) if arena is not None else None
        if file is None:
            raise CacheError(
                "bad_layout", f"CPU tensor {spec.name!r} is not in shared memory: allocate it with ShmArena.tensor"
            )
        handles.append({"kind": "shm", "path": file, "file_bytes": os.stat(file).st_size, "offset": 0})
    del flats
    manifest = {
        "zkv_manifest": MANIFEST_VERSION,
        "instance": instance or PROCESS_INSTANCE,
        "generation": generation,
        "nonce": uuid.uuid4().hex,
        "descriptor": descriptor.to_dict(),
        "handles": handles,
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(msgpack.packb(manifest, use_bin_type=True))
    os.replace(tmp, path)
    return manifest


# --- worker side: read and map ---------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A checked manifest (nothing mapped yet)."""

    instance: str
    generation: int
    nonce: str
    descriptor: CacheDescriptor
    handles: tuple[dict[str, Any], ...]


def _bad(reason: str) -> CacheError:
    return CacheError("bad_manifest", reason)


def _check(where: str, value: Any, kind: type, limit: int = MAX_INT) -> Any:
    if type(value) is not kind:
        raise _bad(f"{where} must be {kind.__name__}, got {type(value).__name__}")
    checked: Any = value
    if kind is int and not 0 <= checked <= limit:
        raise _bad(f"{where} {value} is out of range [0, {limit}]")
    if kind in (str, bytes) and len(checked) > 4096:
        raise _bad(f"{where} is too long")
    return value


_HANDLE_FIELDS = {
    "shm": {"kind": str, "path": str, "file_bytes": int, "offset": int},
    "cuda_ipc": {
        "kind": str,
        "device_uuid": str,
        "handle": bytes,
        "size": int,
        "offset": int,
        "ref_counter_handle": bytes,
        "ref_counter_offset": int,
        "event_handle": bytes,
        "event_sync_required": bool,
    },
}


def parse_manifest(data: bytes, shm_dir: str = SHM_DIR) -> Manifest:
    """Check every field of a manifest's bytes; raise CacheError naming the first bad one."""
    try:
        m = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise _bad(f"not a msgpack manifest ({type(exc).__name__})") from None
    if not isinstance(m, dict) or m.get("zkv_manifest") != MANIFEST_VERSION or type(m.get("zkv_manifest")) is not int:
        raise _bad(f"not a version {MANIFEST_VERSION} zkv manifest")
    if set(m) != {"zkv_manifest", "instance", "generation", "nonce", "descriptor", "handles"}:
        raise _bad(f"unexpected manifest fields {sorted(map(str, m))}")
    try:
        descriptor = CacheDescriptor.from_dict(m["descriptor"])
    except CacheError as err:
        raise _bad(f"descriptor: {err.reason}") from None
    handles = m["handles"]
    if not isinstance(handles, list):
        raise _bad("handles must be a list")
    if len(handles) != len(descriptor.buffers):
        raise _bad(f"{len(handles)} handles for {len(descriptor.buffers)} buffers")
    for i, (h, spec) in enumerate(zip(handles, descriptor.buffers)):
        kind = h.get("kind") if isinstance(h, dict) else None
        fields = _HANDLE_FIELDS.get(kind) if type(kind) is str else None
        if fields is None or set(h) != set(fields):
            raise _bad(f"handles[{i}] is not a shm or cuda_ipc handle")
        for key, typ in fields.items():
            _check(f"handles[{i}].{key}", h[key], typ)
        if (kind == "shm") != (spec.device == "cpu"):
            raise _bad(f"handles[{i}] is {kind} for a {spec.device} buffer")
        if kind == "shm":
            path = h["path"]
            if os.path.dirname(path) != shm_dir or not os.path.basename(path).startswith(SHM_PREFIX):
                raise _bad(f"handles[{i}].path {path!r} is not a {SHM_PREFIX}* file in {shm_dir}")
            if h["offset"] + spec.nbytes > h["file_bytes"]:
                raise _bad(
                    f"buffer {spec.name!r} ({spec.nbytes} bytes at {h['offset']}) "
                    f"is past its file's {h['file_bytes']} bytes"
                )
        elif h["offset"] > MAX_INT or h["size"] < spec.nbytes:
            raise _bad(f"buffer {spec.name!r} of {spec.nbytes} bytes does not fit its IPC storage of {h['size']}")
    return Manifest(
        _check("instance", m["instance"], str),
        _check("generation", m["generation"], int),
        _check("nonce", m["nonce"], str),
        descriptor,
        tuple(handles),
    )


def read_manifest(path: str, shm_dir: str = SHM_DIR) -> Manifest:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CacheError("missing_file", f"manifest {path!r} does not exist") from None
    except OSError as exc:
        raise _bad(f"manifest {path!r} cannot be read: {exc.strerror}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise _bad(f"manifest {path!r} is larger than {MAX_MANIFEST_BYTES} bytes")
    return parse_manifest(data, shm_dir)


def _map_shm(h: dict[str, Any], spec_name: str, nbytes: int) -> torch.Tensor:
    path = h["path"]
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CacheError(
            "missing_file", f"shared-memory file {path!r} of buffer {spec_name!r} does not exist"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise _bad(f"shared-memory file {path!r} of buffer {spec_name!r} is not a regular file")
    if st.st_size != h["file_bytes"]:
        raise CacheError(
            "size_mismatch", f"shared-memory file {path!r} has {st.st_size} bytes, the manifest says {h['file_bytes']}"
        )
    storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(path, True, h["file_bytes"]))
    return _storage_bytes(storage).narrow(0, h["offset"], nbytes)


def _local_cuda_index(uuid_text: str) -> int:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if device_uuid(i) == uuid_text:
                return i
    raise CacheError("no_device", f"CUDA device {uuid_text} is not visible in this process")


def _map_cuda(h: dict[str, Any], spec_name: str, nbytes: int) -> torch.Tensor:
    index = _local_cuda_index(h["device_uuid"])
    torch.cuda._lazy_init()  # as torch's own rebuild_cuda_tensor does before opening a handle
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            h["handle"],
            h["size"],
            h["offset"],
            h["ref_counter_handle"],
            h["ref_counter_offset"],
            h["event_handle"],
            h["event_sync_required"],
        )
    except RuntimeError as exc:
        raise _bad(f"CUDA IPC open of buffer {spec_name!r} failed: {exc}") from None
    return _storage_bytes(storage).narrow(0, 0, nbytes)


def attach(
    path: str,
    expect_generation: int | None = None,
    expect_nonce: str | None = None,
    expect_instance: str | None = None,
    shm_dir: str = SHM_DIR,
) -> EngineCache:
    """Map a manifest's buffers and return the engine cache; ``release()`` unmaps it.

    A generation, nonce or engine instance other than the expected one is ``stale_manifest``."""
    m = read_manifest(path, shm_dir)
    if expect_instance is not None and m.instance != expect_instance:
        raise CacheError(
            "stale_manifest", f"manifest {path!r} is from engine instance {m.instance}, expected {expect_instance}"
        )
    if expect_generation is not None and m.generation != expect_generation:
        raise CacheError(
            "stale_manifest", f"manifest {path!r} is generation {m.generation}, expected {expect_generation}"
        )
    if expect_nonce is not None and m.nonce != expect_nonce:
        raise CacheError("stale_manifest", f"manifest {path!r} has nonce {m.nonce}, expected {expect_nonce}")
    flats: list[torch.Tensor] = []
    try:
        for h, spec in zip(m.handles, m.descriptor.buffers):
            mapper = _map_shm if h["kind"] == "shm" else _map_cuda
            flats.append(mapper(h, spec.name, spec.nbytes))
        return EngineCache(m.descriptor, flats, generation=m.generation, instance=m.instance, nonce=m.nonce)
    finally:
        flats.clear()  # on failure nothing stays mapped; on success the cache holds the only references
