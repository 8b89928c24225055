"""The study's real-engine check (`slotlab study --study-real N`, docs/study.md).

After the simulated cells, two configurations (workload, hit semantics, cache size, load) are picked from
the paired differences `lru − baseline`: the largest one (significant if any is) and one where the
difference is not significant. For each, the first N requests of one seed's workload (replies capped at
`max_output` tokens) run on the numpy engine through the same driver as `slotlab replay`, once with the
baseline and once with `lru`, and the simulator predicts the same slice with the same server settings.
`real.json` holds what the report's "Real engine" section says (experiments/study/report.py).

Each run (real or simulated) is stored as one JSON file under a hash of everything it depends on (the
cell's config, N, the cap, the model file, threads), so a rerun with the same settings reuses it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.results import write_json
from experiments.study.cell import code_fingerprint, metrics_of, server_config
from experiments.study.stats import paired
from experiments.sweep import CellStore, cell_key
from traces import ChatSession, ChatWorkload, Trace

REAL_VERSION = 2
OTHER = "lru"                      # the policy compared with the baseline
DEFAULT_THREADS = 2
DEFAULT_MAX_OUTPUT = 16
REAL_JSON, RUNS_PARQUET, REQUESTS_PARQUET = "real.json", "real_runs.parquet", "real_requests.parquet"
REQUEST_FIELDS = ("request", "session_id", "arrival_s", "n_prompt", "n_cached", "n_output", "ttft_s", "e2e_s",
                  "finish", "slot")
RUN_METRICS = ("token_hit_rate", "n_prompt_tokens", "n_cached_tokens", "evictions", "cache_hits", "cache_misses",
               "cache_saves", "ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "n_requests", "n_errors", "sim_s", "wall_s")


@dataclass(frozen=True)
class RealOptions:
    n_requests: int
    model: str
    threads: int = DEFAULT_THREADS
    max_output: int = DEFAULT_MAX_OUTPUT    # 0 = replies keep their workload lengths
    temp: float = 0.0

    def model_id(self) -> dict[str, Any]:
        st = os.stat(self.model)
        return {"path": str(Path(self.model).resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def check_real(spec: Any, n: int, model: str | None, threads: int, max_output: int) -> RealOptions | None:
    """The real-engine options, or None for N = 0; ValueError (before any cell runs) for a negative N,
    a study without `lru` and its baseline, bad threads / cap, or no model."""
    from experiments.runs import resolve_model

    if n < 0:
        raise ValueError(f"--study-real N: N is a number of requests (>= 1; 0 = no real-engine check), got {n}")
    if n == 0:
        return None
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    if max_output < 0:
        raise ValueError(f"--real-max-output must be >= 0 (0 = no cap), got {max_output}")
    evict = list(spec.axes["evict"])
    if OTHER not in evict or spec.baseline == OTHER:
        raise ValueError(f"--study-real compares `{OTHER}` with the baseline `{spec.baseline}`: the study's "
                         f"axes.evict {evict} must hold both")
    try:
        path = resolve_model(model)
    except ValueError as e:
        raise ValueError(f"--study-real needs a model: {e}") from None
    return RealOptions(n, path, threads, max_output)


# --- which cells --------------------------------------------------------------------------------------------

CONFIG = ["workload", "cache_hit", "cache_ram", "load"]


def _direction(mean: float, significant: bool) -> str:
    if not significant or mean == 0:
        return "same"
    return "better" if mean > 0 else "worse"


def measured_direction(diff_pts: float) -> str:
    """A single pair of runs: the sign of `lru − baseline` (0 exactly = the same token counts)."""
    if not math.isfinite(diff_pts):
        return "n/a"
    return "same" if diff_pts == 0 else "better" if diff_pts > 0 else "worse"


def pick_cells(cells: pd.DataFrame, baseline: str, other: str = OTHER) -> list[dict[str, Any]]:
    """The two configurations to check: "largest" (largest |mean| paired difference among the significant
    ones, else among all) and "no-difference" (not significant; preferring one where the policies decided
    differently and the baseline evicted, then the workload of the first pick, then the smallest |mean|).
    Each with the seed to replay: the seed whose own difference is largest in the mean's direction (first
    pick) or smallest (second pick)."""
    d = paired(cells, "token_hit_rate", baseline, scale=100.0)
    d = d[d["evict"] == other].reset_index(drop=True)
    if d.empty:
        return []
    ok = cells[cells["status"] == "ok"]
    base = ok[ok["evict"] == baseline]
    evicted = base.groupby(CONFIG)["evictions"].mean()
    sig = d[d["significant"]]
    pool = sig if len(sig) else d
    first = pool.loc[pool["mean"].abs().idxmax()]
    picks = [("largest", first)]
    rest = d[~d["significant"] & ~(d[CONFIG] == first[CONFIG]).all(axis=1)]
    if len(rest):
        def rank(r: pd.Series) -> tuple[Any, ...]:
            ev = float(evicted.get(tuple(r[c] for c in CONFIG), 0.0))
            cls = 0 if (not r["identical"] and ev > 0) else 1 if ev > 0 else 2
            return (cls, r["workload"] != first["workload"], abs(r["mean"]), r["cache_ram"], r["load"])
        picks.append(("no-difference", min((r for _, r in rest.iterrows()), key=rank)))
    out = []
    for role, r in picks:
        cfg = {c: r[c] for c in CONFIG}
        seeds = _seed_diffs(ok, cfg, baseline, other)
        sign = 1.0 if r["mean"] >= 0 else -1.0
        seed = (max(seeds, key=lambda s: (sign * seeds[s], -s)) if role == "largest"
                else min(seeds, key=lambda s: (abs(seeds[s]), s)))
        out.append({"role": role, "workload": str(r["workload"]), "cache_hit": str(r["cache_hit"]),
                    "cache_ram": int(r["cache_ram"]), "load": float(r["load"]), "seed": int(seed),
                    "study": {"mean": float(r["mean"]), "lo": float(r["lo"]), "hi": float(r["hi"]), "n": int(r["n"]),
                              "significant": bool(r["significant"]), "identical": bool(r["identical"]),
                              "direction": _direction(float(r["mean"]), bool(r["significant"])),
                              "seed_diff": float(seeds[seed]),
                              "evictions": float(evicted.get(tuple(cfg.values()), math.nan))}})
    return out


def _seed_diffs(ok: pd.DataFrame, cfg: Mapping[str, Any], baseline: str, other: str) -> dict[int, float]:
    sub = ok[(ok[list(cfg)] == pd.Series(cfg)).all(axis=1)]
    hr = sub.set_index(["evict", "seed"])["token_hit_rate"]
    return {int(s): 100.0 * float(hr[(other, s)] - hr[(baseline, s)]) for s in sorted(sub["seed"].unique())
            if (other, s) in hr.index and (baseline, s) in hr.index}


# --- the slice ----------------------------------------------------------------------------------------------


def first_requests(workload: Trace | ChatWorkload, n: int, max_output: int = 0) -> Trace | ChatWorkload:
    """The first `n` requests of a workload, replies capped at `max_output` tokens (0 = no cap). A trace's
    first n by arrival; a closed-loop chat's first n turns by nominal send time (session start + think
    times, service left out), each session keeping a prefix of its turns."""
    cap = (lambda k: min(k, max_output)) if max_output > 0 else (lambda k: k)
    if isinstance(workload, Trace):
        reqs = [dataclasses.replace(r, n_output=cap(r.n_output),
                                    output_tokens=None if r.output_tokens is None else r.output_tokens[:cap(r.n_output)])
                for r in workload.requests[:n]]
        return Trace(reqs, workload.format, workload.source, workload.n_skipped, workload.errors)
    times = []
    for i, s in enumerate(workload.sessions):
        t = s.start_s
        for j, turn in enumerate(s.turns):
            t += turn.think_s if j else 0.0
            times.append((t, i, j))
    keep = [0] * len(workload.sessions)
    for _, i, _ in sorted(times)[:n]:
        keep[i] += 1
    sessions = tuple(ChatSession(s.session_id, s.start_s, s.system_prompt_id,
                                 tuple(dataclasses.replace(t, n_output=cap(t.n_output)) for t in s.turns[:k]))
                     for s, k in zip(workload.sessions, keep) if k)
    return ChatWorkload(sessions, workload.system_prompt_lengths, workload.seed)


def n_requests_of(workload: Trace | ChatWorkload) -> int:
    return len(workload) if isinstance(workload, Trace) else workload.n_turns


# --- running ------------------------------------------------------------------------------------------------


def _cell_config(plan: Any, pick: Mapping[str, Any], evict: str) -> dict[str, Any]:
    for c in plan.cells:
        cfg = c.config
        w = cfg["workload"]
        if (w["name"], cfg["cache_hit"], cfg["cache_ram"], float(w["load"]), w["seed"], cfg["evict"]) == (
                pick["workload"], pick["cache_hit"], pick["cache_ram"], pick["load"], pick["seed"], evict):
            return cfg
    raise KeyError(f"no cell for {pick} with {evict}")


def scaled_cache_mib(cache_ram: int, study_kv: int, model_kv: int) -> int:
    """The cache size that holds as many tokens of the real model's KV as `cache_ram` MiB holds of the
    study's (whole MiB, at least 1)."""
    return max(1, round(cache_ram * model_kv / study_kv))


