"""The KV cache groups of a vLLM engine as zkv serves them
(zkv/engines/vllm/groups.py, docs/engine-vllm.md "Models with several KV
cache groups"), without vLLM: the specs of real engines (the configs
captured in tests/vllm034/groups/) served, what is refused and why, whole
rows that touch their block only (on real torch tensors), every group's
deepest blocks evicted first, and the per-group counts on /metrics."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from zkv.engines.vllm.group_counts import GroupCollector, GroupCounts
from zkv.engines.vllm.groups import (
    block_recompute_exact,
    chain_order,
    check_rows,
    describe,
    group_of,
    refusal,
    refusals,
)
from zkv.engines.vllm.index import Found, OffloadIndex

CAPTURED = Path(__file__).resolve().parent / "vllm034" / "groups"


def captured_config(family: str) -> SimpleNamespace:
    """A captured engine's KV cache config as objects named like vLLM's (``describe`` reads
    the class name and the fields)."""
    data = json.loads((CAPTURED / f"{family}.json").read_text())
    groups = []
    for g in data["kv_cache_groups"]:
        spec = type(g["spec"], (SimpleNamespace,), {})(**g["fields"])
        groups.append(SimpleNamespace(layer_names=g["layer_names"], kv_cache_spec=spec))
    return SimpleNamespace(kv_cache_groups=groups)


def groups_of(family: str) -> list[dict]:
    config = captured_config(family)
    return describe(config, range(len(config.kv_cache_groups)))


@pytest.mark.parametrize("family", ["gemma3", "gpt-oss", "mistral-swa", "qwen3-next", "deepseek-mla"])
def test_every_spec_real_engines_made_is_served(family):
    groups = groups_of(family)
    assert refusals(groups) == {}
    assert [g["group"] for g in groups] == list(range(len(groups)))


def test_a_group_is_refused_with_why_when_zkv_cannot_serve_it_exactly():
    qwen = groups_of("qwen3-next")
    none = [dict(g, fields=dict(g["fields"], mamba_cache_mode="none")) for g in qwen]
    assert sorted(refusals(none)) == [0, 1, 2], "the state groups, not the attention group"
    assert "mamba_cache_mode 'none'" in refusal(none[0])
    odd = dict(qwen[3], spec="RSWASpec")
    assert "has not checked" in refusal(odd) and "RSWASpec" in refusal(odd)
    assert "host memory" in refusal(dict(qwen[3], host_resident=True))
    mixed = dict(qwen[3], spec="UniformTypeKVCacheSpecs", members=["MLAAttentionSpec", "CircularBufferSpec"])
    assert "CircularBufferSpec" in refusal(mixed)
    assert refusal(dict(mixed, members=["MLAAttentionSpec", "SlidingWindowMLASpec"])) is None


def test_only_one_full_attention_group_is_recomputed_from_its_first_failed_block():
    assert block_recompute_exact(groups_of("deepseek-mla"))
    assert block_recompute_exact(None), "groups unknown: one full-attention group, as before"
    for family in ("gemma3", "gpt-oss", "mistral-swa", "qwen3-next"):
        assert not block_recompute_exact(groups_of(family)), family


def test_the_identity_layout_names_each_groups_spec():
    a, b = groups_of("gemma3"), groups_of("gpt-oss")
    assert [g["spec"] for g in a] == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert a[0]["fields"]["sliding_window"] == 64 and a[0]["layers"] == 2 and b[0]["layers"] == 1
    assert a[0]["layer_names"] != a[1]["layer_names"], "which layers: a digest of their names"


def _rows(n: int, row: int) -> torch.Tensor:
    return torch.zeros((n, row), dtype=torch.int8)


def _refs(*tensor_idx: int, page: int = 8) -> list[SimpleNamespace]:
    return [SimpleNamespace(tensor_idx=i, page_size_bytes=page) for i in tensor_idx]


def test_whole_rows_are_served_where_they_touch_their_block_only():
    a, b = _rows(6, 8), _rows(6, 8)
    check_rows([a, b], [_refs(0, 1), _refs(0, 1)])  # two groups over the same two tensors
    buf = torch.zeros(6 * 16, dtype=torch.int8)
    k, v = buf.as_strided((6, 8), (16, 1), 0), buf.as_strided((6, 8), (16, 1), 8)
    check_rows([k, v], [_refs(0, 1)])  # K and V halves interleaved in one allocation
    check_rows([k, k], [_refs(0), _refs(1)])  # the same rows twice: copied alike
    shifted = buf.as_strided((6, 8), (16, 1), 4)
    with pytest.raises(ValueError, match="share bytes"):
        check_rows([k, shifted], [_refs(0), _refs(1)])  # a row astride two of another's
    wide = buf.as_strided((6, 8), (15, 1), 0)  # another stride over the same bytes
    with pytest.raises(ValueError, match="share bytes"):
        check_rows([k, wide], [_refs(0), _refs(1)])
    with pytest.raises(ValueError, match="one block count"):
        check_rows([a, _rows(5, 8)], [_refs(0, 1)])
    with pytest.raises(ValueError, match="names KV tensor 2"):
        check_rows([a, b], [_refs(0, 2)])
    with pytest.raises(ValueError, match="names no KV tensor"):
        check_rows([a, b], [_refs(0, 1), []])
    with pytest.raises(ValueError, match="a page of 16 bytes"):
        check_rows([a], [_refs(0, page=16)])


def key(block: int, group: int) -> bytes:
    return block.to_bytes(4, "big") * 4 + group.to_bytes(4, "big")


class Positions:
    """vLLM's ``ReqContext`` as the manager reads it: each key's end token."""

    def __init__(self, blocks: int, tokens_per_block: int = 32):
        self.at = {key(b, g): (b + 1) * tokens_per_block for b in range(blocks) for g in (0, 1)}

    def get_offload_key_position(self, k: bytes) -> int | None:
        return self.at.get(k)


def test_a_chain_is_ordered_head_to_tail_across_groups():
    keys = [key(b, 0) for b in range(3)] + [key(b, 1) for b in range(3)]  # vLLM's order: group by group
    assert group_of(keys[0]) == 0 and group_of(keys[-1]) == 1
    assert chain_order(keys, Positions(3)) == [key(0, 0), key(0, 1), key(1, 0), key(1, 1), key(2, 0), key(2, 1)]
    assert chain_order(keys, Positions(2)) is None, "a position vLLM did not say: its own order"
    assert chain_order(keys, object()) is None


def test_eviction_takes_every_groups_deepest_blocks_first():
    """Two requests of two groups each fill a tier; a third needs room.  Made recent head to
    tail across groups (the manager's order), the oldest request loses its deepest blocks of
    both groups first, and what stays of it is a prefix of each group that still serves."""
    index = OffloadIndex(cpu_rows=12)
    for r in range(2):
        keys = [key(10 * r + b, 0) for b in range(3)] + [key(10 * r + b, 1) for b in range(3)]
        new, _, _ = index.prepare_store(keys)
        index.touch(chain_order(keys, Positions(30)))  # as ZkvOffloadManager._recent does
        index.complete_store(new, ok=True)
    third = [key(20, 0), key(20, 1)]
    _, _, evicted = index.prepare_store(third)
    assert sorted(evicted) == sorted([key(2, 0), key(2, 1)]), "the oldest request's deepest block of each group"
    assert all(index.lookup(key(b, g)) is Found.HIT for b in (0, 1) for g in (0, 1))


def test_blocks_are_counted_per_group_and_exported():
    counts = GroupCounts({0: "SlidingWindowSpec", 1: "FullAttentionSpec"})
    counts.add("served", [key(0, 0), key(1, 1), key(2, 1), key(3, 7)])  # group 7: no group of this engine
    assert counts.by_group()[0]["served"] == 1 and counts.by_group()[1]["served"] == 2
    registry = CollectorRegistry()
    registry.register(GroupCollector(counts))
    text = generate_latest(registry).decode()
    assert 'zkv_vllm_group_blocks_total{event="served",group="1",spec="FullAttentionSpec"} 2.0' in text
    assert 'zkv_vllm_group_blocks_total{event="from_disk",group="0",spec="SlidingWindowSpec"} 0.0' in text
