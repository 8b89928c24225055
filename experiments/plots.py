"""PNG plots of a run and of a comparison: latency CDFs, prompt-cache hit rate over time, slot occupancy,
and per-configuration overlays and bars. Plots are for people: every axis says its unit.

Uses `matplotlib.figure.Figure` directly (Agg canvas, no pyplot global state), so it is safe in worker
processes and needs no display.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

CDF_METRICS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E latency"))
RUN_PLOTS = {"cdf": "latency_cdf.png", "hit_rate": "cache_hit_rate.png", "occupancy": "occupancy.png"}
COMPARE_PLOTS = {"cdf": "compare_latency_cdf.png", "bars": "compare_bars.png"}
DPI = 110


def _finite_positive(values: pd.Series) -> np.ndarray:
    """Values a log axis can show (latencies of 0 s, e.g. no queueing, cannot be placed on it)."""
    v = values.to_numpy(dtype="float64", na_value=np.nan)
    return np.sort(v[np.isfinite(v) & (v > 0)])


LINE_STYLES = ("-", "--", "-.", ":")   # identical runs overlap exactly: a second style keeps both visible


def _cdf_line(ax, values: np.ndarray, label: str, style: str = "-") -> None:
    if values.size:
        y = np.arange(1, values.size + 1) / values.size  # [n] fraction of requests <= x
        ax.step(values, y, where="post", label=label, ls=style)


def _finished(requests: pd.DataFrame) -> pd.DataFrame:
    return requests[requests["finish"] != "error"]


def plot_latency_cdf(requests: pd.DataFrame, path: str | Path, title: str | None = None) -> Path:
    """Empirical CDFs of TTFT, TPOT and E2E over finished requests, log x, P50/P99 marked in the legend."""
    fig = Figure(figsize=(13, 4), layout="constrained")
    axes = fig.subplots(1, len(CDF_METRICS))
    ok = _finished(requests)
    for ax, (col, name) in zip(axes, CDF_METRICS):
        v = _finite_positive(ok[col])
        if v.size:
            p50, p99 = np.percentile(v, [50, 99])
            _cdf_line(ax, v, f"n={v.size}  P50={p50:.3g} s  P99={p99:.3g} s")
            ax.axhline(0.5, color="0.7", lw=0.8, ls=":")
            ax.axhline(0.99, color="0.7", lw=0.8, ls=":")
            ax.set_xscale("log")
            ax.legend(loc="lower right", fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        ax.set_xlabel(f"{name} (s, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(title or "Latency CDFs (finished requests)")
    fig.savefig(path, dpi=DPI)
    return Path(path)


def rolling_hit_rate(timeline: pd.DataFrame, window_s: float) -> np.ndarray:
    """Prompt-cache hit rate over the trailing `window_s` at each timeline row: cached / (cached + processed)
    prompt tokens counted in (t - window_s, t]; NaN where no prompt token was counted in the window."""
    t = timeline["t_s"].to_numpy(dtype="float64")                       # [n] non-decreasing
    cached = timeline["cum_prompt_cached"].to_numpy(dtype="float64")    # [n] cumulative
    total = cached + timeline["cum_prompt_processed"].to_numpy(dtype="float64")
    j = np.searchsorted(t, t - window_s, side="right") - 1              # [n] last row at or before t - window
    base_c = np.where(j >= 0, cached[np.maximum(j, 0)], 0.0)
    base_t = np.where(j >= 0, total[np.maximum(j, 0)], 0.0)
    d_total = total - base_t
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d_total > 0, (cached - base_c) / d_total, np.nan)


def default_window_s(timeline: pd.DataFrame) -> float:
    """A window of 1/20 of the run, at least 1 s: smooth enough to read, short enough to show phases."""
    if timeline.empty:
        return 1.0
    span = float(timeline["t_s"].iloc[-1] - timeline["t_s"].iloc[0])
    return max(1.0, span / 20)


def plot_hit_rate(timeline: pd.DataFrame, path: str | Path, window_s: float | None = None,
                  title: str | None = None) -> Path:
    """Prompt-cache hit rate over time: rolling (trailing window) and cumulative since the start."""
    window_s = window_s or default_window_s(timeline)
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.subplots()
    if not timeline.empty:
        t = timeline["t_s"].to_numpy(dtype="float64")
        cached = timeline["cum_prompt_cached"].to_numpy(dtype="float64")
        total = cached + timeline["cum_prompt_processed"].to_numpy(dtype="float64")
        with np.errstate(invalid="ignore", divide="ignore"):
            cumulative = np.where(total > 0, cached / total, np.nan)
        ax.plot(t, 100 * rolling_hit_rate(timeline, window_s), label=f"rolling ({window_s:.3g} s window)")
        ax.plot(t, 100 * cumulative, ls="--", label="cumulative since start")
        ax.legend(loc="lower right")
    ax.set_ylim(-2, 102)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("prompt-cache hit rate (% of prompt tokens)")
    ax.set_title(title or "Prompt-cache hit rate over time (cached / (cached + processed) prompt tokens)")
    ax.grid(True, alpha=0.3)
    fig.savefig(path, dpi=DPI)
    return Path(path)


def plot_occupancy(timeline: pd.DataFrame, path: str | Path, n_slots: int | None = None,
                   title: str | None = None) -> Path:
    """Busy slots, waiting requests (queued + deferred) and host-RAM prompt-cache size vs time."""
    fig = Figure(figsize=(10, 7), layout="constrained")
    ax_slots, ax_queue, ax_cache = fig.subplots(3, 1, sharex=True)
    if not timeline.empty:
        t = timeline["t_s"].to_numpy(dtype="float64")
        ax_slots.step(t, timeline["busy_slots"], where="post", label="busy slots")
        if n_slots:
            ax_slots.axhline(n_slots, color="tab:red", ls="--", lw=1, label=f"slots (-np) = {n_slots}")
        ax_queue.step(t, timeline["queued"], where="post", label="queued (not yet started)")
        ax_queue.step(t, timeline["deferred"], where="post", label="deferred (waiting for a slot)")
        ax_cache.step(t, timeline["cache_bytes"] / 2**20, where="post", color="tab:green",
                      label="prompt cache size")
        for ax in (ax_slots, ax_queue, ax_cache):
            ax.legend(loc="upper right", fontsize="small")
    ax_slots.set_ylabel("busy slots")
    ax_queue.set_ylabel("requests waiting")
    ax_cache.set_ylabel("prompt cache (MiB)")
    ax_cache.set_xlabel("simulated time (s)")
    for ax in (ax_slots, ax_queue, ax_cache):
        ax.grid(True, alpha=0.3)
    fig.suptitle(title or "Slot occupancy and queue length over time")
    fig.savefig(path, dpi=DPI)
    return Path(path)


def plot_run(out_dir: str | Path, requests: pd.DataFrame, timeline: pd.DataFrame, n_slots: int | None = None,
             title: str | None = None) -> list[Path]:
    """The three plots of one run, written into `out_dir` (names in RUN_PLOTS)."""
    out = Path(out_dir)
    prefix = f"{title}: " if title else ""
    return [
        plot_latency_cdf(requests, out / RUN_PLOTS["cdf"], title=f"{prefix}latency CDFs (finished requests)"),
        plot_hit_rate(timeline, out / RUN_PLOTS["hit_rate"],
                      title=f"{prefix}prompt-cache hit rate over time" if title else None),
        plot_occupancy(timeline, out / RUN_PLOTS["occupancy"], n_slots=n_slots,
                       title=f"{prefix}slot occupancy and queue length" if title else None),
    ]


# --- comparison ------------------------------------------------------------------------------------


def plot_compare_cdf(runs: Mapping[str, pd.DataFrame], path: str | Path) -> Path:
    """TTFT, TPOT and E2E CDFs, one line per configuration (label -> its per-request table)."""
    fig = Figure(figsize=(14, 4.8), layout="constrained")
    axes = fig.subplots(1, len(CDF_METRICS))
    for ax, (col, name) in zip(axes, CDF_METRICS):
        for i, (label, requests) in enumerate(runs.items()):
            _cdf_line(ax, _finite_positive(_finished(requests)[col]), label, LINE_STYLES[i % len(LINE_STYLES)])
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel(f"{name} (s, log scale)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(3, len(labels)), fontsize="small")
    fig.suptitle("Latency CDFs per configuration (finished requests)")
    fig.savefig(path, dpi=DPI)
    return Path(path)


def plot_compare_bars(comparison: pd.DataFrame, path: str | Path, label_column: str = "label") -> Path:
    """Bars per configuration: P50 and P99 TTFT (s) and prompt-cache hit rate (%)."""
    n = len(comparison)
    fig = Figure(figsize=(max(9, 1.2 * n + 5), 5), layout="constrained")
    ax_ttft, ax_hit = fig.subplots(1, 2)
    x = np.arange(n)
    labels = comparison[label_column].astype(str).tolist()
    width = 0.4
    ax_ttft.bar(x - width / 2, comparison["ttft_p50_s"], width, label="P50")
    ax_ttft.bar(x + width / 2, comparison["ttft_p99_s"], width, label="P99")
    top = np.nanmax(comparison["ttft_p99_s"].to_numpy(dtype="float64")) if n else np.nan
    if np.isfinite(top) and top > 0:
        ax_ttft.set_ylim(0, 1.2 * top)   # headroom for the legend
    ax_ttft.set_ylabel("TTFT (s)")
    ax_ttft.set_title("Time to first token")
    ax_ttft.legend(loc="upper left", ncols=2)
    bars = ax_hit.bar(x, 100 * comparison["prompt_cache_hit_rate"], width * 1.5, color="tab:green")
    ax_hit.bar_label(bars, fmt="%.1f", fontsize="small")
    ax_hit.set_ylabel("prompt-cache hit rate (% of prompt tokens)")
    ax_hit.set_ylim(0, 105)
    ax_hit.set_title("Prompt-cache hit rate")
    for ax in (ax_ttft, ax_hit):
        ax.set_xticks(x, labels, rotation=30 if n > 2 else 0, ha="right" if n > 2 else "center",
                      fontsize="small")
        ax.set_xlabel("configuration")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Per-configuration latency and cache hit rate")
    fig.savefig(path, dpi=DPI)
    return Path(path)
