"""Plots render to PNG from synthetic tables (no simulation needed); the rolling hit rate is computed right."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from experiments.plots import (plot_compare_bars, plot_compare_cdf, plot_hit_rate, plot_latency_cdf,
                               plot_occupancy, plot_run, rolling_hit_rate)
from experiments.results import requests_frame, timeline_frame

PNG_MAGIC = b"\x89PNG"


def synthetic_requests(n: int = 50, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    ttft = rng.lognormal(0, 1, n)
    rows = [{"request": i, "ttft_s": ttft[i], "tpot_s": 0.05 + 0.01 * rng.random(), "e2e_s": ttft[i] + 5,
             "queue_s": 0.0, "finish": "limit", "n_cached": 10, "n_processed": 10, "n_output": 10}
            for i in range(n)]
    return requests_frame(rows)


def synthetic_timeline(n: int = 100) -> pd.DataFrame:
    return timeline_frame([{"t_s": 0.5 * i, "busy_slots": i % 5, "deferred": i % 3, "queued": i % 2,
                            "cache_bytes": 2**20 * i, "cache_entries": i, "cum_prompt_cached": 10 * i,
                            "cum_prompt_processed": 30 * i} for i in range(n)])


def is_png(path) -> bool:
    return path.read_bytes()[:4] == PNG_MAGIC


def test_run_plots_are_three_pngs(tmp_path):
    paths = plot_run(tmp_path, synthetic_requests(), synthetic_timeline(), n_slots=4)
    assert [p.name for p in paths] == ["latency_cdf.png", "cache_hit_rate.png", "occupancy.png"]
    assert all(is_png(p) for p in paths)


def test_plots_survive_empty_tables(tmp_path):
    empty_req, empty_tl = requests_frame([]), timeline_frame([])
    assert is_png(plot_latency_cdf(empty_req, tmp_path / "a.png"))
    assert is_png(plot_hit_rate(empty_tl, tmp_path / "b.png"))
    assert is_png(plot_occupancy(empty_tl, tmp_path / "c.png"))


def test_rolling_hit_rate_counts_only_tokens_inside_the_window():
    tl = timeline_frame([{"t_s": t, "cum_prompt_cached": c, "cum_prompt_processed": p}
                         for t, c, p in [(0, 0, 100), (1, 0, 200), (2, 100, 200), (3, 300, 200)]])
    rate = rolling_hit_rate(tl, window_s=1.0)
    # t=0: 0/100; t=1: 0 cached of 100 new; t=2: 100 of 100; t=3: 200 of 200
    assert rate.tolist() == pytest.approx([0.0, 0.0, 1.0, 1.0])


def test_rolling_hit_rate_is_nan_when_no_prompt_tokens_arrive():
    tl = timeline_frame([{"t_s": t, "cum_prompt_cached": 0, "cum_prompt_processed": 10} for t in range(3)])
    rate = rolling_hit_rate(tl, window_s=0.5)
    assert rate[0] == 0.0 and all(math.isnan(x) for x in rate[1:])


def test_comparison_plots_render(tmp_path):
    runs = {"evict=fifo": synthetic_requests(seed=1), "evict=lru": synthetic_requests(seed=2)}
    table = pd.DataFrame({"label": list(runs), "ttft_p50_s": [1.0, 0.8], "ttft_p99_s": [5.0, 4.0],
                          "prompt_cache_hit_rate": [0.4, 0.6]})
    assert is_png(plot_compare_cdf(runs, tmp_path / "cdf.png"))
    assert is_png(plot_compare_bars(table, tmp_path / "bars.png"))
