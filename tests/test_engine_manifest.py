"""Cross-process attach on CPU: a real engine process owns its tensors in
shared memory and exports a manifest; this process maps it, swaps blocks
through zkv's tier, the engine sees the bytes, and release unmaps every file
(/proc/self/maps) while the engine keeps its own mapping.  Bad manifests are
refused with a code and leave nothing mapped."""

from __future__ import annotations

import gc
import os

import msgpack
import pytest
import torch

from zkv.harness.bus.ipc_check import EngineProcess, check, mapped
from zkv.rank.errors import CacheError
from zkv.rank.memory import layouts
from zkv.rank.memory.manifest import ShmArena, _map_cuda, attach, device_uuid, export_manifest, parse_manifest


@pytest.mark.parametrize("layout", ["fastdeploy", "vllm_flash"])
def test_a_worker_swaps_blocks_of_tensors_another_process_owns_and_release_unmaps_them(layout):
    """The engine is a separate process (zkv.harness.bus.demo_engine); ipc_check drives it."""
    result = check(layout, "cpu")
    assert result["mapped_attached"] > 0, "the worker maps the engine's files while attached"
    assert result["bytes_ok"], "the engine sees the swapped bytes in its own tensors, at the new ids"
    assert result["released"] and result["mapped_after_release"] == 0, (
        "the worker still maps engine memory after release"
    )
    assert result["engine_still_maps"], "the engine keeps its own memory"
    assert result["files_left"] == [], "the engine unlinks its files"
    assert result["ok"]


def test_the_engine_process_answers_within_a_bound_and_is_stopped(tmp_path):
    engine = EngineProcess("fastdeploy", str(tmp_path / "m"), generation=1)
    assert engine.ask("bogus").startswith("error")
    assert len(engine.digest([0, 1])) == 2
    engine.close()
    assert engine.proc.poll() is not None and not [p for p in os.listdir("/dev/shm") if engine.tag in p]


@pytest.fixture
def local_manifest(tmp_path):
    """A manifest of tensors this process owns (same code path, no subprocess)."""
    arena = ShmArena()
    k = arena.tensor("k0", (8, 2, 4, 8), torch.bfloat16)
    path = tmp_path / "m"
    manifest = export_manifest(str(path), layouts.per_layer({"k0": k}), generation=1, arena=arena)
    yield path, manifest, arena
    del k
    arena.close()


def test_a_manifest_of_another_generation_is_stale(local_manifest):
    path, manifest, arena = local_manifest
    for kw in ({"expect_generation": 2}, {"expect_nonce": "0" * 32}, {"expect_instance": "another engine"}):
        with pytest.raises(CacheError) as err:
            attach(str(path), **kw)
        assert err.value.code == "stale_manifest"
    assert mapped(arena.tag) == 1, "only the engine's own mapping"
    cache = attach(str(path), expect_generation=1, expect_nonce=manifest["nonce"])
    assert cache.generation == 1 and mapped(arena.tag) == 2


def rewrite(path, manifest, change):
    m = msgpack.unpackb(msgpack.packb(manifest), raw=False)
    change(m)
    path.write_bytes(msgpack.packb(m, use_bin_type=True))


