"""The KV cache groups of a vLLM engine as zkv serves them (docs/engine-vllm.md,
"Models with several KV cache groups").  Duck-typed on vLLM's objects: no
vLLM import, so the rules are tested anywhere.

vLLM splits a hybrid model's KV cache into groups, one per kind of layer
(sliding-window and full attention in gpt-oss and Gemma 3; linear-attention
state beside attention in Qwen3-Next).  Every group draws its blocks from
one block pool and its layers share the same canonical tensors (a block id
is one group's at a time), and vLLM's offloading scheduler keys each block
by its hash *and its group*, asks for every group a request needs, and takes
a hit only when each group's part is there (full attention: the whole
prefix; a sliding window: the window before the hit; Mamba state: the one
state at vLLM's ``align`` boundary).  So zkv keeps one row per (block,
group) key, and a row is the block's canonical page of every tensor:

- ``describe``: each group's spec, as plain data (the engine's identity names
  them: a model whose window or state shape changes is another identity);
- ``refusals``: the groups zkv cannot serve exactly, each with why; one is
  enough for zkv to serve no request of that engine (a hit needs every group,
  so vLLM recomputes), and the engine's log says which and why at start;
- ``check_rows``: at the worker, that a whole-row copy of one block touches
  that block only (no two canonical tensors overlap), or refuse to start.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

from ...rows.identity import short_digest

# Specs whose blocks are wholly in vLLM's canonical pages and whose reach vLLM's
# offloading scheduler knows (the window it asks for, the state it keeps).
EXACT_SPECS = frozenset(
    {
        "FullAttentionSpec",
        "SinkFullAttentionSpec",
        "MLAAttentionSpec",
        "SlidingWindowSpec",
        "SlidingWindowMLASpec",
        "ChunkedLocalAttentionSpec",
        "MambaSpec",
    }
)
MAMBA_MODES = ("align", "all")  # vLLM keeps a whole state at block boundaries
# Specs whose every earlier block stays in vLLM's cache while a request runs.
FULL_SPECS = frozenset({"FullAttentionSpec", "SinkFullAttentionSpec", "MLAAttentionSpec"})


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data: a dtype or an unknown object by its name."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return str(value)


def spec_fields(spec: Any) -> dict[str, Any]:
    """A KV cache spec's fields (vLLM's specs are dataclasses), as plain data."""
    if dataclasses.is_dataclass(spec):
        return {f.name: _plain(getattr(spec, f.name)) for f in dataclasses.fields(spec)}
    return {k: _plain(v) for k, v in vars(spec).items() if not k.startswith("_")}


def describe(kv_cache_config: Any, group_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Each offloaded group (``group_ids``: those vLLM's offloading selects) as plain data:
    its index, spec class, layers (count and digest of their names) and spec fields."""
    out = []
    for gid in group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        members = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs: one spec per layer
        entry: dict[str, Any] = {
            "group": int(gid),
            "spec": type(spec).__name__,
            "layers": len(group.layer_names),
            "layer_names": short_digest(list(group.layer_names)),
            "fields": spec_fields(spec) if members is None else {},
        }
        if members is not None:
            entry["members"] = sorted({type(s).__name__ for s in members.values()})
            entry["fields"] = {name: spec_fields(s) for name, s in sorted(members.items())}
        if getattr(group, "host_resident", False):
            entry["host_resident"] = True
        out.append(entry)
    return out


def refusal(group: dict[str, Any]) -> str | None:
    """Why zkv cannot serve this group exactly (``describe``'s entry), or None."""
    if group.get("host_resident"):
        return "its blocks live in host memory that vLLM manages itself (HiSparse), not in the KV tensors zkv copies"
    specs = group.get("members") or [group["spec"]]
    unknown = [s for s in specs if s not in EXACT_SPECS]
    if unknown:
        return (
            f"zkv has not checked how vLLM keeps the blocks of a {', '.join(unknown)} group "
            f"(it serves {', '.join(sorted(EXACT_SPECS))})"
        )
    if "MambaSpec" in specs:
        mode = group["fields"].get("mamba_cache_mode")
        if mode not in MAMBA_MODES:
            return (
                f"its state is kept with mamba_cache_mode {mode!r}: no whole state at a block boundary "
                f"(vLLM's prefix caching keeps one with {' or '.join(MAMBA_MODES)})"
            )
    return None


