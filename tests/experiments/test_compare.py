"""`slotlab compare`: a cartesian grid of configurations, one row and one directory each, deterministic."""

from __future__ import annotations

import pandas as pd

from experiments.cli import main
from experiments.compare import config_label, expand_grid, run_subdir


def test_grid_is_the_cartesian_product_in_option_order():
    grid = expand_grid({"evict": ["fifo", "lru"], "cache_hit": ["move", "copy"], "parallel": [4]})
    assert grid == [{"evict": "fifo", "cache_hit": "move", "parallel": 4},
                    {"evict": "fifo", "cache_hit": "copy", "parallel": 4},
                    {"evict": "lru", "cache_hit": "move", "parallel": 4},
                    {"evict": "lru", "cache_hit": "copy", "parallel": 4}]


def test_label_names_only_the_varied_options_and_directory_names_are_safe():
    assert config_label({"evict": "lru", "cache_ram": -1}) == "evict=lru cache_ram=-1"
    assert config_label({}) == "base"
    assert run_subdir(3, "latency=roofline:llama-3-8b@a100-80gb") == "003_latency=roofline_llama-3-8b_a100-80gb"


def test_compare_writes_one_row_and_one_directory_per_configuration(tmp_path, small_args):
    out = tmp_path / "cmp"
    assert main(["compare", *small_args, "--evict", "fifo,lru", "--cache-hit", "move,copy", "--jobs", "2",
                 "--no-plots", "--out", str(out)]) == 0
    table = pd.read_csv(out / "comparison.csv")
    assert len(table) == 4 and (table["status"] == "ok").all()
    assert table[["evict", "cache_hit"]].values.tolist() == [["fifo", "move"], ["fifo", "copy"],
                                                             ["lru", "move"], ["lru", "copy"]]
    assert {"ttft_p50_s", "ttft_p99_s", "prompt_cache_hit_rate", "throughput_rps"} <= set(table.columns)
    assert all((out / d / "requests.parquet").exists() for d in table["run_dir"])


def test_compare_plots_overlay_every_configuration(tmp_path, small_args):
    out = tmp_path / "cmp"
    assert main(["compare", *small_args, "-np", "1,2", "--jobs", "2", "--out", str(out)]) == 0
    assert (out / "compare_latency_cdf.png").stat().st_size > 0 and (out / "compare_bars.png").stat().st_size > 0
    assert all((out / d / "latency_cdf.png").exists() for d in pd.read_csv(out / "comparison.csv")["run_dir"])


def test_negative_values_in_a_comma_list_are_accepted_with_equals(tmp_path, small_args):
    out = tmp_path / "cmp"
    assert main(["compare", *small_args, "--cache-ram=-1,0", "--jobs", "1", "--no-plots", "--out", str(out)]) == 0
    assert pd.read_csv(out / "comparison.csv")["cache_ram"].tolist() == [-1, 0]


def test_a_configuration_run_by_compare_equals_the_same_simulate_run(tmp_path, small_args):
    assert main(["compare", *small_args, "--evict", "fifo,lru", "--jobs", "2", "--no-plots",
                 "--out", str(tmp_path / "cmp")]) == 0
    assert main(["simulate", *small_args, "--evict", "lru", "--no-plots", "--out", str(tmp_path / "sim")]) == 0
    row = pd.read_csv(tmp_path / "cmp" / "comparison.csv").iloc[1]
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "cmp" / row["run_dir"] / "requests.parquet"),
                                  pd.read_parquet(tmp_path / "sim" / "requests.parquet"))


def test_an_invalid_configuration_in_the_grid_stops_before_any_run(tmp_path, capsys):
    assert main(["compare", "-np", "2,0", "--out", str(tmp_path / "cmp")]) == 2
    assert "n_parallel" in capsys.readouterr().err and not (tmp_path / "cmp").exists()
