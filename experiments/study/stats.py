"""Paired-by-seed statistics of a study's cells: differences against the baseline policy and gaps to the
oracle, each with a 95% Student-t confidence interval over seeds.

Two cells are paired when they differ only in the eviction policy: same workload, seed, load, hit
semantics and cache size. Pairing removes the seed-to-seed variation of the workload itself, which is far
larger than most policy differences.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

GROUP = ["workload", "cache_hit", "cache_ram", "load"]
# two-sided 95% Student-t quantiles t(0.975, df) for df = 1..30; beyond, the normal 1.96 is within 2%
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    if df < 1:
        return math.nan
    return _T975[df - 1] if df <= len(_T975) else 1.96


def mean_ci(values: np.ndarray) -> tuple[float, float, float]:
    """(mean, low, high) of a 95% t-interval; the interval is NaN for fewer than two values."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan, math.nan
    m = float(v.mean())
    if v.size < 2:
        return m, math.nan, math.nan
    half = t975(v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return m, m - half, m + half


def paired(cells: pd.DataFrame, metric: str, baseline: str, *, scale: float = 1.0) -> pd.DataFrame:
    """For every policy other than `baseline` and every GROUP cell: the mean over seeds of
    scale * (metric(policy) - metric(baseline)), its 95% CI, n, and flags `identical` (every paired
    difference exactly 0) and `significant` (the CI excludes 0). Columns: GROUP + evict, mean, lo, hi, n,
    identical, significant."""
    ok = cells[cells["status"] == "ok"]
    base = ok[ok["evict"] == baseline][GROUP + ["seed", metric]].rename(columns={metric: "_base"})
    other = ok[ok["evict"] != baseline][GROUP + ["seed", "evict", metric]]
    m = other.merge(base, on=GROUP + ["seed"], how="inner")
    m["_d"] = scale * (m[metric] - m["_base"])
    rows = []
    for key, g in m.groupby(GROUP + ["evict"], sort=False):
        d = g["_d"].to_numpy()
        mean, lo, hi = mean_ci(d)
        identical = bool(np.all(d == 0))
        rows.append({**dict(zip(GROUP + ["evict"], key)), "mean": mean, "lo": lo, "hi": hi, "n": int(len(d)),
                     "identical": identical,
                     "significant": bool(not identical and np.isfinite(lo) and (lo > 0 or hi < 0))})
    return pd.DataFrame(rows, columns=GROUP + ["evict", "mean", "lo", "hi", "n", "identical", "significant"])


def oracle_gap(cells: pd.DataFrame, oracle: str, metric: str = "token_hit_rate") -> pd.Series:
    """Per cell: 100 * (metric of the oracle on the same workload/seed/load/hit/size - the cell's), in
    points; NaN where the oracle cell is missing."""
    ok = cells["status"] == "ok"
    ref = cells[ok & (cells["evict"] == oracle)][GROUP + ["seed", metric]].rename(columns={metric: "_oracle"})
    m = cells[GROUP + ["seed"]].merge(ref, on=GROUP + ["seed"], how="left")
    gap = 100.0 * (m["_oracle"].to_numpy() - cells[metric].to_numpy())
    return pd.Series(np.where(ok.to_numpy(), gap, np.nan), index=cells.index)


def summarize_metric(cells: pd.DataFrame, metric: str, *, scale: float = 1.0) -> pd.DataFrame:
    """Mean and 95% CI over seeds of one metric for every configuration (GROUP + evict)."""
    ok = cells[cells["status"] == "ok"]
    rows = []
    for key, g in ok.groupby(GROUP + ["evict"], sort=False):
        mean, lo, hi = mean_ci(scale * g[metric].to_numpy(dtype=np.float64))
        rows.append({**dict(zip(GROUP + ["evict"], key)), "mean": mean, "lo": lo, "hi": hi, "n": len(g)})
    return pd.DataFrame(rows, columns=GROUP + ["evict", "mean", "lo", "hi", "n"])
