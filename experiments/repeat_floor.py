"""The host's repeatability as a floor under a validation's errors (`validation.json` `repeat_floor`).

A real run measured with the in-run probe (`experiments.calibrate.InRunProbe`) replays some of its own steps,
each right after the step, on cells of its own (`speed_probe.MixSample`): a second execution of the same work a
moment later. How far a replay lands from its step is how far this machine lets two executions of the same step
drift apart; no latency model, however exact, predicts a single step closer than that. This module turns that
scatter into what it means for the validation's figures:

1. the run's replays give, per path (steps with prompt tokens, steps without), the log ratios replay / step,
   centred on their median (a constant offset between replays and steps is a bias of the bench, reported as
   `offset`, not scatter) and scaled to the step's own part of that scatter (`step_share`). A replay and its
   step are two executions; their log ratio holds the noise of both. Without more, the split is taken as even
   (two independent executions of equal spread: a share of 1 / sqrt(2)). With each replay executed a second
   time right after itself (`MixSample.again_s`, validate `--replay-again`), the split is measured: the three
   executions' pairwise log ratios a = replay / step, c = again / step and b = again / replay have spreads
   s_a, s_c, s_b (median absolute deviations, robust to the host's interruptions), and with independent noises
   the step's own variance is (s_a^2 + s_c^2 - s_b^2) / 2, its share sqrt of that over s_a^2, clipped to
   [0, 1]. On this project's host the replays agreed with each other better than with their step
   (docs/validation_sim.md §13, §28): the step carries noise of its own that executions after it do not see,
   and an even split then understates what no simulator can predict;
2. each of `draws` times, every step of the real run gets a time drawn as its measured time times exp(one such
   value of its path, drawn with replacement), the schedule held fixed; each request's TTFT, TPOT and E2E move by
   the part of each step inside its intervals;
3. the drawn runs are compared with the measured run as the simulator is (`validate.aggregate_errors`'
   percentiles, the per-request median |relative error|).

The result is what an ideal simulator (one that knew each step's expected time on this machine at that moment)
would score against this run. It is optimistic: the draws are independent per step, while the host's speed moves
for seconds at a time, and a closed loop's decisions and arrivals do not move with the draws. An aggregate whose
floor is already near a target says the target is below what this machine repeats (docs/validation_sim.md §13).

The schedule free (`dynamic_floor`, validation.json `repeat_floor.dynamic`, validate `--floor-draws`): a step a
little longer or shorter also moves what comes after it. A request that arrives a few milliseconds later meets
the next step instead of this one; a chat turn sent after a reply that ended later meets other slots; a long
prompt step lands before or after another request's last token and adds its whole length to that request. The
fixed floor cannot see this. The dynamic floor re-runs the validation's simulation with every step's time
multiplied by a draw of the same scatter (`sim.latency.JitteredLatency`), the core re-deciding everything that
follows, and compares each drawn simulation with the undisturbed one as validate compares the simulator with the
real run. It is what a simulator exact to each step's expected time would score against a real run whose steps
scatter as this host's do, the schedule's sensitivity included (docs/validation_sim.md §27).

Whose floor (validate `--floor-scatter`, validation.json `repeat_floor.scatter_of`): by default the draws are the
step's own share of the scatter, the ideal simulator's; with "replay" they are a replay's whole scatter against its
step, the floor of a simulator that prices each step by one replay of it, as track-mix prices a prompt step by its
own replay (docs/validation_sim.md §30).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from experiments.flags import FLOOR_SCATTERS
from experiments.results import LATENCY_METRICS, STATS, latency_stats_rows
from sim.latency import JitteredLatency

FLOOR_DRAWS = 400                 # drawn runs per validation: the within-target fractions to about +-2.5%
FLOOR_MIN_REPLAYS = 10            # fewer replays in the run (both paths together): no floor
FLOOR_TARGET = 0.03               # the aggregate target the fractions count against (issue #14: 3%)
FLOOR_METRICS = tuple(m for m in LATENCY_METRICS if m != "queue")   # a queue time is not a step's: no floor
DYNAMIC_DRAWS = 16               # validate --floor-draws: re-simulations of the dynamic floor
_CHUNK_CELLS = 4_000_000          # draws x steps per block of the draws (32 MB of float64)


KIND_NAMES = {(True, False): "prompt", (True, True): "prompt_copies", (False, False): "decode",
              (False, True): "decode_copies"}


def replay_kinds(track: Any) -> dict[tuple[bool, bool], tuple[np.ndarray, np.ndarray]]:
    """Per kind of replay (its path, whether it replayed prompt-cache copies): its log(replay / step), and for those
    executed twice the rows of log(replay / step), log(again / step), log(again / replay)."""
    ratios: dict[tuple[bool, bool], list[float]] = {k: [] for k in KIND_NAMES}
    rows: dict[tuple[bool, bool], list[tuple[float, float, float]]] = {k: [] for k in KIND_NAMES}
    if track is not None:
        for p in track.passes:
            for m in p.mix:
                if not (m.measured_s > 0 and m.step_s > 0):
                    continue
                kind = (bool(m.prompt), bool(m.ops))
                a = math.log(m.measured_s / m.step_s)
                ratios[kind].append(a)
                if m.again_s is not None and m.again_s > 0:
                    rows[kind].append((a, math.log(m.again_s / m.step_s), math.log(m.again_s / m.measured_s)))
    return {k: (np.asarray(ratios[k], dtype=float), np.asarray(rows[k], dtype=float).reshape(-1, 3))
            for k in KIND_NAMES}


def _mad(v: np.ndarray) -> float:
    return float(np.median(np.abs(v - np.median(v))))


def step_share(rows: np.ndarray) -> float:
    """The step's share of the spread of log(replay / step), from rows of log(replay / step), log(again / step),
    log(again / replay) (module docs, 1.): sqrt((s_a^2 + s_c^2 - s_b^2) / 2) / s_a, clipped to [0, 1]; 1 when the
    replays repeat their steps exactly (nothing to split)."""
    s_a, s_c, s_b = (_mad(rows[:, j]) for j in range(3))
    if s_a == 0.0:
        return 1.0
    own = (s_a * s_a + s_c * s_c - s_b * s_b) / 2.0
    return float(min(1.0, math.sqrt(max(own, 0.0)) / s_a))


def one_execution(track: Any, scatter_of: str = "step") -> dict[str, Any] | None:
    """One execution's scatter around its expected time, per path (True: steps with prompt tokens), from a
    track's replays (module docs, 1.): `centred` the log ratios replay / step less their median, times the
    step's share of their scatter; `offset` exp(that median); `scatter` the median |centred|; `n` the replays.

    Without enough second executions (fewer than FLOOR_MIN_REPLAYS on a path: `split` "even"), the path's
    replays are centred on the path's median and scaled by 1 / sqrt 2. With them (`split` "measured"), each kind
    of replay on the path (with prompt-cache copies or without: a copy on the bench writes fresh memory that the
    run's own copies do not, an offset and a noise of the replay's, docs/validation_sim.md §28) is centred on its
    own median and scaled by its own measured share (`step_share_kinds`); a kind with fewer than
    FLOOR_MIN_REPLAYS second executions takes the path's median and the share of the path's rows pooled
    (`step_share`). `n_again` the replays executed twice, `replay_vs_replay` the median |log(again / replay)|
    (NaN without). A path without replays takes the other's. None with fewer than FLOOR_MIN_REPLAYS replays in
    all.

    `scatter_of` "replay" (validate `--floor-scatter replay`): each path's log ratios centred on the path's median
    and not scaled, a replay's whole scatter against its step: what a simulator that prices each step by one
    replay of it would meet (track-mix prices a prompt step by its own replay; docs/validation_sim.md §30).
    `step_share` and `split` still say what the second executions measured."""
    if scatter_of not in FLOOR_SCATTERS:
        raise ValueError(f"scatter_of must be one of {', '.join(FLOOR_SCATTERS)}, got {scatter_of!r}")
    kinds = replay_kinds(track)
    ratios = {path: np.concatenate([kinds[(path, c)][0] for c in (False, True)]) for path in (True, False)}
    again = {path: np.concatenate([kinds[(path, c)][1] for c in (False, True)]) for path in (True, False)}
    n = {k: len(v) for k, v in ratios.items()}
    if n[True] + n[False] < FLOOR_MIN_REPLAYS:
        return None
    even = 1.0 / math.sqrt(2.0)
    centred, offset, scatter, share, split, vs, by_kind = {}, {}, {}, {}, {}, {}, {}
    for path in (True, False):
        if not n[path]:
            continue
        v, rows = ratios[path], again[path]
        med = float(np.median(v))
        measured = len(rows) >= FLOOR_MIN_REPLAYS
        share[path] = step_share(rows) if measured else even
        split[path] = "measured" if measured else "even"
        vs[path] = float(np.median(np.abs(rows[:, 2]))) if len(rows) else math.nan
        if measured:
            parts = []
            for copies in (False, True):
                kv, krows = kinds[(path, copies)]
                if not len(kv):
                    continue
                own = len(krows) >= FLOOR_MIN_REPLAYS
                k_share = step_share(krows) if own else share[path]
                by_kind[KIND_NAMES[(path, copies)]] = k_share
                parts.append((kv - (float(np.median(kv)) if own else med)) * k_share)
            centred[path] = np.concatenate(parts)
        else:
            centred[path] = (v - med) * even
        if scatter_of == "replay":
            centred[path] = v - med
        offset[path] = math.exp(med)
        scatter[path] = float(np.median(np.abs(centred[path])))
    for path in (True, False):                 # a path without replays takes the other's
        if not n[path]:
            other = not path
            for d in (centred, offset, scatter, share, split, vs):
                d[path] = d[other]
    return {"n": n, "centred": centred, "offset": offset, "scatter": scatter, "step_share": share, "split": split,
            "step_share_kinds": by_kind, "n_again": {k: len(v) for k, v in again.items()}, "replay_vs_replay": vs,
            "scatter_of": scatter_of}


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
                 seed: int = 0, target: float = FLOOR_TARGET, scatter_of: str = "step") -> dict[str, Any] | None:
    """validation.json's `repeat_floor` (see the module docs): None when the run has no step log with a clock or
    fewer than FLOOR_MIN_REPLAYS replays. A path without replays of its own takes the other path's scatter.
    `scatter_of`: as `one_execution`'s."""
    if steps is None or "clock_s" not in steps or not len(steps):
        return None
    one = one_execution(track, scatter_of)
    if one is None:
        return None
    n, centred, offset, scatter = one["n"], one["centred"], one["offset"], one["scatter"]
    by_name = {"prompt": True, "decode": False}
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
                "re-execution (the run's own replays, centred, times the step's share of their scatter: "
                "step_share, measured from second executions where split says so, else 1 / sqrt 2), the schedule "
                "fixed; median_abs, p90_abs: the median and 90th percentile over the draws of the |relative "
                "error|; within_target: the fraction of draws within the target; optimistic (independent draws "
                "per step); scatter_of replay: the replays' log ratios centred on their path's median and not "
                "scaled, the floor of a simulator that prices each step by one replay of it",
        "scatter_of": scatter_of,
        "n_replays": {"prompt": n[True], "decode": n[False]},
        "offset": {"prompt": offset[True], "decode": offset[False]},
        "scatter": {"prompt": scatter[True], "decode": scatter[False]},
        "step_share": {k: one["step_share"][p] for k, p in by_name.items()},
        "split": {k: one["split"][p] for k, p in by_name.items()},
        "step_share_kinds": dict(one["step_share_kinds"]),
        "n_again": {k: one["n_again"][p] for k, p in by_name.items()},
        "replay_vs_replay": {k: one["replay_vs_replay"][p] for k, p in by_name.items()},   # NaN: null on write
        "draws": int(draws), "seed": int(seed), "target": float(target),
        "aggregate": aggregate, "per_request": per_request,
    }