class _Model:
    """The model, loaded on first use (a rerun whose runs are all stored loads nothing)."""

    def __init__(self, opts: RealOptions, log: Callable[[str], None]) -> None:
        self.opts, self.log, self.model, self.load_s = opts, log, None, 0.0

    def get(self) -> Any:
        if self.model is None:
            from experiments.replay import load_model

            t0 = time.perf_counter()
            self.model = load_model(self.opts.model, self.opts.threads)
            self.load_s = time.perf_counter() - t0
            self.log(f"real engine: loaded {self.opts.model} in {self.load_s:.1f} s ({self.model.threads_desc})")
        return self.model


def _request_rows(result: Any) -> list[dict[str, Any]]:
    return [{k: r.get(k) for k in REQUEST_FIELDS} for r in result.requests]


def _run_one(kind: str, cell_cfg: dict[str, Any], workload: Any, opts: RealOptions, model: _Model,
             progress: bool, desc: str) -> dict[str, Any]:
    """One run of the slice: `kind` "real" (the numpy engine) or "sim" (the study's latency model), with the
    same server config (the model's facts, the scaled cache size)."""
    from experiments.replay import engine_setup, engine_simulation
    from sim.driver import Simulation
    from sim.latency_spec import get_latency_model

    m = model.get()
    study_cfg = server_config(cell_cfg)
    keep_ctx = bool(cell_cfg["server"].get("n_ctx"))
    cfg, sim_kw = engine_setup(m, study_cfg, keep_n_ctx_train=keep_ctx)
    cache_mib = scaled_cache_mib(cell_cfg["cache_ram"], study_cfg.kv_bytes_per_token, cfg.kv_bytes_per_token)
    cfg = dataclasses.replace(cfg, cache_ram_mib=cache_mib)
    seed = cell_cfg["workload"]["seed"]
    t0 = time.perf_counter()
    if kind == "real":
        from tqdm import tqdm

        from experiments.runs import follow

        with tqdm(total=n_requests_of(workload), unit="req", desc=desc, file=sys.stderr, leave=False,
                  disable=not progress) as bar:
            sim, cfg = engine_simulation(m, cfg, seed, opts.temp, keep_n_ctx_train=True, progress=follow(bar))
            result = sim.run(workload)
        threads_desc = m.threads_desc
    else:
        result = Simulation(cfg, get_latency_model(cell_cfg["latency"]), seed=seed, **sim_kw).run(workload)
        threads_desc = ""
    metrics = metrics_of(result, time.perf_counter() - t0)
    load = result.run.get("load") or {}
    return {"metrics": {k: metrics[k] for k in RUN_METRICS}, "requests": _request_rows(result),
            "load": {k: load.get(k) for k in ("arrival_rps", "service_rps", "backlog_at_last_arrival", "saturated")},
            "cache_ram_mib": cache_mib, "kv_bytes_per_token": cfg.kv_bytes_per_token,
            "study_kv_bytes_per_token": study_cfg.kv_bytes_per_token, "threads_desc": threads_desc}


