"""The step log of a real run: every step the engine executed, what the simulator would charge for it, and what
the engine measured.

`slotlab replay` (and so `slotlab validate`'s real run) writes `steps.parquet` beside `requests.parquet`: one
row per `NumpyBackend.execute` call, in order, with

- `t_s`: when the step started, wall seconds since the first step;
- `clock_s`: when the step started on the run's own clock (replay: the driver's simulated seconds, which advance
  by the measured step times and the idle gaps, the axis the simulator's times are on; NaN when not given);
- `elapsed_s`: the engine's measured time of the step (the value the driver's clock advanced by);
- the plan as the simulated backend counts it (`SimBackend.layout_cost`): `n_prefill_tokens`,
  `n_decode_tokens`, `n_seqs`, `attn_ctx_tokens`, `n_forward_calls`, `kv_copy_bytes`, `kv_save_bytes`,
  `kv_shift_tokens`, `kv_read_tokens`, `calls` (each forward call's chunks as `[seq, pos0, n_tokens]`, JSON);
  `charged`: False for a step the simulator charges nothing (KV bookkeeping only, no task and no forward call);
- `kind`: decode, prefill, mixed, copy (host-RAM cache save/load in the step) or shift (K re-rotation);
- `others_cores`: the CPU that *other* processes used while the step ran, in cores, from /proc/stat
  (machine busy time minus this process's own CPU time, over windows of at least half a second; NaN where
  /proc/stat is not readable or before the first window closed);
- `steal_cores`: of those, the CPU the hypervisor gave to other guests while this one wanted it (/proc/stat's
  `steal`, same windows; NaN where unknown): on a virtual machine, contention no process list shows;
- `minor_faults`: the pages the kernel supplied to the process during the step (the engine counts them and passes
  them to its `on_step` observer; all threads; NaN where unknown): a step whose blob or temporaries land in
  memory new to the process (a kept prompt-cache save, or temporaries after a save took the heap space they had
  used) takes hundreds to thousands, which its replay does not (docs/validation_sim.md §16, §18).

`step_errors(steps, latency)` prices every logged step with a latency model and compares it with the measured
time. Because both sides see the *same* step, this error is the timing model's alone: it does not depend on
whether the simulated run made the same decisions as the real one (a closed-loop run whose arrivals drift apart
compares different steps request by request). Its `page_faults` sets apart the steps that took memory new to the
process and compares them with the other steps of their kinds. It also shows the machine: the measured/predicted
ratio over the run's duration (`drift`) moves when the machine's speed moved (another process took a core), and
`others_cores` says whether something else ran.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.core.types import BatchPlan, ForwardCall
from experiments.calibrate import STEAL_CORES_WARN, proc_cpu_seconds, proc_steal_seconds
from experiments.speed_probe import window_knots
from sim.backend import SimBackend
from sim.latency import ConstantLatency, StepCost, unscaled

STEPS_FILE = "steps.parquet"
KINDS = ("decode", "prefill", "mixed", "copy", "shift")
COST_COLUMNS = ("n_prefill_tokens", "n_decode_tokens", "n_seqs", "attn_ctx_tokens", "n_forward_calls",
                "kv_copy_bytes", "kv_save_bytes", "kv_shift_tokens", "kv_read_tokens")
# other processes' CPU (cores, in some window of the real run) above which validate warns
OTHERS_CORES_WARN = 0.5
# measured/predicted ratio moving by more than this between tenths of the run: validate warns (machine speed)
DRIFT_WARN = 0.10
# a step that took at least this many pages (4 KiB: 1 MiB) of memory new to the process is compared apart
FAULT_STEP_PAGES = 256
# ... and validate warns when those steps' median error is this much more negative than the other steps'
FAULT_BIAS_WARN = 0.05


def step_kind(cost: StepCost) -> str:
    if cost.kv_shift_tokens:
        return "shift"
    if cost.kv_copy_bytes:
        return "copy"
    if cost.n_prefill_tokens and cost.n_decode_tokens:
        return "mixed"
    return "prefill" if cost.n_prefill_tokens else "decode"


class StepLog:
    """`NumpyBackend.on_step` observer: one row per executed plan (see the module docs for the columns).

    `cpu_reader` returns (machine busy CPU seconds, this process's CPU seconds) or None (`proc_cpu_seconds`);
    a window closes at the first step ending at least `window_s` after it opened, and its others' cores are
    given to every step that started in it. Each call's `minor_faults` is the page faults the engine counted
    during the step (`NumpyBackend.execute`), or None: the column is then NaN."""

    def __init__(self, kv_bytes_per_token: int, *, cpu_reader: Callable[[], tuple[float, float] | None] = proc_cpu_seconds,
                 clock: Callable[[], float] = time.perf_counter, window_s: float = 0.5,
                 run_clock: Callable[[], float] | None = None,
                 steal_reader: Callable[[], float | None] = proc_steal_seconds) -> None:
        self._steal = steal_reader
        self._win_steal: float | None = None
        self._run_clock = run_clock
        self._costs = SimBackend(ConstantLatency(0.0), kv_bytes_per_token)
        self._cpu = cpu_reader
        self._clock = clock
        self._window_s = window_s
        self.rows: list[dict[str, Any]] = []
        self._t0: float | None = None
        self._win_start = 0                        # first row of the open window
        self._win_clock = 0.0
        self._win_cpu: tuple[float, float] | None = None

    def __call__(self, plan: BatchPlan, elapsed_s: float, minor_faults: int | None = None) -> None:
        end = self._clock()
        start = end - elapsed_s
        if self._t0 is None:
            self._t0 = start
            # the first reading comes at the first step's end: the first window opens there
            self._win_clock, self._win_cpu, self._win_steal = end, self._cpu(), self._steal()
        cost = self._costs.layout_cost(plan)
        charged = bool(plan.tasks) or any(type(p) is ForwardCall for p in plan.program)
        row = {"t_s": start - self._t0, "elapsed_s": elapsed_s, "kind": step_kind(cost), "charged": charged,
               "others_cores": math.nan, "steal_cores": math.nan,
               "minor_faults": math.nan if minor_faults is None else float(minor_faults),
               "clock_s": self._run_clock() if self._run_clock is not None else math.nan}
        for name in COST_COLUMNS:
            row[name] = getattr(cost, name)
        row["calls"] = json.dumps([[list(c) for c in call] for call in cost.calls or ()], separators=(",", ":"))
        self.rows.append(row)
        if end - self._win_clock >= self._window_s:
            self._close_window(end)

    def _close_window(self, end: float) -> None:
        cpu, steal = self._cpu(), self._steal()
        if cpu is not None and self._win_cpu is not None and end > self._win_clock:
            busy = cpu[0] - self._win_cpu[0]
            own = cpu[1] - self._win_cpu[1]
            others = max(0.0, (busy - own) / (end - self._win_clock))
            for row in self.rows[self._win_start:]:
                row["others_cores"] = others
        if steal is not None and self._win_steal is not None and end > self._win_clock:
            stolen = max(0.0, (steal - self._win_steal) / (end - self._win_clock))
            for row in self.rows[self._win_start:]:
                row["steal_cores"] = stolen
        self._win_start, self._win_clock, self._win_cpu, self._win_steal = len(self.rows), end, cpu, steal

    def frame(self) -> pd.DataFrame:
        if self._win_start < len(self.rows):
            self._close_window(self._clock())
        cols = ["t_s", "elapsed_s", "kind", "charged", *COST_COLUMNS, "calls", "others_cores", "steal_cores",
                "minor_faults", "clock_s"]
        return pd.DataFrame(self.rows, columns=cols)

    def write(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / STEPS_FILE
        self.frame().to_parquet(path, index=False)
        return path


def read_steps(run_dir: str | Path) -> pd.DataFrame | None:
    """A results directory's step log, or None when it has none (a simulated run, or a real run written
    before step logs existed)."""
    path = Path(run_dir) / STEPS_FILE
    if not path.exists():
        return None
    steps = pd.read_parquet(path)
    missing = [c for c in ("t_s", "elapsed_s", "kind", "charged", *COST_COLUMNS, "calls") if c not in steps.columns]
    if missing:
        raise ValueError(f"{path}: not a step log (missing columns {', '.join(missing)})")
    return steps


def path_steps(steps: pd.DataFrame, prompt: bool) -> int:
    """How many of the logged steps the in-run probe's path `prompt` offers to replay (`experiments.calibrate.
    InRunProbe`): the steps with prompt tokens, or (False) the decode steps, those without that ran a forward pass."""
    if prompt:
        return int((steps["n_prefill_tokens"] > 0).sum())
    return int(((steps["n_prefill_tokens"] == 0) & (steps["n_forward_calls"] > 0) & (steps["elapsed_s"] > 0)).sum())


def step_costs(steps: pd.DataFrame, with_layout: bool = True) -> list[StepCost]:
    """Each logged step's StepCost (as the simulated backend builds it: without the layout unless asked)."""
    costs = []
    ints = {name: steps[name].to_numpy() for name in COST_COLUMNS}
    calls = steps["calls"].tolist()
    for i in range(len(steps)):
        layout = tuple(tuple(tuple(int(x) for x in c) for c in call) for call in json.loads(calls[i]))
        costs.append(StepCost(
            int(ints["n_prefill_tokens"][i]), int(ints["n_decode_tokens"][i]), int(ints["n_seqs"][i]),
            int(ints["attn_ctx_tokens"][i]), int(ints["n_forward_calls"][i]), int(ints["kv_copy_bytes"][i]),
            int(ints["kv_shift_tokens"][i]), int(ints["kv_read_tokens"][i]),
            layout if with_layout else None, int(ints["kv_save_bytes"][i]) if with_layout else None))
    return costs


def has_run_clock(steps: pd.DataFrame) -> bool:
    """True when every logged step has its start on the run's clock (`clock_s`; logs written before it have none)."""
    return "clock_s" in steps.columns and not steps["clock_s"].isna().any()


def compared(steps: pd.DataFrame, measured: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """The steps a measured / predicted ratio is taken over: charged, with both times > 0."""
    return steps["charged"].to_numpy(bool) & (measured > 0) & (predicted > 0)


def predict_steps(steps: pd.DataFrame, latency: Any) -> np.ndarray:
    """What `latency` charges for each logged step (0 where the simulator charges nothing). A model whose
    factor follows the clock (`TrackedLatency`) is priced at each step's `clock_s` (the run's clock at its start);
    ValueError for a log without that column (written before it existed)."""
    layout = bool(getattr(latency, "wants_layout", False))
    charged = steps["charged"].to_numpy(bool)
    factor_at = getattr(latency, "cost_factor_at", None)
    if factor_at is None:
        return np.array([latency.step_time_s(c) if ok else 0.0
                         for c, ok in zip(step_costs(steps, layout), charged)], dtype=float)
    if not has_run_clock(steps):
        raise ValueError("this step log has no run clock (clock_s): a clock-tracked latency model cannot price it")
    base = latency.base                      # the tracked model's own clock is the simulation's, not this log's
    return np.array([factor_at(t, c) * base.step_time_s(c) if ok else 0.0
                     for c, ok, t in zip(step_costs(steps, layout), charged, steps["clock_s"])], dtype=float)


KNOT_WINDOW_S = 1.0                # --speed-correct steps and track-mix: one knot per path per this many seconds of
                                   # the run's clock (--knot-window; the host's speed moves within seconds, §12)


def step_knots(steps: pd.DataFrame, latency: Any, every_s: float = KNOT_WINDOW_S) -> dict[str, Any]:
    """The knots of `--speed-correct steps`: the machine's speed of each moment read from the real run's own steps.

    The run's clock is cut into windows of `every_s` seconds; a window's knot (at its centre) is the median
    measured / predicted ratio of its charged steps, `latency` pricing them as `predict_steps` does: `factor` over
    the steps without prompt tokens, `factor_prompt` over those with (the two paths of `TrackedLatency`). A window
    without steps of a path takes that path's nearest window that has some (the other path's factor where the run
    has none of it). The same keys as `speed_probe.track_knots`, so the track's printing and plots read it.

    This is an oracle, not a prediction: the simulator is given the speed the real run measured, so what is left of
    its error is the latency model's across step shapes, the closed loop's and the decisions'. It says how close the
    simulator comes on a machine whose speed it knew (docs/validation_sim.md §10). ValueError for a log without a
    run clock or without a charged step."""
    if not (math.isfinite(every_s) and every_s > 0):
        raise ValueError(f"the knots' window must be a number of seconds > 0, got {every_s}")
    if not has_run_clock(steps):
        raise ValueError("this step log has no run clock (clock_s): the step knots need one")
    measured = steps["elapsed_s"].to_numpy(float)
    predicted = predict_steps(steps, unscaled(latency))
    ok = compared(steps, measured, predicted)
    if not ok.any():
        raise ValueError("the step log has no charged step with a measured time: no speed to read from it")
    clock = steps["clock_s"].to_numpy(float)[ok]
    ratio = measured[ok] / predicted[ok]
    prompt = steps["n_prefill_tokens"].to_numpy()[ok] > 0
    end = float(clock.max() + measured[ok][clock.argmax()])
    knots = window_knots(clock.tolist(), ratio.tolist(), prompt.tolist(), every_s, end, np.median)
    return {**knots, "n_steps": int(ok.sum()),
            "definition": "knots at the centres of windows of every_s seconds of the real run's clock; factor = the "
                          "median measured / predicted ratio of the window's steps without prompt tokens, "
                          "factor_prompt of those with (raw, raw_prompt: None where the window has none, then the "
                          "nearest window's); the real run's own speed given to the simulator: an oracle, not a "
                          "prediction"}


def _errors(measured: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    rel = predicted / measured - 1.0
    return {"n": len(measured), "median_abs_err": float(np.median(np.abs(rel))),
            "median_err": float(np.median(rel)), "busy_err": float(predicted.sum() / measured.sum() - 1.0)}


def step_errors(steps: pd.DataFrame, latency: Any, n_bins: int = 10,
                predicted: np.ndarray | None = None) -> dict[str, Any]:
    """The latency model's error on the real run's own steps.

    Over the charged steps with a measured time > 0: `all` and per `kind` the median |predicted/measured − 1|,
    its median signed value (the bias: negative = the model is faster than the engine) and `busy_err`
    (Σ predicted / Σ measured − 1: the error of the run's total busy time). `drift`: the median
    measured/predicted ratio in each of `n_bins` equal tenths of the steps in time order (a machine whose speed
    did not move gives a flat list) and `drift_range` = max/min − 1 of it. `others_cores`: mean and max over the
    run of the CPU other processes used (None without /proc/stat); `steal_cores` the same of the CPU the
    hypervisor gave to other guests (None without it, e.g. a step log written before it was recorded). `shape_err`: the median |ratio / (centred
    rolling median of the ratio over `window_steps` steps) − 1| — the model's error across step shapes once the
    machine's speed of the moment is taken out (how well it would do on a machine of steady speed).
    `predicted`: `predict_steps(steps, latency)` when the caller has it already (priced once)."""
    measured = steps["elapsed_s"].to_numpy(float)
    if predicted is None:
        predicted = predict_steps(steps, latency)
    ok = compared(steps, measured, predicted)
    out: dict[str, Any] = {"n_steps": len(steps), "n_compared": int(ok.sum())}
    if not ok.any():
        return out
    m, p = measured[ok], predicted[ok]
    kinds = steps["kind"].to_numpy()[ok]
    out["all"] = _errors(m, p)
    out["by_kind"] = {k: _errors(m[kinds == k], p[kinds == k]) for k in KINDS if (kinds == k).any()}
    ratio = m / p
    bins = [b for b in np.array_split(ratio, min(n_bins, len(ratio))) if len(b)]
    drift = [float(np.median(b)) for b in bins]
    out["drift"] = drift
    out["drift_range"] = float(max(drift) / min(drift) - 1.0)
    # each step against its neighbours' speed: ratio / centred rolling median of the ratio; what is left is
    # the model's error across step shapes at the machine's speed of the moment (not its absolute speed)
    window = max(5, len(ratio) // 20)
    local = pd.Series(ratio).rolling(window, center=True, min_periods=1).median().to_numpy()
    out["shape_err"] = {"median_abs_err": float(np.median(np.abs(ratio / local - 1.0))), "window_steps": window}
    out["others_cores"] = _mean_max(steps, "others_cores")
    out["steal_cores"] = _mean_max(steps, "steal_cores")
    out["page_faults"] = _fault_errors(steps, ok, m, p)
    return out


def fault_split(pages: np.ndarray, known: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(took new memory, did not): masks over `pages` (page-fault counts) of the entries whose count is known (and
    `known`, when given) with at least FAULT_STEP_PAGES faults, and of the others. The one reading of "memory new to
    the process" for steps (`step_errors`), requests (`ttft_by_faults`) and campaigns (validate_settings.py)."""
    ok = np.isfinite(pages) if known is None else np.isfinite(pages) & known
    faulted = ok & (pages >= FAULT_STEP_PAGES)
    return faulted, ok & ~faulted


def _fault_errors(steps: pd.DataFrame, ok: np.ndarray, m: np.ndarray, p: np.ndarray) -> dict[str, Any] | None:
    """step_errors' `page_faults`: the compared steps that took at least FAULT_STEP_PAGES pages of memory new to
    the process (`minor_faults`) against the other steps of the same kinds (the model's bias differs by kind:
    a prompt step that faults is compared with prompt steps that did not). `excess_s`: their measured time beyond
    the model's price of them at the speed of the other steps of their kind (Σ measured / Σ predicted; of all
    the other steps for a kind that has none), floored at 0. None without the column or a count in it (a log
    written before it was recorded, a platform without getrusage)."""
    if "minor_faults" not in steps.columns:
        return None
    pages = steps["minor_faults"].to_numpy(float)[ok]
    known = np.isfinite(pages)
    if not known.any():
        return None
    kinds = steps["kind"].to_numpy()[ok]
    faulting, calm = fault_split(pages)
    calm |= ~known                          # a step of unknown count is compared as one that did not fault
    alike = calm & np.isin(kinds, np.unique(kinds[faulting]))
    excess = 0.0
    for kind in np.unique(kinds[faulting]):
        ref = calm & (kinds == kind)
        if not ref.any():
            ref = calm
        speed = m[ref].sum() / p[ref].sum() if ref.any() and p[ref].sum() > 0 else 1.0
        here = faulting & (kinds == kind)
        excess += float(m[here].sum() - speed * p[here].sum())
    return {"threshold_pages": FAULT_STEP_PAGES, "n_steps": int(faulting.sum()), "n_compared": int(len(m)),
            "pages": int(pages[faulting].sum()),
            "faulting": _errors(m[faulting], p[faulting]) if faulting.any() else None,
            "other": _errors(m[alike], p[alike]) if alike.any() else None,
            "other_kinds": sorted(str(k) for k in np.unique(kinds[alike])),
            "excess_s": max(0.0, excess)}


def first_token_faults(steps: pd.DataFrame, requests: pd.DataFrame) -> pd.Series:
    """Per request (indexed by `request`), the page faults of the steps its first token waited for: the steps that
    started on the run's clock at or after its arrival and before its first token (`clock_s`; a step already
    running when the request arrived is not its own). NaN for a request without a first token, a log without
    `minor_faults` or `clock_s`, or a window with a step whose count is unknown."""
    out = pd.Series(math.nan, index=requests["request"].to_numpy(), dtype="float64", name="ttft_faults_real")
    if "minor_faults" not in steps.columns or not has_run_clock(steps):
        return out
    start = steps["clock_s"].to_numpy(float)
    faults = steps["minor_faults"].to_numpy(float)
    eps = 1e-9
    for req, arrival, first in zip(requests["request"], requests["arrival_s"].to_numpy(float),
                                   requests["first_token_s"].to_numpy(float)):
        if not (math.isfinite(arrival) and math.isfinite(first)):
            continue
        window = faults[(start >= arrival - eps) & (start < first - eps)]
        if len(window) and np.isfinite(window).all():
            out[req] = float(window.sum())
    return out


def ttft_by_faults(per: pd.DataFrame) -> dict[str, Any] | None:
    """validation.json's `ttft_by_faults`: the per-request TTFT error (`ttft_rel_err`) of the requests whose
    first-token steps took at least FAULT_STEP_PAGES page faults (`ttft_faults_real`) and of the others: n, median
    signed and median absolute error of each side (None for a side without requests). None when no request has
    a count."""
    if "ttft_faults_real" not in per.columns:
        return None
    err = per["ttft_rel_err"].to_numpy(float)
    faulted, other = fault_split(per["ttft_faults_real"].to_numpy(float), np.isfinite(err))
    if not (faulted.any() or other.any()):
        return None

    def side(mask: np.ndarray) -> dict[str, Any] | None:
        e = err[mask]
        return ({"n": int(mask.sum()), "median_err": float(np.median(e)), "median_abs_err": float(np.median(np.abs(e)))}
                if mask.any() else None)
    return {"threshold_pages": FAULT_STEP_PAGES, "faulted": side(faulted), "other": side(other)}


def format_ttft_by_faults(split: Mapping[str, Any] | None) -> str:
    """One line for the terminal ("" when no request's first token came from steps that took new memory)."""
    if not split or not split["faulted"]:
        return ""
    f, o = split["faulted"], split["other"]
    line = (f"TTFT per request: the {f['n']} requests whose first token came from steps that took memory new to "
            f"the process (at least {split['threshold_pages']} page faults) erred {100 * f['median_err']:+.1f}% "
            f"(median; |err| {100 * f['median_abs_err']:.1f}%)")
    if o:
        line += f", the other {o['n']} {100 * o['median_err']:+.1f}% (|err| {100 * o['median_abs_err']:.1f}%)"
    return line


def _mean_max(steps: pd.DataFrame, column: str) -> dict[str, float] | None:
    """{"mean", "max"} of a column's finite values, None when it has none (or the log has no such column)."""
    values = steps[column].to_numpy(float) if column in steps.columns else np.array([])
    values = values[np.isfinite(values)]
    return {"mean": float(values.mean()), "max": float(values.max())} if len(values) else None


def step_warnings(errors: dict[str, Any]) -> list[str]:
    """What in a real run's step log makes its times not the calibrated machine's (empty when nothing)."""
    warnings = []
    others = errors.get("others_cores")
    if others and others["max"] > OTHERS_CORES_WARN:
        warnings.append(f"other processes used up to {others['max']:.2f} cores (mean {others['mean']:.2f}) during "
                        f"the real run: its step times are those of a shared machine")
    steal = errors.get("steal_cores")
    if steal and steal["mean"] > STEAL_CORES_WARN:
        warnings.append(f"the hypervisor gave this machine's CPUs to other guests for {steal['mean']:.2f} cores "
                        f"on average (max {steal['max']:.2f}) during the real run (steal time, /proc/stat): its "
                        f"steps include waits for a CPU that no latency model predicts; rerun when the host is "
                        f"quieter, or compare with --speed-correct track")
    faults = errors.get("page_faults")
    if (faults and faults["faulting"] and faults["other"]
            and faults["faulting"]["median_err"] < faults["other"]["median_err"] - FAULT_BIAS_WARN):
        warnings.append(f"{_fault_text(faults)}. Such memory can cost far more than the recently used memory "
                        f"the calibration's steps got (on a virtual machine a page the guest has not touched before "
                        f"costs ~2 ns a byte, 10-20 times as much), and no latency model here predicts which step "
                        f"gets it; the requests whose prompts ran in those steps show it in their TTFT "
                        f"(docs/validation_sim.md §18)")
    if errors.get("drift_range", 0.0) > DRIFT_WARN:
        d = errors["drift"]
        warnings.append(f"the engine's speed moved during the real run: measured/predicted step time went "
                        f"{min(d):.2f}..{max(d):.2f} over its tenths (the machine's speed changed)")
    return warnings


def _fault_text(faults: Mapping[str, Any]) -> str:
    f, o = faults["faulting"], faults["other"]
    return (f"{faults['n_steps']} of the real run's {faults['n_compared']} steps took memory new to the process (at "
            f"least {faults['threshold_pages']} page faults each, {faults['pages']:,} in all), and the latency "
            f"model's median error on them was {100 * f['median_err']:+.1f}% against {100 * o['median_err']:+.1f}% "
            f"on the other steps of their kinds ({', '.join(faults['other_kinds'])}): {faults['excess_s']:.2f} s "
            f"beyond the model at those steps' speed")


def format_step_errors(errors: dict[str, Any]) -> str:
    """One paragraph: the model's error on the real steps, by kind, and the machine during the run."""
    if "all" not in errors:
        return f"real run steps: {errors['n_steps']} logged, none priced"
    a = errors["all"]
    head = (f"latency model on the real run's own {errors['n_compared']} steps: median |err| "
            f"{100 * a['median_abs_err']:.1f}%, bias {100 * a['median_err']:+.1f}%, busy time "
            f"{100 * a['busy_err']:+.1f}%")
    parts = [head]
    kinds = ", ".join(f"{k} {v['n']}: {100 * v['median_abs_err']:.1f}% ({100 * v['median_err']:+.1f}%)"
                      for k, v in errors["by_kind"].items())
    parts.append(f"  by kind (median |err| (bias)): {kinds}")
    d = errors["drift"]
    others = errors.get("others_cores")
    machine = (f"; other processes {others['mean']:.2f} cores mean, {others['max']:.2f} max" if others
               else "; other processes' CPU unknown (no /proc/stat)")
    steal = errors.get("steal_cores")
    if steal:
        machine += f" (of which steal {steal['mean']:.2f} mean, {steal['max']:.2f} max)"
    parts.append(f"  measured/predicted over the run's tenths {min(d):.2f}..{max(d):.2f}{machine}")
    parts.append(f"  against the machine's speed of the moment (ratio / its rolling median over "
                 f"{errors['shape_err']['window_steps']} steps): median |err| "
                 f"{100 * errors['shape_err']['median_abs_err']:.1f}%")
    faults = errors.get("page_faults")
    if faults and faults["faulting"] and faults["other"]:
        parts.append(f"  {_fault_text(faults)}")
    return "\n".join(parts)


def plot_step_ratio(steps: pd.DataFrame, predicted: Sequence[float], path: str | Path, title: str,
                    probe: Mapping[str, Any] | None = None) -> Path:
    """Measured / predicted time of every real step over the run (rolling median), with other processes'
    CPU on a second axis: where the line leaves 1, the model or the machine moved. `probe`: the speed track's
    knots (`experiments.speed_probe.track_knots`), drawn as the probe's decode factor at each knot, placed on
    the wall-time axis through the steps' run clock: where the markers follow the line, the machine moved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = np.asarray(predicted, dtype=float)
    m = steps["elapsed_s"].to_numpy(float)
    ok = compared(steps, m, p)
    t = steps["t_s"].to_numpy(float)[ok]
    ratio = pd.Series(m[ok] / p[ok])
    kinds = steps["kind"].to_numpy()[ok]
    fig, ax = plt.subplots(figsize=(9, 4))
    for k in KINDS:
        sel = kinds == k
        if sel.any():
            ax.scatter(t[sel], ratio[sel], s=4, alpha=0.35, label=k)
    if len(ratio):
        ax.plot(t, ratio.rolling(max(5, len(ratio) // 50), center=True, min_periods=1).median(), color="black",
                lw=1.2, label="rolling median")
    if probe and "clock_s" in steps.columns and steps["clock_s"].notna().all() and len(steps):
        at = np.interp(probe["clock_s"], steps["clock_s"].to_numpy(float), steps["t_s"].to_numpy(float))
        ax.plot(at, probe["raw"], "D", color="tab:purple", ms=3, label="speed probe, decode shapes / model")
        ax.plot(at, probe["factor"], color="tab:purple", lw=1, alpha=0.7, label="its rolling median (the track)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("wall time of the real run (s)")
    ax.set_ylabel("measured / predicted step time")
    ax.set_title(title, fontsize=9)
    if "others_cores" in steps.columns and np.isfinite(steps["others_cores"].to_numpy(float)).any():
        ax2 = ax.twinx()
        ax2.plot(steps["t_s"], steps["others_cores"], color="tab:red", lw=0.8, alpha=0.7)
        ax2.set_ylabel("other processes' CPU (cores)", color="tab:red")
        ax2.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=7, markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
