"""Whose KV a row holds: the model, the KV layout and the weights it was
computed under (docs/engine-vllm.md, "Warm restart").  Every journal of a
tier (``journal.py``) names one; a restarted engine serves a row only under
an equal identity, so KV of another model, config, layout or weights misses.

The weights are named by what the engine loaded them from: a local
checkpoint's files (name, size, modification time of each: a rewrite in
place changes it without reading gigabytes), or a hub model's revision.
Once zkv learns the weights may have changed in place (a clear that did not
keep the CPU tier: ``zkv.cycle`` measures vLLM's own checksums and
keeps the tiers only when they did not move), ``moved`` names weights that
no checkpoint holds, so that what is written after never outlives the
engine that computed it.  An engine adapter builds one from its own config
(vLLM's: ``zkv.engines.vllm.identity.identity_of``)."""

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

    def namespace(self) -> str:
        """The namespace of a keyed store this identity's blocks live in (24 hex digits):
        its config, KV layout, revision and weights, not where the model was loaded from,
        so that engines loading one checkpoint from other paths (other hosts) share it.
        Weights named by their files' listing differ between hosts whose copies differ in
        modification time: a fleet names them with a version (``with_weights``)."""
        said = {"revision": self.revision, "config": self.config, "layout": self.layout, "weights": self.weights}
        return short_digest(said)

    def with_weights(self, version: str) -> "EngineIdentity":
        """The same engine with its weights named by a version a trainer sets (one name
        fleet-wide, whatever each host's copy of the files)."""
        return msgspec.structs.replace(self, weights=f"version:{version}")

    def moved(self) -> "EngineIdentity":
        """The same engine on weights that changed in place: a version no restart loads."""
        base = self.weights.split("+moved-", 1)[0]
        return msgspec.structs.replace(self, weights=f"{base}+moved-{uuid.uuid4().hex[:12]}")

    def differs(self, other: "EngineIdentity") -> list[str]:
        """The fields that differ from ``other`` (what a refused adoption names)."""
        return [f for f in self.__struct_fields__ if getattr(self, f) != getattr(other, f)]


def short_digest(value: Any) -> str:
    """24 hex digits naming ``value`` (JSON with sorted keys): a config, a file listing."""
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
        return "files:" + short_digest(listing)
    return f"hub:{revision or commit or 'main'}"