def verdict(study_direction: str, real_direction: str, real_evictions: int) -> str:
    """"holds" / "does not hold" the study's direction on the measured pair, or "untested" when neither
    real run evicted an entry (the slice cannot separate the policies)."""
    if real_evictions == 0:
        return "untested"
    return "holds" if real_direction == study_direction else "does not hold"


class _Runs:
    """Every run of the check, stored under a hash of what it depends on and reused when found."""

    def __init__(self, plan: Any, opts: RealOptions, store_dir: Path, progress: bool,
                 log: Callable[[str], None]) -> None:
        self.plan, self.opts, self.progress, self.log = plan, opts, progress, log
        self.store = CellStore(store_dir)
        self.model = _Model(opts, log)
        self.n_real = self.done_real = self.reused = 0

    def get(self, kind: str, pick: Mapping[str, Any], evict: str, n: int) -> dict[str, Any]:
        cell_cfg = _cell_config(self.plan, pick, evict)
        key_cfg = {"real": REAL_VERSION, "code": code_fingerprint(), "kind": kind, "cell": cell_cfg, "n": n,
                   "max_output": self.opts.max_output, "model": self.opts.model_id(), "temp": self.opts.temp,
                   **({"threads": self.opts.threads} if kind == "real" else {})}
        key = cell_key(key_cfg)
        rec = self.store.get(key)
        if kind == "real":
            self.done_real += 1
        if rec is not None and rec.get("status") == "ok":
            self.reused += kind == "real"
            return rec["row"]
        wkey = f"{pick['workload']}|{pick['seed']}|{pick['load']:g}"
        sliced = first_requests(self.plan.workloads[wkey], n, self.opts.max_output)
        tag = f"real engine {self.done_real}/{self.n_real}"
        if kind == "real":
            self.log(f"{tag}: {pick['role']} cell ({pick['workload']}, {pick['cache_hit']} hits, "
                     f"{pick['cache_ram']} MiB, load {pick['load']:g}, seed {pick['seed']}), {evict}: first "
                     f"{n_requests_of(sliced)} requests ...")
        row = _run_one(kind, cell_cfg, sliced, self.opts, self.model, self.progress, f"{tag} {evict}")
        self.store.put(key, {"key": key, "config": key_cfg, "status": "ok", "row": row})
        if kind == "real":
            m = row["metrics"]
            self.log(f"{tag}: token hit rate {100 * m['token_hit_rate']:.1f}%, {m['evictions']} evictions, "
                     f"TTFT P50 {m['ttft_p50_s']:.2f} s, {m['wall_s']:.0f} s")
        return row


