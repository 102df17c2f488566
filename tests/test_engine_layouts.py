"""Every supported engine layout, with real tensors of the engine's exact shape.

Known bytes go into the engine's own tensors directly; blocks are swapped out
through the copy engine into zkv's block-major CPU tier, the engine tensors
are overwritten, the rows are swapped back into *different* block ids, and
the bytes are compared through the engine's own indexing (not through zkv's
views), so a wrong region offset or stride cannot hide."""

from __future__ import annotations

import random
import threading
from typing import Callable

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zkv.engines import fastdeploy, sglang, vllm
from zkv.engines.transformers import layout as transformers_layout
from zkv.rank.copies import cpu_copy
from zkv.rank.copies.copier import CopyEngine, coalesce
from zkv.rank.errors import CacheError
from zkv.rank.memory import layouts
from zkv.rank.memory.regions import EngineCache, TensorEntry
from zkv.rank.tiers.cpu_tier import CpuTier

NB, BS, H, D, L = 12, 4, 2, 8, 3


def scribble(tensors, seed: int) -> None:
    """Random bits into every byte of the engine's tensors, written directly."""
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        flat = t.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).clone()


class Engine:
    """An engine's tensors, and how the engine itself finds block ``b`` in them."""

    def __init__(
        self, tensors: list[torch.Tensor], entries: list[TensorEntry], block: Callable[[int], list[torch.Tensor]]
    ):
        self.tensors, self.entries, self.block = tensors, entries, block

    def snapshot(self, ids):
        return [[raw(t) for t in self.block(b)] for b in ids]


def zkv_engine(nb: int = NB):
    store = torch.zeros((2 * L, nb, H, BS, D), dtype=torch.bfloat16)  # zkv/kvcache.py's gpu_store
    per_layer = list(store.unbind(0))
    ks, vs = per_layer[0::2], per_layer[1::2]
    return Engine([store], layouts.zkv_native(ks, vs), lambda b: [t[b] for t in per_layer])


def fastdeploy_engine(nb: int = NB):
    ks = [torch.zeros((nb, H, BS, D), dtype=torch.bfloat16) for _ in range(L)]
    vs = [torch.zeros((nb, H, BS, D), dtype=torch.bfloat16) for _ in range(L)]
    scales = [torch.zeros((nb, H, BS), dtype=torch.float32) for _ in range(L)]
    tensors = ks + vs + scales
    return Engine(tensors, fastdeploy.regions(ks, vs, key_scales=scales), lambda b: [t[b] for t in tensors])


def vllm_flash_engine(nb: int = NB):
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros((2, nb, BS, H, D), dtype=torch.float16) for i in range(L)}
    return Engine(list(kv.values()), vllm.flash_attn(kv, null_block=None), lambda b: [t[:, b] for t in kv.values()])


def vllm_flash_hnd_engine(nb: int = NB):
    """FlashAttention's logical shape over an HND physical order (get_kv_cache_stride_order)."""
    kv = {f"layer.{i}": torch.zeros((2, nb, H, BS, D), dtype=torch.bfloat16).permute(0, 1, 3, 2, 4) for i in range(L)}
    storage = [t.permute(0, 1, 3, 2, 4) for t in kv.values()]  # contiguous again, for scribbling
    return Engine(storage, vllm.flash_attn(kv, null_block=None), lambda b: [t[:, b] for t in kv.values()])


def vllm_mla_engine(nb: int = NB):
    kv = {f"layer.{i}": torch.zeros((nb, BS, 576), dtype=torch.bfloat16) for i in range(L)}
    return Engine(list(kv.values()), layouts.per_layer(kv), lambda b: [t[b] for t in kv.values()])


def vllm_cross_layer_engine(nb: int = NB):
    t = torch.zeros((nb, L, 2, BS, H, D), dtype=torch.bfloat16)
    return Engine([t], layouts.per_layer({"kv_cache": t}), lambda b: [t[b]])


def vllm_canonical_engine(nb: int = NB):
    """What vLLM's offloading spec hands ``get_worker``: per layer, FlashAttention's storage viewed
    as int8 ``(2, blocks, page / 2)`` and unbound into a K and a V tensor (offloading/worker.py)."""
    kv = [torch.zeros((2, nb, BS, H, D), dtype=torch.bfloat16) for _ in range(L)]
    canonical = []
    for t in kv:
        flat = torch.empty(0, dtype=torch.int8).set_(t.untyped_storage())
        canonical += list(flat.view(2, nb, -1).unbind(0))
    entries = vllm.canonical_pages(canonical, null_block=None)
    return Engine(kv, entries, lambda b: [t[:, b] for t in kv])


