"""The repeat floor (experiments/repeat_floor.py): an ideal simulator's errors against a real run, from the scatter
of the run's own replays. Built on hand-made step logs, requests and tracks, so every figure is known exactly."""

import math

import numpy as np
import pandas as pd
import pytest

from experiments.repeat_floor import (
    FLOOR_MIN_REPLAYS,
    dynamic_floor,
    floor_expected_hits,
    format_dynamic_floor,
    hits_within,
    format_repeat_floor,
    interval_deltas,
    one_execution,
    repeat_floor,
)
from experiments.results import requests_frame
from sim.latency import ConstantLatency
from experiments.speed_probe import MixSample, SpeedTrack, TrackPass

CALL = (((0, 0, 1, True, False),),)


def track(prompt_ratios=(), decode_ratios=()):
    """One pass holding replays at these replay / step ratios."""
    mix = tuple(MixSample(CALL, prompt, 0.01 * r, 0.01, 1.0) for prompt, rs in ((True, prompt_ratios),
                                                                               (False, decode_ratios)) for r in rs)
    return SpeedTrack(10.0, (TrackPass(1.0, 1.0, {}, 0.5, mix),))


def track_again(prompt_pairs=(), decode_pairs=()):
    """One pass holding replays executed twice, at these (replay / step, again / step) ratios."""
    mix = tuple(MixSample(CALL, prompt, 0.01 * r, 0.01, 1.0, again_s=0.01 * a)
                for prompt, pairs in ((True, prompt_pairs), (False, decode_pairs)) for r, a in pairs)
    return SpeedTrack(10.0, (TrackPass(1.0, 1.0, {}, 0.5, mix),))


def steps_of(rows):
    """rows: (clock_s, elapsed_s, prompt tokens)."""
    return pd.DataFrame([{"clock_s": c, "elapsed_s": e, "n_prefill_tokens": p} for c, e, p in rows])


def request(arrival, first, end, n_output, finish="limit"):
    tpot = (end - first) / (n_output - 1) if n_output > 1 else math.nan
    return {"arrival_s": arrival, "first_token_s": first, "end_s": end, "ttft_s": first - arrival,
            "e2e_s": end - arrival, "tpot_s": tpot, "n_output": n_output, "finish": finish}


def agg(floor, metric, stat):
    (row,) = [r for r in floor["aggregate"] if r["metric"] == metric and r["stat"] == stat]
    return row


# --- interval_deltas ---------------------------------------------------------------------------------------


def test_an_interval_takes_each_step_by_the_part_of_it_inside():
    start = np.array([0.0, 0.01, 0.03])            # steps of 10, 10 (then 5 idle), 20 ms
    elapsed = np.array([0.01, 0.01, 0.02])
    change = np.array([[0.1, 0.2, 0.4]])
    lo = np.array([0.005, 0.0, 0.012, 0.021, 0.0, 0.06])
    hi = np.array([0.02, 0.05, 0.018, 0.029, 0.0, 0.07])
    got = interval_deltas(start, elapsed, lo, hi, change)[0]
    assert got == pytest.approx([0.005 * 0.1 + 0.01 * 0.2,        # half the first step, all of the second
                                 0.01 * 0.1 + 0.01 * 0.2 + 0.02 * 0.4,
                                 0.006 * 0.2,                      # inside one step
                                 0.0,                              # idle between steps
                                 0.0,                              # empty
                                 0.0], abs=1e-15)                  # after the last step


def test_interval_deltas_take_every_draw():
    start, elapsed = np.array([0.0, 1.0]), np.array([1.0, 1.0])
    change = np.array([[0.0, 0.0], [1.0, -0.5]])
    got = interval_deltas(start, elapsed, np.array([0.5]), np.array([2.0]), change)
    assert got[:, 0] == pytest.approx([0.0, 0.5 * 1.0 - 0.5])


# --- repeat_floor ------------------------------------------------------------------------------------------


def one_prompt_run():
    """Two requests, each TTFT one prompt step (100 ms, 300 ms), then decode steps of 10 ms."""
    rows = [(0.0, 0.1, 50)] + [(0.1 + 0.01 * i, 0.01, 0) for i in range(10)]
    rows += [(1.0, 0.3, 80)] + [(1.3 + 0.01 * i, 0.01, 0) for i in range(10)]
    reqs = pd.DataFrame([request(0.0, 0.1, 0.2, 11), request(1.0, 1.3, 1.4, 11)])
    return steps_of(rows), reqs