def refusals(groups: Sequence[dict[str, Any]]) -> dict[int, str]:
    """Group index -> why it is refused, for every group zkv cannot serve exactly."""
    found = {g["group"]: refusal(g) for g in groups}
    return {gid: why for gid, why in found.items() if why is not None}


def block_recompute_exact(groups: Sequence[dict[str, Any]] | None) -> bool:
    """Whether recomputing a failed load from its first failed block (vLLM 0.32's
    ``get_block_ids_with_load_errors``) gives the engine's own tokens: only with one group of
    full attention, where every block before it is still in vLLM's cache.  A sliding window
    or a state before the failed block is gone (the window before a load's first block was
    never loaded), so there the whole request is recomputed from its first token, and 0.32
    refuses block ids for several groups anyway.  None (groups not known): one full group."""
    if groups is None:
        return True
    return len(groups) == 1 and not groups[0].get("members") and groups[0]["spec"] in FULL_SPECS


def name(group: dict[str, Any]) -> str:
    """How the log names a group: ``group 1 (FullAttentionSpec, 2 layers)``."""
    return f"group {group['group']} ({group['spec']}, {group['layers']} layers)"


def group_of(key: bytes) -> int:
    """The KV cache group an offload key names (vLLM's ``make_offload_key``: the hash, then
    the group index as 4 big-endian bytes)."""
    return int.from_bytes(key[-4:], "big") if len(key) >= 4 else 0


def chain_order(keys: list[bytes], req_context: Any) -> list[bytes] | None:
    """``keys`` head to tail by the token position vLLM gave each (every group's first
    blocks first), or None when vLLM did not say every position (one group: its order)."""
    position = getattr(req_context, "get_offload_key_position", None)
    if position is None:
        return None
    found = [position(k) for k in keys]
    if any(p is None for p in found):
        return None
    return [k for _, _, k in sorted(zip(found, range(len(keys)), keys))]


def check_rows(tensors: Sequence[Any], group_refs: Sequence[Sequence[Any]]) -> None:
    """Raise ``ValueError`` naming the group unless a copy of block ``b``'s row of every
    canonical tensor (``tensors``: vLLM's ``CanonicalKVCacheTensor``s or tensors, rows
    ``(num_blocks, page_bytes)``) touches block ``b`` only: every tensor has the same
    blocks, every group's refs name tensors that exist, and no two tensors share a byte."""
    ts = [getattr(t, "tensor", t) for t in tensors]
    if not ts:
        raise ValueError("vLLM handed zkv no KV tensors")
    blocks = {int(t.shape[0]) for t in ts}
    if len(blocks) != 1:
        raise ValueError(f"zkv serves KV tensors of one block count; these have {sorted(blocks)} blocks")
    for g, refs in enumerate(group_refs):
        if not refs:
            raise ValueError(f"KV cache group {g} names no KV tensor")
        for ref in refs:
            i = int(ref.tensor_idx)
            if not 0 <= i < len(ts):
                raise ValueError(f"KV cache group {g} names KV tensor {i} of {len(ts)}")
            row = int(ts[i].shape[1]) * ts[i].element_size()
            if int(ref.page_size_bytes) > row:
                raise ValueError(f"KV cache group {g}: a page of {ref.page_size_bytes} bytes in rows of {row}")
    spans = [_span(t) for t in ts]
    for i in range(len(ts)):
        for j in range(i + 1, len(ts)):
            if _overlap(spans[i], spans[j]):
                users = sorted({g for g, refs in enumerate(group_refs) for r in refs if r.tensor_idx in (i, j)})
                raise ValueError(
                    f"KV tensors {i} and {j} share bytes (KV cache groups {users}): zkv copies whole rows "
                    "of every tensor per block, which would write another block's bytes; this layout is refused"
                )


def _span(t: Any) -> tuple[int, int, int, int]:
    """(first byte, end byte, row stride, row bytes) of a block-major tensor."""
    size = t.element_size()
    start, stride, row = t.data_ptr(), t.stride(0) * size, t.shape[1] * size
    return start, start + (t.shape[0] - 1) * stride + row, stride, row


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    if a == b or a[1] <= b[0] or b[1] <= a[0]:
        return False  # the same rows (copied twice, alike) or apart
    if a[2] != b[2] or a[2] == 0:
        return True  # interleaved at different strides: not shown disjoint
    stride = a[2]
    d = (b[0] - a[0]) % stride  # b's rows sit d bytes into a's row slots
    return not (d >= a[3] and d + b[3] <= stride)