def flashinfer_engine(nb: int = NB):
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros((nb, 2, BS, H, D), dtype=torch.bfloat16) for i in range(L)}
    return Engine(list(kv.values()), vllm.flashinfer(kv, null_block=None), lambda b: [t[b] for t in kv.values()])


def transformers_engine(nb: int = NB):
    dtype = torch.bfloat16
    page = L * 2 * BS * H * D * 2
    cache_tensor = torch.zeros(nb * page, dtype=torch.uint8)
    typed = cache_tensor.view(dtype).view(nb, L, 2, BS, H, D)
    return Engine([cache_tensor], transformers_layout.regions(cache_tensor, L, BS, H, D, dtype), lambda b: [typed[b]])


def sglang_engine(nb: int = NB):
    page_size = BS
    slots = nb * page_size
    ks = [torch.zeros((slots, H, D), dtype=torch.bfloat16) for _ in range(L)]
    vs = [torch.zeros((slots, H, D), dtype=torch.bfloat16) for _ in range(L)]
    tensors = ks + vs
    return Engine(
        tensors, sglang.mha(ks, vs, page_size), lambda b: [t[b * page_size : (b + 1) * page_size] for t in tensors]
    )


ENGINES = {
    "zkv": zkv_engine,
    "fastdeploy": fastdeploy_engine,
    "vllm_flash": vllm_flash_engine,
    "vllm_flash_hnd": vllm_flash_hnd_engine,
    "vllm_canonical": vllm_canonical_engine,
    "vllm_mla": vllm_mla_engine,
    "vllm_cross_layer": vllm_cross_layer_engine,
    "flashinfer": flashinfer_engine,
    "transformers_cb": transformers_engine,
    "sglang": sglang_engine,
}


@pytest.mark.parametrize("make", ENGINES.values(), ids=ENGINES.keys())
@pytest.mark.parametrize(
    "src,rows,dst",
    [
        ([0, 1, 2, 3], [5, 6, 7, 8], [8, 9, 10, 11]),
        ([7, 2, 9, 3], [0, 19, 4, 5], [1, 11, 0, 6]),
        (list(range(10)), list(range(10, 20)), list(range(2, 12))),
    ],
    ids=["short runs", "scattered", "one long run"],
)
def test_swap_out_overwrite_swap_in_elsewhere_restores_the_bytes(make, src, rows, dst):
    engine = make()
    cache = EngineCache.from_tensors(engine.entries)
    assert cache.num_blocks == NB
    assert cache.descriptor.block_bytes * NB == sum(t.numel() * t.element_size() for t in engine.tensors)
    tier = CpuTier.for_cache(cache.descriptor, rows=20)
    copier = CopyEngine(cache, tier)
    scribble(engine.tensors, seed=1)
    before = engine.snapshot(src)
    assert copier.swap_out(src, rows) == len(src) * cache.descriptor.block_bytes
    scribble(engine.tensors, seed=2)
    untouched = [b for b in range(NB) if b not in dst]
    others = engine.snapshot(untouched)
    copier.swap_in(rows, dst)
    after = engine.snapshot(dst)
    for want, got in zip(before, after):
        assert all(torch.equal(w, g) for w, g in zip(want, got))
    for want, got in zip(others, engine.snapshot(untouched)):
        assert all(torch.equal(w, g) for w, g in zip(want, got)), "a swap-in wrote outside its destination blocks"


def test_the_tier_is_block_major_one_row_per_block():
    engine = fastdeploy_engine()
    cache = EngineCache.from_tensors(engine.entries)
    tier = CpuTier.for_cache(cache.descriptor, rows=4)
    scribble(engine.tensors, seed=3)
    CopyEngine(cache, tier).swap_out([5], [2])
    assert tier.row_bytes_of(2) == b"".join(bytes(raw(t[5]).tolist()) for t in engine.tensors)