def test_replays_that_repeat_their_steps_leave_no_floor_and_an_offset_is_not_scatter():
    steps, reqs = one_prompt_run()
    floor = repeat_floor(steps, reqs, track([1.05] * 6, [0.98] * 6), draws=50)
    assert floor["offset"] == pytest.approx({"prompt": 1.05, "decode": 0.98}, rel=1e-12)
    assert floor["scatter"] == {"prompt": 0.0, "decode": 0.0}
    assert floor["n_replays"] == {"prompt": 6, "decode": 6}
    for r in floor["aggregate"]:
        assert r["median_abs"] == pytest.approx(0.0, abs=1e-12) and r["within_target"] == 1.0
    assert floor["per_request"] == pytest.approx({"ttft_median_ape": 0, "tpot_median_ape": 0, "e2e_median_ape": 0},
                                                 abs=1e-12)
    assert floor_expected_hits(floor) == 6.0


def test_a_ttft_of_one_step_moves_by_one_executions_scatter():
    """Prompt replays at exp(+-a): one execution scatters by exp(+-a / sqrt 2); each TTFT is one prompt step, so
    each drawn TTFT is its step's times exp(+-a / sqrt 2), and the within-target fraction is the chance of the
    smaller side."""
    a = 0.0300 * math.sqrt(2)                       # exp(0.03) - 1 = 3.05% > 3%, 1 - exp(-0.03) = 2.96% <= 3%
    steps, reqs = one_prompt_run()
    reqs = reqs.iloc[:1]                             # one request: its P50 is its TTFT
    floor = repeat_floor(steps, reqs, track([math.exp(a), math.exp(-a)] * 5, [1.0] * 10), draws=400, seed=3)
    assert floor["scatter"]["prompt"] == pytest.approx(0.03, rel=1e-12)
    p50 = agg(floor, "ttft", "p50")
    assert p50["p90_abs"] == pytest.approx(math.expm1(0.03), rel=1e-9)
    assert 0.4 < p50["within_target"] < 0.6         # binomial(400, 1/2): 6 sigma
    low, high = -math.expm1(-0.03), math.expm1(0.03)  # a median over draws of the two sides lies between them
    assert low - 1e-12 <= p50["median_abs"] <= high + 1e-12
    assert low - 1e-12 <= floor["per_request"]["ttft_median_ape"] <= high + 1e-12
    # decode replays equal to their steps: TPOT does not move; E2E moves by the prompt step's share of it
    assert agg(floor, "tpot", "p50")["p90_abs"] == pytest.approx(0.0, abs=1e-12)
    assert agg(floor, "e2e", "p50")["p90_abs"] == pytest.approx(0.1 * math.expm1(0.03) / 0.2, rel=1e-9)


def test_a_path_without_replays_takes_the_other_paths_scatter():
    a = 0.1
    steps, reqs = one_prompt_run()
    floor = repeat_floor(steps, reqs, track([], [math.exp(a), math.exp(-a)] * 6), draws=100)
    assert floor["n_replays"] == {"prompt": 0, "decode": 12}
    assert floor["scatter"]["prompt"] == pytest.approx(a / math.sqrt(2)) == floor["scatter"]["decode"]
    assert agg(floor, "ttft", "p90")["p90_abs"] > 0.05


# --- the step's share of a replay's scatter, measured (replays executed twice, validate --replay-again) ------


def test_without_second_executions_the_split_is_even():
    one = one_execution(track([1.1, 0.9] * 6, [1.05, 0.95] * 6))
    assert one["step_share"] == {True: 1 / math.sqrt(2), False: 1 / math.sqrt(2)}
    assert one["split"] == {True: "even", False: "even"} and one["n_again"] == {True: 0, False: 0}


def test_replays_that_repeat_each_other_exactly_leave_all_of_the_scatter_to_the_step():
    """Two executions after the step that agree to the last digit: the step alone drifts, by all of the scatter."""
    a = 0.05
    pairs = [(math.exp(a), math.exp(a)), (math.exp(-a), math.exp(-a))] * 6
    one = one_execution(track_again(pairs, pairs))
    assert one["step_share"] == {True: 1.0, False: 1.0} and one["split"] == {True: "measured", False: "measured"}
    assert one["centred"][True] == pytest.approx(np.log([math.exp(a), math.exp(-a)] * 6), rel=1e-12)
    assert one["scatter"][True] == pytest.approx(a, rel=1e-12)
    assert one["n_again"] == {True: 12, False: 12} and one["replay_vs_replay"][True] == pytest.approx(0.0, abs=1e-15)


