"""`slotlab simulate` end to end, in-process: the results directory, its tables, bad traces, determinism."""

from __future__ import annotations

import json

import pandas as pd

from experiments.cli import main
from experiments.results import REQUEST_COLUMNS, TIMELINE_COLUMNS, load_results

RUN_FILES = ("config.json", "run.json", "summary.csv", "requests.parquet", "timeline.parquet",
             "latency_cdf.png", "cache_hit_rate.png", "occupancy.png")


def test_simulate_without_arguments_writes_every_file_and_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["simulate", "--out", str(out)]) == 0   # the built-in chat workload, upstream defaults
    printed = capsys.readouterr().out
    assert all((out / name).stat().st_size > 0 for name in RUN_FILES)
    assert "TTFT" in printed and "hit rate" in printed and f"results: {out}" in printed


def test_requests_table_has_the_documented_columns_one_row_per_request(tmp_path, small_args):
    assert main(["simulate", *small_args, "--no-plots", "--out", str(tmp_path)]) == 0
    requests = pd.read_parquet(tmp_path / "requests.parquet")
    assert list(requests.columns) == list(REQUEST_COLUMNS)
    assert len(requests) == 8 and requests["request"].tolist() == list(range(8))   # 4 users x 2 turns
    assert list(pd.read_parquet(tmp_path / "timeline.parquet").columns) == list(TIMELINE_COLUMNS)


def test_config_json_holds_the_command_line_versions_and_a_rerun_command(tmp_path, small_args):
    assert main(["simulate", *small_args, "--no-plots", "--out", str(tmp_path)]) == 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["argv"][:3] == ["simulate", "--users", "4"]
    assert {"python", "simpy", "pandas", "slotlab"} <= set(config["versions"])
    assert config["rerun"].startswith("slotlab simulate --users 4 --turns 2")
    assert config["server_config"]["n_ctx_train"] == 8192 and config["sim"]["seed"] == 0


def test_csv_flag_also_writes_requests_csv(tmp_path, small_args):
    assert main(["simulate", *small_args, "--no-plots", "--csv", "--out", str(tmp_path)]) == 0
    assert len(pd.read_csv(tmp_path / "requests.csv")) == 8


def test_bad_trace_exits_2_naming_file_and_line(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,374,44\n"
                     "2023-11-16 18:15:47.0000000,abc,3\n")
    assert main(["simulate", "--trace", str(trace), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:3:" in err and "ContextTokens" in err and "Traceback" not in err


def test_skip_bad_rows_replays_the_good_rows(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,374,4\n"
                     "2023-11-16 18:15:47.0,abc,3\n2023-11-16 18:15:48.0,100,4\n")
    out = tmp_path / "r"
    assert main(["simulate", "--trace", str(trace), "--skip-bad-rows", "--latency", "constant:0.01", "--quiet",
                 "--no-plots", "--out", str(out)]) == 0
    res = load_results(out)
    assert len(res.requests) == 2 and res.config["workload"]["n_skipped"] == 1


def test_missing_trace_file_exits_2(tmp_path, capsys):
    assert main(["simulate", "--trace", str(tmp_path / "nope.csv")]) == 2
    assert "trace file not found" in capsys.readouterr().err


def test_same_seed_and_config_give_identical_requests_tables(tmp_path, small_args):
    for name in ("a", "b"):
        assert main(["simulate", *small_args, "--seed", "3", "--no-plots", "--out", str(tmp_path / name)]) == 0
    a, b = (pd.read_parquet(tmp_path / name / "requests.parquet") for name in ("a", "b"))
    pd.testing.assert_frame_equal(a, b)


def test_open_loop_poisson_workload_runs_the_requested_count(tmp_path):
    assert main(["simulate", "--workload", "poisson", "--rate", "5", "--requests", "12", "--prompt-tokens", "50",
                 "--output-tokens", "4", "--latency", "constant:0.01", "--quiet", "--no-plots",
                 "--out", str(tmp_path)]) == 0
    requests = load_results(tmp_path).requests
    assert len(requests) == 12 and (requests["n_prompt"] == 50).all()


def test_a_saturated_server_is_reported_with_rates_and_knobs(tmp_path, capsys):
    """Arrivals at 40 req/s on 2 slots of 50 ms steps and 20 output tokens (~2 req/s): the queue grows."""
    args = ["simulate", "--workload", "poisson", "--rate", "40", "--requests", "300", "--prompt-tokens", "50-100",
            "--output-tokens", "20", "-np", "2", "--latency", "constant:0.05", "--no-plots"]
    assert main([*args, "--out", str(tmp_path / "sat")]) == 0
    printed = capsys.readouterr().out
    assert "warning: the server is saturated" in printed
    assert "--rate" in printed and "--time-scale" in printed and "-np" in printed and "--latency" in printed
    load = json.loads((tmp_path / "sat" / "run.json").read_text())["load"]
    assert load["saturated"] is True and load["arrival_rps"] > 10 * load["service_rps"]
    assert 1.5 < load["service_rps"] < 2.5            # 2 slots x 1 request / (20 x 50 ms)
    assert load["backlog_at_last_arrival"] > 200
    summary = pd.read_csv(tmp_path / "sat" / "summary.csv").iloc[0]
    assert bool(summary["saturated"]) is True

    assert main([*args[:4], "0.5", *args[5:], "--out", str(tmp_path / "ok")]) == 0   # 0.5 req/s: keeps up
    assert "warning: the server is saturated" not in capsys.readouterr().out
    load = json.loads((tmp_path / "ok" / "run.json").read_text())["load"]
    assert load["saturated"] is False and load["arrival_rps"] < 1


def test_quiet_run_prints_the_saturation_warning_too(tmp_path, capsys):
    assert main(["simulate", "--workload", "poisson", "--rate", "40", "--requests", "200", "--output-tokens", "20",
                 "-np", "2", "--latency", "constant:0.05", "--no-plots", "--quiet", "--out", str(tmp_path)]) == 0
    assert "warning: the server is saturated" in capsys.readouterr().out
