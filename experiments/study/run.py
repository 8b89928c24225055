"""Running a study: spec -> cells -> sweep runner (resumable) -> cells.parquet, report.md, plots, study.json.

Layout: `<root>/<name>/cells/<key>.json` is the cell store shared by every run of the study (a rerun
skips the cells found there); each run writes `<root>/<name>/<timestamp>/` (or `--out DIR`, whose store
is `DIR/cells`).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.results import write_json
from experiments.runs import versions
from experiments.study.cell import (
    CELL_VERSION,
    build_workload,
    code_fingerprint,
    find_trace,
    run_cell,
)
from experiments.study.report import write_report
from experiments.study.spec import REUSE_PARAMS, SpecError, StudySpec
from experiments.study.stats import oracle_gap
from experiments.sweep import Cell, CellStore, cell_key, run_cells

CELLS_PARQUET = "cells.parquet"
METRICS = ("token_hit_rate", "entry_hit_rate", "evictions", "cache_hits", "cache_misses", "cache_saves",
           "bytes_to_cache", "bytes_from_cache", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p90_s",
           "throughput_rps", "output_tokens_per_s", "n_requests", "n_errors", "n_prompt_tokens", "n_cached_tokens",
           "sim_s", "wall_s")


@dataclass
class Plan:
    """A study resolved for running: its cells, the workloads they share, what was skipped and why."""

    spec: StudySpec
    cells: list[Cell]
    workloads: dict[str, Any]
    descriptions: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)


def describe_workload(w: Any) -> str:
    p = w.params
    reuse = ", ".join(f"{k} = {p[k]}" for k in REUSE_PARAMS[w.kind] if k in p)
    size = {"chat": lambda: f"{p['users']} users × {p['turns']} turns, think time {p['think_time']:g} s / load",
            "zipf_conversations": lambda: f"{p['n_requests']} requests at {p['rate']:g} req/s × load",
            "tenants": lambda: f"{p['n_requests']} requests at {p['rate']:g} req/s × load",
            "trace": lambda: f"first {p['max_requests']} requests"
                             + (f" at {p['rate']:g} req/s × load" if p["rate"] > 0 else "")}[w.kind]()
    return f"{w.kind} ({size}; reuse set by {reuse})"


def plan_study(spec: StudySpec, traces_dir: str | None = None) -> Plan:
    """Every cell of the spec, with the workloads built once per (workload, seed, load). Raises SpecError
    for a required trace that is missing; an optional one is skipped with the reason."""
    code = code_fingerprint()
    cells: list[Cell] = []
    workloads: dict[str, Any] = {}
    descriptions: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for w in spec.workloads:
        trace_path = None
        if w.kind == "trace":
            found = find_trace(w.params["path"], w.params.get("spec_dir"), traces_dir)
            if found is None:
                why = f"trace file {w.params['path']!r} not found (looked in --traces-dir, $SLOTLAB_TRACES_DIR, " \
                      "the spec's directory, the current directory and ../shared/traces)"
                if w.optional:
                    skipped[w.name] = why
                    continue
                raise SpecError(spec.source, None, f"workloads.{w.name}.path", why)
            trace_path = str(found)
        descriptions[w.name] = describe_workload(w)
        params = {k: v for k, v in w.params.items() if k != "spec_dir"}
        if trace_path:
            params["path"] = trace_path
        for seed in spec.seeds:
            for load in spec.axes["load"]:
                wkey = f"{w.name}|{seed}|{load:g}"
                workloads[wkey] = build_workload(w.kind, params, seed, load, trace_path)
                for evict in spec.axes["evict"]:
                    for hit in spec.axes["cache_hit"]:
                        for ram in spec.axes["cache_ram"]:
                            config = {"cell": CELL_VERSION, "code": code, "study": spec.name,
                                      "workload": {"name": w.name, "kind": w.kind, **params, "seed": seed,
                                                   "load": load},
                                      "server": spec.server, "latency": spec.latency,
                                      "evict": evict, "cache_hit": hit, "cache_ram": ram}
                            cells.append(Cell(cell_key(config), config, wkey))
    if not cells:
        raise SpecError(spec.source, None, "workloads", "no workload left to run: " + "; ".join(
            f"{k}: {v}" for k, v in skipped.items()))
    return Plan(spec, cells, workloads, descriptions, skipped)


def cells_frame(records: Sequence[dict[str, Any]]) -> pd.DataFrame:
    """One row per cell: config fields, status, error, every metric (NaN for failed cells)."""
    rows = []
    for r in records:
        c = r["config"]
        w = c["workload"]
        status = r["status"]
        row = {"study": c["study"], "workload": w["name"], "kind": w["kind"], "seed": w["seed"], "load": w["load"],
               "evict": c["evict"], "cache_hit": c["cache_hit"], "cache_ram": c["cache_ram"],
               "latency": c["latency"],
               **{f"server_{k}": v for k, v in sorted(c["server"].items())},
               "workload_params": json.dumps({k: v for k, v in w.items() if k not in ("name", "kind", "seed", "load")},
                                             sort_keys=True),
               "key": r["key"], "code": c["code"], "status": "ok" if status == "ok" else "error",
               "error": None if status == "ok" else status.removeprefix("error: ")}
        m = r.get("row") or {}
        for k in METRICS:
            v = m.get(k)
            row[k] = math.nan if v is None else v
        rows.append(row)
    df = pd.DataFrame.from_records(rows)
    for k in METRICS:
        df[k] = pd.to_numeric(df[k], errors="coerce").astype("float64")
    return df


def real_files(out_dir: Path, real: dict[str, Any] | None) -> list[str]:

    from experiments.study.real import REAL_JSON, REQUESTS_PARQUET, RUNS_PARQUET

    return [f for f in (REAL_JSON, RUNS_PARQUET, REQUESTS_PARQUET) if real is not None and (out_dir / f).is_file()]


def add_gaps(df: pd.DataFrame, oracle: str) -> pd.DataFrame:

    df["gap_to_oracle_pts"] = oracle_gap(df, oracle) if oracle else math.nan
    return df


def run_study(spec: StudySpec, out_dir: Path, store_dir: Path, *, jobs: int, dask: Any = None,
              progress: bool = True, plan: Plan | None = None, argv: Sequence[str] = (),
              runner_desc: str = "", real: Callable[[pd.DataFrame, Path, Plan], dict[str, Any]] | None = None,
              log: Callable[[str], None] | None = None, plots: bool = True) -> dict[str, Any]:
    """Run (or resume) the study and write its results into `out_dir`; returns the study.json content.
    `real(cells, out_dir, plan)`: the real-engine check (experiments/study/real.py), run after the cells;
    its result is real.json's content, which the report's "Real engine" section is written from."""

    log = log or (lambda msg: print(msg, file=sys.stderr))
    plan = plan or plan_study(spec)
    t0 = time.perf_counter()
    records, counts = run_cells(plan.cells, run_cell, plan.workloads, CellStore(store_dir), jobs=jobs, dask=dask,
                                progress=progress, desc=f"study {spec.name}", log=log)
    wall = time.perf_counter() - t0
    df = add_gaps(cells_frame(records), spec.oracle)
    df.to_parquet(out_dir / CELLS_PARQUET, index=False)
    from experiments.study.plots import (
        plot_study,  # matplotlib only when plots are wanted
    )

    plots = plot_study(df, out_dir, spec.oracle) if plots and (df["status"] == "ok").any() else []
    real_rows = real(df, out_dir, plan) if real is not None else None
    meta = {"name": spec.name, "description": spec.description, "baseline": spec.baseline, "oracle": spec.oracle,
            "workloads": plan.descriptions, "skipped_workloads": plan.skipped, "n_configs": len(plan.cells) // max(
                1, len(spec.seeds)), "seeds": list(spec.seeds), "wall_s": wall, "counts": counts, "plots": plots,
            "runner": runner_desc, "real": real_rows}
    (out_dir / "report.md").write_text(write_report(df, meta), encoding="utf-8")

    vers = versions()
    for pkg in ("dask", "distributed"):
        try:
            vers[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            vers[pkg] = "not installed"
    study_json = {"slotlab_study": 1, "spec": spec.as_dict(), "versions": vers, "code": code_fingerprint(),
                  "command": shlex.join(["slotlab", *argv]), "rerun": shlex.join(["slotlab", *argv]),
                  "cell_store": str(store_dir), "counts": counts, "wall_s": wall, "runner": runner_desc,
                  "skipped_workloads": plan.skipped, "files": [CELLS_PARQUET, "report.md", *plots, *real_files(out_dir, real_rows)],
                  "real": real_rows}
    write_json(out_dir / "study.json", study_json)
    return study_json
