"""`slotlab validate` on a tiny random-weight GGUF: both runs, the per-request and aggregate error tables, and
the error arithmetic on hand-made tables."""

import argparse
import math

import pandas as pd
import pytest

from experiments.validate import (FILES, add_validate_parser, aggregate_errors, compare_requests,
                                  per_request_summary, read_validation, run_validate)
from sim.latency import ParametricLatency, save_calibration

WORKLOAD = ["--workload", "poisson", "--rate", "20", "--requests", "6", "--prompt-tokens", "10-40",
            "--output-tokens", "3-8", "-np", "2", "-c", "512", "--seed", "5"]
MEASURED_ON = {"machine": "test", "cpu": "test", "threads": 1, "engine": "slotlab numpy", "model": "tiny.gguf",
               "date": "2025-01-01", "notes": "hand-made for tests"}


def parse(*argv):
    """validate's arguments, the heap reserve off unless `argv` sets one: these tests run the engine in pytest's own
    process, whose allocator a reserve would change for every test after it (engine/model/heap.py)."""
    parser = argparse.ArgumentParser()
    add_validate_parser(parser.add_subparsers())
    return parser.parse_args(["validate", "--mem-reserve", "0", *argv])


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    path = tmp_path_factory.mktemp("cal") / "calib.json"
    save_calibration(ParametricLatency(1e-3, 2e-5, 3e-4, 1e-8), path, MEASURED_ON)
    return path


@pytest.fixture(scope="module")
def validated(tiny, calib, tmp_path_factory):
    out = tmp_path_factory.mktemp("val")
    rc = run_validate(parse("-m", tiny, "--threads", "1", "--latency", f"parametric:{calib}", "--quiet",
                            "--out", str(out), *WORKLOAD))
    return rc, out


def test_validate_writes_both_runs_and_the_tables(validated):
    rc, out = validated
    assert rc == 0
    for run in ("real", "sim"):
        assert (out / run / "summary.csv").exists() and (out / run / "requests.parquet").exists()
    for name in ("per_request", "errors", "summary", "scatter", "cdf"):
        assert (out / FILES[name]).exists()


def test_per_request_table_has_one_row_per_request_and_decision_columns(validated):
    per, _, summary = read_validation(validated[1])
    assert sorted(per["request"]) == list(range(6))
    for col in ("slot_real", "slot_sim", "slot_match", "n_cached_real", "n_cached_sim", "n_cached_match",
                "decision_match", "ttft_rel_err", "tpot_abs_err_s", "e2e_rel_err"):
        assert col in per.columns
    assert (per["n_prompt_real"] == per["n_prompt_sim"]).all()     # the same prompts in both runs
    assert summary["n_requests"] == 6 and 0 <= summary["decision_match_rate"] <= 1


def test_aggregate_table_has_every_metric_and_percentile(validated):
    _, errors, _ = read_validation(validated[1])
    assert len(errors) == 16
    assert set(errors["metric"]) == {"ttft", "tpot", "e2e", "queue"}
    assert set(errors["stat"]) == {"p50", "p90", "p99", "mean"}


def test_simulated_twin_uses_the_real_runs_server_config(validated):
    from experiments.results import load_results

    real, sim = load_results(validated[1] / "real"), load_results(validated[1] / "sim")
    assert sim.config["server_config"] == real.config["server_config"]
    assert sim.config["sim"]["latency"]["kind"] == "parametric"


def test_closed_loop_chat_joins_every_turn(tiny, calib, tmp_path):
    rc = run_validate(parse("-m", tiny, "--threads", "1", "--latency", f"parametric:{calib}", "--quiet",
                            "--no-plots", "--out", str(tmp_path), "--users", "2", "--turns", "2",
                            "--think-time", "0.01", "--user-tokens", "8-16", "--output-tokens", "2-4",
                            "-np", "2", "-c", "2048"))          # system prompts are 200-500 tokens
    assert rc == 0
    per, _, _ = read_validation(tmp_path)
    assert len(per) == 4 and set(per["turn"]) == {0, 1}
    assert (per["finish_real"] == "limit").all() and (per["n_cached_real"][per["turn"] == 1] > 0).all()