def dynamic_floor(simulate: Callable[[Any], pd.DataFrame],
                  score: Callable[[pd.DataFrame], tuple[Mapping[tuple[str, str], float], Mapping[str, Any]]],
                  latency: Any, track: Any, *, draws: int = DYNAMIC_DRAWS, seed: int = 0,
                  target: float = FLOOR_TARGET, progress: Callable[[], Any] | None = None,
                  scatter_of: str = "step") -> dict[str, Any] | None:
    """validation.json's `repeat_floor.dynamic` (module docs, "The schedule free"): the validation's simulation
    run `draws` more times, each with every step's time multiplied by a draw of one execution's scatter
    (`one_execution`, `sim.latency.JitteredLatency` over `latency`), and compared with the undisturbed simulation
    as validate compares the simulator with the real run.

    `simulate(latency)` runs the validation's simulation (its workload, arrivals and server) with that latency
    model and returns the requests; `score(requests)` compares them with the undisturbed run's and returns
    ({(metric, stat): relative error}, validate's per-request summary: `<metric>_median_ape`,
    `decision_match_rate`). `progress()` is called after each draw. `hits`: per draw, how many of the P50s and
    P90s met the target, and their median and 10th and 90th percentiles: the range a simulator exact to each
    step's expected time lands in on this host. None without enough replays or draws. `scatter_of`: as
    `one_execution`'s."""
    one = one_execution(track, scatter_of)
    if one is None or draws < 1:
        return None
    errs: dict[tuple[str, str], list[float]] = {(m, st): [] for m in FLOOR_METRICS for st in STATS}
    per: dict[str, list[float]] = {m: [] for m in FLOOR_METRICS}
    alike: list[float] = []
    hits: list[int] = []            # per draw: how many P50s and P90s (FLOOR_METRICS) met the target
    for i in range(draws):
        drawn = simulate(JitteredLatency(latency, one["centred"][True], one["centred"][False], seed=seed + i))
        agg, summary = score(drawn)
        for key, values in errs.items():
            values.append(abs(float(agg.get(key, math.nan))))
        for m, values in per.items():
            values.append(float(summary.get(f"{m}_median_ape", math.nan)))
        alike.append(float(summary.get("decision_match_rate", math.nan)))
        hits.append(hits_within(agg, target))
        if progress is not None:
            progress()
    aggregate = []
    for (m, stat), values in errs.items():
        v = np.asarray(values)
        v = v[np.isfinite(v)]
        if not v.size:
            continue
        aggregate.append({"metric": m, "stat": stat, "median_abs": float(np.median(v)),
                          "p90_abs": float(np.percentile(v, 90)), "within_target": float(np.mean(v <= target))})

    def median(values: list[float]) -> float:
        v = np.asarray(values)
        v = v[np.isfinite(v)]
        return float(np.median(v)) if v.size else math.nan

    return {
        "what": "the simulation run again `draws` times with every step's time multiplied by a draw of one "
                "execution's scatter (as the fixed floor draws), each time re-deciding what follows from the times "
                "(batches, slots, cached prefixes, a closed loop's arrivals), and compared with the undisturbed "
                "simulation as the simulator is with the real run; within_target: the fraction of draws within the "
                "target",
        "draws": int(draws), "seed": int(seed), "target": float(target), "scatter_of": scatter_of,
        "aggregate": aggregate, "per_request": {f"{m}_median_ape": median(v) for m, v in per.items()},
        "decision_match_rate": median(alike),
        "hits": {"of": 2 * len(FLOOR_METRICS), "per_draw": hits, "median": float(np.median(hits)),
                 "p10": float(np.percentile(hits, 10)), "p90": float(np.percentile(hits, 90))},
    }


