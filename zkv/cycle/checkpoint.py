"""A checkpoint checked before anything pauses (docs/engine-vllm.md,
"Staged, then committed"): a directory of safetensors files is read as the
engine will read it, without torch: every file complete (its header, and
every tensor's bytes inside the file), every file an index names present,
and its tensors' names, shapes and dtypes those of the model the engine
serves; its digest is the BLAKE2b of every file's bytes (computed once per
file version: the same path unchanged is not read again).

Everything read from a file is range-checked where it enters: a header
longer than ``MAX_HEADER``, offsets outside the file, a shape whose bytes
are not its data's, a dtype safetensors does not define: each fails the
check with the file and the tensor named."""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_HEADER = 100 * 2**20  # safetensors' own limit
MAX_FILES = 10_000
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that will not load as the engine's weights (the path, the file and why)."""


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Checkpoint:
    path: str
    tensors: dict[str, Tensor]
    digest: str  # BLAKE2b-128 of every file's bytes, in name order

    def differs(self, other: "Checkpoint", limit: int = 5) -> list[str]:
        """What ``other`` (the model's own) has that this one does not, or has otherwise."""
        out = []
        for name in sorted(set(self.tensors) | set(other.tensors)):
            mine, theirs = self.tensors.get(name), other.tensors.get(name)
            if mine != theirs:
                if mine is None:
                    out.append(f"{name} missing")
                elif theirs is None:
                    out.append(f"{name} not in the model")
                else:
                    out.append(
                        f"{name} {mine.dtype}{list(mine.shape)} where the model has {theirs.dtype}{list(theirs.shape)}"
                    )
            if len(out) >= limit:
                out.append("...")
                break
        return out


def _header(path: Path) -> tuple[dict[str, Tensor], int]:
    """The tensors of one safetensors file, checked against its size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"{path}: header of {n} bytes in a file of {size}")
        try:
            meta = json.loads(f.read(n))
        except ValueError as err:
            raise CheckpointError(f"{path}: header is not JSON ({err})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: header is not a map")
    tensors: dict[str, Tensor] = {}
    end = 0
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor(path, name, info, size - 8 - n)
        end = max(end, info["data_offsets"][1])
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: {size} bytes where its tensors end at {8 + n + end} (truncated or padded)")
    return tensors, size


def _tensor(path: Path, name: str, info: Any, data_bytes: int) -> Tensor:
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor {name!r} is not described by a map")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ITEMSIZE:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r}, not one safetensors defines")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**40 for d in shape) or len(shape) > 16:
        raise CheckpointError(f"{path}: tensor {name!r} has shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise CheckpointError(f"{path}: tensor {name!r} has data offsets {offsets!r} outside its file")
    if offsets[1] - offsets[0] != math.prod(shape) * _ITEMSIZE[dtype]:
        raise CheckpointError(f"{path}: tensor {name!r} holds {offsets[1] - offsets[0]} bytes, not its shape's")
    return Tensor(dtype, tuple(shape))


_digests: dict[tuple[str, int, int, int], str] = {}
_digests_lock = threading.Lock()


def _file_digest(path: Path, size: int) -> str:
    """BLAKE2b of the file's bytes, cached per (path, size, mtime, inode)."""
    st = path.stat()
    key = (str(path.resolve()), size, st.st_mtime_ns, st.st_ino)
    with _digests_lock:
        if key in _digests:
            return _digests[key]
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(4 * 2**20):
            h.update(chunk)
    with _digests_lock:
        _digests[key] = h.hexdigest()
    return h.hexdigest()


def read(path: str | os.PathLike[str], digest: bool = True) -> Checkpoint:
    """The checkpoint at ``path`` (a directory of ``*.safetensors``), checked; ``CheckpointError`` if not."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such checkpoint directory here")
    files = sorted(root.glob("*.safetensors"))
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            named = sorted({str(v) for v in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise CheckpointError(f"{index}: not a safetensors index ({err})") from None
        missing = [f for f in named if not (root / f).is_file() or "/" in f]
        if missing:
            raise CheckpointError(f"{root}: files its index names are missing: {missing[:5]}")
        files = [root / f for f in named]
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files")
    if len(files) > MAX_FILES:
        raise CheckpointError(f"{root}: {len(files)} files, more than {MAX_FILES}")
    tensors: dict[str, Tensor] = {}
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        found, size = _header(f)
        twice = set(found) & set(tensors)
        if twice:
            raise CheckpointError(f"{f}: tensors also in another file: {sorted(twice)[:5]}")
        tensors.update(found)
        if digest:
            h.update(f"{f.name}:{_file_digest(f, size)};".encode())
    if index.is_file() and set(weight_map) != set(tensors):
        raise CheckpointError(f"{root}: its index and its files name different tensors")
    return Checkpoint(str(root), tensors, h.hexdigest() if digest else "")


def check(path: str, model: str | None) -> Checkpoint:
    """``path`` checked, and against the model's own checkpoint ``model`` when that is
    readable here (names, shapes and dtypes must be the same)."""
    new = read(path)
    if model is not None and Path(model).is_dir():
        try:
            own = read(model, digest=False)
        except CheckpointError:
            return new  # the model came from elsewhere (a hub id, another format): only the new one is checked
        differs = new.differs(own)
        if differs:
            raise CheckpointError(f"{path}: not the model's tensors: {'; '.join(differs)}")
    return new


def write(path: str | os.PathLike[str], tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> str:
    """A safetensors checkpoint of ``tensors`` (name -> dtype, shape, bytes) written without
    torch (stand-in engines, tests); returns the directory."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape, data) in sorted(tensors.items()):
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    tmp = root / "model.safetensors.tmp"
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for _, (_, _, data) in sorted(tensors.items()):
            f.write(data)
    os.replace(tmp, root / "model.safetensors")
    return str(root)