def test_a_run_whose_decisions_diverged_is_warned_about_with_how_to_pin_its_arrivals():
    """Below DIVERGED_WARN of the requests decided alike, the errors are the decisions' as much as the latency
    model's: validate says so, and for a closed-loop chat in its own loop names `--arrivals real` with the run."""
    from experiments.validate import DIVERGED_WARN, divergence_warning
    assert DIVERGED_WARN == 0.8
    assert divergence_warning(0.8, True, "loop", "/r/real") is None
    assert divergence_warning(1.0, True, "loop", "/r/real") is None
    assert divergence_warning(math.nan, True, "loop", "/r/real") is None      # no request compared
    text = divergence_warning(0.42, True, "loop", "/r/real")
    assert text.startswith("only 42% of the requests were decided alike")
    assert "`--real-run /r/real --arrivals real`" in text
    for closed_loop, arrivals in ((False, "loop"), (True, "real")):        # open loop; turns already pinned
        text = divergence_warning(0.5, closed_loop, arrivals, "/r/real")
        assert text.startswith("only 50%") and "--arrivals real" not in text


def test_arrivals_real_pins_the_simulated_turns_to_the_real_runs_arrivals(tiny, calib, tmp_path, capsys):
    """`--arrivals real` on an existing closed-loop real run: every later turn is pinned, and arrives in the
    simulation when it did in the real run, unless the simulated previous reply ended later (then right after
    it); `loop` leaves the loop; a recorded trace refuses it."""
    chat = ["--users", "3", "--turns", "3", "--think-time", "0.2", "--user-tokens", "8-16", "--output-tokens", "2-4",
            "-np", "2", "-c", "2048"]
    common = ["-m", tiny, "--threads", "1", "--latency", f"parametric:{calib}", "--quiet", "--no-plots"]
    assert run_validate(parse(*common, "--out", str(tmp_path / "loop"), *chat)) == 0
    real = str(tmp_path / "loop" / "real")
    capsys.readouterr()
    assert run_validate(parse(*common, "--out", str(tmp_path / "pin"), "--real-run", real, "--arrivals", "real",
                              *chat)) == 0
    assert "arrivals pinned" in capsys.readouterr().out
    per, _, summary = read_validation(tmp_path / "pin")
    later = per[per["turn"] > 0]
    assert summary["arrivals"]["mode"] == "real" and summary["arrivals"]["n_pinned"] == len(later) == 6
    assert (later["arrival_sim_s"] >= later["arrival_real_s"] - 1e-9).all()
    sim = pd.read_parquet(tmp_path / "pin" / "sim" / "requests.parquet").set_index(["session_id", "turn"])
    for (sid, turn), row in sim.iterrows():
        if turn > 0:
            prev_end = sim.loc[(sid, turn - 1), "end_s"]
            want = max(float(per[(per["session_id"] == sid) & (per["turn"] == turn)]["arrival_real_s"].iloc[0]),
                       prev_end)
            assert row["arrival_s"] == pytest.approx(want, abs=1e-9)
    _, _, looped = read_validation(tmp_path / "loop")
    assert looped["arrivals"] == {**looped["arrivals"], "mode": "loop", "n_pinned": 0}
    trace = tmp_path / "t.jsonl"
    trace.write_text("")
    assert run_validate(parse("--recorded", str(trace), "--arrivals", "real", "--out", str(tmp_path / "r"))) == 2
    assert "--arrivals real" in capsys.readouterr().err


def test_bad_latency_spec_is_a_usage_error(tiny, tmp_path, capsys):
    assert run_validate(parse("-m", tiny, "--latency", "parametric:/nope.json", "--out", str(tmp_path),
                              *WORKLOAD)) == 2
    assert "nope.json" in capsys.readouterr().err


def frame(values: dict) -> pd.DataFrame:
    n = len(values["request"])
    base = {"session_id": [None] * n, "turn": [0] * n, "n_prompt": [10] * n, "n_output": [4] * n,
            "arrival_s": [0.0] * n, "n_deferred": [0] * n, "finish": ["limit"] * n,
            "queue_s": [0.0] * n, "tpot_s": [0.1] * n}
    return pd.DataFrame({**base, **values})


REAL = frame({"request": [0, 1, 2], "ttft_s": [1.0, 2.0, 3.0], "e2e_s": [2.0, 4.0, 6.0], "slot": [0, 1, 0],
              "n_cached": [0, 0, 5]})
SIM = frame({"request": [2, 1, 0], "ttft_s": [6.0, 3.0, 1.5], "e2e_s": [6.0, 4.0, 1.0], "slot": [0, 0, 0],
             "n_cached": [0, 0, 0]})


def test_per_request_errors_are_sim_minus_real_joined_on_request():
    per = compare_requests(REAL, SIM)
    assert list(per["request"]) == [0, 1, 2]
    assert list(per["ttft_abs_err_s"]) == [0.5, 1.0, 3.0]
    assert list(per["ttft_rel_err"]) == [0.5, 0.5, 1.0]
    assert list(per["e2e_rel_err"]) == [-0.5, 0.0, 0.0]
    assert per["queue_rel_err"].isna().all()                  # real queue 0 s: no relative error


