"""`slotlab compare`: the cartesian product of comma-listed options, run in parallel processes on one workload,
collected into comparison.csv and comparison plots.
"""

from __future__ import annotations

import argparse
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm import tqdm

from experiments.flags import COMPARE, SWEEP_DESTS, add_command, option_values
from experiments.results import load_results
from experiments.runs import RunSpec, check_options, out_dir, run_context, run_one, usage_errors
from experiments.sweep import close_dask, connect_dask, execute
from experiments.workloads import build_workload

COMPARISON_CSV = "comparison.csv"
COMPARE_EPILOG = """examples:
  slotlab compare --evict fifo,lru,lfu,gdsf --cache-hit move,copy
      8 configurations (4 x 2) on the built-in chat workload
  slotlab compare --trace mooncake_trace.jsonl --max-requests 1000 -np 4,8 --cache-ram=0,2048,8192 --jobs 2
      prompt-cache size vs slot count on a trace (write negative values as --cache-ram=-1,0)
  slotlab compare --workload poisson --rate 2 --batch decode_first,prefill_first,token_budget:512 --latency default
      batch-building policies under open-loop load
"""


def expand_grid(options: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the listed values, the first option varying slowest (itertools.product order)."""
    names = list(options)
    return [dict(zip(names, combo)) for combo in itertools.product(*(options[n] for n in names))]


def _text(value: Any) -> str:
    if isinstance(value, tuple):
        return "-".join(str(v) for v in value)
    return str(value)


def config_label(varied: Mapping[str, Any]) -> str:
    """"evict=lru cache_hit=copy" (only the options that differ between configurations); "base" if none do."""
    return " ".join(f"{k}={_text(v)}" for k, v in varied.items()) or "base"


def run_subdir(index: int, label: str) -> str:
    """A directory name for a configuration: its index (keeps the grid order) and a filesystem-safe label."""
    slug = re.sub(r"[^A-Za-z0-9.=_-]+", "_", label).strip("_")
    return f"{index:03d}_{slug}"[:96]


def _fail_row(exc: BaseException) -> dict[str, Any]:
    return {"status": f"error: {type(exc).__name__}: {exc}"}


def _call_runner(spec: Any, shared: tuple[Callable[..., dict[str, Any]], Any]) -> dict[str, Any]:
    runner, workload = shared
    return runner(spec, workload)


def run_grid(specs: Sequence[Any], workload: Any, runner: Callable[..., dict[str, Any]], out_dir: str | Path, *,
             jobs: int = 1, progress: bool = True, plots: bool = True, dask: Any = None) -> pd.DataFrame:
    """Run `runner(spec, workload)` for every spec and write comparison.csv, on the sweep runner shared with
    `slotlab study` (experiments/sweep.py): `jobs` processes when jobs > 1, or a Dask client (`dask`); the
    workload is shipped once per worker.

    Each spec has `label`, `params` (its varied options) and `out_dir`. A configuration that raises is kept as
    a row with `status` = the error; the others get status "ok". Rows keep the order of `specs`.
    """
    rows: list[dict[str, Any] | None] = [None] * len(specs)
    bar = tqdm(total=len(specs), unit="run", desc="compare", disable=not progress, leave=False)
    with bar:
        for i, row, exc in execute(specs, _call_runner, (runner, workload), jobs=jobs, dask=dask):
            rows[i] = _fail_row(exc) if exc is not None else {"status": "ok", **row}
            bar.update(1)
    records = []
    for spec, row in zip(specs, rows):
        params = {k: _text(v) for k, v in spec.params.items()}
        records.append({"label": spec.label, **params, "run_dir": Path(spec.out_dir).name, **(row or {})})
    table = pd.DataFrame.from_records(records)
    out = Path(out_dir)
    table.to_csv(out / COMPARISON_CSV, index=False)
    if plots:
        write_comparison_plots(out, table)
    return table


def write_comparison_plots(out_dir: Path, table: pd.DataFrame) -> list[Path]:
    """CDF overlays (from each run's requests table) and the per-configuration bars, for the runs that worked."""
    from experiments.plots import COMPARE_PLOTS, plot_compare_bars, plot_compare_cdf  # matplotlib: only for plots

    ok = table[table["status"] == "ok"]
    if ok.empty:
        return []
    runs = {row.label: load_results(out_dir / row.run_dir).requests for row in ok.itertuples()}
    return [plot_compare_cdf(runs, out_dir / COMPARE_PLOTS["cdf"]),
            plot_compare_bars(ok, out_dir / COMPARE_PLOTS["bars"])]


def format_comparison(table: pd.DataFrame) -> str:
    """A terminal table: one line per configuration with its key metrics."""
    width = max([len("configuration")] + [len(str(x)) for x in table["label"]])
    head = (f"{'configuration':<{width}}  {'TTFT P50':>9} {'TTFT P99':>9} {'E2E P50':>9} {'E2E P99':>9} "
            f"{'hit rate':>8} {'req/s':>7} {'errors':>6}")
    lines = [head]
    for row in table.to_dict("records"):
        if row.get("status") != "ok":
            lines.append(f"{row['label']:<{width}}  {row.get('status')}")
            continue
        lines.append(f"{row['label']:<{width}}  {row['ttft_p50_s']:>9.4g} {row['ttft_p99_s']:>9.4g} "
                     f"{row['e2e_p50_s']:>9.4g} {row['e2e_p99_s']:>9.4g} "
                     f"{100 * row['prompt_cache_hit_rate']:>7.1f}% {row['throughput_rps']:>7.3g} "
                     f"{row['n_errors']:>6}")
    return "\n".join(lines)


# --- command line ----------------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    return add_command(subparsers, COMPARE, "simulate several configurations (comma lists) on one workload",
                       "Run the cartesian product of comma-listed options on one workload in\n"
                       "parallel processes; write one results directory per configuration, comparison.csv\n"
                       "and comparison plots. On/off switches and workload options apply to every run.",
                       COMPARE_EPILOG)


def _preload(plots: bool) -> None:
    """Import matplotlib once, before worker processes fork from this one (saves ~1 s per run)."""
    if plots:
        import experiments.plots  # noqa: F401  (matplotlib: only when plots are wanted)


def cmd_compare(args: argparse.Namespace, argv: Sequence[str]) -> int:
    values = option_values(args)
    grid = expand_grid({d: values[d] for d in SWEEP_DESTS})
    with usage_errors():   # every configuration is checked before any starts
        workload, desc = build_workload(values)
        for combo in grid:
            check_options({**values, **combo})
        client = connect_dask(args.dask, args.jobs) if args.dask else None   # before anything is written
        out = out_dir(args, COMPARE)
    context = run_context(argv, desc)
    specs = []
    for i, combo in enumerate(grid):
        varied = {d: v for d, v in combo.items() if len(values[d]) > 1}
        label = config_label(varied)
        specs.append(RunSpec({**values, **combo}, str(out / run_subdir(i, label)), label, varied, args.csv,
                             not args.no_plots, context))
    _preload(plots=not args.no_plots)
    try:
        table = run_grid(specs, workload, run_one, out, jobs=args.jobs, progress=not args.quiet,
                         plots=not args.no_plots, dask=client)
    finally:
        close_dask(client)
    n_failed = int((table["status"] != "ok").sum())
    if args.quiet:
        print(f"slotlab compare: {len(table)} configurations, {n_failed} failed -> {out}")
    else:
        print(format_comparison(table))
        print(f"results: {out}/  (comparison.csv, one subdirectory per configuration)")
    return 1 if n_failed else 0
