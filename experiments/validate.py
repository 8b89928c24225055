"""`slotlab validate`: one workload on the real numpy engine and in the simulator, compared request by request
(how far the simulator's predicted latencies are from measured ones, and whether the core decided the same).

The real run is `slotlab replay` (measured step times); the simulated run uses the same server configuration
(the one the real run resolved, with the engine's KV bytes per token and end-of-generation tokens), the same
prompt token space and a latency model, normally `parametric:` a calibration from `slotlab calibrate`. The
serving core is the same, so any difference comes from timing: predicted vs measured step durations.

`--recorded TRACE` compares instead with a trace `slotlab record` wrote in front of any llama-server compatible
server: the recorded requests (their prompt ids, and their generated ids where the endpoint returns them)
are simulated with the given server flags and latency model, and compared with what the upstream measured
(`recorded_requests` says how each metric is read from the recorded timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from engine.core import PolicyNames, ServerConfig
from engine.model import load
from engine.model.heap import reserved_mib
from engine.model.tokenizer import ATTR_BYTE, ATTR_NORMAL, Tokenizer
from experiments.flags import (
    MEASURE_MEM_RESERVE,
    OPT_BY_DEST,
    VALIDATE,
    WORKLOAD_DESTS,
    UsageError,
    add_flags,
    flag_names,
    option_values,
    simulate_argv,
)
from experiments.calibrate import (
    MIX_BUDGET,
    InRunProbe,
    calibration_numerics,
    measure_probe,
    mix_predictions,
    probe_points,
    probe_predictions,
    replay_sampling,
)
from experiments.repeat_floor import (
    dynamic_floor,
    format_dynamic_floor,
    format_repeat_floor,
    hits_within,
    repeat_floor,
)
from experiments.replay import run_replay
from experiments.results import (
    LATENCY_METRICS,
    STATS,
    latency_stats,
    load_results,
    requests_frame,
    write_json,
    write_run,
)
from experiments.runs import follow, out_dir, reserve_heap, resolve_model, run_context, server_config
from experiments.speed_probe import (
    PROBE_FILE,
    SpeedProbe,
    TRACK_EVERY_S,
    SpeedTrack,
    calibration_probe,
    format_speed,
    geomean,
    grid_offset,
    mix_knots,
    probe_mismatch,
    read_run_probes,
    read_run_track,
    speed_report,
    speed_warnings,
    track_knots,
    track_span,
    write_run_probes,
    write_run_track,
)
from experiments.steplog import (
    KNOT_WINDOW_S,
    first_token_faults,
    format_step_errors,
    format_ttft_by_faults,
    has_run_clock,
    plot_step_ratio,
    predict_steps,
    read_steps,
    step_errors,
    step_knots,
    step_warnings,
    ttft_by_faults,
)
from experiments.workloads import build_workload
from sim.driver import Simulation
from sim.latency import ScaledLatency, TrackedLatency, unscaled
from sim.latency_spec import get_latency_model
from traces import Trace, read_trace
from traces.synthetic.chat import ChatWorkload

METRICS = LATENCY_METRICS
CORRECTIONS = ("probe", "grid", "track", "track-mix", "steps")   # --speed-correct values that change the step times
# fewer requests than this share decided alike (same slot, same cached prefix): the run's errors are as much the
# decisions' as the latency model's, and validate says so. Closed loops at 4-16 slots that drifted decided 42-47% alike
# (np4, evictions; per request up to 7.2%) where the runs that kept together decided 83-100% (docs/validation_sim.md §21)
DIVERGED_WARN = 0.8
MEASURED_CALIBRATION = Path(__file__).resolve().parents[1] / "sim" / "data" / "smollm2_numpy_2threads.json"
# the same grid measured in the ggml numerics (`slotlab calibrate --threads 2 --numerics ggml`): the default latency
# of `validate --numerics ggml`
MEASURED_CALIBRATION_GGML = MEASURED_CALIBRATION.with_name("smollm2_ggml_2threads.json")
FILES = {"per_request": "validation.csv", "errors": "errors.csv", "summary": "validation.json",
         "scatter": "sim_vs_real_scatter.png", "cdf": "sim_vs_real_cdf.png",
         "steps": "real_steps_ratio.png"}


# --- comparison ------------------------------------------------------------------------------------------


def compare_requests(real: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    """Per-request table (inner join on `request`): each metric real/sim, signed absolute error (sim − real,
    seconds) and signed relative error ((sim − real) / real; NaN when real is 0 or missing), and whether the
    core decided the same: same slot, same number of cached prompt tokens (`decision_match` = both)."""
    keep = ["request", "session_id", "turn", "n_prompt", "n_output", "arrival_s", "slot", "n_cached",
            "n_deferred", "finish"] + [f"{m}_s" for m in METRICS]
    r = real[[c for c in keep if c in real.columns]]
    s = sim[[c for c in keep if c in sim.columns]]
    j = r.merge(s, on="request", how="inner", suffixes=("_real", "_sim"), validate="one_to_one")
    out = pd.DataFrame({"request": j["request"]})
    for c in ("session_id", "turn"):
        if f"{c}_real" in j.columns:
            out[c] = j[f"{c}_real"]
    out["n_prompt_real"], out["n_prompt_sim"] = j["n_prompt_real"], j["n_prompt_sim"]
    out["n_output_real"], out["n_output_sim"] = j["n_output_real"], j["n_output_sim"]
    out["arrival_real_s"], out["arrival_sim_s"] = j["arrival_s_real"], j["arrival_s_sim"]
    for m in METRICS:
        rv = j[f"{m}_s_real"].astype("float64")
        sv = j[f"{m}_s_sim"].astype("float64")
        out[f"{m}_real_s"] = rv
        out[f"{m}_sim_s"] = sv
        out[f"{m}_abs_err_s"] = sv - rv
        with np.errstate(divide="ignore", invalid="ignore"):
            out[f"{m}_rel_err"] = ((sv - rv) / rv).where(rv != 0)
    for c in ("slot", "n_cached", "n_deferred"):
        out[f"{c}_real"], out[f"{c}_sim"] = j[f"{c}_real"], j[f"{c}_sim"]
    out["slot_match"] = (j["slot_real"] == j["slot_sim"]).astype(bool)
    out["n_cached_match"] = (j["n_cached_real"] == j["n_cached_sim"]).astype(bool)
    out["decision_match"] = out["slot_match"] & out["n_cached_match"]
    out["finish_real"], out["finish_sim"] = j["finish_real"], j["finish_sim"]
    return out.sort_values("request").reset_index(drop=True)


def aggregate_errors(real: pd.DataFrame, sim: pd.DataFrame) -> pd.DataFrame:
    """The aggregate table: for each metric and statistic (over finished requests of each run), the real and
    simulated value, their difference (sim − real, seconds) and relative error ((sim − real) / real)."""
    rows = []
    ok_r = real[real["finish"] != "error"]
    ok_s = sim[sim["finish"] != "error"]
    for m in METRICS:
        sr, ss = latency_stats(ok_r[f"{m}_s"]), latency_stats(ok_s[f"{m}_s"])
        for st in STATS:
            rv, sv = sr[st], ss[st]
            rel = (sv - rv) / rv if rv and math.isfinite(rv) else math.nan
            rows.append({"metric": m, "stat": st, "real_s": rv, "sim_s": sv, "abs_err_s": sv - rv, "rel_err": rel})
    return pd.DataFrame(rows)


def _ape_stats(per: pd.DataFrame, out: dict[str, Any]) -> None:
    """Median and mean |relative error| per metric of `per`'s rows into `out`."""
    for m in METRICS:
        ape = per[f"{m}_rel_err"].abs().to_numpy(dtype="float64", na_value=np.nan)
        ape = ape[np.isfinite(ape)]
        out[f"{m}_median_ape"] = float(np.median(ape)) if ape.size else math.nan
        out[f"{m}_mape"] = float(ape.mean()) if ape.size else math.nan