def test_decision_match_needs_same_slot_and_same_cached_prefix():
    per = compare_requests(REAL, SIM)
    assert list(per["slot_match"]) == [True, False, True]
    assert list(per["n_cached_match"]) == [True, True, False]
    assert list(per["decision_match"]) == [True, False, False]
    summary = per_request_summary(per)
    assert summary["decision_match_rate"] == pytest.approx(1 / 3)
    assert summary["ttft_median_ape"] == 0.5 and summary["ttft_mape"] == pytest.approx(2 / 3)
    # the same errors over the requests whose decisions matched (request 0 only): the timing model's alone
    assert summary["decision_matched"]["n_requests"] == 1
    assert summary["decision_matched"]["ttft_median_ape"] == 0.5
    assert summary["decision_matched"]["e2e_median_ape"] == 0.5


def test_aggregate_errors_compare_percentiles_of_each_run():
    errors = aggregate_errors(REAL, SIM).set_index(["metric", "stat"])
    p50 = errors.loc[("ttft", "p50")]
    assert (p50["real_s"], p50["sim_s"], p50["abs_err_s"], p50["rel_err"]) == (2.0, 3.0, 1.0, 0.5)
    assert errors.loc[("ttft", "mean"), "sim_s"] == pytest.approx(3.5)
    assert errors.loc[("ttft", "p90"), "real_s"] == pytest.approx(2.8)     # linear interpolation
    assert math.isnan(errors.loc[("queue", "p50"), "rel_err"])


def test_errored_requests_are_left_out_of_the_aggregates():
    real = REAL.assign(finish=["limit", "limit", "error"])
    errors = aggregate_errors(real, SIM).set_index(["metric", "stat"])
    assert errors.loc[("ttft", "p50"), "real_s"] == 1.5


def test_real_run_is_reused_without_running_the_engine_again(validated, tiny, tmp_path):
    other = tmp_path / "calib2.json"
    save_calibration(ParametricLatency(2e-3, 2e-5, 3e-4, 1e-8), other, MEASURED_ON)
    out = tmp_path / "v2"
    assert run_validate(parse("-m", tiny, "--threads", "1", "--latency", f"parametric:{other}", "--quiet",
                              "--no-plots", "--real-run", str(validated[1] / "real"), "--out", str(out),
                              *WORKLOAD)) == 0
    assert not (out / "real").exists()
    per, _, summary = read_validation(out)
    first, _, _ = read_validation(validated[1])
    assert summary["real_reused"] and list(per["ttft_real_s"]) == list(first["ttft_real_s"])
    assert list(per["ttft_sim_s"]) != list(first["ttft_sim_s"])       # the other latency model


def test_real_run_of_another_numerics_is_refused(validated, tiny, calib, tmp_path, capsys):
    """The reused run ran ggml, the default (recorded in its config); a validation of the f32 numerics may not
    compare with it."""
    assert run_validate(parse("-m", tiny, "--numerics", "f32", "--latency", f"parametric:{calib}", "--real-run",
                              str(validated[1] / "real"), "--out", str(tmp_path), *WORKLOAD)) == 2
    assert "ran numerics ggml, here: f32 (--numerics)" in capsys.readouterr().err


def test_real_run_with_other_options_is_refused(validated, tiny, calib, tmp_path, capsys):
    args = [a if a != "6" else "5" for a in WORKLOAD]                   # --requests 5
    assert run_validate(parse("-m", tiny, "--latency", f"parametric:{calib}", "--real-run",
                              str(validated[1] / "real"), "--out", str(tmp_path), *args)) == 2
    assert "ran different options" in capsys.readouterr().err


def test_a_calibration_of_another_model_or_thread_count_is_named():
    from experiments.validate import MEASURED_CALIBRATION, calibration_mismatch
    from sim.latency_spec import get_latency_model
    smollm2 = get_latency_model(f"parametric:{MEASURED_CALIBRATION}")       # SmolLM2 Q4_1, 2 threads
    assert calibration_mismatch(smollm2, "/x/SmolLM2-135M-Instruct.Q4_1.gguf", 2) is None
    other = calibration_mismatch(smollm2, "/tmp/tiny.gguf", 1)
    assert "model SmolLM2-135M-Instruct.Q4_1.gguf (this run: tiny.gguf)" in other
    assert "2 threads (this run: 1)" in other and "slotlab calibrate -m /tmp/tiny.gguf --threads 1" in other
    assert calibration_mismatch(get_latency_model("constant:0.01"), "/tmp/tiny.gguf", 1) is None