def hits_within(rel_errors: Mapping[tuple[str, str], float], target: float = FLOOR_TARGET) -> int:
    """How many P50s and P90s of FLOOR_METRICS in {(metric, stat): relative error} are within `target` (a missing or
    NaN one is not)."""
    return sum(abs(float(rel_errors.get((m, st), math.nan))) <= target for m in FLOOR_METRICS for st in ("p50", "p90"))


def format_dynamic_floor(dyn: Mapping[str, Any]) -> str:
    """The dynamic floor for the terminal: per metric how often P50 / P90 met the target, per request, decisions."""
    agg = {(r["metric"], r["stat"]): r for r in dyn["aggregate"]}
    target = 100 * dyn["target"]
    parts = [f"{m.upper()} {100 * agg[(m, 'p50')]['within_target']:.0f}/{100 * agg[(m, 'p90')]['within_target']:.0f}%"
             for m in FLOOR_METRICS if (m, "p50") in agg and (m, "p90") in agg]
    per = dyn["per_request"]
    return (f"repeat floor, the schedule free ({dyn['draws']} re-simulations with that scatter): P50/P90 within "
            f"{target:g}% in " + ", ".join(parts) + " of the draws, expected "
            f"{floor_expected_hits(dyn):.1f} of {2 * len(parts)}; per request median "
            + ", ".join(f"{m.upper()} {100 * per[f'{m}_median_ape']:.1f}%" for m in FLOOR_METRICS
                        if math.isfinite(per.get(f"{m}_median_ape", math.nan)))
            + f"; decided alike {100 * dyn['decision_match_rate']:.0f}%" + _hits_text(dyn))