def per_request_summary(per: pd.DataFrame) -> dict[str, Any]:
    """Median and mean |relative error| per metric over the joined requests, and the decision-match rates;
    `decision_matched`: the same errors over the requests whose slot and cached prefix matched (where the
    timing model alone made the difference: a request with another cached prefix did other work)."""
    out: dict[str, Any] = {"n_requests": len(per)}
    _ape_stats(per, out)
    n = max(len(per), 1)
    out["slot_match_rate"] = float(per["slot_match"].sum() / n) if len(per) else math.nan
    out["n_cached_match_rate"] = float(per["n_cached_match"].sum() / n) if len(per) else math.nan
    out["decision_match_rate"] = float(per["decision_match"].sum() / n) if len(per) else math.nan
    out["n_prompt_equal"] = bool((per["n_prompt_real"] == per["n_prompt_sim"]).all())
    matched = per[per["decision_match"].astype(bool)]
    out["decision_matched"] = {"n_requests": len(matched)}
    _ape_stats(matched, out["decision_matched"])
    return out


def _pct(v: float) -> str:
    """A relative error as a signed percentage, "n/a" when it is not finite."""
    return f"{100 * v:+.1f}%" if math.isfinite(v) else "n/a"


def format_errors(errors: pd.DataFrame, summary: Mapping[str, Any]) -> str:
    """The aggregate table for the terminal, then the per-request errors and decision-match rates."""
    names = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "E2E", "queue": "queue"}
    lines = [f"{'metric':<7}{'stat':<6}{'real (s)':>11}{'sim (s)':>11}{'sim-real':>11} {'rel err':>9}"]
    for _, r in errors.iterrows():
        rel = _pct(r["rel_err"])
        lines.append(f"{names[r['metric']]:<7}{r['stat']:<6}{r['real_s']:>11.4g}{r['sim_s']:>11.4g}"
                     f"{r['abs_err_s']:>+11.3g} {rel:>9}")   # a space: errors of 1000%+ stay apart
    lines.append("per request |rel err|: " + ", ".join(
        f"{names[m]} median {100 * summary[f'{m}_median_ape']:.1f}% mean {100 * summary[f'{m}_mape']:.1f}%"
        for m in ("ttft", "tpot", "e2e")))
    arrivals = summary.get("arrivals") or {}
    pinned = (f" (arrivals pinned to the real run's: {arrivals['n_pinned']} turns)"
              if arrivals.get("mode") == "real" else "")
    lines.append(f"decisions: same slot {100 * summary['slot_match_rate']:.1f}%, same n_cached "
                 f"{100 * summary['n_cached_match_rate']:.1f}%, both {100 * summary['decision_match_rate']:.1f}% "
                 f"of {summary['n_requests']} requests{pinned}")
    matched = summary.get("decision_matched") or {}
    if matched.get("n_requests"):
        lines.append(f"over the {matched['n_requests']} requests with the same decisions, per request |rel err| "
                     "median: " + ", ".join(f"{names[m]} {100 * matched[f'{m}_median_ape']:.1f}%"
                                            for m in ("ttft", "tpot", "e2e")))
    return "\n".join(lines)


# --- plots -------------------------------------------------------------------------------------------------


def _plain_log_ticks(*axes: Any) -> None:
    """Log axes labelled with plain numbers (0.02, not 2x10^-2): powers of ten, and 2x / 5x of them."""
    from matplotlib.ticker import FuncFormatter

    for axis in axes:
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(FuncFormatter(_label_2_5))


def _label_2_5(value: float, _pos: Any) -> str:
    """Minor log ticks: label only 2x and 5x a power of ten."""
    if value <= 0:
        return ""
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return f"{value:g}" if round(mantissa) in (2, 5) and abs(mantissa - round(mantissa)) < 1e-6 else ""