def test_a_second_execution_equal_to_the_step_leaves_the_step_no_scatter_of_its_own():
    """The first replay drifts and the second lands on the step: all of the scatter is the first replay's."""
    a = 0.05
    pairs = [(math.exp(a), 1.0), (math.exp(-a), 1.0)] * 6
    one = one_execution(track_again(pairs, [(1.0, 1.0)] * 12))
    assert one["step_share"][True] == 0.0 and one["scatter"][True] == 0.0
    steps, reqs = one_prompt_run()
    floor = repeat_floor(steps, reqs, track_again(pairs, [(1.0, 1.0)] * 12), draws=50)
    assert all(r["median_abs"] == pytest.approx(0.0, abs=1e-12) for r in floor["aggregate"])
    assert floor["step_share"] == {"prompt": 0.0, "decode": 1.0} and floor["split"]["prompt"] == "measured"


@pytest.mark.parametrize("sd_step, sd_replay, tol", [(0.03, 0.03, 0.03), (0.03, 0.01, 0.015), (0.01, 0.03, 0.09)])
def test_the_measured_share_recovers_how_the_scatter_splits(sd_step, sd_replay, tol):
    """Step, replay and second execution each off their expected time by an independent normal draw: the share is
    sd_step / sqrt(sd_step^2 + sd_replay^2). From 20,000 replays the estimate's standard deviation over seeds is
    0.008, 0.004 and 0.023 in these three cases (300 seeds; the third is a small difference of two large spreads);
    `tol` is about four of them (the seed makes the draw fixed)."""
    rng = np.random.default_rng(11)
    step, first, second = (rng.normal(0, sd, 20_000) for sd in (sd_step, sd_replay, sd_replay))
    pairs = list(zip(np.exp(first - step), np.exp(second - step)))
    one = one_execution(track_again(pairs, pairs[:40]))
    assert one["step_share"][True] == pytest.approx(sd_step / math.hypot(sd_step, sd_replay), abs=tol)
    # one execution's scatter: the share times the replays' (a normal's median |x| is 0.6745 sd; its estimate from
    # 20,000 draws is within 2%)
    both = math.hypot(sd_step, sd_replay)
    assert one["scatter"][True] == pytest.approx(one["step_share"][True] * 0.6745 * both, rel=0.03)


def test_prompt_replays_with_copies_get_a_share_and_a_centre_of_their_own():
    """A replay's prompt-cache copies on the bench write fresh memory the run's own copies do not: those replays
    run slower than their steps by an offset and scatter by noise of their own (the second execution lands back
    on the step), while the plain prompt replays repeat each other exactly (all of their scatter the step's).
    Each kind is centred on its own median and scaled by its own share."""
    a = 0.04
    copy = ((("save", 0, 32),))
    plain = [MixSample(CALL, True, 0.01 * r, 0.01, 1.0, again_s=0.01 * r) for r in (math.exp(a), math.exp(-a)) * 6]
    copies = [MixSample(CALL, True, 0.01 * math.exp(0.05 + d), 0.01, 1.0, copy, 0.001, 0.01)
              for d in (a, -a) * 6]
    decode = [MixSample(CALL, False, 0.01, 0.01, 1.0, again_s=0.01)] * 12
    t = SpeedTrack(10.0, (TrackPass(1.0, 1.0, {}, 0.5, tuple(plain + copies + decode)),))
    one = one_execution(t)
    # (the share is the square root of a difference of spreads: rounding in the logs leaves ~1e-8 of it)
    assert one["step_share_kinds"] == pytest.approx({"prompt": 1.0, "prompt_copies": 0.0, "decode": 1.0}, abs=1e-6)
    assert one["n_again"] == {True: 24, False: 12} and one["split"][True] == "measured"
    # the plain ones keep their scatter, the ones with copies none: centred per kind, not on the path's median
    assert sorted(one["centred"][True]) == pytest.approx(sorted([a, -a] * 6 + [0.0] * 12), abs=1e-8)
    steps, reqs = one_prompt_run()
    floor = repeat_floor(steps, reqs, t, draws=20)
    assert "measured from second executions: 1.00 prompt, 0.00 prompt with copies / 1.00 decode)" in \
        format_repeat_floor(floor)
    assert floor["step_share_kinds"] == pytest.approx({"prompt": 1.0, "prompt_copies": 0.0, "decode": 1.0}, abs=1e-6)
    # too few of a kind: it takes its path's centre and share (the path's rows pooled)
    few = SpeedTrack(10.0, (TrackPass(1.0, 1.0, {}, 0.5, tuple(plain + copies[:4] + decode)),))
    one = one_execution(few)
    assert one["step_share_kinds"]["prompt_copies"] == one["step_share"][True]
    assert one["n_again"] == {True: 16, False: 12}