def test_a_calibration_with_the_heap_reserve_off_is_named_for_a_run_with_it_on(tmp_path):
    """Saves into memory new to the process cost several times one into memory it has (docs/validation_sim.md §20),
    so a calibration measured with `--mem-reserve 0` does not describe a run with a reserve, nor the reverse. Only
    on against off counts, and a file that did not record it (written before it) is not second-guessed."""
    import dataclasses

    from experiments.validate import MEASURED_CALIBRATION, calibration_mismatch
    from sim.latency_spec import get_latency_model
    shipped = get_latency_model(f"parametric:{MEASURED_CALIBRATION}")
    model = "/x/SmolLM2-135M-Instruct.Q4_1.gguf"

    def with_reserve(mib):
        return dataclasses.replace(shipped, measured_on=dataclasses.replace(shipped.measured_on, mem_reserve_mib=mib))
    assert calibration_mismatch(with_reserve(1024), model, 2, "f32", mem_reserve_mib=2048) is None
    off = calibration_mismatch(with_reserve(0), model, 2, "f32", mem_reserve_mib=1024)
    assert "--mem-reserve 0 (this run: 1024" in off and "--mem-reserve 1024 --out cal.json" in off
    assert "--mem-reserve 1024 (this run: 0" in calibration_mismatch(with_reserve(1024), model, 2, "f32",
                                                                       mem_reserve_mib=0)
    assert calibration_mismatch(with_reserve(None), model, 2, "f32", mem_reserve_mib=1024) is None
    assert calibration_mismatch(with_reserve(0), model, 2, "f32", mem_reserve_mib=None) is None


def test_a_calibration_of_another_numerics_is_named():
    """The shipped f32 calibration names no numerics (f32, the mode it was measured in); the ggml one names ggml;
    either, used for a run in the other mode, is named with the command that calibrates the run's mode."""
    from experiments.validate import MEASURED_CALIBRATION, calibration_mismatch
    from sim.latency_spec import get_latency_model
    f32 = get_latency_model(f"parametric:{MEASURED_CALIBRATION}")
    ggml = get_latency_model(f"parametric:{MEASURED_CALIBRATION.with_name('smollm2_ggml_2threads.json')}")
    model = "/x/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert calibration_mismatch(f32, model, 2, "f32") is None
    assert calibration_mismatch(ggml, model, 2, "ggml") is None
    other = calibration_mismatch(f32, model, 2, "ggml")
    assert "numerics f32 (this run: ggml)" in other and "--numerics ggml" in other
    assert "numerics ggml (this run: f32)" in calibration_mismatch(ggml, model, 2, "f32")


def test_a_ggml_calibration_fitted_before_the_by_token_layout_is_named_with_the_refit(tmp_path):
    from dataclasses import replace

    from experiments.validate import MEASURED_CALIBRATION, calibration_mismatch
    from sim.latency_spec import get_latency_model
    ggml = get_latency_model(f"parametric:{MEASURED_CALIBRATION.with_name('smollm2_ggml_2threads.json')}")
    assert ggml.layout.attend_by_token == 1                      # the shipped file is fitted with it
    old = replace(ggml, layout=replace(ggml.layout, attend_by_token=0))
    why = calibration_mismatch(old, "/x/SmolLM2-135M-Instruct.Q4_1.gguf", 2, "ggml")
    assert "slotlab calibrate --refit" in why


def test_validate_warns_when_the_calibration_is_of_another_setup(tiny, calib, tmp_path, capsys):
    assert run_validate(parse("-m", tiny, "--threads", "2", "--latency", f"parametric:{calib}", "--quiet",
                              "--no-plots", "--out", str(tmp_path / "v"), *WORKLOAD)) == 0
    err = capsys.readouterr().err
    assert "warning: the latency model was calibrated with 1 thread (this run: 2)" in err
    _, _, summary = read_validation(tmp_path / "v")
    assert summary["latency_mismatch"].startswith("the latency model")


def test_noise_floor_compares_two_real_runs_of_the_same_workload(validated, tiny, calib, tmp_path, capsys):
    out = tmp_path / "again"
    assert run_validate(parse("-m", tiny, "--threads", "1", "--latency", f"parametric:{calib}", "--no-plots",
                              "--noise-floor", str(validated[1] / "real"), "--out", str(out), *WORKLOAD)) == 0
    printed = capsys.readouterr().out
    _, _, summary = read_validation(out)
    floor = summary["noise_floor"]
    assert floor["real_dir"] == str(validated[1] / "real")
    # the floor is the two real runs compared request by request exactly as sim and real are (the other run in
    # the sim's place)
    other = pd.read_parquet(validated[1] / "real" / "requests.parquet")
    this = pd.read_parquet(out / "real" / "requests.parquet")
    expect = per_request_summary(compare_requests(this, other))
    for m in ("ttft", "tpot", "e2e"):
        assert floor["per_request"][f"{m}_median_ape"] == pytest.approx(expect[f"{m}_median_ape"])
    assert floor["per_request"]["decision_match_rate"] == expect["decision_match_rate"]
    agg = {(r["metric"], r["stat"]): r["rel_err"] for r in floor["aggregate"]}
    assert agg[("e2e", "p50")] == pytest.approx(
        aggregate_errors(this, other).set_index(["metric", "stat"]).loc[("e2e", "p50"), "rel_err"])
    assert "noise floor" in printed