def plot_scatter(per: pd.DataFrame, path: str | Path, title: str) -> Path:
    """Simulated vs measured TTFT and E2E per request (log-log) with the y = x line; decision mismatches marked."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5), layout="constrained")
    for ax, (m, name) in zip(fig.subplots(1, 2), (("ttft", "TTFT"), ("e2e", "E2E latency"))):
        x, y = per[f"{m}_real_s"].to_numpy(float), per[f"{m}_sim_s"].to_numpy(float)
        ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
        if ok.any():
            lo, hi = min(x[ok].min(), y[ok].min()) * 0.8, max(x[ok].max(), y[ok].max()) * 1.25
            ax.plot([lo, hi], [lo, hi], color="0.5", lw=1, ls="--", label="y = x")
            same = per["decision_match"].to_numpy(bool)
            ax.scatter(x[ok & same], y[ok & same], s=20, label="same slot and n_cached")
            if (ok & ~same).any():
                ax.scatter(x[ok & ~same], y[ok & ~same], s=26, marker="x", color="C3", label="decision differs")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlim(lo, hi)
            ax.set_ylim(lo, hi)
            _plain_log_ticks(ax.xaxis, ax.yaxis)
            ax.legend(loc="upper left", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(f"{name}, real engine (s, log scale)")
        ax.set_ylabel(f"{name}, simulator (s, log scale)")
        ax.set_title(f"{name} per request")
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_cdfs(real: pd.DataFrame, sim: pd.DataFrame, path: str | Path, title: str) -> Path:
    """Empirical CDFs of TTFT, TPOT and E2E, real and simulated overlaid (finished requests, log x)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4), layout="constrained")
    for ax, (m, name) in zip(fig.subplots(1, 3), (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E latency"))):
        drawn = False
        for df, label, style in ((real, "real engine", "-"), (sim, "simulator", "--")):
            v = df.loc[df["finish"] != "error", f"{m}_s"].to_numpy(dtype="float64", na_value=np.nan)
            v = np.sort(v[np.isfinite(v) & (v > 0)])
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", ls=style,
                        label=f"{label}: P50 {np.percentile(v, 50):.3g} s, P99 {np.percentile(v, 99):.3g} s")
                drawn = True
        if drawn:
            ax.set_xscale("log")
            _plain_log_ticks(ax.xaxis)
            ax.legend(loc="lower right", fontsize="small")
        ax.set_title(name)
        ax.set_xlabel(f"{name} (s, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)


# --- the simulated twin of a real run -----------------------------------------------------------------------


def server_config_from_json(data: Mapping[str, Any]):
    """The ServerConfig a results directory's config.json recorded (`server_config`)."""
    names = {f.name for f in fields(ServerConfig)}
    kw = {k: v for k, v in data.items() if k in names}
    kw["eog_ids"] = frozenset(kw.get("eog_ids") or ())
    kw["policies"] = PolicyNames(**kw.get("policies", {}))
    return ServerConfig(**kw)


def token_space_of(model_path: str) -> tuple[int, frozenset[int]]:
    """(vocabulary size, reserved ids) as `slotlab replay` builds its prompts: only normal and byte tokens."""
    tok = Tokenizer.from_gguf_path(model_path)
    reserved = frozenset(i for i, a in enumerate(tok.attrs) if not a & (ATTR_NORMAL | ATTR_BYTE))
    return tok.n_vocab, reserved


def twin_simulation(values: Mapping[str, Any], real_config: Mapping[str, Any], token_space: tuple[int, frozenset[int]],
                    latency: Any, progress: Any = None) -> Simulation:
    """The simulator set up as the real run's twin: the server configuration the real run resolved, the model's
    prompt token space (`token_space_of`), replies to their full length (`ignore_eos`), `latency` for the step
    times."""
    vocab_size, reserved = token_space
    return Simulation(server_config_from_json(real_config["server_config"]), latency, seed=values["seed"],
                      fast_forward=not values["no_fast_forward"], progress=progress, vocab_size=vocab_size,
                      reserved_tokens=reserved, task_defaults={"ignore_eos": True})


def run_sim_twin(values: Mapping[str, Any], workload: Any, real_config: Mapping[str, Any], model_path: str,
                 out_dir: str | Path, context: Mapping[str, Any], *, csv: bool, plots: bool,
                 progress: Any = None, latency: Any = None) -> dict[str, Any]:
    """Simulate `workload` with the server configuration the real run used; write its results directory.
    `latency`: a LatencyModel object to use instead of the `values["latency"]` spec."""
    if latency is None:
        latency = get_latency_model(values["latency"])
    cfg = server_config_from_json(real_config["server_config"])
    fast = not values["no_fast_forward"]
    result = twin_simulation(values, real_config, token_space_of(model_path), latency, progress).run(workload)
    config = {"slotlab_results": 1, **context, "label": "simulator", "rerun": shlex.join(simulate_argv(values)),
              "options": dict(values), "latency_spec": values["latency"], "server_config": cfg,
              "seed": values["seed"], "fast_forward": fast, "twin_of": "real engine run (same server_config)"}
    return write_run(out_dir, result, config, csv=csv, plots=plots, n_slots=cfg.resolve().n_slots)


def rel_errors(errors: pd.DataFrame) -> dict[tuple[str, str], float]:
    """An `aggregate_errors` table as {(metric, stat): relative error}."""
    return {(r.metric, r.stat): r.rel_err for r in errors.itertuples()}


def run_dynamic_floor(values: Mapping[str, Any], workload: Any, real_config: Mapping[str, Any], model_path: str,
                      latency: Any, reference: pd.DataFrame, track: Any, draws: int,
                      progress: Callable[[], Any] | None = None, scatter_of: str = "step") -> dict[str, Any] | None:
    """validation.json's `repeat_floor.dynamic` (`experiments.repeat_floor.dynamic_floor`): the twin simulation of
    `workload` (its arrivals as simulated: pinned ones included) run again `draws` times under `latency` jittered
    by the real run's replay scatter, each compared with `reference`, the undisturbed simulation's requests, as
    the simulator is compared with the real run."""
    space = token_space_of(model_path)

    def simulate(jittered: Any) -> pd.DataFrame:
        return requests_frame(twin_simulation(values, real_config, space, jittered).run(workload).requests)

    def score(drawn: pd.DataFrame) -> tuple[dict[tuple[str, str], float], dict[str, Any]]:
        return rel_errors(aggregate_errors(reference, drawn)), per_request_summary(compare_requests(reference, drawn))

    return dynamic_floor(simulate, score, latency, track, draws=draws, progress=progress, scatter_of=scatter_of)


# --- command line ----------------------------------------------------------------------------------------

VALIDATE_EPILOG = """examples:
  slotlab calibrate --threads 2 --out cal.json
  slotlab validate --latency parametric:cal.json --speed-correct track-mix --users 10 --turns 3 -np 4 -c 8192
      a calibration of this machine, then closed-loop chat sessions (prompt-cache reuse) on SmolLM2 and in the
      simulator, which follows the machine's speed through the run's own steps replayed; validation.csv,
      errors.csv, validation.json, plots (docs/validation_sim.md, "Where it stands")
  slotlab validate --workload poisson --rate 0.2 --requests 30 --prompt-tokens 50-400 --output-tokens 16-64 \\
      -np 4 -c 4096 --threads 2 --out results/val1
      30 open-loop requests; default latency: the shipped SmolLM2 calibration of the run's numerics
"""


def add_validate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `slotlab validate` subcommand: `simulate`'s workload, server and policy options, plus the real
    engine's (-m, --threads, --temp) and output options."""
    p = subparsers.add_parser(
        VALIDATE, help="run one workload on the real engine and in the simulator, compare per request",
        allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=VALIDATE_EPILOG,
        description="Run a workload on the numpy engine (`slotlab replay`) and in the simulator with the same\n"
                    "server configuration and a calibrated latency model (--latency parametric:FILE); write\n"
                    "both results directories (real/, sim/) under --out, then validation.csv (per request:\n"
                    "TTFT/TPOT/E2E/queue real, sim, errors; same slot, same n_cached), errors.csv (P50/P90/\n"
                    "P99/mean real vs sim), validation.json and plots.")
    # the default latency: the shipped calibration (run_validate takes the ggml one for a ggml run)
    defaults = {"mem_reserve": MEASURE_MEM_RESERVE}
    if MEASURED_CALIBRATION.is_file():
        defaults["latency"] = (
            f"parametric:{MEASURED_CALIBRATION}",
            f"the shipped calibration of the run's numerics, parametric:sim/data/{MEASURED_CALIBRATION_GGML.name} for "
            f"ggml, parametric:sim/data/{MEASURED_CALIBRATION.name} for f32 and q")
    add_flags(p, VALIDATE, defaults=defaults)
    p.set_defaults(func=run_validate)
    return p


def divergence_warning(match_rate: float, closed_loop: bool, arrivals: str, real_dir: str | Path) -> str | None:
    """The warning for a run whose simulation decided fewer than DIVERGED_WARN of its requests as the real run did
    (`decision_match_rate`), None otherwise; for a closed-loop chat simulated in its own loop, how to pin its turns
    to the real run's arrivals instead."""
    if not math.isfinite(match_rate) or match_rate >= DIVERGED_WARN:
        return None
    text = (f"only {100 * match_rate:.0f}% of the requests were decided alike (same slot and cached prompt prefix) "
            "in the simulation and the real run: this run's errors mix the latency model's with different decisions")
    if closed_loop and arrivals == "loop":
        text += ("; the simulated chat's turns followed its own replies and drifted from the real run's (a turn "
                 "that arrives earlier or later meets other slots and cache entries): rerun with `--real-run "
                 f"{real_dir} --arrivals real` to re-simulate this run with every turn pinned to its real arrival")
    return text


def pin_arrivals(workload: Any, real_requests: pd.DataFrame) -> tuple[Any, int]:
    """(`workload` with every chat turn after the first sent when the real run's request of that session and
    turn arrived (`Turn.send_at_s`; the simulator still waits for the simulated previous reply), how many turns
    were pinned). An open-loop workload, whose arrivals are its own in both runs, comes back unchanged (0).
    A turn the real run never sent (its session ended early) keeps its think time."""
    if not isinstance(workload, ChatWorkload):
        return workload, 0
    at = {(str(s), int(t)): float(a) for s, t, a in
          zip(real_requests["session_id"], real_requests["turn"], real_requests["arrival_s"])}
    sessions, n = [], 0
    for sess in workload.sessions:
        turns = []
        for k, turn in enumerate(sess.turns):
            when = at.get((sess.session_id, k)) if k > 0 else None
            if when is not None and math.isfinite(when):
                turn = dataclasses.replace(turn, send_at_s=when)
                n += 1
            turns.append(turn)
        sessions.append(dataclasses.replace(sess, turns=tuple(turns)))
    return dataclasses.replace(workload, sessions=tuple(sessions)), n


def _validate_argv(values: Mapping[str, Any], model: str, threads: int, temp: float,
                   speed_correct: str = "off", probe_every: float = TRACK_EVERY_S, numerics: str = "f32",
                   arrivals: str = "loop", knot_window: float = KNOT_WINDOW_S,
                   replay_decode: float = MIX_BUDGET, replay_again: bool = False) -> list[str]:
    correct = [] if speed_correct == "off" else ["--speed-correct", speed_correct]
    correct += [] if knot_window == KNOT_WINDOW_S else ["--knot-window", f"{knot_window:g}"]
    correct += [] if arrivals == "loop" else ["--arrivals", arrivals]
    every = [] if probe_every == TRACK_EVERY_S else ["--probe-every", f"{probe_every:g}"]
    every += [] if replay_decode == MIX_BUDGET else ["--replay-decode", f"{replay_decode:g}"]
    every += ["--replay-again"] if replay_again else []
    num = ["--numerics", numerics]
    return ["validate", *simulate_argv(values)[2:], "-m", model, "--threads", str(threads), "--temp", str(temp),
            *num, *correct, *every]


def _options_key(argv: list[str]) -> list[str]:
    """A run's option tokens without the ones that do not change the real run (latency model, knot window,
    fast-forward)."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok in ("--latency", "--knot-window"):
            skip = True
        elif not tok.startswith(("--latency=", "--knot-window=")) and tok != "--no-fast-forward":
            out.append(tok)
    return out


def check_same_run(real: Any, values: Mapping[str, Any], model: str, numerics: str = "f32") -> None:
    """ValueError unless results directory `real` is a replay of these options (workload, server, policies)
    on this model in this numerics (runs that record none ran f32): `--real-run` must not compare a simulation
    with a different experiment."""
    rerun = str(real.config.get("rerun", ""))
    if real.config.get("backend") != "numpy" or not rerun.startswith("slotlab replay"):
        raise ValueError(f"{real.path}: not a real-engine run (slotlab replay / validate real/)")
    theirs = _options_key(shlex.split(rerun)[2:])
    mine = _options_key(simulate_argv(values)[2:])
    if theirs != mine:
        raise ValueError(f"{real.path} ran different options: {' '.join(theirs)!r}, here: {' '.join(mine)!r}")
    if Path(str(real.config.get("model"))).resolve() != Path(model).resolve():
        raise ValueError(f"{real.path} ran model {real.config.get('model')}, here: {model}")
    if real.config.get("numerics", "f32") != numerics:
        raise ValueError(f"{real.path} ran numerics {real.config.get('numerics')}, here: {numerics} (--numerics)")


def calibration_mismatch(latency: Any, model: str, threads: int, numerics: str = "f32", *,
                         mem_reserve_mib: int | None = None) -> str | None:
    """Why `latency`'s calibration does not describe this run (another model file, thread count or numerics; a
    heap reserve, `--mem-reserve`, on in one and off in the other when both are known), or None. The
    calibration's numerics are read as `calibrate --refit` reads them (`calibration_numerics`): a file of this
    engine that names none was measured in f32; one not measured on this engine has none to compare.

    The simulator then predicts another setup's step times, and sim-vs-real errors mostly measure that."""
    measured = getattr(latency, "measured_on", None)
    if measured is None:
        return None
    differences = []
    if measured.model and Path(measured.model).name != Path(model).name:
        differences.append(f"model {Path(measured.model).name} (this run: {Path(model).name})")
    if measured.threads is not None and measured.threads != threads:
        differences.append(f"{measured.threads} thread{'s' if measured.threads != 1 else ''} (this run: {threads})")
    engine = str(getattr(measured, "engine", "") or "")
    cal_numerics = calibration_numerics(engine)
    if cal_numerics is not None and cal_numerics != numerics:
        differences.append(f"numerics {cal_numerics} (this run: {numerics})")
    cal_reserve = getattr(measured, "mem_reserve_mib", None)
    if cal_reserve is not None and mem_reserve_mib is not None and (cal_reserve > 0) != (mem_reserve_mib > 0):
        differences.append(f"--mem-reserve {cal_reserve} (this run: {mem_reserve_mib}; a save into memory new to "
                           f"the process costs several times one into memory it has)")
    layout = getattr(latency, "layout", None)
    if not differences and cal_numerics == "ggml" and layout is not None and not layout.attend_by_token:
        return (f"the latency model's file ({getattr(latency, 'source', None) or 'calibration'}) was fitted before "
                f"the physical and table models priced the ggml kernels' attention as they lay it out; refit it "
                f"(nothing runs) with `slotlab calibrate --refit FILE --out new.json` and pass "
                f"`--latency parametric:new.json`")
    if not differences:
        return None
    return (f"the latency model was calibrated with {' and '.join(differences)}; sim-vs-real errors will mostly "
            f"measure that difference. Calibrate this setup with `slotlab calibrate -m {model} --threads {threads} "
            f"--numerics {numerics}{'' if mem_reserve_mib is None else f' --mem-reserve {mem_reserve_mib}'} "
            f"--out cal.json` and pass `--latency parametric:cal.json`")


# --- a recorded trace (slotlab record) as the real run -----------------------------------------------------


def recorded_requests(trace: Trace) -> pd.DataFrame:
    """The per-request table of a recorded trace, in the columns of a results directory's requests.

    From the proxy's clock: `arrival_s`, `e2e_s` = recorded end − arrival (the client's view: queueing, prompt,
    generation and HTTP). From the upstream's `timings`: `tpot_s` = predicted_ms / (predicted_n − 1),
    `ttft_s` = e2e − predicted_ms (everything before the first token: HTTP, queue, prompt), `queue_s` = ttft −
    prompt_ms; `n_cached` = cache_n; `slot` = the response's id_slot (NaN for OpenAI endpoints, which do not
    report it); `finish` = its stop_type (native) or finish_reason (OpenAI)."""
    rows = []
    nan = math.nan
    for r in trace:
        rec = r.recorded or {}
        t = rec.get("timings") or {}
        end = rec.get("end_s")
        e2e = end - r.arrival_s if end is not None else nan
        pred_ms, pred_n, prompt_ms = t.get("predicted_ms"), t.get("predicted_n"), t.get("prompt_ms")
        ttft = e2e - pred_ms / 1e3 if pred_ms is not None and pred_n else nan
        slot = rec.get("id_slot")
        rows.append({
            "request": r.index, "session_id": r.session_id, "turn": 0, "arrival_s": r.arrival_s,
            "n_prompt": r.n_prompt, "n_output": t.get("predicted_n", r.n_output),
            "slot": slot if slot is not None and slot >= 0 else nan,
            "n_cached": rec.get("n_cached", t.get("cache_n", nan)), "n_deferred": nan,
            "finish": rec.get("stop_type") or "unknown",
            "ttft_s": ttft,
            "tpot_s": pred_ms / 1e3 / (pred_n - 1) if pred_ms is not None and pred_n and pred_n > 1 else nan,
            "e2e_s": e2e,
            "queue_s": ttft - prompt_ms / 1e3 if prompt_ms is not None and math.isfinite(ttft) else nan,
            "output_ids": r.output_tokens is not None,
        })
    return pd.DataFrame(rows)


def recorded_eog_ids(trace: Trace) -> frozenset[int]:
    """End-of-generation ids seen in the recording: the last generated id of every request that stopped on EOS."""
    return frozenset(r.output_tokens[-1] for r in trace
                     if r.output_tokens and (r.recorded or {}).get("stop_type") == "eos")


def load_recorded(path: str) -> Trace:
    trace = read_trace(path, format="native")
    if not any(r.recorded for r in trace):
        raise ValueError(f"{path}: no recorded requests (a trace written by `slotlab record` has a 'recorded' "
                         "object on each line)")
    return trace


def run_validate_recorded(args: argparse.Namespace, values: dict[str, Any]) -> int:
    """`slotlab validate --recorded TRACE`: simulate the recorded requests, compare with the recorded timings."""
    try:
        given = [d for d in WORKLOAD_DESTS if values.get(d) != OPT_BY_DEST[d].default]
        if given:
            raise UsageError(f"--recorded replaces the workload: drop {flag_names(given)}")
        if args.real_run:
            raise UsageError("--recorded and --real-run are two different real runs: give one")
        if args.speed_correct != "off":
            raise UsageError("--speed-correct measures this machine around a real engine run; a recorded "
                             "trace has none: drop it (or use --latency scaled:FACTOR:SPEC)")
        if args.noise_floor:
            raise UsageError("--noise-floor compares two real engine runs of a generated workload or trace; a "
                             "recorded trace is one upstream run: drop it")
        if args.arrivals != "loop":
            raise UsageError("--arrivals real pins a chat's turns to a real engine run's arrivals; a recorded "
                             "trace is replayed at its own recorded arrival times already: drop it")
        trace = load_recorded(args.recorded)
        latency = get_latency_model(values["latency"])
        cfg = server_config(values, latency)
        eog = recorded_eog_ids(trace)
        cfg = dataclasses.replace(cfg, eog_ids=frozenset(cfg.eog_ids) | eog)
        out = out_dir(args, VALIDATE)
    except (UsageError, ValueError, OSError) as exc:
        print(f"slotlab validate: error: {exc}", file=sys.stderr)
        return 2
    argv = ["validate", "--recorded", str(Path(args.recorded).resolve()), *simulate_argv(values)[2:]]
    desc = {"kind": "recorded", "trace": str(args.recorded), "n_requests": len(trace),
            "n_with_output_ids": sum(1 for r in trace if r.output_tokens is not None)}
    context = run_context(argv, desc)
    load_start = os.getloadavg()
    fast = not values["no_fast_forward"]
    with tqdm(total=len(trace), unit="req", desc="validate: sim", file=sys.stderr, leave=False,
              disable=args.quiet) as b:
        sim = Simulation(cfg, latency, seed=values["seed"], fast_forward=fast, progress=follow(b))
        result = sim.run(trace)
    config = {"slotlab_results": 1, **context, "label": "simulator", "rerun": shlex.join(["slotlab", *argv]),
              "options": dict(values), "latency_spec": values["latency"], "server_config": cfg,
              "seed": values["seed"], "fast_forward": fast, "twin_of": f"recorded trace {args.recorded}"}
    write_run(out / "sim", result, config, csv=args.csv, plots=not args.no_plots, n_slots=cfg.resolve().n_slots)
    simres = load_results(out / "sim")
    real = recorded_requests(trace)
    per = compare_requests(real, simres.requests)
    errors = aggregate_errors(real, simres.requests)
    summary = per_request_summary(per)
    known = per["slot_real"].notna()
    summary["slot_known"] = int(known.sum())
    if not known.all():       # OpenAI endpoints do not report the slot: rates over the requests that did
        summary["slot_match_rate"] = float(per.loc[known, "slot_match"].mean()) if known.any() else math.nan
        summary["decision_match_rate"] = (float(per.loc[known, "decision_match"].mean()) if known.any()
                                          else summary["n_cached_match_rate"])
    summary.update(
        recorded=str(args.recorded), recorded_source=trace.source, n_with_output_ids=desc["n_with_output_ids"],
        eog_ids_from_trace=sorted(eog), latency=values["latency"], latency_model=latency.describe(),
        load_average_start=list(load_start), load_average_end=list(os.getloadavg()), sim_dir=str(out / "sim"),
        sim_steps=simres.run.get("steps"), command=context["command"])
    title = f"recorded {Path(args.recorded).name} vs {latency.describe().get('kind')} latency ({len(per)} requests)"
    _write_comparison(out, per, errors, summary, real, simres.requests, None if args.no_plots else title)
    if args.quiet:
        _print_quiet(errors, summary, out, "recorded requests")
    else:
        print(format_errors(errors, summary).replace("real (s)", "rec (s)").replace("sim-real", "sim-rec"))
        print(f"recorded {len(trace)} requests ({desc['n_with_output_ids']} with output ids, slot known for "
              f"{summary['slot_known']}); load average {load_start[0]:.2f} -> {summary['load_average_end'][0]:.2f}; "
              f"latency {values['latency']}")
        print(f"results: {out}/  (sim/, {FILES['per_request']}, {FILES['errors']}, {FILES['summary']})")
    return 0


def run_validate(args: argparse.Namespace, *, speed_probe: Callable[[Any], SpeedProbe] | None = None) -> int:
    """`slotlab validate`; returns the exit code (2 = bad usage or input). `speed_probe(model)` measures the
    speed probe on the loaded engine model immediately before and after the real run (default: calibrate's
    `measure_probe` with replay's sampling)."""
    values = option_values(args)
    if args.recorded:
        return run_validate_recorded(args, values)
    if (args.numerics == "ggml" and values["latency"] == f"parametric:{MEASURED_CALIBRATION}"
            and MEASURED_CALIBRATION_GGML.is_file()):
        values["latency"] = f"parametric:{MEASURED_CALIBRATION_GGML}"     # the default latency, of this mode
    correct = args.speed_correct in CORRECTIONS
    try:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        if not (math.isfinite(args.probe_every) and args.probe_every >= 0):
            raise ValueError(f"--probe-every must be a number of seconds >= 0 (0 = off), got {args.probe_every}")
        if not 0 <= args.replay_decode <= 1:
            raise ValueError(f"--replay-decode must be a fraction of the decode step time in [0, 1], got "
                             f"{args.replay_decode}")
        if args.replay_again and args.probe_every == 0 and not args.real_run:
            raise ValueError("--replay-again executes the in-run probe's replays a second time: it needs the "
                             "probe (--probe-every > 0)")
        if args.floor_draws < 0:
            raise ValueError(f"--floor-draws must be a number of re-simulations >= 0 (0 = off), got {args.floor_draws}")
        if not (math.isfinite(args.knot_window) and args.knot_window > 0):
            raise ValueError(f"--knot-window must be a number of seconds > 0, got {args.knot_window}")
        model = resolve_model(args.model)
        workload, desc = build_workload(values)
        latency = get_latency_model(values["latency"])
        server_config({**values, "kv_bytes_per_token": None})
        cal_probe = calibration_probe_of(latency)
        reused = run_probes = track = None
        if args.real_run:
            reused = load_results(args.real_run)
            check_same_run(reused, values, model, args.numerics)
            run_probes = read_run_probes(reused.path)
            track = read_run_track(reused.path)
        floor_run = None
        if args.noise_floor:
            if args.real_run and Path(args.noise_floor).resolve() == Path(args.real_run).resolve():
                raise UsageError(f"--noise-floor is the run --real-run reuses ({args.real_run}): give another "
                                 "real run of the same workload")
            floor_run = load_results(args.noise_floor)
            try:
                check_same_run(floor_run, values, model, args.numerics)
            except ValueError as exc:
                raise ValueError(f"--noise-floor {args.noise_floor}: {exc}") from exc
        if correct:
            check_speed_correction(values["latency"], cal_probe, model, args.threads, reused, run_probes,
                                   args.speed_correct, args.probe_every, track)
        if reused is None:
            reserve_heap(args.mem_reserve, VALIDATE)
        out = out_dir(args, VALIDATE)
    except (UsageError, ValueError, OSError) as exc:
        print(f"slotlab validate: error: {exc}", file=sys.stderr)
        return 2
    mismatch = calibration_mismatch(latency, model, args.threads, args.numerics,
                                    mem_reserve_mib=reserved_mib() if reused is None else
                                    reused.config.get("mem_reserve_mib"))
    if mismatch:
        print(f"slotlab validate: warning: {mismatch}", file=sys.stderr)
    if getattr(latency, "load_moved", None):
        print(f"slotlab validate: warning: the machine's load moved while {values['latency']} was calibrated "
              f"(load_moved in the file): its step times mix loads", file=sys.stderr)
    argv = _validate_argv(values, model, args.threads, args.temp, args.speed_correct, args.probe_every,
                          args.numerics, args.arrivals, args.knot_window, args.replay_decode, args.replay_again)
    context = run_context(argv, desc)
    load_start = os.getloadavg()

    def bar(name: str):
        return tqdm(total=desc.get("n_requests"), unit="req", desc=f"validate: {name}", file=sys.stderr,
                    leave=False, disable=args.quiet)

    if reused is None:
        loaded = load(model, n_threads=args.threads, numerics=args.numerics)
        if speed_probe is None:
            def speed_probe(m: Any) -> SpeedProbe:
                return measure_probe(m, replay_sampling(m, args.temp, values["seed"]), seed=values["seed"])
        before = speed_probe(loaded)                  # immediately before and after the real run, same engine
        in_run = (InRunProbe(loaded, replay_sampling(loaded, args.temp, values["seed"]), args.probe_every,
                             seed=values["seed"], budget=args.replay_decode, again=args.replay_again)
                  if args.probe_every > 0 else None)
        with bar("real") as b:
            run_replay(values, workload, model, args.threads, args.temp, str(out / "real"), context,
                       csv=args.csv, plots=not args.no_plots, progress=follow(b), loaded=loaded, probe=in_run,
                       numerics=args.numerics)
        after = speed_probe(loaded)
        write_run_probes(out / "real", before, after)
        run_probes = (before, after)
        if in_run is not None:
            track = in_run.track()
            write_run_track(out / "real", track)
        del loaded, in_run
        real = load_results(out / "real")
    else:
        real = reused
    load_mid = os.getloadavg()
    steps = read_steps(real.path)
    knots_of_steps = None
    if args.speed_correct == "steps":
        try:
            knots_of_steps = step_knots(steps, latency, args.knot_window)
        except ValueError as exc:
            print(f"slotlab validate: error: --speed-correct steps: {real.path}: {exc}", file=sys.stderr)
            return 2
    speed, sim_latency = speed_correction(
        cal_probe, run_probes, model, args.threads, args.speed_correct, latency, track=track,
        end_clock_s=real.summary.get("sim_s") or 0.0,
        kv_bytes_per_token=int((real.config.get("server_config") or {}).get("kv_bytes_per_token") or 0),
        knots_of_steps=knots_of_steps, knot_window_s=args.knot_window)
    speed["run_probes"] = ("measured with this real run" if reused is None else
                           f"stored with the real run ({PROBE_FILE})" if run_probes else None)
    for warning in speed_warnings(speed, values["latency"], args.speed_correct, speed["factor"], real.path):
        print(f"slotlab validate: warning: {warning}", file=sys.stderr)
    n_pinned = 0
    if args.arrivals == "real":
        workload, n_pinned = pin_arrivals(workload, real.requests)
    with bar("sim") as b:
        run_sim_twin(values, workload, real.config, model, out / "sim", context, csv=args.csv,
                     plots=not args.no_plots, progress=follow(b), latency=sim_latency)
    sim = load_results(out / "sim")
    per = compare_requests(real.requests, sim.requests)
    if steps is not None:           # each request's TTFT beside the page faults of the steps its first token took
        per["ttft_faults_real"] = per["request"].map(first_token_faults(steps, real.requests))
    errors = aggregate_errors(real.requests, sim.requests)
    summary = per_request_summary(per)
    summary.update(
        model=model, threads=real.config.get("threads"), latency=values["latency"],
        latency_model=sim_latency.describe(), latency_mismatch=mismatch, load_average_start=list(load_start),
        load_average_after_real=list(load_mid), load_average_end=list(os.getloadavg()), real_dir=str(real.path),
        real_reused=reused is not None, sim_dir=str(out / "sim"), real_sim_s=real.summary.get("sim_s"),
        sim_sim_s=sim.summary.get("sim_s"), real_steps=real.run.get("steps"), sim_steps=sim.run.get("steps"),
        command=context["command"], speed_probe=speed,
        arrivals={"mode": args.arrivals, "n_pinned": n_pinned,
                  "definition": "loop: the simulated chat turns follow the simulated replies (closed loop, as the "
                                "real run); real: turns after the first arrive when they did in the real run, "
                                "or when the simulated previous reply ends if later"})
    scaled = f" {factor_text(speed)}" if correct else ""
    title = (f"{Path(model).name}, {summary['threads']} threads vs {latency.describe().get('kind')}{scaled} latency "
             f"({summary['n_requests']} requests)")
    summary["calibration_error"] = calibration_error(latency)
    if floor_run is not None:
        summary["noise_floor"] = noise_floor(real, floor_run)
    summary["repeat_floor"] = repeat_floor(steps, real.requests, track, scatter_of=args.floor_scatter)
    if summary["repeat_floor"] is not None and args.floor_draws > 0:
        with tqdm(total=args.floor_draws, unit="draw", desc="validate: repeat floor", file=sys.stderr, leave=False,
                  disable=args.quiet) as b:
            dyn = summary["repeat_floor"]["dynamic"] = run_dynamic_floor(
                values, workload, real.config, model, sim_latency, sim.requests, track, args.floor_draws, b.update,
                scatter_of=args.floor_scatter)
        if dyn is not None:       # the simulator's own count, beside the draws' range
            dyn["simulator_hits"] = hits_within(rel_errors(errors), dyn["target"])
    step_report = None
    if steps is not None:
        predicted = predict_steps(steps, sim_latency)
        summary["real_step_errors"] = step_report = step_errors(steps, sim_latency, predicted=predicted)
        summary["ttft_by_faults"] = ttft_by_faults(per)
        for warning in step_warnings(step_report):
            print(f"slotlab validate: warning: {warning}", file=sys.stderr)
        if not args.no_plots:
            # the probe's knots beside the ratio to the model as it is: not to a model that already follows them
            knots = speed.get("track") if speed.get("correct") not in ("track", "track-mix", "steps") else None
            plot_step_ratio(steps, predicted, out / FILES["steps"], title, probe=knots)
    closed_loop = isinstance(workload, ChatWorkload) and any(len(sess.turns) > 1 for sess in workload.sessions)
    diverged = divergence_warning(summary["decision_match_rate"], closed_loop, args.arrivals, real.path)
    if diverged:
        print(f"slotlab validate: warning: {diverged}", file=sys.stderr)
    _write_comparison(out, per, errors, summary, real.requests, sim.requests, None if args.no_plots else title)
    if args.quiet:
        _print_quiet(errors, summary, out, "requests")
    else:
        print(format_errors(errors, summary))
        if step_report is not None:
            print(format_step_errors(step_report))
            by_faults = format_ttft_by_faults(summary.get("ttft_by_faults"))
            if by_faults:
                print(by_faults)
        cal = summary["calibration_error"]
        if cal and "in_sample" in cal:
            held = cal.get("held_out_shape")
            print(f"calibration's own error ({cal['model']} model, over its grid's steps): MAPE in sample "
                  f"{100 * cal['in_sample']['mape']:.1f}%"
                  + (f", held-out shape {100 * held['mape']:.1f}% (median {100 * held['median_ape']:.1f}%)"
                     if held else ""))
        print(format_speed(speed, speed["factor"]))
        if floor_run is not None:
            print(format_noise_floor(summary["noise_floor"]))
        if summary["repeat_floor"] is not None:
            print(format_repeat_floor(summary["repeat_floor"]))
            if summary["repeat_floor"].get("dynamic"):
                print(format_dynamic_floor(summary["repeat_floor"]["dynamic"]))
        print(f"threads {summary['threads']}, load average {load_start[0]:.2f} -> {summary['load_average_end'][0]:.2f}"
              f"; latency {values['latency']}")
        where = "real/" if reused is None else f"real: {real.path}"
        print(f"results: {out}/  ({where}, sim/, "
              f"{FILES['per_request']}, {FILES['errors']}, {FILES['summary']})")
    return 0


# --- the noise floor: two real runs -------------------------------------------------------------------------


def noise_floor(real: Any, other: Any) -> dict[str, Any]:
    """validation.json's `noise_floor`: this run's real results against another real run of the same workload
    (`other`, checked by `check_same_run`), compared as sim and real are (`compare_requests`, `other` in the
    sim's place): per request (median and mean |rel err|, decision-match rates) and aggregate (P50/P90/P99/mean
    relative differences)."""
    per = compare_requests(real.requests, other.requests)
    agg = aggregate_errors(real.requests, other.requests)
    return {"real_dir": str(other.path), "what": "another real run of the same workload compared with this "
            "one as the simulator is (its values in the sim's place)",
            "per_request": per_request_summary(per),
            "aggregate": [{"metric": r["metric"], "stat": r["stat"], "rel_err": r["rel_err"]}
                          for _, r in agg.iterrows()]}


def format_noise_floor(floor: Mapping[str, Any]) -> str:
    per = floor["per_request"]
    agg = {(r["metric"], r["stat"]): r["rel_err"] for r in floor["aggregate"]}
    return ("noise floor (two real runs of this workload, " + floor["real_dir"] + "): per request median |diff| "
            + ", ".join(f"{m.upper()} {100 * per[f'{m}_median_ape']:.1f}%" for m in ("ttft", "tpot", "e2e"))
            + "; P50/P90 " + ", ".join(f"{m.upper()} {_pct(agg[(m, 'p50')])}/{_pct(agg[(m, 'p90')])}"
                                       for m in ("ttft", "tpot", "e2e"))
            + f"; same decisions {100 * per['decision_match_rate']:.0f}%")


# --- the speed probe ---------------------------------------------------------------------------------------


def calibration_probe_of(latency: Any) -> SpeedProbe | None:
    """The speed probe of the calibration file `latency` was read from (under any ScaledLatency); None for a
    model not read from a file, or a file written before the probe."""
    source = unscaled(latency).describe().get("source")
    return calibration_probe(source) if source else None


def probe_unusable(cal_probe: SpeedProbe, run_probes: tuple[SpeedProbe, SpeedProbe] | None, model: str,
                   threads: int) -> str | None:
    """Why the calibration's probe cannot be compared with the run's (another model or thread count, no shape
    in common), or None. Without the run's probes: with what this run would measure (`probe_points`)."""
    if run_probes:
        why = probe_mismatch(cal_probe, run_probes[0].model, run_probes[0].threads or threads)
        shapes = set(run_probes[0].medians_s)
    else:
        why = probe_mismatch(cal_probe, model, threads)
        shapes = {p.label for p in probe_points()}
    if why is None and not shapes & set(cal_probe.medians_s):
        why = (f"speed probe has no shape in common with this run's (calibration: "
               f"{', '.join(cal_probe.medians_s)}; run: {', '.join(sorted(shapes))})")
    return why


def check_speed_correction(spec: str, cal_probe: SpeedProbe | None, model: str, threads: int, reused: Any,
                           run_probes: tuple[SpeedProbe, SpeedProbe] | None, correct: str = "probe",
                           probe_every: float = TRACK_EVERY_S, track: SpeedTrack | None = None) -> None:
    """UsageError unless `--speed-correct probe|grid|track|track-mix|steps` has what it needs, checked before
    the engine runs: (probe, grid) a calibration with a probe comparable with this run's and (grid) the grid's
    own medians of the probe's shapes; (all but steps) with --real-run, probes stored with the run. track and
    track-mix compare the run's probe passes with the latency model's own times of the same shapes: they need
    no calibration probe, and (without --real-run) passes during the run (--probe-every > 0); track-mix with
    --real-run, passes that replayed some of the run's steps (`track`: the reused run's speed track)."""
    flag = f"--speed-correct {correct}"
    if correct == "steps":
        if reused is not None:
            steps = read_steps(reused.path)
            if steps is None or not has_run_clock(steps):
                raise UsageError(f"{flag} reads the machine's speed from the real run's step log with its clock, and "
                                 f"{reused.path} has none (a run written before the step log's clock_s): rerun "
                                 "validate without --real-run")
        return
    tracked = correct in ("track", "track-mix")
    if reused is None and tracked and probe_every == 0:
        raise UsageError(f"{flag} follows the probe passes taken during the real run, and --probe-every 0 turns "
                         "them off: leave --probe-every at its default (10 s) or give a number of seconds")
    if not tracked and cal_probe is None:
        raise UsageError(f"{flag} needs a calibration with a speed probe, and {spec} has none (not a "
                         "calibration file, or one written before the probe): calibrate this setup with "
                         f"`slotlab calibrate -m {model} --threads {threads} --out cal.json` and pass "
                         "--latency parametric:cal.json, or use --speed-correct track or off")
    if correct == "grid" and grid_offset(cal_probe) is None:
        raise UsageError(f"{flag}: {spec}'s grid did not measure the speed probe's shapes (a --quick "
                         "calibration): use the full grid (`slotlab calibrate` without --quick), or "
                         "--speed-correct probe or track")
    if reused is not None and run_probes is None:
        raise UsageError(f"{flag}: {reused.path} has no {PROBE_FILE} (a `slotlab replay` run, or "
                         "a validate run made before the speed probe): rerun validate without --real-run, or use "
                         "--speed-correct off")
    if correct == "track-mix" and reused is not None:
        if track is None or not any(p.mix for p in track.passes):
            raise UsageError(f"{flag}: {reused.path} has no probe pass that replayed the run's own steps (a run "
                             "recorded before the replays, or with --probe-every 0): rerun validate without "
                             "--real-run, or use --speed-correct track")
    if tracked:
        return
    why = probe_unusable(cal_probe, run_probes, model, threads)
    if why:
        raise UsageError(f"{flag}: {spec} is not comparable with this run: the calibration's {why}")


def speed_correction(cal_probe: SpeedProbe | None, run_probes: tuple[SpeedProbe, SpeedProbe] | None, model: str,
                     threads: int, correct: str, latency: Any, *, track: SpeedTrack | None = None,
                     end_clock_s: float = 0.0, kv_bytes_per_token: int = 0,
                     knots_of_steps: dict[str, Any] | None = None,
                     knot_window_s: float = KNOT_WINDOW_S) -> tuple[dict[str, Any], Any]:
    """validation.json's `speed_probe` (ratios, `correct`, the `factor` used) and the latency model the
    simulator runs with: `latency`, or ScaledLatency(latency, ratio.mean) with `correct` = "probe",
    ScaledLatency(latency, ratio.grid) with "grid", TrackedLatency through `track_knots` with "track": the
    probes before and after the run and `track`'s passes during it (`end_clock_s`: the run's end on its clock)
    over what `latency` charges for the probe's shapes (`probe_predictions`; `kv_bytes_per_token` of the run's
    server), whose `factor` is then the geometric mean of the knots' factors; the track needs no calibration
    probe. With "track-mix", TrackedLatency through `mix_knots`: the passes' replays of the run's own steps over
    what `latency` charges for them (`mix_predictions`), a knot per path per `knot_window_s` of the run's clock.
    A calibration probe that is not comparable gives no ratio (`calibration_unusable` says why). With the run's
    probes, `track` and `track_mix` hold the knots whatever `correct` is. With "steps", TrackedLatency through `knots_of_steps` (`steplog.step_knots`: the real
    run's own speed, an oracle), kept as `steps_track`."""
    before, after = run_probes if run_probes else (None, None)
    why = probe_unusable(cal_probe, run_probes, model, threads) if cal_probe is not None else None
    report = speed_report(None if why else cal_probe, before, after)
    report["calibration_unusable"] = why
    if cal_probe is not None:
        report["calibration"] = cal_probe.to_dict()
    fixed = None
    if before is not None and after is not None:
        fixed = track_knots(probe_predictions(latency, kv_bytes_per_token), before, after, track, end_clock_s,
                            prompt_labels=[p.label for p in probe_points() if p.prompt])
    mixed = mix_knots(track, mix_predictions(latency, kv_bytes_per_token, track), knot_window_s)
    knots = mixed if correct == "track-mix" else fixed
    report["track"] = fixed
    report["track_mix"] = mixed
    report["steps_track"] = knots_of_steps
    if correct == "steps":
        if knots_of_steps is None:
            raise RuntimeError("--speed-correct steps without the step log's knots")
        k = knots_of_steps
        report.update(correct=correct, factor=geomean(k["factor"]))
        return report, TrackedLatency(latency, k["clock_s"], k["factor"], k["factor_prompt"])
    if correct in ("track", "track-mix"):
        if knots is None:             # check_speed_correction rules this out before the run
            raise RuntimeError(f"--speed-correct {correct} without knots ({why or 'a probe is missing'})")
        factor = geomean(knots["factor"])
        report.update(correct=correct, factor=factor)
        return report, TrackedLatency(latency, knots["clock_s"], knots["factor"], knots["factor_prompt"])
    factor = {"probe": report["ratio"]["mean"], "grid": report["ratio"]["grid"]}.get(correct, 1.0)
    if factor is None:                # check_speed_correction rules this out before the run
        raise RuntimeError(f"--speed-correct {correct} without a ratio ({why or 'a probe is missing'})")
    report.update(correct=correct, factor=factor)
    return report, (ScaledLatency(latency, factor) if correct in ("probe", "grid") else latency)


def factor_text(speed: Mapping[str, Any]) -> str:
    """The simulator's step-time factor as printed: x0.913, or for a tracked correction its range and knots."""
    if speed.get("correct") == "track" and speed.get("track"):
        k = speed["track"]
        return f"{track_span(k)} (tracked: {len(k['clock_s'])} knots, {k['n_in_run']} during the run)"
    if speed.get("correct") == "track-mix" and speed.get("track_mix"):
        k = speed["track_mix"]
        return (f"{track_span(k)} (tracked: {k['n_replays']} of the run's own steps replayed, {k['n_in_run']} "
                f"windows of {k['every_s']:g} s)")
    if speed.get("correct") == "steps" and speed.get("steps_track"):
        k = speed["steps_track"]
        return f"{track_span(k)} (the real run's own steps: {len(k['clock_s'])} knots of {k['every_s']:g} s)"
    return f"x{speed['factor']:.3f}"


def calibration_error(latency: Any) -> dict[str, Any] | None:
    """The calibration's own error for the model in use (from its file: in sample and held out by shape, over
    the calibrated grid's steps), to be read beside the run's; None for a model not read from a calibration."""
    desc = unscaled(latency).describe()
    source = desc.get("source")
    if not source:
        return None
    try:
        data = json.loads(Path(source).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = ("table" if desc.get("call_table") else "physical") if desc.get("kind") == "physical" else "simple"
    errs = ((data.get("cross_validation") or {}).get("errors") or {}).get(name)
    if not errs:
        return None
    pick = {"in_sample": "in_sample", "held_out_shape": "loso", "held_out_group": "group"}
    out: dict[str, Any] = {"model": name}
    for label, key in pick.items():
        part = (errs.get(key) or {}).get("all")
        if part:
            out[label] = {"mape": part["mape"], "median_ape": part["median_ape"]}
    return out


def read_validation(path: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """A validate output directory read back: (per-request table, aggregate errors, summary)."""
    p = Path(path)
    return (pd.read_csv(p / FILES["per_request"]), pd.read_csv(p / FILES["errors"]),
            json.loads((p / FILES["summary"]).read_text(encoding="utf-8")))


def _write_comparison(out: Path, per, errors, summary: dict, real_rows, sim_rows, plot_title: str | None) -> None:
    """The files of a validation: per-request and aggregate errors, the summary, and (with a title) plots."""
    per.to_csv(out / FILES["per_request"], index=False)
    errors.to_csv(out / FILES["errors"], index=False)
    write_json(out / FILES["summary"], summary)
    if plot_title is not None:
        plot_scatter(per, out / FILES["scatter"], plot_title)
        plot_cdfs(real_rows, sim_rows, out / FILES["cdf"], plot_title)


def _print_quiet(errors, summary: dict, out: Path, what: str) -> None:
    e2e = errors[(errors["metric"] == "e2e") & (errors["stat"] == "p50")].iloc[0]
    pinned = ", arrivals pinned" if (summary.get("arrivals") or {}).get("mode") == "real" else ""
    print(f"slotlab validate: {summary['n_requests']} {what}, E2E P50 real {e2e['real_s']:.3g} s sim "
          f"{e2e['sim_s']:.3g} s ({100 * e2e['rel_err']:+.1f}%), decisions match "
          f"{100 * summary['decision_match_rate']:.0f}%{pinned}{_steps_clause(summary)}{_speed_clause(summary)} -> {out}")


def _speed_clause(summary: dict) -> str:
    speed = summary.get("speed_probe") or {}
    ratio = (speed.get("ratio") or {}).get("mean")
    if ratio is None:
        return ""
    out = f", speed probe now / calibration x{ratio:.3f}"
    if speed.get("correct") in CORRECTIONS:
        out += f" (corrected: --speed-correct {speed['correct']} {factor_text(speed)})"
    return out


def _steps_clause(summary: dict) -> str:
    steps = (summary.get("real_step_errors") or {}).get("all")
    if not steps:
        return ""
    return (f", latency model on the real steps median |err| {100 * steps['median_abs_err']:.1f}% "
            f"(bias {100 * steps['median_err']:+.1f}%)")
