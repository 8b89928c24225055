"""Results tables and the summary row: columns, percentiles, hit rate, throughput; write and read back."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from experiments.results import REQUEST_COLUMNS, load_results, requests_frame, summarize, write_run


def row(i: int, **kw) -> dict:
    base = {"request": i, "session_id": None, "turn": 0, "arrival_s": 0.0, "launch_s": 0.0,
            "first_token_s": 1.0, "end_s": 2.0, "slot": 0, "n_prompt": 10, "n_cached": 0, "n_processed": 10,
            "n_output": 5, "n_output_target": 5, "queue_s": 0.0, "ttft_s": 1.0, "tpot_s": 0.25, "e2e_s": 2.0,
            "finish": "limit", "error": None, "n_deferred": 0, "truncated": False}
    return {**base, **kw}


def known_table() -> pd.DataFrame:
    """100 requests whose TTFT is 1..100 s, TPOT 0.01..1.00 s, E2E 2..200 s, queue 0..99 s."""
    return requests_frame([row(i, ttft_s=float(i + 1), tpot_s=(i + 1) / 100, e2e_s=2.0 * (i + 1),
                               queue_s=float(i)) for i in range(100)])


def test_summary_percentiles_and_means_on_a_known_table():
    s = summarize(known_table(), sim_s=50.0)
    assert (s["ttft_p50_s"], s["ttft_p90_s"], s["ttft_p99_s"], s["ttft_mean_s"]) == \
        pytest.approx((50.5, 90.1, 99.01, 50.5))
    assert (s["tpot_p50_s"], s["tpot_p99_s"]) == pytest.approx((0.505, 0.9901))
    assert (s["e2e_p50_s"], s["e2e_p90_s"]) == pytest.approx((101.0, 180.2))
    assert (s["queue_p50_s"], s["queue_mean_s"]) == pytest.approx((49.5, 49.5))


def test_summary_leaves_errors_out_of_latency_but_counts_them():
    df = requests_frame([row(0, ttft_s=1.0), row(1, ttft_s=3.0),
                         row(2, finish="error", error="Context size has been exceeded.", ttft_s=math.nan,
                             n_output=0)])
    s = summarize(df, sim_s=10.0)
    assert (s["n_requests"], s["n_finished"], s["n_errors"]) == (3, 2, 1)
    assert s["ttft_p50_s"] == pytest.approx(2.0)


def test_tpot_ignores_requests_with_one_output_token():
    df = requests_frame([row(0, tpot_s=0.5), row(1, tpot_s=math.nan, n_output=1)])
    assert summarize(df, sim_s=1.0)["tpot_p99_s"] == pytest.approx(0.5)


def test_hit_rate_is_cached_over_cached_plus_processed_prompt_tokens():
    df = requests_frame([row(0, n_cached=0, n_processed=100), row(1, n_cached=300, n_processed=100)])
    assert summarize(df, sim_s=1.0)["prompt_cache_hit_rate"] == pytest.approx(0.6)


def test_throughput_is_over_simulated_time():
    df = requests_frame([row(i, n_output=50) for i in range(10)])
    s = summarize(df, sim_s=20.0)
    assert (s["throughput_rps"], s["output_tokens_per_s"]) == pytest.approx((0.5, 25.0))


def test_counters_come_from_cache_stats_and_metrics():
    s = summarize(requests_frame([row(0)]), sim_s=1.0, cache_stats={"evictions": 3, "hits": 7, "saves": 9},
                  metrics={"n_context_shifts": 2, "n_deferrals": 5})
    assert (s["evictions"], s["cache_hits"], s["cache_saves"], s["context_shifts"], s["deferrals"]) == \
        (3, 7, 9, 2, 5)


def test_requests_frame_keeps_column_order_and_appends_extra_driver_keys():
    df = requests_frame([row(0, extra_field=1)])
    assert list(df.columns) == [*REQUEST_COLUMNS, "extra_field"]


def test_requests_frame_uses_nullable_ints_where_a_value_is_missing():
    df = requests_frame([row(0, slot=None), row(1, slot=2)])
    assert str(df["slot"].dtype) == "Int64" and df["slot"].isna().tolist() == [True, False]


def fake_result() -> SimpleNamespace:
    timeline = [{"t_s": t, "busy_slots": 1, "deferred": 0, "queued": 0, "cache_bytes": 0, "cache_entries": 0,
                 "cum_prompt_cached": 5 * t, "cum_prompt_processed": 10 * t} for t in range(5)]
    return SimpleNamespace(requests=[row(0), row(1, session_id="u", turn=1)], timeline=timeline,
                           metrics={"n_context_shifts": 0, "n_deferrals": 0}, run={"sim_s": 4.0, "n_requests": 2},
                           cache_stats={"evictions": 0, "hits": 1, "saves": 1}, config={"seed": 0})


def test_write_run_then_load_results_round_trips(tmp_path):
    summary = write_run(tmp_path, fake_result(), {"command": "slotlab simulate"}, csv=True, plots=False)
    back = load_results(tmp_path)
    assert back.config["command"] == "slotlab simulate" and back.config["sim"] == {"seed": 0}
    assert back.run["sim_s"] == 4.0 and back.run["cache_stats"]["hits"] == 1
    assert back.summary["n_requests"] == summary["n_requests"] == 2
    assert back.requests["session_id"].isna().tolist() == [True, False]
    assert len(back.timeline) == 5 and (tmp_path / "requests.csv").exists()


def test_summary_nan_is_written_as_null_in_json_and_empty_in_csv(tmp_path):
    res = fake_result()
    res.requests = [row(0, tpot_s=math.nan)]
    write_run(tmp_path, res, {"note": float("nan")}, plots=False)
    back = load_results(tmp_path)
    assert back.config["note"] is None and np.isnan(back.summary["tpot_p50_s"])