def _hits_text(dyn: Mapping[str, Any]) -> str:
    """The draws' range of P50s and P90s within the target, beside the simulator's own count when validate set it
    (`simulator_hits`); "" for a floor written before `hits`."""
    h = dyn.get("hits")
    if not h:
        return ""
    text = (f"; P50s and P90s within target per draw: median {h['median']:g} of {h['of']} "
            f"(10-90%: {h['p10']:g}-{h['p90']:g})")
    own = dyn.get("simulator_hits")
    if own is not None:
        where = ("within that range" if h["p10"] <= own <= h["p90"] else
                 "below that range" if own < h["p10"] else "above that range")
        text += f"; the simulator met {own}, {where}"
    return text


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
    split = floor.get("split", {})
    share = floor.get("step_share", {})
    kinds = floor.get("step_share_kinds", {})

    def path_share(path: str) -> str:
        if split[path] != "measured":
            return f"even {path}"
        own = [f"{v:.2f} {k.replace('_copies', ' with copies')}" for k, v in kinds.items() if k.startswith(path)]
        return ", ".join(own) if own else f"{share[path]:.2f} {path}"

    measured = (f", the step's share of a replay's scatter measured from second executions: "
                + " / ".join(path_share(k) for k in ("prompt", "decode"))
                if "measured" in split.values() else "")
    offset = floor.get("offset") or {}
    # the replays' median against their steps: the track-mix knots price the machine as the replays found it, so a
    # run whose prompt steps ran slower than their replays reads short in TTFT by about as much (over 40 held-out
    # runs, each run's median per-request TTFT error was 0.95 times its prompt offset, r = 0.79,
    # docs/validation_sim.md §30); within a run it is mostly the steps' own scatter, which the draws hold
    against = (f", replay / step x{offset['prompt']:.3f} prompt / x{offset['decode']:.3f} decode (median)"
               if "prompt" in offset and "decode" in offset else "")
    by_replay = floor.get("scatter_of") == "replay"
    whose = "a replay's whole scatter against its step" if by_replay else "one execution's scatter"
    who = "a simulator pricing each step by one replay of it" if by_replay else "an ideal simulator"
    return (f"repeat floor ({n['prompt']} + {n['decode']} replays, {whose} "
            f"{100 * floor['scatter']['prompt']:.1f}% prompt / {100 * floor['scatter']['decode']:.1f}% decode"
            f"{against}{measured}): {who}'s P50/P90 |err| in 9 of 10 draws within " + ", ".join(parts)
            + "; per request median " + ", ".join(f"{m.upper()} {100 * per[f'{m}_median_ape']:.1f}%"
                                                  for m in FLOOR_METRICS if f"{m}_median_ape" in per))
