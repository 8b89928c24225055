"""A study's figures: hit rate vs cache size (log x, one line per policy with its 95% CI band, one panel per
workload x hit semantics), TTFT P90 vs size, gap to the oracle, and a small-multiples page of every metric."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from experiments.study.stats import summarize_metric  # noqa: E402

PLOTS = {"hit": "hit_rate_vs_size.png", "ttft": "ttft_p90_vs_size.png", "gap": "gap_to_oracle.png",
         "multiples": "small_multiples.png"}
SMALL_MULTIPLES = (("token_hit_rate", "token hit rate (%)", 100.0), ("entry_hit_rate", "entry hit rate (%)", 100.0),
                   ("evictions", "evictions", 1.0), ("bytes_to_cache", "GiB to cache", 1 / 2**30),
                   ("bytes_from_cache", "GiB from cache", 1 / 2**30), ("ttft_p90_s", "TTFT P90 (s)", 1.0),
                   ("e2e_p90_s", "E2E P90 (s)", 1.0), ("throughput_rps", "throughput (req/s)", 1.0))


def _style(policies: list[str]) -> dict[str, dict]:
    cmap = plt.get_cmap("tab10")
    return {p: {"color": cmap(i % 10), "ls": "--" if p.startswith("belady") else "-",
                "marker": "o" if i < 5 else "s"} for i, p in enumerate(policies)}


def _panel_lines(ax, summ: pd.DataFrame, styles: dict, label: bool) -> None:
    for p, g in summ.groupby("evict", sort=False):
        g = g.sort_values("cache_ram")
        st = styles[p]
        ax.plot(g["cache_ram"], g["mean"], color=st["color"], ls=st["ls"], marker=st["marker"], ms=3, lw=1.3,
                label=p if label else None)
        if g["lo"].notna().any():
            ax.fill_between(g["cache_ram"], g["lo"], g["hi"], color=st["color"], alpha=0.15, lw=0)
    ax.set_xscale("log", base=2)
    sizes = sorted(summ["cache_ram"].unique())
    if sizes:
        ax.set_xticks(sizes, [f"{int(x)}" for x in sizes])
        ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)


def _grid_plot(cells: pd.DataFrame, metric: str, scale: float, ylabel: str, path: Path, title: str,
               load: float | None = None) -> Path:
    ok = cells[cells["status"] == "ok"]
    if load is None:
        load = float(ok["load"].max())
    ok = ok[ok["load"] == load]
    wls = list(dict.fromkeys(ok["workload"]))
    hits = list(dict.fromkeys(ok["cache_hit"]))
    policies = list(dict.fromkeys(ok["evict"]))
    styles = _style(policies)
    fig, axes = plt.subplots(len(wls), len(hits), figsize=(4.2 * len(hits), 3.0 * len(wls)), squeeze=False,
                             sharex=True)
    summ = summarize_metric(ok, metric, scale=scale)
    for i, wl in enumerate(wls):
        for j, hit in enumerate(hits):
            ax = axes[i][j]
            _panel_lines(ax, summ[(summ["workload"] == wl) & (summ["cache_hit"] == hit)], styles, i == 0 and j == 0)
            ax.set_title(f"{wl}, {hit} hits", fontsize=9)
            if j == 0:
                ax.set_ylabel(ylabel)
            if i == len(wls) - 1:
                ax.set_xlabel("--cache-ram (MiB, log)")
    fig.suptitle(f"{title} (load {load:g}; bands: 95% CI over seeds)", y=0.995, fontsize=10)
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.975), ncol=min(8, len(policies)), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_study(cells: pd.DataFrame, out: Path, oracle: str) -> list[str]:
    """Write the study's PNGs into `out`; return their file names."""
    out = Path(out)
    written = [_grid_plot(cells, "token_hit_rate", 100.0, "token hit rate (%)", out / PLOTS["hit"],
                          "Token hit rate vs cache size"),
               _grid_plot(cells, "ttft_p90_s", 1.0, "TTFT P90 (s)", out / PLOTS["ttft"], "TTFT P90 vs cache size")]
    if oracle and "gap_to_oracle_pts" in cells and cells["gap_to_oracle_pts"].notna().any():
        sub = cells[cells["evict"] != oracle]
        written.append(_grid_plot(sub, "gap_to_oracle_pts", 1.0, f"{oracle} − policy (points)", out / PLOTS["gap"],
                                  f"Gap to the {oracle} oracle"))
    written.append(_small_multiples(cells, out / PLOTS["multiples"]))
    return [p.name for p in written]


def _small_multiples(cells: pd.DataFrame, path: Path) -> Path:
    ok = cells[cells["status"] == "ok"]
    load = float(ok["load"].max())
    ok = ok[ok["load"] == load]
    cols = [(wl, hit) for wl in dict.fromkeys(ok["workload"]) for hit in dict.fromkeys(ok["cache_hit"])]
    policies = list(dict.fromkeys(ok["evict"]))
    styles = _style(policies)
    fig, axes = plt.subplots(len(SMALL_MULTIPLES), len(cols), figsize=(2.6 * len(cols), 1.9 * len(SMALL_MULTIPLES)),
                             squeeze=False, sharex=True)
    for i, (metric, label, scale) in enumerate(SMALL_MULTIPLES):
        summ = summarize_metric(ok, metric, scale=scale)
        for j, (wl, hit) in enumerate(cols):
            ax = axes[i][j]
            _panel_lines(ax, summ[(summ["workload"] == wl) & (summ["cache_hit"] == hit)], styles, i == 0 and j == 0)
            ax.tick_params(labelsize=7)
            if i == 0:
                ax.set_title(f"{wl}, {hit}", fontsize=8)
            if j == 0:
                ax.set_ylabel(label, fontsize=7)
    fig.suptitle(f"Every metric vs cache size (MiB, log x), load {load:g}", y=0.998, fontsize=9)
    fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.988), ncol=min(8, len(policies)), fontsize=7,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.965))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


