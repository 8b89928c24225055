"""The benchmark and validation scripts still import and parse their arguments (they are run by hand, with
the reference tools, so nothing else would notice a broken import), bench_engine's summary is right, and
validate_settings reads a second real run (`--repeat`) as a row of its own."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from tests.benchmark_scripts import BENCHMARKS, load

SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


def test_every_script_is_covered():
    assert {"bench_engine.py", "bench_sim.py", "validate_llamacpp.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help(script):
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage:")


def test_bench_engine_summary_prints_each_figure_per_run_and_its_median(capsys):
    mod = load("bench_engine")
    mod.print_summary([{"prefill tok/s": 500.0, "16 seq / llama.cpp 1 seq (best)": 1.9},
                       {"prefill tok/s": 600.0, "16 seq / llama.cpp 1 seq (best)": 2.3},
                       {"prefill tok/s": 550.0}])
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "summary of 3 runs (each row: run 1 .. run 3 | median over runs)"
    prefill = next(line for line in out if "prefill tok/s" in line).split()
    assert prefill[2:] == ["500.00", "600.00", "550.00", "|", "550.00"]
    ratio = next(line for line in out if "16 seq" in line).split()
    assert ratio[-4:] == ["1.90", "2.30", "|", "2.10"]


def test_bench_jitter_lag_spread_compares_each_step_with_the_one_k_later():
    mod = load("bench_jitter")
    f = mod.lag_spread([1.0, 2.0] * 6, lags=(1, 2, 50))
    assert f["n"] == 12 and f["median_s"] == 1.5
    assert math.isclose(f["spread"], 1 / 3)                     # every step is a third from the median
    m1, p1, n1 = f["by_lag"][1]                                  # 1 -> 2: +100%, 2 -> 1: -50%
    assert n1 == 11 and math.isclose(m1, 1.0) and 0.5 < p1 <= 1.0
    assert f["by_lag"][2] == (0.0, 0.0, 10)                      # two steps on, the same time
    assert 50 not in f["by_lag"]                                 # no pair that far apart
    for bad in ([1.0], [1.0, 0.0]):
        with pytest.raises(ValueError, match="two positive step times"):
            mod.lag_spread(bad)


def test_bench_jitter_lag_pairs_pair_steps_a_lag_apart_and_of_a_like_context():
    mod = load("bench_jitter")
    clock = [0.0, 0.01, 0.02, 0.5, 0.51, 3.0]
    took = [0.010, 0.011, 0.012, 0.020, 0.010, 0.010]
    ctx = [100, 101, 102, 103, 104, 400]
    got = mod.lag_pairs(clock, took, ctx, lags_s=(0.01, 0.5, 2.5))
    assert np.allclose(got[0.01], [0.1, 1 / 11, 0.5])           # 0->0.01, 0.01->0.02, 0.5->0.51
    assert np.allclose(got[0.5], [1.0, 1 / 11])          # 0->0.5, 0.01->0.51; from 0.02 the next is 3.0: too far
    assert got[2.5].size == 0                                    # 0.5->3.0 is the right lag, but 4x the context


def test_bench_jitter_reads_a_validate_folder_through_its_real_run(tmp_path, capsys):
    mod = load("bench_jitter")
    pd = pytest.importorskip("pandas")
    from experiments.speed_probe import MixSample, SpeedTrack, TrackPass, write_run_track
    from experiments.steplog import COST_COLUMNS
    real = tmp_path / "val" / "real"
    real.mkdir(parents=True)
    n = 200                                                      # decode steps every 10 ms, alternately 10 and 11 ms
    log = {"t_s": [0.01 * i for i in range(n)], "kind": ["decode"] * n, "charged": [True] * n,
           **{c: [0] * n for c in COST_COLUMNS}, "calls": ["[]"] * n, "clock_s": [0.01 * i for i in range(n)],
           "elapsed_s": [0.010 if i % 2 == 0 else 0.011 for i in range(n)]}
    log.update(n_seqs=[1] * n, attn_ctx_tokens=[300 + i for i in range(n)])
    pd.DataFrame(log).to_parquet(real / "steps.parquet")
    mix = (MixSample((((0, 0, 64, True, True),),), True, 0.104, 0.100, 1.0),      # a prompt replay 4% off its step
           MixSample((((0, 64, 1, True, False),),), False, 0.0101, 0.0100, 1.1))  # a decode replay 1% off
    write_run_track(real, SpeedTrack(10.0, (TrackPass(1.2, 1.2, {"prompt 64": 0.07}, 1.0, mix),)))
    assert mod.read_runs([str(tmp_path / "val")]) == 0
    out = capsys.readouterr().out
    assert "1 runs;" in out
    (two_on,) = [line for line in out.splitlines() if "lag  0.02 s" in line]
    assert "median   0.0%" in two_on                            # two steps on: the same time again
    assert "within 3%: 0% of 1" in out and "within 3%: 100% of 1" in out   # the prompt replay 4% off, the decode 1%
    with pytest.raises(SystemExit, match="no step log there"):
        mod.read_runs([str(tmp_path)])
    (real / "speed_track.json").write_text('{"every_s": 10, "passes": [{"clock_s": 1}]}')
    with pytest.raises(SystemExit, match=r"speed_track.json: field 'passes\[0\].wall_s'"):
        mod.read_runs([str(real)])


def _validate_settings():
    return load("validate_settings")


def test_validate_settings_reads_two_real_runs_as_a_row_and_counts_it_like_the_simulator(tmp_path):
    mod = _validate_settings()
    errs = {("ttft", "p50"): 0.02, ("ttft", "p90"): -0.041, ("tpot", "p50"): 0.001, ("tpot", "p90"): -0.029,
            ("e2e", "p50"): 0.031, ("e2e", "p90"): -0.005, ("e2e", "p99"): 0.2}
    (tmp_path / "validation.json").write_text(json.dumps({
        "threads": 2, "load_average_start": [1.5, 1.0, 0.9], "load_average_end": [1.8, 1.2, 1.0],
        "noise_floor": {"real_dir": "first/real", "what": "...",
                        "per_request": {"n_requests": 36, "tpot_median_ape": 0.021, "e2e_median_ape": 0.033,
                                        "decision_match_rate": 0.75},
                        "aggregate": [{"metric": m, "stat": st, "rel_err": v} for (m, st), v in errs.items()]}}))
    row = mod.read_noise(tmp_path)
    assert row["ttft_p90"] == -0.041 and row["e2e_p50"] == 0.031 and "e2e_p99" not in row
    assert (row["tpot_req"], row["e2e_req"], row["same"], row["n"]) == (0.021, 0.033, 0.75, 36)
    assert row["load"] == "1.50->1.80" and math.isnan(row["bias"]) and math.isnan(row["floor_ttft"])
    summary = mod.summary_table([{"run": "np1 1", "correction": "real vs real", **row}])
    cells = summary.splitlines()[2].split(" | ")
    # within 3%: TTFT P50, TPOT P50 and P90, E2E P90 (4 of 6); within 5%: all six
    assert cells[5] == "4/6 · 6/6" and cells[6] == "1/2 · 2/2 · 1/2" and cells[7] == "n/a · n/a · n/a"
    assert cells[8].rstrip(" |") == "n/a · n/a · n/a"
    assert "real vs real" in mod.table([{"run": "np1 1", "correction": "real vs real", **row}])
    assert math.isnan(row["offset_prompt"])                 # two real runs: no replays priced


def test_validate_settings_counts_the_repeat_floor_with_the_schedule_fixed_and_free(tmp_path):
    mod = _validate_settings()

    def floor(within):
        return {"aggregate": [{"metric": m, "stat": st, "within_target": within[m] if st != "p99" else 0.5}
                              for m in ("ttft", "tpot", "e2e") for st in ("p50", "p90", "p99")]}

    fixed = {**floor({"ttft": 0.7, "tpot": 1.0, "e2e": 0.9}), "offset": {"prompt": 0.968, "decode": 1.002}}
    runs = []
    for i, dynamic in enumerate((floor({"ttft": 0.5, "tpot": 0.75, "e2e": 1.0}), None)):
        run = tmp_path / str(i)
        run.mkdir()
        (run / "errors.csv").write_text("metric,stat,rel_err\n" + "".join(
            f"{m},{st},0.01\n" for m in ("ttft", "tpot", "e2e") for st in ("p50", "p90")))
        (run / "validation.csv").write_text("request,ttft_rel_err\n0,0.01\n")
        (run / "validation.json").write_text(json.dumps({
            "threads": 2, "load_average_start": [1.0], "load_average_end": [1.0], "tpot_median_ape": 0.01,
            "e2e_median_ape": 0.01, "decision_match_rate": 1.0,
            "n_requests": 1, "repeat_floor": {**fixed, **({"dynamic": dynamic} if dynamic else {})}}))
        runs.append(mod.read_run(run))
    assert (runs[0]["floor_ttft"], runs[0]["dyn_ttft"], runs[0]["dyn_tpot"]) == (1.4, 1.0, 1.5)
    assert math.isnan(runs[1]["dyn_e2e"]) and runs[1]["floor_e2e"] == 1.8
    # the prompt replays' median against their steps, in the per-run table beside the steps' bias
    assert runs[0]["offset_prompt"] == pytest.approx(-0.032)
    line = mod.table([{"run": "np1 1", "correction": "track-mix", **runs[0]}]).splitlines()
    assert "prompt replays / steps" in line[0] and line[2].split(" | ")[7] == "-3.2"
    cells = mod.summary_table([{"run": "np1 1", "correction": "track-mix", **runs[0]}]).splitlines()[2].split(" | ")
    assert cells[7] == "1.4/2 · 2.0/2 · 1.8/2" and cells[8].rstrip(" |") == "1.0/2 · 1.5/2 · 2.0/2"
    both = [{"run": f"np1 {i}", "correction": "track-mix", **r} for i, r in enumerate(runs)]
    cells = mod.summary_table(both).splitlines()[2].split(" | ")
    assert cells[7] == "2.8/4 · 4.0/4 · 3.6/4" and cells[8].rstrip(" |") == "n/a · n/a · n/a"   # one run without


def test_validate_settings_says_which_folder_lacks_the_second_run(tmp_path):
    mod = _validate_settings()
    (tmp_path / "validation.json").write_text(json.dumps({"threads": 2}))
    with pytest.raises(SystemExit, match="has no noise_floor: was it run with --noise-floor"):
        mod.read_noise(tmp_path)


def test_validate_settings_runs_a_folder_once_and_a_run_done_again_takes_its_stale_folders_with_it(tmp_path, capsys):
    mod = _validate_settings()
    # a stand-in for `slotlab validate --out DIR`: counts its runs and writes DIR/validation.json
    fake = [sys.executable, "-c", "import pathlib, sys; d = pathlib.Path(sys.argv[-1]); d.mkdir(parents=True); "
            "(d / 'validation.json').write_text('{}'); c = d.parent / 'count'; "
            "c.write_text(str(int(c.read_text()) + 1 if c.exists() else 1))"]
    first, resim, repeat = tmp_path / "track-mix", tmp_path / "steps", tmp_path / "repeat"
    mod.ensure_run(fake, first, tmp_path / "first.log", "np1 1: real run + sim", stale=(resim, repeat))
    assert (first / "validation.json").is_file() and (tmp_path / "count").read_text() == "1"
    assert capsys.readouterr().out.startswith("  np1 1: real run + sim in ")
    for made in (resim, repeat):
        made.mkdir()
        (made / "validation.json").write_text("{}")
    mod.ensure_run(fake, first, tmp_path / "first.log", "np1 1", stale=(resim, repeat))     # finished: kept
    assert (tmp_path / "count").read_text() == "1" and resim.is_dir() and repeat.is_dir()
    assert capsys.readouterr().out == ""
    (first / "validation.json").unlink()                          # an unfinished run is done again, from scratch
    mod.ensure_run(fake, first, tmp_path / "first.log", stale=(resim, repeat))
    assert (tmp_path / "count").read_text() == "2" and not resim.exists() and not repeat.exists()
    assert capsys.readouterr().out == ""                          # no label: no timing line
