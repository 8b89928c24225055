"""The real run's step log (`steps.parquet`): what is recorded per step, the other processes' CPU, and the
latency model's error on the logged steps (the timing model's error alone, whatever the decisions did)."""

import json
import math

import numpy as np
import pandas as pd
import pytest

from engine.core.types import BatchPlan, Chunk, ForwardCall, KVOp, Task
from experiments.cli import main
from experiments.steplog import (
    DRIFT_WARN,
    FAULT_STEP_PAGES,
    STEAL_CORES_WARN,
    STEPS_FILE,
    StepLog,
    first_token_faults,
    format_step_errors,
    format_ttft_by_faults,
    predict_steps,
    read_steps,
    step_errors,
    step_warnings,
    ttft_by_faults,
)
from sim.latency import ConstantLatency

BPT = 1000   # KV bytes per token of the hand-made plans

WORKLOAD = ["--workload", "poisson", "--rate", "20", "--requests", "6", "--prompt-tokens", "10-40",
            "--output-tokens", "3-8", "-np", "2", "-c", "512", "--seed", "5"]


def plan(*program, sample=()):
    tasks = {sid: Task(id=sid, tokens=[1]) for sid in sample}
    n_prompt = sum(len(c.tokens) for p in program if isinstance(p, ForwardCall) for c in p.chunks if c.is_prompt)
    n_decode = sum(1 for p in program if isinstance(p, ForwardCall) for c in p.chunks if not c.is_prompt)
    return BatchPlan(0.0, tuple(program), n_prompt, n_decode, tasks)


def call(*chunks):
    return ForwardCall(tuple(chunks), sum(len(c.tokens) for c in chunks))


class Fake:
    """A clock and a /proc/stat reader driven by the test."""

    def __init__(self):
        self.t = 100.0
        self.busy = 50.0
        self.own = 5.0
        self.stolen = 2.0

    def clock(self):
        return self.t

    def cpu(self):
        return self.busy, self.own

    def steal(self):
        return self.stolen


def test_each_step_is_logged_with_its_cost_kind_and_measured_time():
    fake = Fake()
    log = StepLog(BPT, cpu_reader=fake.cpu, steal_reader=fake.steal, clock=fake.clock, window_s=10.0)
    steps = [
        (plan(call(Chunk(0, 0, [5] * 7, 3, (0,), True)), sample=(0,)), 0.2),
        (plan(call(Chunk(0, 0, [5], 10, (0,), False), Chunk(1, 1, [6], 4, (1,), False)), sample=(0, 1)), 0.05),
        (plan(KVOp("cache_save", seq=1, entry=3, n_tokens=12), call(Chunk(1, 1, [5] * 4, 0, (1,), True)),
              sample=(1,)), 0.1),
        (plan(KVOp("seq_add", seq=0, p0=4, p1=11, delta=-2), call(Chunk(0, 0, [5], 9, (0,), False),
                                                                 Chunk(1, 1, [5] * 3, 4, (), True)), sample=(0,)), 0.07),
        (plan(KVOp("cache_drop", entry=3)), 0.001),
    ]
    for p, elapsed in steps:
        fake.t += elapsed
        log(p, elapsed)
    df = log.frame()
    assert list(df["kind"]) == ["prefill", "decode", "copy", "shift", "decode"]
    assert list(df["charged"]) == [True, True, True, True, False]     # the KV-only step costs nothing in sim
    assert list(df["elapsed_s"]) == [e for _, e in steps]
    assert np.allclose(df["t_s"], np.cumsum([0] + [e for _, e in steps])[:-1])
    first = df.iloc[0]
    assert (first.n_prefill_tokens, first.n_decode_tokens, first.attn_ctx_tokens, first.kv_read_tokens) == \
        (7, 0, 7 * 3 + 28, 10)
    second = df.iloc[1]
    assert (second.n_decode_tokens, second.n_seqs, second.attn_ctx_tokens) == (2, 2, 11 + 5)
    assert json.loads(second.calls) == [[[0, 10, 1], [1, 4, 1]]]
    assert df.iloc[2].kv_copy_bytes == df.iloc[2].kv_save_bytes == 12 * BPT
    assert df.iloc[3].kv_shift_tokens == 7