def test_vllm_flash_is_two_regions_per_layer_and_flashinfer_one():
    flash = EngineCache.from_tensors(vllm_flash_engine().entries).descriptor
    infer = EngineCache.from_tensors(flashinfer_engine().entries).descriptor
    assert len(flash.regions) == 2 * L and len(infer.regions) == L
    assert [r.name for r in flash.regions][:2] == ["model.layers.0.self_attn.attn.k", "model.layers.0.self_attn.attn.v"]
    assert flash.regions[1].offset == NB * flash.regions[0].page_bytes  # V half starts after all K blocks
    assert flash.regions[0].page_bytes == BS * H * D * 2 and infer.regions[0].page_bytes == 2 * BS * H * D * 2


def test_layers_sharing_one_tensor_are_copied_once():
    t = torch.zeros((NB, H, BS, D))
    cache = EngineCache.from_tensors(layouts.per_layer({"layer0": t, "layer1": t}))
    assert [r.name for r in cache.descriptor.regions] == ["layer0"]


def test_slots_past_the_last_whole_page_are_not_a_block():
    k = torch.zeros((NB * BS + 1, H, D))  # one padding slot, as transformers' older per-group tensors have
    cache = EngineCache.from_tensors(sglang.mha([k], [], BS))
    assert cache.num_blocks == NB


REFUSED = {
    "block dim not outermost": (lambda: torch.zeros((BS, NB, H, D)).transpose(0, 1), "not outermost"),
    "page not contiguous": (lambda: torch.zeros((NB, H, BS, 2 * D))[..., ::2], "not one contiguous run"),
    "pages overlap": (lambda: torch.zeros(NB * 64).as_strided((NB, 4, 16), (32, 16, 1)), "overlap"),
}


@pytest.mark.parametrize("case", REFUSED, ids=REFUSED.keys())
def test_a_tensor_that_cannot_be_copied_block_by_block_is_refused_naming_it(case):
    make, words = REFUSED[case]
    with pytest.raises(CacheError) as err:
        EngineCache.from_tensors([TensorEntry("key_caches_3", make())])
    assert err.value.code == "bad_layout"
    assert "key_caches_3" in str(err.value) and words in str(err.value)


def test_slots_of_one_sglang_page_must_be_adjacent():
    k = torch.zeros((NB * BS, H, 2 * D))[:, :, :D]  # slots with gaps between them
    with pytest.raises(CacheError, match="not adjacent|not one contiguous") as err:
        EngineCache.from_tensors(sglang.mha([k], [], BS))
    assert "k_buffer[0]" in str(err.value)


@pytest.mark.parametrize(
    "bad",
    [
        lambda: vllm.flash_attn({"l0": torch.zeros((3, NB, BS, H, D))}),
        lambda: vllm.flashinfer({"l0": torch.zeros((NB, BS, H, D))}),
        lambda: transformers_layout.regions(torch.zeros(100, dtype=torch.uint8), L, BS, H, D, torch.bfloat16),
        lambda: fastdeploy.regions([torch.zeros((NB, H, BS))]),
        lambda: EngineCache.from_tensors(layouts.per_layer({"a": torch.zeros((NB, 4)), "b": torch.zeros((NB + 1, 4))})),
    ],
)
def test_wrong_shapes_are_refused_at_attach(bad):
    with pytest.raises(CacheError) as err:
        bad()
    assert err.value.code == "bad_layout"


def test_block_ids_are_checked_against_the_engine_block_count():
    engine = zkv_engine()
    cache = EngineCache.from_tensors(engine.entries)
    copier = CopyEngine(cache, CpuTier.for_cache(cache.descriptor, rows=4))
    for src, dst in (
        ([NB], [0]),
        ([-1], [0]),
        ([True], [0]),
        ([1.0], [0]),
        ([0], [4]),
        ([0, 1], [2, 2]),
        ([0], [0, 1]),
        ([], []),
    ):
        with pytest.raises(CacheError) as err:
            copier.swap_out(src, dst)
        assert err.value.code == "bad_block_id"
    with pytest.raises(CacheError, match="duplicate"):
        copier.swap_in([0, 1], [3, 3])
    copier.swap_out([1, 1], [0, 1])  # the same source twice is fine


def test_coalesce_merges_consecutive_pairs_only():
    assert coalesce([3, 0, 1, 2, 9], [13, 10, 11, 12, 1]) == [(0, 10, 4), (9, 1, 1)]
    assert coalesce([0, 1], [5, 7]) == [(0, 5, 1), (1, 7, 1)]


