"""The vLLM backend's settings (zkv/engines/vllm/settings.py), read from
``kv_connector_extra_config``: the defaults that decide what the disk tier
serves, and what a worker says it reserves."""

import pytest

from zkv.engines.vllm.settings import ZkvSettings


def test_with_a_disk_tier_every_cpu_row_is_spilled_by_default():
    on_disk = ZkvSettings.from_extra({"cpu_blocks": 40, "disk_dir": "/var/tmp/zkv"}, "engine0")
    assert on_disk.spill_below == 40
    assert ZkvSettings.from_extra({"cpu_blocks": 40}, "engine0").spill_below == 0
    assert ZkvSettings.from_extra({"cpu_blocks": 40, "disk_dir": "/d", "spill_below": 8}, "e").spill_below == 8


def test_a_worker_says_the_bytes_its_tiers_reserve():
    block = 2 * 32 * 16 * 8 * 128 * 2  # a Llama 3 8B block of 16 tokens in bf16: 2 MiB
    said = ZkvSettings.from_extra(
        {"cpu_blocks": 4096, "tier_dir": "/dev/shm", "disk_dir": "/var/cache/zkv", "disk_blocks": 16384}, "engine0"
    ).reserved(0, block)
    assert "8.00 GiB for its CPU tier in a file in /dev/shm" in said
    assert "32.00 GiB of disk in /var/cache/zkv (16384 blocks)" in said
    in_memory = ZkvSettings.from_extra({"cpu_blocks": 512, "tier_dir": None}, "engine0").reserved(1, block)
    assert "rank 1 reserves 1.00 GiB for its CPU tier in process memory" in in_memory and "disk" not in in_memory


def test_only_a_named_bus_keeps_its_cpu_tier_for_the_next_engine():
    assert ZkvSettings.from_extra({"bus_dir": "/run/zkv/engine-0"}, "engine0").bus_named
    unnamed = ZkvSettings.from_extra({}, "0123456789abcdef")
    assert not unnamed.bus_named and unnamed.bus_dir.endswith("vllm-0123456789ab")


def test_the_cpu_tier_is_a_file_in_dev_shm_unless_told_otherwise():
    assert ZkvSettings.from_extra({}, "engine0").tier_dir == "/dev/shm"
    assert ZkvSettings.from_extra({"tier_dir": "/mnt/tiers"}, "engine0").tier_dir == "/mnt/tiers"
    assert ZkvSettings.from_extra({"tier_dir": None}, "engine0").tier_dir is None  # process memory


def test_the_manager_hears_broadcasts_unless_told_not_to():
    assert ZkvSettings.from_extra({}, "e").hear_broadcasts and ZkvSettings.from_extra({}, "e").status_interval_s == 1.0
    assert not ZkvSettings.from_extra({"hear_broadcasts": False}, "e").hear_broadcasts
    with pytest.raises(ValueError, match="bool.*hear_broadcasts"):
        ZkvSettings.from_extra({"hear_broadcasts": "no"}, "e")


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"cpu_blocks": 0}, "cpu_blocks"),
        ({"cpu_blocks": True}, "cpu_blocks"),
        ({"disk_blocks": 1 << 30}, "disk_blocks"),
        ({"task_timeout_s": float("nan")}, "task_timeout_s"),
        ({"task_timeout_s": float("inf")}, "task_timeout_s"),
        ({"status_interval_s": -1}, "status_interval_s"),
        ({"broker": "remote"}, "broker"),
        ({"tier_dir": ""}, "tier_dir"),
        ({"metrics_port": 70000}, "metrics_port"),
        ({"disk_dir": "/d", "cpu_blocks": 8, "spill_below": 9}, "spill_below"),
    ],
)
def test_every_value_is_range_checked_where_it_enters_naming_its_key(extra, key):
    with pytest.raises(ValueError, match=key):
        ZkvSettings.from_extra(extra, "e")


def test_what_zkv_works_out_is_never_read_from_the_map_and_unknown_keys_are_vllms():
    settings = ZkvSettings.from_extra({"bus_named": True, "blocks_per_chunk": 1}, "e")
    assert not settings.bus_named
    assert settings.spill_below == 0 and settings.metrics_port is None


def test_the_settings_make_no_directory_until_asked(tmp_path):
    settings = ZkvSettings.from_extra({"bus_dir": str(tmp_path / "bus")}, "e")
    assert settings.endpoints.frontend.endswith("bus/frontend.sock") and not (tmp_path / "bus").exists()
    settings.make_bus_dir()
    assert (tmp_path / "bus").is_dir() and (tmp_path / "bus").stat().st_mode & 0o777 == 0o700
