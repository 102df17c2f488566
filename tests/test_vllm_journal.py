"""The journals of an engine's tiers (zkv/rows/journal.py) and the
identity they are written under (identity.py): what a restarted engine reads
back, what it refuses, and what names the weights."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import msgpack
import pytest

from zkv.engines.vllm.identity import EngineIdentity, checkpoint_version, identity_of
from zkv.rows import RowChange
from zkv.rows.journal import Header, Journal, JournalError, encode, encode_header, replay
from zkv.wire.vocab import Tier

IDENTITY = EngineIdentity("llama", "", "cfg", {"block_size": 32, "layers": 2}, "files:w0")


def test_a_journal_reads_back_each_keys_last_row_in_the_order_written(tmp_path):
    j = Journal(tmp_path / "j", Tier.DISK, rows=8, sync=True)
    j.start(IDENTITY, cpu_gen=3, rows=[(b"a", 0), (b"b", 1)])
    j.append([RowChange(Tier.DISK, b"a", None), RowChange(Tier.DISK, b"c", 0), RowChange(Tier.DISK, b"b", 5)])
    j.flush_drops()
    found = Journal(tmp_path / "j", Tier.DISK, rows=8).read()
    assert found is not None
    assert found.header == Header(IDENTITY, 3, Tier.DISK, 8)
    assert list(found.rows.items()) == [(b"c", 0), (b"b", 5)]
    j.remove()
    assert Journal(tmp_path / "j", Tier.DISK, rows=8).read() is None


def test_a_torn_last_record_is_left_out_and_the_rest_is_served():
    data = encode_header(Header(IDENTITY, 1, Tier.CPU, 4)) + encode(
        [RowChange(Tier.CPU, b"a", 0), RowChange(Tier.CPU, b"b", 1)]
    )
    for cut in range(1, len(msgpack.packb([b"b", 1]))):
        assert list(replay(data[:-cut]).rows.items()) == [(b"a", 0)]


@pytest.mark.parametrize(
    "tail, why",
    [
        (msgpack.packb([b"a", 9]), "row 9 of a tier of 4"),
        (msgpack.packb([b"a", -2]), "row -2"),
        (msgpack.packb({"a": 1}), "does not decode"),
        (msgpack.packb([b"a", "0"]), "not \\[key, row\\]"),
        (msgpack.packb([b"a", 0]) + msgpack.packb([b"b", 0]), "row 0 under a second key"),
        (b"\xc1", "does not decode"),
    ],
)
def test_a_record_that_does_not_check_throws_the_whole_journal_away(tail, why):
    with pytest.raises(JournalError, match=why):
        replay(encode_header(Header(IDENTITY, 1, Tier.CPU, 4)) + tail)


def test_a_header_that_does_not_check_is_refused():
    good = encode_header(Header(IDENTITY, 1, Tier.CPU, 4))
    with pytest.raises(JournalError, match="no header"):
        replay(b"ZKVJRNL0" + good[8:])
    with pytest.raises(JournalError, match="torn"):
        replay(good[:-3])
    body = msgpack.unpackb(good[12:])
    body["identity"]["weights"] = "files:w1"  # the identity edited without its digest
    forged = msgpack.packb(body, use_bin_type=True)
    with pytest.raises(JournalError, match="digest"):
        replay(good[:8] + len(forged).to_bytes(4, "little") + forged)


def test_identities_differ_by_every_field_and_moved_weights_are_never_a_checkpoints():
    assert IDENTITY.digest() == EngineIdentity("llama", "", "cfg", {"layers": 2, "block_size": 32}, "files:w0").digest()
    other = EngineIdentity("llama", "", "cfg", {"block_size": 16, "layers": 2}, "files:w0")
    assert other.digest() != IDENTITY.digest() and IDENTITY.differs(other) == ["layout"]
    moved = IDENTITY.moved()
    assert moved.weights.startswith("files:w0+moved-") and moved != IDENTITY.moved()
    assert moved.moved().weights.count("+moved-") == 1
    assert IDENTITY.differs(moved) == ["weights"]


def test_engines_a_clear_named_the_weights_of_share_one_namespace_and_unnamed_ones_share_none():
    from zkv.rows.records import TierRecords

    a, b = TierRecords(IDENTITY, {}), TierRecords(IDENTITY.with_weights("step-1"), {})
    for records in (a, b):  # one cycle cleared both buses under its label
        records.forget(moved=True, weights="step-2")
    assert a.identity.weights == b.identity.weights == "version:step-2"
    assert a.identity.namespace() == b.identity.namespace() == IDENTITY.with_weights("step-2").namespace()
    a.forget(moved=True, weights=None)  # a clear that named nothing: weights of its own
    assert a.identity.weights.startswith("version:step-2+moved-") and a.identity.namespace() != b.identity.namespace()
    b.forget(moved=False, weights="step-3")  # the same weights (their tiers came back elsewhere): no new name
    assert b.identity.weights == "version:step-2"


def test_the_checkpoint_version_follows_the_files_not_the_path(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"w" * 64)
    (tmp_path / "config.json").write_text("{}")
    first = checkpoint_version(str(tmp_path), None)
    assert first.startswith("files:") and checkpoint_version(str(tmp_path), None) == first
    st = os.stat(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").write_bytes(b"v" * 64)  # rewritten in place, same size
    os.utime(tmp_path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert checkpoint_version(str(tmp_path), None) != first
    assert checkpoint_version("meta-llama/Llama-3-8B", "abc123") == "hub:abc123"
    assert checkpoint_version("meta-llama/Llama-3-8B", None, commit="c0ffee") == "hub:c0ffee"


def _config(model: str, rope: dict | None = None, dtype: str = "torch.bfloat16", block: int = 32, cache: str = "auto"):
    hf = SimpleNamespace(to_dict=lambda: {"architectures": ["LlamaForCausalLM"], "rope_scaling": rope})
    mc = SimpleNamespace(
        model=model,
        revision=None,
        hf_config=hf,
        dtype=dtype,
        quantization=None,
        get_num_layers=lambda pc: 2,
        get_num_kv_heads=lambda pc: 2,
        get_head_size=lambda: 32,
    )
    return SimpleNamespace(
        model_config=mc,
        cache_config=SimpleNamespace(block_size=block, cache_dtype=cache),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def test_an_engines_identity_names_its_config_dtype_and_layout(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"w")
    base = identity_of(_config(str(tmp_path)))
    assert base == identity_of(_config(str(tmp_path)))
    assert base.layout == {
        "block_size": 32,
        "layers": 2,
        "kv_heads": 2,
        "head_dim": 32,
        "kv_dtype": "torch.bfloat16",
        "tp": 1,
    }
    assert base.differs(identity_of(_config(str(tmp_path), rope={"type": "linear", "factor": 2.0}))) == ["config"]
    assert base.differs(identity_of(_config(str(tmp_path), dtype="torch.float16"))) == ["config", "layout"]
    assert base.differs(identity_of(_config(str(tmp_path), block=16))) == ["layout"]
    assert base.differs(identity_of(_config(str(tmp_path), cache="fp8"))) == ["layout"]


def test_tier_list_says_whose_kv_each_tier_holds_and_clean_takes_the_journal_with_the_file(tmp_path):
    from click.testing import CliRunner

    from zkv.cli.commands import main
    from zkv.rank.tiers.tier_file import TierFile, TierPlace, journal_path
    from zkv.rows.journal import DISK_JOURNAL

    TierFile(TierPlace("b0b0b0b0b0b0", 0, str(tmp_path)), ("shape",), rows=4, row_bytes=64).close()  # no worker
    Journal(journal_path(tmp_path, "b0b0b0b0b0b0"), Tier.CPU, 4).start(IDENTITY, 2, [(b"k", 1), (b"l", 3)])
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "zkv-rank0.disk").write_bytes(bytes(4096))
    (tmp_path / "disk" / DISK_JOURNAL).write_bytes(b"ZKVJRNL1\xff\xff\xff\xff")  # torn at its header
    out = CliRunner().invoke(main, ["tier", "list", "--tier-dir", str(tmp_path), "--disk-dir", str(tmp_path / "disk")])
    assert out.exit_code == 0, out.output
    cpu, disk = out.output.splitlines()
    assert "engine llama (config cfg, weights files:w0, block 32" in cpu and "2 blocks journaled" in cpu
    assert "journal does not check" in disk and "a restart serves none of it" in disk
    out = CliRunner().invoke(main, ["tier", "list", "--tier-dir", str(tmp_path), "--json"])
    assert json.loads(out.output)["engine"]["journaled"] == 2
    assert "kept for a warm restart of its engine" in cpu, "its journal checks: the next engine adopts it"
    out = CliRunner().invoke(main, ["tier", "clean", "--tier-dir", str(tmp_path), "--all"])
    assert out.exit_code == 0 and "1 kept for a restart" in out.output, out.output
    assert journal_path(tmp_path, "b0b0b0b0b0b0").exists(), "clean --all keeps what a warm restart adopts"
    out = CliRunner().invoke(main, ["tier", "clean", "--tier-dir", str(tmp_path), "--all", "--with-kept"])
    assert out.exit_code == 0, out.output
    assert not journal_path(tmp_path, "b0b0b0b0b0b0").exists() and "zkv-index-b0b0b0b0b0b0.journal" in out.output


def test_the_journals_old_import_path_works_and_warns():
    import importlib
    import sys

    sys.modules.pop("zkv.engines.vllm.journal", None)
    with pytest.warns(DeprecationWarning, match="zkv.rows.journal"):
        old = importlib.import_module("zkv.engines.vllm.journal")
    assert old.Journal is Journal
