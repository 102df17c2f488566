"""The descriptor as plain data (msgpack round trip, range checks on load),
release of engine memory in-process, and keeping the CPU tier over a clear."""

from __future__ import annotations

import copy

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

from zkv.engines import vllm
from zkv.rank.copies.copier import CopyEngine
from zkv.rank.errors import CacheError
from zkv.rank.memory import layouts
from zkv.rank.memory.descriptor import CacheDescriptor
from zkv.rank.memory.regions import EngineCache, TensorEntry, canonicalize
from zkv.rank.tiers.cpu_tier import CpuTier


def flash_descriptor(num_blocks=8) -> CacheDescriptor:
    kv = {f"l{i}": torch.zeros((2, num_blocks, 4, 2, 8), dtype=torch.bfloat16) for i in range(2)}
    return canonicalize(vllm.flash_attn(kv))[0]


def test_a_descriptor_survives_msgpack():
    desc = flash_descriptor()
    wire = msgpack.unpackb(msgpack.packb(desc.to_dict()), raw=False)
    assert CacheDescriptor.from_dict(wire) == desc


def _set(d, path, value):
    d = copy.deepcopy(d)
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


BAD = {
    "version": (("version",), 2),
    "bool blocks": (("num_blocks",), True),
    "zero blocks": (("num_blocks",), 0),
    "float offset": (("regions", 0, "offset"), 1.0),
    "negative offset": (("regions", 0, "offset"), -1),
    "huge stride": (("regions", 0, "row_stride"), 2**64),
    "buffer index": (("regions", 0, "buffer"), 9),
    "past the buffer": (("regions", 1, "offset"), 10**9),
    "overlapping regions": (("regions", 1, "offset"), 64),
    "unknown dtype": (("buffers", 0, "dtype"), "float7"),
    "unknown device": (("buffers", 0, "device"), "tpu"),
    "unknown field": (("regions", 0, "evil"), 1),
    "missing field": (("regions", 0, "page_bytes"), KeyError),
    "not a list": (("regions",), {"a": 1}),
    "empty name": (("regions", 0, "name"), ""),
    "duplicate name": (("regions", 1, "name"), "l0.k"),
}


@pytest.mark.parametrize("case", BAD, ids=BAD.keys())
def test_a_bad_descriptor_is_refused_on_load(case):
    path, value = BAD[case]
    with pytest.raises(CacheError) as err:
        CacheDescriptor.from_dict(_set(flash_descriptor().to_dict(), path, value))
    assert err.value.code == "bad_layout"


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
        max_leaves=12,
    )
)
def test_any_garbage_gives_a_cache_error_not_a_crash(junk):
    with pytest.raises(CacheError):
        CacheDescriptor.from_dict(junk)


def test_release_drops_every_reference_to_engine_memory():
    k, v = torch.zeros((8, 2, 4, 8)), torch.zeros((8, 2, 4, 8))
    refs = [StorageWeakRef(k.untyped_storage()), StorageWeakRef(v.untyped_storage())]
    cache = EngineCache.from_tensors(layouts.zkv_native([k], [v]))
    copier = CopyEngine(cache, CpuTier.for_cache(cache.descriptor, rows=4))
    copier.swap_out([0, 1], [0, 1])
    del k, v  # the engine frees ...
    assert not any(r.expired() for r in refs), "zkv's views must keep the storage alive until released"
    cache.release()
    assert all(r.expired() for r in refs), "after release the engine's free is a real free"
    with pytest.raises(CacheError) as err:
        copier.swap_in([0], [0])
    assert err.value.code == "released"


def test_a_kept_tier_serves_a_new_generation_with_another_block_count():
    old = torch.zeros((8, 2, 4, 8), dtype=torch.bfloat16)
    old.view(torch.int16).copy_(torch.arange(old.numel(), dtype=torch.int16).view(old.shape))
    cache = EngineCache.from_tensors(layouts.per_layer({"layer0": old}), generation=1)
    tier = CpuTier.for_cache(cache.descriptor, rows=4)
    CopyEngine(cache, tier).swap_out([5, 6], [0, 1])
    want = old[5:7].clone()
    cache.release()  # clear with keep_cpu
    new = torch.zeros((32, 2, 4, 8), dtype=torch.bfloat16)
    cache2 = EngineCache.from_tensors(layouts.per_layer({"layer0": new}), generation=2)
    assert tier.fits(cache2.descriptor)
    CopyEngine(cache2, tier).swap_in([0, 1], [30, 31])
    assert torch.equal(new[30:32].view(torch.int16), want.view(torch.int16))


def test_a_tier_does_not_fit_a_cache_with_another_page_shape():
    cache = EngineCache.from_tensors(layouts.per_layer({"layer0": torch.zeros((8, 2, 4, 8))}))
    tier = CpuTier.for_cache(cache.descriptor, rows=4)
    other = EngineCache.from_tensors(layouts.per_layer({"layer0": torch.zeros((8, 2, 8, 8))}))
    renamed = EngineCache.from_tensors(layouts.per_layer({"layer_0": torch.zeros((8, 2, 4, 8))}))
    assert not tier.fits(other.descriptor) and not tier.fits(renamed.descriptor)
    with pytest.raises(CacheError, match="page shape"):
        CopyEngine(other, tier)


@st.composite
def strided_tensors(draw):
    """A tensor over an arange storage (each element holds its own index), in any physical order, maybe sliced."""
    dims = draw(st.integers(2, 4))
    shape = draw(st.lists(st.integers(1, 4), min_size=dims, max_size=dims))
    order = draw(st.permutations(range(dims)))
    physical = torch.arange(int(torch.Size(shape).numel()) * 2, dtype=torch.int64)[: int(torch.Size(shape).numel())]
    t = physical.view([shape[d] for d in order]).permute(*[order.index(d) for d in range(dims)])
    if draw(st.booleans()):
        dim = draw(st.integers(1, dims - 1))
        t = t.narrow(dim, 0, max(1, t.shape[dim] - draw(st.integers(0, 1))))
    return t


@given(strided_tensors())
def test_a_tensor_is_accepted_exactly_when_each_block_is_one_run_and_blocks_do_not_overlap(t):
    spans = []
    for b in range(t.shape[0]):
        idx = sorted(t[b].flatten().tolist())
        spans.append((idx[0], idx[-1] + 1, idx == list(range(idx[0], idx[-1] + 1))))
    copyable = all(dense for *_, dense in spans) and all(
        a[1] <= b[0] or b[1] <= a[0] for i, a in enumerate(spans) for b in spans[i + 1 :]
    )
    try:
        cache = EngineCache.from_tensors([TensorEntry("t", t)])
    except CacheError as err:
        assert err.code == "bad_layout" and not copyable, f"refused a copyable tensor: {err}"
        return
    assert copyable, "accepted a tensor whose blocks are not copyable row by row"
    for b in range(t.shape[0]):  # row b covers exactly block b's elements
        assert sorted(cache.views[0][b].view(torch.int64).tolist()) == sorted(t[b].flatten().tolist())