def _diff(runs: Mapping[str, Mapping[str, Any]], base: str, kind: str = "") -> float:
    get = (lambda e: runs[e][kind]) if kind else (lambda e: runs[e])
    return 100.0 * (get(OTHER)["metrics"]["token_hit_rate"] - get(base)["metrics"]["token_hit_rate"])


def run_real(cells: pd.DataFrame, out_dir: Path, *, plan: Any, opts: RealOptions, store_dir: Path,
             progress: bool = True, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Pick the two configurations, run (or reuse) their slices real and simulated, write real.json,
    real_runs.parquet and real_requests.parquet into `out_dir`; returns real.json's content. An engine
    failure is caught and returned as {"error": ...} (the simulated results are kept).

    Where the simulated slice does not show the study's direction, the simulator (only) is also run on
    slices of 2N, 4N, ... requests, to say from which length on it does (`sim_longer`)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    t0 = time.perf_counter()
    base = plan.spec.baseline
    info: dict[str, Any] = {"slotlab_study_real": REAL_VERSION, "n_requests": opts.n_requests,
                            "max_output": opts.max_output, "model": opts.model, "threads": opts.threads,
                            "baseline": base, "other": OTHER, "cells": []}
    runs = _Runs(plan, opts, store_dir, progress, log)
    try:
        picks = pick_cells(cells, base)
        runs.n_real = 2 * len(picks)
        for p in picks:
            r = p["runs"] = {e: {k: runs.get(k, p, e, opts.n_requests) for k in ("sim", "real")}
                             for e in (base, OTHER)}
            wkey = f"{p['workload']}|{p['seed']}|{p['load']:g}"
            total = n_requests_of(plan.workloads[wkey])
            p["n_requests"] = int(r[base]["real"]["metrics"]["n_requests"])
            p["workload_requests"] = total
            p["cache_ram_real"] = r[base]["real"]["cache_ram_mib"]
            info["kv_bytes_per_token"] = {"study": r[base]["real"]["study_kv_bytes_per_token"],
                                          "model": r[base]["real"]["kv_bytes_per_token"]}
            info["threads_desc"] = r[base]["real"]["threads_desc"]
            for kind in ("sim", "real"):
                p[f"{kind}_diff"] = _diff(r, base, kind)
                p[f"{kind}_direction"] = measured_direction(p[f"{kind}_diff"])
            p["real_evictions"] = int(sum(r[e]["real"]["metrics"]["evictions"] for e in (base, OTHER)))
            p["verdict"] = verdict(p["study"]["direction"], p["real_direction"], p["real_evictions"])
            p["holds"] = p["verdict"] == "holds"
            p["agrees_with_sim"] = p["real_direction"] == p["sim_direction"]
            p["sim_longer"] = None
            if p["study"]["direction"] != "same" and p["sim_direction"] != p["study"]["direction"]:
                n = opts.n_requests
                while n < total:
                    n = min(2 * n, total)
                    d = _diff({e: runs.get("sim", p, e, n) for e in (base, OTHER)}, base)
                    if measured_direction(d) == p["study"]["direction"]:
                        p["sim_longer"] = {"n": n, "diff": d}
                        break
            info["cells"].append(p)
        info["reused_real_runs"] = runs.reused
        info["model_load_s"] = runs.model.load_s
    except Exception as e:  # noqa: BLE001 - the engine failing must not lose the simulated study
        info["error"] = f"{type(e).__name__}: {e}"
        info["traceback"] = traceback.format_exc()[-4000:]
        log(f"real engine: failed: {info['error']}")
    info["wall_s"] = time.perf_counter() - t0
    return _write(out_dir, info)


def _write(out_dir: Path, info: dict[str, Any]) -> dict[str, Any]:
    """real_runs.parquet (one row per run), real_requests.parquet (one row per request of every run) and
    real.json (everything but the request rows), which is returned."""
    runs, reqs = [], []
    for p in info.get("cells", []):
        for evict, kinds in p.get("runs", {}).items():
            for kind, row in kinds.items():
                at = {"role": p["role"], "workload": p["workload"], "cache_hit": p["cache_hit"],
                      "cache_ram": p["cache_ram"], "cache_ram_real": row["cache_ram_mib"], "load": p["load"],
                      "seed": p["seed"], "evict": evict, "backend": "numpy" if kind == "real" else "sim"}
                runs.append({**at, **row["metrics"]})
                reqs += [{**at, **q} for q in row["requests"]]
    slim = {**info, "cells": [{**p, "runs": {e: {k: {f: v for f, v in row.items() if f != "requests"}
                                                 for k, row in kinds.items()}
                                             for e, kinds in p.get("runs", {}).items()}}
                              for p in info.get("cells", [])]}
    write_json(out_dir / REAL_JSON, slim)
    if runs:
        pd.DataFrame(runs).to_parquet(out_dir / RUNS_PARQUET, index=False)
        pd.DataFrame(reqs).to_parquet(out_dir / REQUESTS_PARQUET, index=False)
    return json.loads((out_dir / REAL_JSON).read_text())
