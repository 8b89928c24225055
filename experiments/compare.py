"""`slotlab compare`: the cartesian product of comma-listed options, run in parallel processes on one workload,
collected into comparison.csv and comparison plots.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import pandas as pd

COMPARISON_CSV = "comparison.csv"


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


def run_grid(specs: Sequence[Any], workload: Any, runner: Callable[..., dict[str, Any]], out_dir: str | Path, *,
             jobs: int = 1, progress: bool = True, plots: bool = True) -> pd.DataFrame:
    """Run `runner(spec, workload)` for every spec (in `jobs` processes when jobs > 1) and write comparison.csv.

    Each spec has `label`, `params` (its varied options) and `out_dir`. A configuration that raises is kept as
    a row with `status` = the error; the others get status "ok". Rows keep the order of `specs`.
    """
    from tqdm import tqdm

    rows: list[dict[str, Any] | None] = [None] * len(specs)
    bar = tqdm(total=len(specs), unit="run", desc="compare", disable=not progress, leave=False)
    with bar:
        if jobs <= 1 or len(specs) <= 1:
            for i, spec in enumerate(specs):
                try:
                    rows[i] = {"status": "ok", **runner(spec, workload)}
                except Exception as exc:   # one failed configuration must not lose the others
                    rows[i] = _fail_row(exc)
                bar.update(1)
        else:
            with ProcessPoolExecutor(max_workers=min(jobs, len(specs))) as pool:
                futures = {pool.submit(runner, spec, workload): i for i, spec in enumerate(specs)}
                for fut in as_completed(futures):
                    i = futures[fut]
                    try:
                        rows[i] = {"status": "ok", **fut.result()}
                    except Exception as exc:
                        rows[i] = _fail_row(exc)
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
    from experiments.plots import COMPARE_PLOTS, plot_compare_bars, plot_compare_cdf
    from experiments.results import load_results

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
