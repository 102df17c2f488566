"""Whose KV a row holds: the model, the KV layout and the weights it was
computed under (docs/engine-vllm.md, "Warm restart").  Every journal of an
engine's tiers names one; a restarted engine serves a row only under an
equal identity, so KV of another model, config, layout or weights misses.

The weights are named by what the engine loaded them from: a local
checkpoint's files (name, size, modification time of each: a rewrite in
place changes it without reading gigabytes), or a hub model's revision.
Once zkv learns the weights may have changed in place (a clear that did not
keep the CPU tier: ``zkv.cycle`` measures vLLM's own checksums and
keeps the tiers only when they did not move), ``moved`` names weights that
no checkpoint holds, so that what is written after never outlives the
engine that computed it.  No vLLM import: ``identity_of`` reads its config
duck-typed."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

import msgspec


class EngineIdentity(msgspec.Struct, frozen=True):
    """The model (``model``, ``revision``, ``config``: a digest of its config and
    dtype), the KV layout (``layout``) and the ``weights``."""

    model: str
    revision: str
    config: str
    layout: dict[str, Any]
    weights: str

    def digest(self) -> bytes:
        """16 bytes equal for equal identities, whatever the order of the layout's fields."""
        raw = json.dumps(msgspec.to_builtins(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(raw.encode(), digest_size=16).digest()

    def moved(self) -> "EngineIdentity":
        """The same engine on weights that changed in place: a version no restart loads."""
        base = self.weights.split("+moved-", 1)[0]
        return msgspec.structs.replace(self, weights=f"{base}+moved-{uuid.uuid4().hex[:12]}")

    def differs(self, other: "EngineIdentity") -> list[str]:
        """The fields that differ from ``other`` (what a refused adoption names)."""
        return [f for f in self.__struct_fields__ if getattr(self, f) != getattr(other, f)]


def _digest(value: Any) -> str:
    raw = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(raw.encode(), digest_size=12).hexdigest()


def checkpoint_version(model: str, revision: str | None, commit: str | None = None) -> str:
    """The weights a model path or hub id names: for a directory, every file's name,
    size and modification time (``st_mtime_ns``); for a hub id, its revision."""
    if os.path.isdir(model):
        listing = []
        for name in sorted(os.listdir(model)):
            path = os.path.join(model, name)
            if name.startswith(".") or not os.path.isfile(path):
                continue
            st = os.stat(path)
            listing.append((name, st.st_size, st.st_mtime_ns))
        return "files:" + _digest(listing)
    return f"hub:{revision or commit or 'main'}"


def identity_of(vllm_config: Any) -> EngineIdentity:
    """The identity of the engine ``vllm_config`` describes (vLLM's ``VllmConfig``)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else dict(vars(mc.hf_config))
    commit = hf.pop("_commit_hash", None)
    kv_dtype = str(mc.dtype) if cc.cache_dtype == "auto" else str(cc.cache_dtype)
    layout = {
        "block_size": int(cc.block_size),
        "layers": int(mc.get_num_layers(pc)),
        "kv_heads": int(mc.get_num_kv_heads(pc)),
        "head_dim": int(mc.get_head_size()),
        "kv_dtype": kv_dtype,
        "tp": int(pc.tensor_parallel_size),
    }
    config = _digest({"hf": hf, "dtype": str(mc.dtype), "quantization": getattr(mc, "quantization", None)})
    return EngineIdentity(
        model=str(mc.model),
        revision=str(mc.revision or commit or ""),
        config=config,
        layout=layout,
        weights=checkpoint_version(str(mc.model), mc.revision, commit),
    )