def test_other_processes_cpu_is_busy_time_minus_our_own_per_window():
    fake = Fake()
    log = StepLog(BPT, cpu_reader=fake.cpu, steal_reader=fake.steal, clock=fake.clock, window_s=0.8)
    p = plan(call(Chunk(0, 0, [5], 10, (0,), False)), sample=(0,))
    # window 1 opens at the first reading (end of step 1) and closes after step 4: 0.9 s wall, the machine
    # busy 1.8 CPU s, 0.9 of them ours -> others 1.0 core (step 1 gets its window's figure)
    for _ in range(4):
        fake.t += 0.3
        fake.busy += 0.6
        fake.own += 0.3
        log(p, 0.3)
    # window 2 (closed by frame()): 0.6 s, only our own CPU
    for _ in range(2):
        fake.t += 0.3
        fake.busy += 0.3
        fake.own += 0.3
        log(p, 0.3)
    df = log.frame()
    assert np.allclose(df["others_cores"], [1.0] * 4 + [0.0] * 2)


def test_without_proc_stat_others_cpu_is_unknown():
    fake = Fake()
    log = StepLog(BPT, cpu_reader=lambda: None, steal_reader=lambda: None, clock=fake.clock, window_s=0.1)
    for _ in range(3):
        fake.t += 0.2
        log(plan(call(Chunk(0, 0, [5], 3, (0,), False)), sample=(0,)), 0.2)
    df = log.frame()
    assert df["others_cores"].isna().all() and df["steal_cores"].isna().all()
    err = step_errors(df, ConstantLatency(0.1))
    assert err["others_cores"] is None and err["steal_cores"] is None


def test_steal_time_is_recorded_per_window_and_warned_about():
    """The hypervisor's steal (part of the machine's busy time) per window, in cores; a run whose mean steal is
    above STEAL_CORES_WARN is warned about, an idle host's is not."""
    fake = Fake()
    log = StepLog(BPT, cpu_reader=fake.cpu, steal_reader=fake.steal, clock=fake.clock, window_s=0.5)
    p = plan(call(Chunk(0, 0, [5], 10, (0,), False)), sample=(0,))
    for stolen in (0.0, 0.12, 0.12, 0.0):                # per 0.6 s step: 0, 0.2, 0.2, 0 cores
        fake.t += 0.6
        fake.busy += 0.6 + stolen
        fake.own += 0.6
        fake.stolen += stolen
        log(p, 0.6)
    df = log.frame()
    assert np.allclose(df["steal_cores"].iloc[1:], [0.2, 0.2, 0.0]) and np.allclose(df["others_cores"].iloc[1:],
                                                                                      [0.2, 0.2, 0.0])
    err = step_errors(df, ConstantLatency(0.6))
    assert err["steal_cores"]["max"] == pytest.approx(0.2) and err["steal_cores"]["mean"] > STEAL_CORES_WARN
    assert any("steal time" in w for w in step_warnings(err))
    quiet = step_errors(frame([0.1] * 5).assign(steal_cores=0.01), ConstantLatency(0.1))
    assert not any("steal" in w for w in step_warnings(quiet))
    old = step_errors(frame([0.1] * 5), ConstantLatency(0.1))          # a step log from before the column
    assert old["steal_cores"] is None


def frame(measured, kinds=None, others=0.0):
    n = len(measured)
    return pd.DataFrame({
        "t_s": np.arange(n, dtype=float), "elapsed_s": measured, "kind": kinds or ["decode"] * n,
        "charged": [True] * n, "n_prefill_tokens": 0, "n_decode_tokens": 1, "n_seqs": 1, "attn_ctx_tokens": 10,
        "n_forward_calls": 1, "kv_copy_bytes": 0, "kv_save_bytes": 0, "kv_shift_tokens": 0, "kv_read_tokens": 10,
        "calls": ["[[[0,9,1]]]"] * n, "others_cores": others})


def test_step_errors_compare_the_model_with_each_measured_step():
    measured = [0.2] * 6 + [0.4] * 4
    kinds = ["decode"] * 6 + ["prefill"] * 4
    err = step_errors(frame(measured, kinds), ConstantLatency(0.1))
    assert err["n_compared"] == 10
    assert err["by_kind"]["decode"]["median_err"] == pytest.approx(-0.5)
    assert err["by_kind"]["prefill"]["median_abs_err"] == pytest.approx(0.75)
    assert err["all"]["busy_err"] == pytest.approx(1.0 / 2.8 - 1)
    assert err["drift"] == pytest.approx([2.0] * 6 + [4.0] * 4)
    assert err["drift_range"] == pytest.approx(1.0)


