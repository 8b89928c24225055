"""The host's repeatability as a floor under a validation's errors (`validation.json` `repeat_floor`).

A real run measured with the in-run probe (`experiments.calibrate.InRunProbe`) replays some of its own steps,
each right after the step, on cells of its own (`speed_probe.MixSample`): a second execution of the same work a
moment later. How far a replay lands from its step is how far this machine lets two executions of the same step
drift apart; no latency model, however exact, predicts a single step closer than that. This module turns that
scatter into what it means for the validation's figures:

1. the run's replays give, per path (steps with prompt tokens, steps without), the log ratios replay / step,
   centred on their median (a constant offset between replays and steps is a bias of the bench, reported as
   `offset`, not scatter) and divided by sqrt(2): a replay and its step are two independent executions of equal
   spread, so their log ratio has twice the variance of one execution around its expected time;
2. each of `draws` times, every step of the real run gets a time drawn as its measured time times exp(one such
   value of its path, drawn with replacement), the schedule held fixed; each request's TTFT, TPOT and E2E move by
   the part of each step inside its intervals;
3. the drawn runs are compared with the measured run as the simulator is (`validate.aggregate_errors`'
   percentiles, the per-request median |relative error|).

The result is what an ideal simulator (one that knew each step's expected time on this machine at that moment)
would score against this run. It is optimistic: the draws are independent per step, while the host's speed moves
for seconds at a time, and a closed loop's decisions and arrivals do not move with the draws. An aggregate whose
floor is already near a target says the target is below what this machine repeats (docs/validation_sim.md §13).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from experiments.results import LATENCY_METRICS, STATS, latency_stats_rows

FLOOR_DRAWS = 400                 # drawn runs per validation: the within-target fractions to about +-2.5%
FLOOR_MIN_REPLAYS = 10            # fewer replays in the run (both paths together): no floor
FLOOR_TARGET = 0.03               # the aggregate target the fractions count against (issue #14: 3%)
FLOOR_METRICS = tuple(m for m in LATENCY_METRICS if m != "queue")   # a queue time is not a step's: no floor
_CHUNK_CELLS = 4_000_000          # draws x steps per block of the draws (32 MB of float64)


def replay_log_ratios(track: Any) -> dict[bool, np.ndarray]:
    """log(replay / step) of every replay in a `SpeedTrack`, per path (True: steps with prompt tokens)."""
    out: dict[bool, list[float]] = {True: [], False: []}
    if track is not None:
        for p in track.passes:
            for m in p.mix:
                if m.measured_s > 0 and m.step_s > 0:
                    out[bool(m.prompt)].append(math.log(m.measured_s / m.step_s))
    return {k: np.asarray(v, dtype=float) for k, v in out.items()}


def interval_deltas(start_s: np.ndarray, elapsed_s: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                    change: np.ndarray) -> np.ndarray:
    """How much each interval [lo, hi] lengthens when each step's time changes by `change` x its part inside it.

    `start_s`, `elapsed_s`: the steps, in clock order, not overlapping; `change`: [draws, steps] relative changes
    (drawn factor - 1). Returns [draws, intervals]: sum over steps of (seconds of the step inside the interval) x
    its change; time between steps (idle) does not change."""
    end_s = start_s + elapsed_s
    first = np.searchsorted(end_s, lo, side="right")            # first step that ends after lo
    stop = np.searchsorted(start_s, hi, side="left")             # steps [first, stop) start before hi
    cum = np.concatenate([np.zeros((change.shape[0], 1)), np.cumsum(change * elapsed_s, axis=1)], axis=1)
    some = stop > first
    f, s = np.where(some, first, 0), np.where(some, stop, 1)
    full = cum[:, s] - cum[:, f]
    cut_left = np.clip(lo - start_s[f], 0.0, elapsed_s[f])      # the first step's part before lo
    cut_right = np.clip(end_s[s - 1] - hi, 0.0, elapsed_s[s - 1])  # the last step's part after hi
    out = full - cut_left * change[:, f] - cut_right * change[:, s - 1]
    return np.where(some, out, 0.0)


def repeat_floor(steps: pd.DataFrame | None, requests: pd.DataFrame, track: Any, *, draws: int = FLOOR_DRAWS,
                 seed: int = 0, target: float = FLOOR_TARGET) -> dict[str, Any] | None:
    """validation.json's `repeat_floor` (see the module docs): None when the run has no step log with a clock or
    fewer than FLOOR_MIN_REPLAYS replays. A path without replays of its own takes the other path's scatter."""
    if steps is None or "clock_s" not in steps or not len(steps):
        return None
    ratios = replay_log_ratios(track)
    n = {k: len(v) for k, v in ratios.items()}
    if n[True] + n[False] < FLOOR_MIN_REPLAYS:
        return None
    pooled = np.concatenate([ratios[True], ratios[False]])
    centred, offset, scatter = {}, {}, {}
    for path, v in ratios.items():
        v = v if len(v) else pooled
        med = float(np.median(v))
        centred[path] = (v - med) / math.sqrt(2.0)
        offset[path] = math.exp(med)
        scatter[path] = float(np.median(np.abs(centred[path])))
    start = steps["clock_s"].to_numpy(float)
    elapsed = steps["elapsed_s"].to_numpy(float)
    keep = np.isfinite(start) & np.isfinite(elapsed) & (elapsed > 0)
    order = np.argsort(start[keep], kind="stable")
    start, elapsed = start[keep][order], elapsed[keep][order]
    prompt = (steps["n_prefill_tokens"].to_numpy() > 0)[keep][order]
    ok = requests[(requests["finish"] != "error") & np.isfinite(requests["ttft_s"].to_numpy(float))
                  & np.isfinite(requests["e2e_s"].to_numpy(float))]
    if not len(ok) or not len(start):
        return None
    arrival = ok["arrival_s"].to_numpy(float)
    first, end = ok["first_token_s"].to_numpy(float), ok["end_s"].to_numpy(float)
    ttft, e2e = ok["ttft_s"].to_numpy(float), ok["e2e_s"].to_numpy(float)
    tpot = ok["tpot_s"].to_numpy(float)
    gaps = np.maximum(ok["n_output"].to_numpy(float) - 1, 1)
    has_tpot = np.isfinite(tpot)
    gen_end = first + np.where(has_tpot, tpot, 0.0) * gaps      # the last token (tpot's span), not the reply's end
    base = {"ttft": ttft, "tpot": tpot[has_tpot], "e2e": e2e}
    base_stats = {m: latency_stats_rows(v[None, :])[0] for m, v in base.items() if len(v)}
    rng = np.random.default_rng(seed)
    agg: dict[str, list[np.ndarray]] = {m: [] for m in base_stats}
    per: dict[str, list[np.ndarray]] = {m: [] for m in base_stats}
    block = max(1, min(draws, _CHUNK_CELLS // max(len(start), 1)))
    done = 0
    while done < draws:
        k = min(block, draws - done)
        drawn = np.empty((k, len(start)))
        for path in (True, False):
            sel = prompt == path
            drawn[:, sel] = rng.choice(centred[path], size=(k, int(sel.sum())))
        change = np.expm1(drawn)
        d_ttft = interval_deltas(start, elapsed, arrival, first, change)
        d_gen = interval_deltas(start, elapsed, first, gen_end, change)
        d_e2e = interval_deltas(start, elapsed, arrival, end, change)
        new = {"ttft": ttft + d_ttft, "e2e": e2e + d_e2e, "tpot": (tpot + d_gen / gaps)[:, has_tpot]}
        for m in agg:
            agg[m].append(latency_stats_rows(new[m]) / base_stats[m] - 1.0)
            per[m].append(np.median(np.abs(new[m] / base[m] - 1.0), axis=1))
        done += k
    aggregate = []
    for m in FLOOR_METRICS:
        if m not in agg:
            continue
        err = np.abs(np.concatenate(agg[m]))
        for j, stat in enumerate(STATS):
            aggregate.append({"metric": m, "stat": stat, "median_abs": float(np.median(err[:, j])),
                              "p90_abs": float(np.percentile(err[:, j], 90)),
                              "within_target": float(np.mean(err[:, j] <= target))})
    per_request = {f"{m}_median_ape": float(np.median(np.concatenate(per[m]))) for m in FLOOR_METRICS if m in per}
    return {
        "what": "an ideal simulator's errors against this run: every step redrawn with the scatter of a "
                "re-execution (the run's own replays, centred, / sqrt 2), the schedule fixed; median_abs, p90_abs: "
                "the median and 90th percentile over the draws of the |relative error|; within_target: the "
                "fraction of draws within the target; optimistic (independent draws per step)",
        "n_replays": {"prompt": n[True], "decode": n[False]},
        "offset": {"prompt": offset[True], "decode": offset[False]},
        "scatter": {"prompt": scatter[True], "decode": scatter[False]},
        "draws": int(draws), "seed": int(seed), "target": float(target),
        "aggregate": aggregate, "per_request": per_request,
    }


def floor_expected_hits(floor: Mapping[str, Any], stats: Sequence[str] = ("p50", "p90")) -> float:
    """How many of the aggregates (FLOOR_METRICS x `stats`) the ideal simulator meets the target in, on average."""
    return float(sum(r["within_target"] for r in floor["aggregate"] if r["stat"] in stats))


def format_repeat_floor(floor: Mapping[str, Any]) -> str:
    """The floor for the terminal: the scatter, then per metric P50 / P90 (90th percentile of the draws' |error|)
    and how often the target is met, then per request."""
    agg = {(r["metric"], r["stat"]): r for r in floor["aggregate"]}
    n = floor["n_replays"]
    target = 100 * floor["target"]
    parts = []
    for m in FLOOR_METRICS:
        if (m, "p50") in agg:
            p50, p90 = agg[(m, "p50")], agg[(m, "p90")]
            parts.append(f"{m.upper()} {100 * p50['p90_abs']:.1f}/{100 * p90['p90_abs']:.1f}% "
                         f"(within {target:g}%: {100 * p50['within_target']:.0f}/{100 * p90['within_target']:.0f}%)")
    per = floor["per_request"]
    return (f"repeat floor ({n['prompt']} + {n['decode']} replays, one execution's scatter "
            f"{100 * floor['scatter']['prompt']:.1f}% prompt / {100 * floor['scatter']['decode']:.1f}% decode): an "
            f"ideal simulator's P50/P90 |err| in 9 of 10 draws within " + ", ".join(parts)
            + "; per request median " + ", ".join(f"{m.upper()} {100 * per[f'{m}_median_ape']:.1f}%"
                                                  for m in FLOOR_METRICS if f"{m}_median_ape" in per))