def test_a_path_with_too_few_second_executions_keeps_the_even_split():
    pairs = [(1.05, 1.05), (0.95, 0.95)] * 4                    # 8 < FLOOR_MIN_REPLAYS on the prompt path
    one = one_execution(track_again(pairs, [(1.05, 1.05), (0.95, 0.95)] * 6))
    assert one["step_share"] == {True: 1 / math.sqrt(2), False: 1.0}
    assert one["split"] == {True: "even", False: "measured"} and one["n_again"] == {True: 8, False: 12}


def test_the_floor_prints_a_measured_split():
    steps, reqs = one_prompt_run()
    pairs = [(1.1, 1.1), (0.9, 0.9)] * 6
    text = format_repeat_floor(repeat_floor(steps, reqs, track_again(pairs, pairs), draws=20))
    # (the median of log 1.1 and log 0.9, six of each: their mean, -0.5%)
    assert ("one execution's scatter 10.0% prompt / 10.0% decode, replay / step x0.995 prompt / x0.995 decode "
            "(median), the step's share of a replay's scatter measured from second executions: 1.00 prompt / 1.00 "
            "decode)") in text


def test_the_floor_prints_the_replays_median_against_their_steps():
    # prompt replays 4% faster than their steps: what the track-mix knots carry into TTFT
    steps, reqs = one_prompt_run()
    text = format_repeat_floor(repeat_floor(steps, reqs, track([0.96, 0.95, 0.97] * 4, [1.01] * 12), draws=20))
    assert "replay / step x0.960 prompt / x1.010 decode (median)" in text


def test_the_draws_are_seeded():
    steps, reqs = one_prompt_run()
    t = track([1.1, 0.9, 1.02] * 4, [1.05, 0.97, 1.0] * 4)
    assert repeat_floor(steps, reqs, t, seed=1) == repeat_floor(steps, reqs, t, seed=1)
    assert repeat_floor(steps, reqs, t, seed=1) != repeat_floor(steps, reqs, t, seed=2)


def test_no_floor_without_enough_replays_or_a_step_log():
    steps, reqs = one_prompt_run()
    assert repeat_floor(steps, reqs, track([1.0] * (FLOOR_MIN_REPLAYS - 1))) is None
    assert repeat_floor(steps, reqs, None) is None
    assert repeat_floor(None, reqs, track([1.0] * FLOOR_MIN_REPLAYS)) is None
    assert repeat_floor(steps.drop(columns="clock_s"), reqs, track([1.0] * FLOOR_MIN_REPLAYS)) is None


def test_failed_requests_and_single_token_replies_are_left_out_as_validate_leaves_them():
    steps, reqs = one_prompt_run()
    extra = pd.DataFrame([request(0.0, 0.1, 0.1, 1), {**request(1.0, 1.3, 1.4, 11), "finish": "error"}])
    both = pd.concat([reqs, extra], ignore_index=True)
    t = track([1.1, 0.9] * 5, [1.05, 0.95] * 5)
    got, ref = repeat_floor(steps, both, t, draws=60), repeat_floor(steps, reqs, t, draws=60)
    # the one-token reply has a TTFT and an E2E, no TPOT; the failed request counts nowhere
    assert got["per_request"]["tpot_median_ape"] == ref["per_request"]["tpot_median_ape"]
    assert agg(got, "tpot", "p90") == agg(ref, "tpot", "p90")


def test_the_floor_prints_per_metric_and_per_request():
    steps, reqs = one_prompt_run()
    floor = repeat_floor(steps, reqs, track([1.1, 0.9] * 5, [1.0] * 10), draws=50)
    text = format_repeat_floor(floor)
    assert text.startswith("repeat floor (10 + 10 replays, one execution's scatter 7.1% prompt / 0.0% decode, "
                           "replay / step x0.995 prompt / x1.000 decode (median))")
    assert "TTFT " in text and "TPOT 0.0/0.0% (within 3%: 100/100%)" in text and "per request median TTFT" in text