def test_shape_error_takes_the_machines_speed_of_the_moment_out():
    # the machine halves its speed half way: the bias moves, but every step is exactly as its neighbours
    err = step_errors(frame([0.1] * 40 + [0.2] * 40), ConstantLatency(0.1))
    assert err["drift_range"] == pytest.approx(1.0) and err["shape_err"]["median_abs_err"] == 0.0
    # three interleaved shapes, two of them 20% off either way: that error stays, at either speed
    err = step_errors(frame([0.12, 0.10, 0.08] * 20 + [0.24, 0.20, 0.16] * 20), ConstantLatency(0.1))
    assert err["shape_err"]["median_abs_err"] == pytest.approx(0.2)


def test_a_flat_run_on_a_quiet_machine_gives_no_warning_and_a_drifting_or_shared_one_does():
    quiet = step_errors(frame([0.1] * 20), ConstantLatency(0.1))
    assert quiet["drift_range"] == 0 and step_warnings(quiet) == []
    slower = step_errors(frame([0.1] * 10 + [0.1 * (1 + 2 * DRIFT_WARN)] * 10), ConstantLatency(0.1))
    assert any("speed moved" in w for w in step_warnings(slower))
    shared = step_errors(frame([0.1] * 20, others=0.9), ConstantLatency(0.1))
    assert any("0.90 cores" in w for w in step_warnings(shared))


def test_steps_that_took_new_memory_are_compared_apart_and_warned_about_when_they_ran_slower():
    # 40 steps as the model says, but 4 (spread over the run) took 300 pages of memory new to the process each
    # (over the mark) and ran 30% slower; one more took 40 pages (under it)
    faulting = [3, 13, 23, 33]
    measured = [0.13 if i in faulting else 0.1 for i in range(40)]
    df = frame(measured)
    df["minor_faults"] = [300.0 if i in faulting else 0.0 for i in range(40)]
    df.loc[5, "minor_faults"] = FAULT_STEP_PAGES - 1.0
    err = step_errors(df, ConstantLatency(0.1))
    pf = err["page_faults"]
    assert pf["n_steps"] == 4 and pf["pages"] == 1200 and pf["threshold_pages"] == FAULT_STEP_PAGES
    assert pf["faulting"]["median_err"] == pytest.approx(0.1 / 0.13 - 1) and pf["other"]["median_err"] == 0.0
    assert pf["excess_s"] == pytest.approx(4 * 0.03)       # beyond the model at the other steps' speed
    (warning,) = [w for w in step_warnings(err) if "memory new to the process" in w]
    assert "4 of the real run's 40 steps" in warning and "1,200 in all" in warning and "0.12 s" in warning
    assert "4 of the real run's 40 steps" in format_step_errors(err)
    # as fast as the others: recorded, no warning; the other steps' speed is the comparison, not the model's
    even = frame([0.2] * 40)
    even["minor_faults"] = [300.0 if i in faulting else 0.0 for i in range(40)]
    quiet = step_errors(even, ConstantLatency(0.1))
    assert quiet["page_faults"]["n_steps"] == 4 and quiet["page_faults"]["excess_s"] == pytest.approx(0.0)
    assert not any("memory new" in w for w in step_warnings(quiet))
    # a log without the column (written before it was recorded), or without a count in it: nothing to say
    assert step_errors(frame([0.1] * 40), ConstantLatency(0.1))["page_faults"] is None
    unknown = frame([0.1] * 40)
    unknown["minor_faults"] = math.nan
    assert step_errors(unknown, ConstantLatency(0.1))["page_faults"] is None