def test_noise_floor_of_another_workload_is_refused(validated, tiny, calib, tmp_path, capsys):
    args = [a if a != "6" else "5" for a in WORKLOAD]                   # --requests 5
    assert run_validate(parse("-m", tiny, "--latency", f"parametric:{calib}", "--noise-floor",
                              str(validated[1] / "real"), "--out", str(tmp_path), *args)) == 2
    err = capsys.readouterr().err
    assert "--noise-floor" in err and "ran different options" in err
    assert not (tmp_path / "real").exists()                            # refused before the engine ran


def test_noise_floor_of_the_reused_run_itself_is_refused(validated, tiny, calib, tmp_path, capsys):
    real = str(validated[1] / "real")
    assert run_validate(parse("-m", tiny, "--latency", f"parametric:{calib}", "--real-run", real, "--noise-floor",
                              real, "--out", str(tmp_path), *WORKLOAD)) == 2
    assert "--noise-floor is the run --real-run reuses" in capsys.readouterr().err


def test_a_calibration_not_measured_on_this_engine_is_not_said_to_be_of_other_numerics():
    """The embedded default (derived from the roofline model, measured on nothing) names no numerics: a ggml run
    validated against it is not told that it was measured in f32."""
    from experiments.validate import calibration_mismatch
    from sim.latency_spec import get_latency_model
    derived = get_latency_model("default")
    assert "none" in derived.measured_on.engine
    why = calibration_mismatch(derived, "/x/SmolLM2-135M-Instruct.Q4_1.gguf", 2, "ggml") or ""
    assert "numerics f32 (this run" not in why


def test_validate_help_names_its_default_latency_per_numerics(capsys):
    from experiments.cli import main
    assert main(["validate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "smollm2_ggml_2threads.json for ggml" in text and "(default: default)" not in text


def test_a_command_gives_a_shared_flag_its_own_default_and_its_help_says_so():
    import argparse

    from experiments.flags import add_flags
    p = argparse.ArgumentParser()
    add_flags(p, "validate", defaults={"latency": ("parametric:x.json", "x.json, this command's")})
    assert p.parse_args([]).latency == "parametric:x.json"
    assert "(default: x.json, this command's)" in " ".join(p.format_help().split())
    # a flag whose help does not state its default in the form "(default: X)" cannot be given another one quietly
    with pytest.raises(ValueError, match="does not say"):
        add_flags(argparse.ArgumentParser(), "validate", defaults={"threads": (4, "four")})


def test_the_measuring_commands_reserve_the_heap_by_default_serve_and_replay_keep_the_allocators(capsys):
    """calibrate and validate measure the engine for the simulator: a heap reserve takes the page faults of memory
    new to the process out of its steps (docs/validation_sim.md §29). serve and replay stand for llama-server and
    keep its allocator's defaults; each command's help says which it takes."""
    from experiments.cli import build_parser, main
    from experiments.flags import MEASURE_MEM_RESERVE_MIB
    parser = build_parser()
    assert MEASURE_MEM_RESERVE_MIB > 0
    assert parser.parse_args(["validate"]).mem_reserve == MEASURE_MEM_RESERVE_MIB
    assert parser.parse_args(["calibrate"]).mem_reserve == MEASURE_MEM_RESERVE_MIB
    assert parser.parse_args(["replay"]).mem_reserve == 0
    assert parser.parse_args(["serve", "-m", "x.gguf"]).mem_reserve == 0
    assert parser.parse_args(["validate", "--mem-reserve", "0"]).mem_reserve == 0
    for command, default in (("validate", f"(default: {MEASURE_MEM_RESERVE_MIB}: calibrate and validate measure"),
                             ("calibrate", f"(default: {MEASURE_MEM_RESERVE_MIB}: calibrate and validate measure"),
                             ("replay", "(default: 0)")):
        assert main([command, "--help"]) == 0
        assert default in " ".join(capsys.readouterr().out.split())