# --- the schedule free (dynamic_floor) -----------------------------------------------------------------------

BASE = ConstantLatency(0.01, 1e-4)


def simulated(latency):
    """Twelve requests 50 ms apart on two slots, prompts of 40-117 tokens: later ones wait for a slot, so a step's
    time moves which step a request is admitted in."""
    from engine.core import ServerConfig
    from sim.driver import Simulation
    from traces import Trace, TraceRequest
    reqs = [TraceRequest(i, 0.05 * i, 40 + 7 * i, 8 + i % 5) for i in range(12)]
    rows = Simulation(ServerConfig(n_ctx=2048, n_parallel=2, cache_prompt=False), latency).run(
        Trace(reqs, "native", "test")).requests
    return requests_frame(rows)


def scorer(reference):
    """validate's comparison of a drawn simulation with the undisturbed one."""
    from experiments.validate import aggregate_errors, compare_requests, per_request_summary

    def score(drawn):
        agg = aggregate_errors(reference, drawn)
        return ({(r.metric, r.stat): r.rel_err for r in agg.itertuples()},
                per_request_summary(compare_requests(reference, drawn)))
    return score


def test_replays_equal_to_their_steps_give_back_the_undisturbed_simulation_every_draw():
    ref = simulated(BASE)
    calls = []
    dyn = dynamic_floor(simulated, scorer(ref), BASE, track([1.05] * 6, [0.98] * 6), draws=3,
                        progress=lambda: calls.append(1))
    assert dyn["draws"] == 3 and len(calls) == 3 and dyn["decision_match_rate"] == 1.0
    assert {(r["metric"], r["stat"]) for r in dyn["aggregate"]} == {(m, st) for m in ("ttft", "tpot", "e2e")
                                                                   for st in ("p50", "p90", "p99", "mean")}
    for r in dyn["aggregate"]:
        assert r["median_abs"] == 0.0 and r["p90_abs"] == 0.0 and r["within_target"] == 1.0
    assert dyn["per_request"] == {"ttft_median_ape": 0.0, "tpot_median_ape": 0.0, "e2e_median_ape": 0.0}
    assert floor_expected_hits(dyn) == 6.0
    assert dyn["hits"] == {"of": 6, "per_draw": [6, 6, 6], "median": 6.0, "p10": 6.0, "p90": 6.0}


def test_a_scattered_host_moves_the_drawn_simulations_and_the_draws_are_seeded():
    ref = simulated(BASE)
    t = track([math.exp(0.2), math.exp(-0.2)] * 5, [math.exp(0.2), math.exp(-0.2)] * 5)
    one = dynamic_floor(simulated, scorer(ref), BASE, t, draws=6, seed=4)
    assert one == dynamic_floor(simulated, scorer(ref), BASE, t, draws=6, seed=4)
    assert one != dynamic_floor(simulated, scorer(ref), BASE, t, draws=6, seed=5)
    assert floor_expected_hits(one) < 6.0
    assert all(one["per_request"][f"{m}_median_ape"] > 0 for m in ("ttft", "tpot", "e2e"))
    # each draw's count of P50s and P90s within the target: their mean is the expected count
    counts = one["hits"]["per_draw"]
    assert len(counts) == 6 and all(0 <= c <= 6 for c in counts)
    assert np.mean(counts) == pytest.approx(floor_expected_hits(one), rel=1e-12)
    assert one["hits"]["p10"] <= one["hits"]["median"] <= one["hits"]["p90"]


