"""The copy benchmark runs and reports every layout and id pattern beside its baseline."""

import torch

from zkv.harness.copies.bench import LAYOUTS, PATTERNS, bench_copy, format_table


def test_bench_copy_reports_every_engine_layout_beside_a_plain_copy():
    threads = torch.get_num_threads()
    result = bench_copy(blocks=8, layers=2, kv_heads=2, block_size=4, head_dim=8, reps=1)
    assert torch.get_num_threads() == threads, "the bench restores the thread setting"
    assert (
        set(result["layouts"])
        == set(LAYOUTS)
        == {"fastdeploy", "vllm_flash", "vllm_canonical", "sglang", "block_major"}
    )
    assert [result["layouts"][name]["regions"] for name in LAYOUTS] == [4, 4, 4, 4, 1]
    for row in result["layouts"].values():
        for name in PATTERNS:
            assert row[name]["out_gbps"] > 0 and row[name]["copy_in_gbps"] > 0 and row[name]["in_vs_copy"] > 0
    assert "scattered_both" in format_table(result)