@given(
    runs=st.lists(st.tuples(st.integers(0, 99), st.integers(0, 99), st.integers(1, 9)), max_size=6),
    cut=st.integers(0, 60),
)
def test_halving_runs_keeps_every_pair_in_order_and_puts_the_first_rows_first(runs, cut):
    def pairs(rs):
        return [(s + i, d + i) for s, d, n in rs for i in range(n)]

    first, second = cpu_copy.halve(runs, cut)
    assert pairs(first) + pairs(second) == pairs(runs)
    assert len(pairs(first)) == min(cut, len(pairs(runs)))
    assert all(n > 0 for _, _, n in first + second)


def test_copy_threads_follow_the_cores_unless_the_operator_says(monkeypatch):
    monkeypatch.delenv(cpu_copy.COPY_THREADS_ENV, raising=False)
    monkeypatch.setattr(cpu_copy.os, "sched_getaffinity", lambda pid: set(range(2)))
    assert cpu_copy.copy_threads() == 1, "2 cores: a bus's other processes need the second"
    monkeypatch.setattr(cpu_copy.os, "sched_getaffinity", lambda pid: set(range(4)))
    assert cpu_copy.copy_threads() == 2
    monkeypatch.setenv(cpu_copy.COPY_THREADS_ENV, "1")
    assert cpu_copy.copy_threads() == 1
    monkeypatch.setenv(cpu_copy.COPY_THREADS_ENV, "3")
    with pytest.raises(ValueError, match="ZKV_COPY_THREADS must be 1 or 2"):
        cpu_copy.copy_threads()