def test_a_replays_whole_scatter_is_the_floor_of_pricing_each_step_by_one_replay():
    # --floor-scatter replay: the log ratios centred on their path's median, not scaled by the step's share
    ratios = [1.10, 0.92, 1.03, 0.97, 1.05] * 2
    t = track(ratios, [1.02, 0.99] * 5)
    whole = one_execution(t, "replay")
    logs = np.log(ratios)
    assert sorted(whole["centred"][True]) == pytest.approx(sorted(logs - np.median(logs)), rel=1e-12)
    assert whole["scatter_of"] == "replay" and whole["step_share"][True] == pytest.approx(1 / math.sqrt(2))
    share = one_execution(t)
    assert share["scatter_of"] == "step"
    assert whole["scatter"][True] == pytest.approx(share["scatter"][True] * math.sqrt(2), rel=1e-12)
    # with second executions measuring a share of 1 for the plain kind, the two agree on that kind
    pairs = [(1.1, 1.1), (0.9, 0.9)] * 6
    assert one_execution(track_again(pairs, pairs), "replay")["centred"][True] == pytest.approx(
        one_execution(track_again(pairs, pairs))["centred"][True], abs=1e-8)
    # more scatter, fewer aggregates an ideal draw meets; the floor says whose it is
    steps, reqs = one_prompt_run()
    by_step, by_replay = (repeat_floor(steps, reqs, t, draws=200, scatter_of=w) for w in ("step", "replay"))
    assert by_replay["scatter_of"] == "replay" and by_step["scatter_of"] == "step"
    assert floor_expected_hits(by_replay) <= floor_expected_hits(by_step)
    text = format_repeat_floor(by_replay)
    assert "a replay's whole scatter against its step 6.0% prompt" in text
    assert "a simulator pricing each step by one replay of it's P50/P90" in text
    assert "an ideal simulator's P50/P90" in format_repeat_floor(by_step)
    with pytest.raises(ValueError, match="scatter_of must be one of step, replay"):
        one_execution(t, "steps")


def test_the_drawn_simulations_get_one_executions_scatter_per_path():
    seen = []

    def simulate(latency):
        seen.append(latency)
        return simulated(latency)

    t = track([math.exp(0.3), math.exp(-0.3)] * 5, [1.0] * 10)
    dynamic_floor(simulate, scorer(simulated(BASE)), BASE, t, draws=2, seed=7)
    one = one_execution(t)
    assert [m.seed for m in seen] == [7, 8] and all(m.base is BASE for m in seen)
    assert sorted(seen[0]._prompt) == pytest.approx(sorted(np.exp(one["centred"][True])), rel=1e-12)
    assert set(seen[0]._decode) == {1.0}
    # --floor-scatter replay: the draws get a replay's whole scatter
    seen.clear()
    dyn = dynamic_floor(simulate, scorer(simulated(BASE)), BASE, t, draws=1, seed=7, scatter_of="replay")
    assert dyn["scatter_of"] == "replay"
    assert sorted(seen[0]._prompt) == pytest.approx(sorted(np.exp(one_execution(t, "replay")["centred"][True])))
    assert sorted(seen[0]._prompt) == pytest.approx(sorted([math.exp(0.3), math.exp(-0.3)] * 5), rel=1e-12)


def test_no_dynamic_floor_without_enough_replays_or_draws():
    score = scorer(simulated(BASE))
    assert dynamic_floor(simulated, score, BASE, track([1.0] * (FLOOR_MIN_REPLAYS - 1)), draws=2) is None
    assert dynamic_floor(simulated, score, BASE, None, draws=2) is None
    assert dynamic_floor(simulated, score, BASE, track([1.0] * FLOOR_MIN_REPLAYS), draws=0) is None


def test_the_dynamic_floor_prints_how_often_each_aggregate_met_the_target():
    ref = simulated(BASE)
    dyn = dynamic_floor(simulated, scorer(ref), BASE, track([1.0] * 6, [1.0] * 6), draws=2)
    text = format_dynamic_floor(dyn)
    assert text.startswith("repeat floor, the schedule free (2 re-simulations with that scatter): P50/P90 within 3% "
                           "in TTFT 100/100%, TPOT 100/100%, E2E 100/100% of the draws, expected 6.0 of 6")
    assert text.endswith("per request median TTFT 0.0%, TPOT 0.0%, E2E 0.0%; decided alike 100%; P50s and P90s "
                         "within target per draw: median 6 of 6 (10-90%: 6-6)")
    for own, where in ((4, "below"), (6, "within")):
        assert format_dynamic_floor({**dyn, "simulator_hits": own}).endswith(
            f"; the simulator met {own}, {where} that range")
    assert "per draw" not in format_dynamic_floor({k: v for k, v in dyn.items() if k != "hits"})   # written before


def test_hits_count_the_p50s_and_p90s_within_the_target_and_not_a_missing_one():
    errs = {("ttft", "p50"): 0.03, ("ttft", "p90"): -0.031, ("tpot", "p50"): math.nan, ("e2e", "p50"): -0.01,
            ("e2e", "p90"): 0.0, ("e2e", "p99"): 0.0, ("queue", "p50"): 0.0}
    assert hits_within(errs) == 3          # TTFT P50, E2E P50 and P90; TPOT P90 missing, P99 and queue not counted
    assert hits_within(errs, 0.05) == 4