def test_each_requests_first_token_steps_give_it_their_page_faults():
    # steps on the run's clock: [0, 0.1) decode, [0.1, 0.3) a prompt step that faulted, [0.3, 0.35) decode, ...
    steps = pd.DataFrame({"clock_s": [0.0, 0.1, 0.3, 0.35, 0.4], "elapsed_s": [0.1, 0.2, 0.05, 0.05, 0.05],
                          "minor_faults": [3.0, 900.0, 0.0, 40.0, math.nan]})
    requests = pd.DataFrame({"request": [0, 1, 2, 3, 4],
                             "arrival_s": [0.1, 0.05, 0.35, 0.4, 0.2],
                             "first_token_s": [0.3, 0.3, 0.4, 0.45, math.nan]})   # 4: no first token
    got = first_token_faults(steps, requests)
    # 0: the prompt step alone; 1 arrived during the first step, so its first token came from the second alone
    # (a step that started before the arrival is not the request's); 2: one decode step; 3: a count not known
    assert list(got[:3]) == [900.0, 900.0, 40.0] and math.isnan(got[3]) and math.isnan(got[4])
    assert list(got.index) == [0, 1, 2, 3, 4]
    assert first_token_faults(steps.drop(columns="minor_faults"), requests).isna().all()   # an older log


def test_ttft_errors_are_split_by_whether_the_first_token_steps_took_new_memory():
    per = pd.DataFrame({"ttft_rel_err": [-0.20, -0.10, 0.01, -0.01, 0.03, 0.5],
                        "ttft_faults_real": [900.0, 300.0, 0.0, 10.0, math.nan, 0.0]})
    split = ttft_by_faults(per)
    assert split["threshold_pages"] == FAULT_STEP_PAGES
    assert split["faulted"]["n"] == 2 and split["faulted"]["median_err"] == pytest.approx(-0.15)
    assert split["other"]["n"] == 3 and split["other"]["median_err"] == pytest.approx(0.01)
    assert split["other"]["median_abs_err"] == pytest.approx(0.01)
    assert "2 requests whose first token came from steps that took memory new to the process" in \
        format_ttft_by_faults(split)
    assert ttft_by_faults(per.assign(ttft_faults_real=math.nan)) is None       # no counts: nothing to split
    none_faulted = ttft_by_faults(per.assign(ttft_faults_real=0.0))
    assert none_faulted["faulted"] is None and format_ttft_by_faults(none_faulted) == ""


def test_steps_the_simulator_charges_nothing_are_not_compared():
    df = frame([0.1, 0.002])
    df.loc[1, "charged"] = False
    assert list(predict_steps(df, ConstantLatency(0.1))) == [0.1, 0.0]
    assert step_errors(df, ConstantLatency(0.1))["n_compared"] == 1


def test_replay_writes_the_step_log_of_every_token_it_computed(tiny, tmp_path):
    out = tmp_path / "r"
    assert main(["replay", "-m", tiny, "--threads", "1", "--quiet", "--no-plots", "--out", str(out), *WORKLOAD]) == 0
    steps = read_steps(out)
    rows = pd.read_parquet(out / "requests.parquet")
    assert (steps["elapsed_s"] > 0).all() and steps["t_s"].is_monotonic_increasing
    # every prompt token not taken from the cache is prefilled once, every token after the first is decoded once
    assert steps["n_prefill_tokens"].sum() == (rows["n_prompt"] - rows["n_cached"]).sum()
    assert steps["n_decode_tokens"].sum() == (rows["n_output"] - 1).sum()
    assert set(steps["kind"]) <= {"decode", "prefill", "mixed", "copy", "shift"}
    # the engine's count of the process's page faults during each step (Linux: getrusage)
    assert (steps["minor_faults"] >= 0).all() and (steps["minor_faults"] % 1 == 0).all()


def test_a_results_directory_without_a_step_log_reads_as_none_and_a_foreign_file_is_refused(tmp_path):
    assert read_steps(tmp_path) is None
    pd.DataFrame({"x": [1]}).to_parquet(tmp_path / STEPS_FILE)
    with pytest.raises(ValueError, match="not a step log"):
        read_steps(tmp_path)