def test_interleaved_halves_of_one_tensor_are_two_regions_and_partial_overlap_is_refused():
    t = torch.zeros((NB, 2, BS, H, D))  # FlashInfer's K and V halves taken as regions of their own
    cache = EngineCache.from_tensors([TensorEntry("k", t[:, 0]), TensorEntry("v", t[:, 1])])
    assert [r.offset for r in cache.descriptor.regions] == [0, BS * H * D * 4]
    half = BS * H * D
    with pytest.raises(CacheError, match="'k' and 'kv' overlap"):
        straddling = t.view(NB, -1)[:, half // 2 : half + half // 2]  # the second half of K and the first of V
        EngineCache.from_tensors([TensorEntry("k", t[:, 0]), TensorEntry("kv", straddling)])


def test_vllm_canonical_pages_are_one_region_per_tensor_and_halves_share_a_buffer():
    descriptor = EngineCache.from_tensors(vllm_canonical_engine().entries).descriptor
    half = BS * H * D * 2
    assert len(descriptor.regions) == 2 * L and len(descriptor.buffers) == L
    assert [r.name for r in descriptor.regions][:2] == ["canonical[0]", "canonical[1]"]
    assert [(r.buffer, r.offset, r.row_stride, r.page_bytes) for r in descriptor.regions[:2]] == [
        (0, 0, half, half),
        (0, NB * half, half, half),
    ]
    assert descriptor.reserved == ()
    pages = [torch.zeros((NB, 64), dtype=torch.int8)]
    assert EngineCache.from_tensors(vllm.canonical_pages(pages)).descriptor.reserved == (vllm.NULL_BLOCK,)


def test_vllm_canonical_pages_take_the_spec_objects_and_check_them():
    class CanonicalKVCacheTensor:  # vllm/v1/kv_offload/spec.py's shape: a tensor and its page bytes
        def __init__(self, tensor, page_size_bytes):
            self.tensor, self.page_size_bytes = tensor, page_size_bytes

    t = torch.zeros((NB, 128), dtype=torch.int8)
    entries = vllm.canonical_pages([CanonicalKVCacheTensor(t, 128)], names=["layer.0"], null_block=None)
    assert [(e.name, e.tensor is t) for e in entries] == [("layer.0", True)]
    with pytest.raises(CacheError, match="page_size_bytes 64"):
        vllm.canonical_pages([CanonicalKVCacheTensor(t, 64)])
    with pytest.raises(CacheError, match=r"expected \(num_blocks, page_bytes\)"):
        vllm.canonical_pages([t.view(NB, 2, 64)])
    with pytest.raises(CacheError, match="2 names for 1"):
        vllm.canonical_pages([t], names=["a", "b"])


def _patterns(nb: int, rows: int, seed: int) -> dict[str, tuple[list[int], list[int]]]:
    """Block ids and tier rows: every shape the CPU copy plan cuts a swap into."""
    rng = random.Random(seed)
    n = 40
    blocks = rng.sample(range(nb), n)
    run = list(range(7, 7 + n))
    rng.shuffle(run)
    mixed_rows = list(range(50, 62)) + list(range(70, 82)) + rng.sample(range(90, rows), n - 24)
    mixed_blocks = list(range(3, 15)) + rng.sample(range(20, nb), n - 12)
    return {
        "scattered blocks into a run of rows": (blocks, run),
        "scattered on both sides": (blocks, rng.sample(range(rows), n)),
        "runs, scattered runs and loose pairs": (mixed_blocks, mixed_rows),
        "a few loose pairs beside a run": (blocks[:12], list(range(30, 39)) + [2, 90, 5]),
    }


# How the CPU copy plan moves a run: every region's pages with one call (cpu_copy.Span), that call
# in two halves at once (a large run, here every run), a call per region group (no span: pages of
# several sizes, padded tier rows), or the span refusing a swap-in whose source lies among the
# regions' addresses (numpy would copy it to a temporary first).
SPAN_PATHS = ("span", "span in two halves", "no span", "span refuses the source")


@pytest.mark.parametrize("make", ENGINES.values(), ids=ENGINES.keys())
@pytest.mark.parametrize("pattern", list(_patterns(96, 160, 0)))
@pytest.mark.parametrize("path", SPAN_PATHS)
def test_random_scattered_swaps_are_bit_exact_in_every_layout(make, pattern, path, monkeypatch):
    nb, rows = 96, 160
    engine = make(nb)
    cache = EngineCache.from_tensors(engine.entries)
    tier = CpuTier.for_cache(cache.descriptor, rows=rows)
    copier = CopyEngine(cache, tier)
    copier.cpu.split = path == "span in two halves"
    if path == "span in two halves":
        monkeypatch.setattr(cpu_copy, "SPLIT_BYTES", 1)
    if path == "no span":
        monkeypatch.setattr(copier.cpu, "_span", lambda: None)
    elif path == "span refuses the source":
        monkeypatch.setattr(cpu_copy.np, "may_share_memory", lambda *a: True)
    copier.cpu.stage_rows = 5  # several staging chunks
    blocks, tier_rows = _patterns(nb, rows, seed=len(pattern))[pattern]
    scribble(engine.tensors, seed=4)
    want = torch.zeros_like(tier.store)  # the same swap, a page at a time through the views
    for b, r in zip(blocks, tier_rows):
        for view, (start, page) in zip(cache.views, _spans(cache)):
            want[r, start : start + page] = view[b]
    copier.swap_out(blocks, tier_rows)
    assert torch.equal(tier.store, want), "swap_out moved other bytes than a page-by-page copy"
    before = engine.snapshot(blocks)
    scribble(engine.tensors, seed=5)
    dst = random.Random(1).sample(range(nb), len(blocks))
    untouched = [b for b in range(nb) if b not in dst]
    others = engine.snapshot(untouched)
    copier.swap_in(tier_rows, dst)
    for want_b, got_b in zip(before, engine.snapshot(dst)):
        assert all(torch.equal(w, g) for w, g in zip(want_b, got_b))
    for want_b, got_b in zip(others, engine.snapshot(untouched)):
        assert all(torch.equal(w, g) for w, g in zip(want_b, got_b)), "a swap-in wrote outside its blocks"


def test_a_half_that_fails_on_the_helper_thread_fails_the_copy_and_the_next_copy_runs(monkeypatch):
    engine = ENGINES["vllm_flash"](64)
    cache = EngineCache.from_tensors(engine.entries)
    tier = CpuTier.for_cache(cache.descriptor, rows=64)
    copier = CopyEngine(cache, tier)
    copier.cpu.split = True
    monkeypatch.setattr(cpu_copy, "SPLIT_BYTES", 1)
    real = cpu_copy.Span.gather

    def gather(span, blocks, out):
        if threading.current_thread().name.startswith("zkv-copy"):
            raise RuntimeError("the helper's half failed")
        return real(span, blocks, out)

    monkeypatch.setattr(cpu_copy.Span, "gather", gather)
    blocks = random.Random(3).sample(range(64), 32)
    with pytest.raises(RuntimeError, match="helper's half"):
        copier.swap_out(blocks, list(range(32)))
    monkeypatch.setattr(cpu_copy.Span, "gather", real)
    scribble(engine.tensors, seed=6)
    want = engine.snapshot(blocks)
    copier.swap_out(blocks, list(range(32)))
    scribble(engine.tensors, seed=7)
    copier.swap_in(list(range(32)), blocks)
    assert all(torch.equal(w, g) for wb, gb in zip(want, engine.snapshot(blocks)) for w, g in zip(wb, gb))
    copier.close()
    assert copier.cpu._helper is None, "closing the copier ends its helper thread"


def test_one_call_per_run_where_every_page_has_one_size():
    """The span covers every region where their pages are one size and the tier's rows are those
    pages side by side; a swap-in from memory among the regions is refused, not copied twice."""
    engine = vllm_flash_engine(32)
    cache = EngineCache.from_tensors(engine.entries)
    tier = CpuTier.for_cache(cache.descriptor, rows=32)
    span = CopyEngine(cache, tier).cpu._span()
    assert span is not None and span.count == len(cache.views)
    inside = span.pages_np[: 2 * span.count]  # regions' own bytes as a source
    assert not span.scatter(np.arange(2), inside)
    mixed = EngineCache.from_tensors(ENGINES["fastdeploy"](32).entries)  # pages of two sizes
    assert CopyEngine(mixed, CpuTier.for_cache(mixed.descriptor, rows=32)).cpu._span() is None


def _spans(cache: EngineCache) -> list[tuple[int, int]]:
    out, start = [], 0
    for r in cache.descriptor.regions:
        out.append((start, r.page_bytes))
        start += r.page_bytes
    return out


def test_repeated_rows_and_blocks_copy_like_a_page_at_a_time():
    """swap_out may read one block into two rows, swap_in one row into two blocks."""
    engine = vllm_flash_engine(32)
    cache = EngineCache.from_tensors(engine.entries)
    tier = CpuTier.for_cache(cache.descriptor, rows=32)
    copier = CopyEngine(cache, tier)
    scribble(engine.tensors, seed=6)
    blocks = [5, 9, 5, 2, 9, 30, 1, 5, 17, 17]
    copier.swap_out(blocks, list(range(10, 20)))
    for b, r in zip(blocks, range(10, 20)):
        assert all(torch.equal(v[b], c[r]) for v, c in zip(cache.views, tier.columns))
    rows = [10, 11, 10, 12, 13, 13, 14, 15, 16, 10]
    dst = list(range(20, 30))
    copier.swap_in(rows, dst)
    for r, b in zip(rows, dst):
        assert all(torch.equal(v[b], c[r]) for v, c in zip(cache.views, tier.columns))


def test_each_copy_strategy_is_chosen_in_its_domain():
    """``cpu_copy.choose`` picks each strategy of ``STRATEGIES`` where its domain says, and
    every strategy has one."""
    S, MIN = cpu_copy.Strategy, cpu_copy.MIN_RUN
    assert set(cpu_copy.STRATEGIES) == set(S) and all(d.chosen and d.measured for d in cpu_copy.STRATEGIES.values())
    assert cpu_copy.is_block_at_a_time(MIN - 1, small_pages=True)
    assert not cpu_copy.is_block_at_a_time(MIN, small_pages=True)
    assert cpu_copy.is_block_at_a_time(10 * MIN, small_pages=False)

    def chosen(tier, engine, has_span, out):
        return [s for s, _ in cpu_copy.choose(cpu_copy.plan(tier, engine), has_span, out)]

    rows = list(range(MIN))
    assert chosen(rows, [b + 40 for b in rows], has_span=True, out=True) == [S.SLICES]
    assert chosen(rows, [b + 40 for b in rows], has_span=False, out=False) == [S.SLICES]
    assert chosen(rows, [b + 40 for b in rows], has_span=True, out=False) == [S.SPAN]  # read once, in order
    scattered = [3 * b for b in rows]
    assert chosen(rows, scattered, has_span=True, out=True) == [S.SPAN]
    assert chosen(rows, scattered, has_span=False, out=True) == [S.INDEXED]
    loose = cpu_copy.STAGE_MIN_PAIRS
    assert chosen([2 * r for r in range(loose)], [5 * r for r in range(loose)], True, True) == [S.STAGED]
    assert chosen([2 * r for r in range(loose - 1)], [5 * r for r in range(loose - 1)], True, True) == [S.PAGES]
    mixed = chosen(rows + [100, 102], [b + 40 for b in rows] + [7, 9], has_span=False, out=True)
    assert mixed == [S.SLICES, S.PAGES]  # slices first, loose pairs last