BAD = {
    "wrong version": (lambda m: m.update(zkv_manifest=2), "bad_manifest"),
    "unknown dtype": (lambda m: m["descriptor"]["buffers"][0].update(dtype="float7"), "bad_manifest"),
    "negative generation": (lambda m: m.update(generation=-1), "bad_manifest"),
    "bool generation": (lambda m: m.update(generation=True), "bad_manifest"),
    "huge blocks": (lambda m: m["descriptor"].update(num_blocks=2**60), "bad_manifest"),
    "region past the buffer": (lambda m: m["descriptor"]["regions"][0].update(offset=10**6), "bad_manifest"),
    "buffer past the file": (lambda m: m["handles"][0].update(offset=8), "bad_manifest"),
    "file outside shm": (lambda m: m["handles"][0].update(path="/etc/passwd"), "bad_manifest"),
    "not a zkv file": (lambda m: m["handles"][0].update(path="/dev/shm/other"), "bad_manifest"),
    "unknown handle kind": (lambda m: m["handles"][0].update(kind="rdma"), "bad_manifest"),
    "cuda handle for a cpu buffer": (
        lambda m: m["handles"].__setitem__(
            0,
            {
                "kind": "cuda_ipc",
                "device_uuid": "GPU-x",
                "handle": b"h",
                "size": 1024,
                "offset": 0,
                "ref_counter_handle": b"r",
                "ref_counter_offset": 0,
                "event_handle": b"",
                "event_sync_required": False,
            },
        ),
        "bad_manifest",
    ),
    "extra field": (lambda m: m.update(evil=1), "bad_manifest"),
    "missing file": (lambda m: m["handles"][0].update(path=m["handles"][0]["path"] + "-gone"), "missing_file"),
    "wrong size": (lambda m: m["handles"][0].update(file_bytes=2048), "size_mismatch"),
}


@pytest.mark.parametrize("case", BAD, ids=BAD.keys())
def test_a_bad_manifest_is_refused_with_a_code_and_maps_nothing(local_manifest, case):
    path, manifest, arena = local_manifest
    change, code = BAD[case]
    rewrite(path, manifest, change)
    before = mapped(arena.tag)
    with pytest.raises(CacheError) as err:
        attach(str(path))
    assert err.value.code == code, err.value
    gc.collect()
    assert mapped(arena.tag) == before


def test_a_symlink_in_place_of_the_file_is_refused(local_manifest, tmp_path):
    path, manifest, arena = local_manifest
    link = f"/dev/shm/zkv-{arena.tag}-link"
    os.symlink(next(iter(arena.paths.values())), link)
    try:
        rewrite(path, manifest, lambda m: m["handles"][0].update(path=link))
        with pytest.raises(CacheError, match="not a regular file"):
            attach(str(path))
    finally:
        os.unlink(link)


def test_a_file_that_shrank_is_a_size_mismatch(local_manifest):
    path, _, arena = local_manifest
    os.truncate(next(iter(arena.paths.values())), 512)
    with pytest.raises(CacheError) as err:
        attach(str(path))
    assert err.value.code == "size_mismatch"


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x93\x01\x02", msgpack.packb([1, 2]), b"x" * 100])
def test_garbage_is_a_bad_manifest(data):
    with pytest.raises(CacheError) as err:
        parse_manifest(data)
    assert err.value.code == "bad_manifest"


def test_a_missing_manifest(tmp_path):
    with pytest.raises(CacheError) as err:
        attach(str(tmp_path / "none"))
    assert err.value.code == "missing_file"


def test_a_cpu_tensor_outside_shared_memory_cannot_be_exported(tmp_path):
    with pytest.raises(CacheError, match="not in shared memory"):
        export_manifest(str(tmp_path / "m"), layouts.per_layer({"k": torch.zeros((4, 8))}), generation=1)


def test_a_cuda_buffer_is_found_by_device_uuid_not_index(monkeypatch):
    """CUDA control flow with fakes: the worker's device 1 is the engine's device."""

    class Props:
        def __init__(self, i):
            self.uuid = f"GPU-{i}"

    opened = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props(i))
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(
        torch.UntypedStorage,
        "_new_shared_cuda",
        staticmethod(lambda *args: opened.append(args) or torch.UntypedStorage(64)),
    )
    assert device_uuid(1) == "GPU-1"
    h = {
        "kind": "cuda_ipc",
        "device_uuid": "GPU-1",
        "handle": b"h" * 64,
        "size": 64,
        "offset": 0,
        "ref_counter_handle": b"r",
        "ref_counter_offset": 8,
        "event_handle": b"e",
        "event_sync_required": True,
    }
    flat = _map_cuda(h, "layer0", 64)
    assert flat.numel() == 64 and opened[0][0] == 1 and opened[0][1] == b"h" * 64
    with pytest.raises(CacheError) as err:
        _map_cuda(dict(h, device_uuid="GPU-9"), "layer0", 64)
    assert err.value.code == "no_device"