def test_validate_reports_the_models_error_on_the_real_steps_and_the_calibrations_own(tiny, tmp_path, capsys):
    from experiments.validate import FILES, read_validation, run_validate
    from tests.experiments.test_validate import parse      # the heap reserve off: the engine runs in this process

    out = tmp_path / "v"
    args = parse("-m", tiny, "--threads", "1", "--latency", "constant:0.01", "--out", str(out), *WORKLOAD)
    assert run_validate(args) == 0
    printed = capsys.readouterr().out
    _, _, summary = read_validation(out)
    steps = read_steps(out / "real")
    measured = steps.loc[steps["charged"], "elapsed_s"].to_numpy()
    got = summary["real_step_errors"]
    assert got["n_compared"] == len(measured)
    assert got["all"]["median_err"] == pytest.approx(float(np.median(0.01 / measured - 1)))
    assert got["all"]["busy_err"] == pytest.approx(0.01 * len(measured) / measured.sum() - 1)
    assert "latency model on the real run's own" in printed
    assert summary["calibration_error"] is None            # a constant model has no calibration file
    assert (out / FILES["steps"]).exists()
    assert math.isfinite(got["drift_range"])
    # every request's TTFT beside the page faults of its first-token steps, and the split of TTFT errors by them
    per, _, _ = read_validation(out)
    real = pd.read_parquet(out / "real" / "requests.parquet").set_index("request")
    expected = first_token_faults(steps, real.reset_index())
    assert list(per["ttft_faults_real"]) == list(expected[per["request"]])
    assert (per["ttft_faults_real"] >= 0).all()
    split = summary["ttft_by_faults"]
    assert sum(side["n"] for side in (split["faulted"], split["other"]) if side) == len(per)


def test_each_step_records_the_runs_clock_when_given_one():
    fake, run_clock = Fake(), [12.5]
    log = StepLog(BPT, cpu_reader=fake.cpu, steal_reader=fake.steal, clock=fake.clock, window_s=10.0, run_clock=lambda: run_clock[0])
    for t in (12.5, 13.0):
        run_clock[0] = t
        fake.t += 0.1
        log(plan(call(Chunk(0, 0, [5], 10, (0,), False)), sample=(0,)), 0.1)
    assert list(log.frame()["clock_s"]) == [12.5, 13.0]
    plain = StepLog(BPT, cpu_reader=fake.cpu, steal_reader=fake.steal, clock=fake.clock)
    plain(plan(call(Chunk(0, 0, [5], 10, (0,), False)), sample=(0,)), 0.1)
    assert plain.frame()["clock_s"].isna().all()


def test_a_tracked_model_prices_each_step_at_its_clock_and_path():
    from sim.latency import TrackedLatency
    steps = frame([0.01] * 3).assign(clock_s=[0.0, 5.0, 10.0], n_prefill_tokens=[0, 0, 4])
    model = TrackedLatency(ConstantLatency(0.01), (0.0, 10.0), (1.0, 2.0), prompt_factors=(3.0, 3.0))
    assert list(predict_steps(steps, model)) == pytest.approx([0.01, 0.015, 0.03], rel=1e-12)
    with pytest.raises(ValueError, match="no run clock"):
        predict_steps(steps.drop(columns="clock_s"), model)


def test_the_step_ratio_plot_draws_the_speed_track(tmp_path):
    from experiments.steplog import plot_step_ratio
    steps = frame([0.01] * 20).assign(clock_s=np.arange(20) * 0.5)
    knots = {"clock_s": [0.0, 5.0, 9.5], "raw": [1.0, 1.3, 1.1], "factor": [1.1, 1.1, 1.1]}
    out = plot_step_ratio(steps, [0.01] * 20, tmp_path / "ratio.png", "test", probe=knots)
    assert out.stat().st_size > 1000
    assert plot_step_ratio(steps.drop(columns="clock_s"), [0.01] * 20, tmp_path / "plain.png", "test",
                           probe=knots).exists()                    # an old step log: no track drawn, no error


def test_each_step_records_the_page_faults_the_engine_counted():
    fake = Fake()
    log = StepLog(BPT, cpu_reader=fake.cpu, steal_reader=fake.steal, clock=fake.clock)
    for n in (3, 2711, None):
        fake.t += 0.1
        log(plan(call(Chunk(0, 0, [5], 10, (0,), False)), sample=(0,)), 0.1, n)
    fake.t += 0.1
    log(plan(call(Chunk(0, 0, [5], 10, (0,), False)), sample=(0,)), 0.1)     # an observer call without the count
    got = log.frame()["minor_faults"]
    assert list(got[:2]) == [3, 2711] and math.isnan(got[2]) and math.isnan(got[3])
