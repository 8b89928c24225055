"""report.md of a study: every sentence is computed from the cells (paired-by-seed differences against the
baseline, the gap to the oracle), so a changed policy or workload changes the report. Nothing in it is
written in advance except the frame of each sentence."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from experiments.study.stats import paired, summarize_metric

PRIMARY = "token_hit_rate"


def _pts(x: float) -> str:
    return f"{x:+.1f}" if math.isfinite(x) else "n/a"


def _ci(lo: float, hi: float) -> str:
    return f"[{lo:+.1f}, {hi:+.1f}]" if math.isfinite(lo) and math.isfinite(hi) else "[n/a: one seed]"


def _mib(x: Any) -> str:
    return f"{int(x)} MiB"


def _load(x: Any) -> str:
    return f"load {float(x):g}"


def _where(rows: pd.DataFrame, many_loads: bool) -> str:
    """'128 MiB (load 1: +2.1 [0.8, 3.4]; load 2: +1.0 [0.2, 1.8]), 512 MiB (...)'."""
    parts = []
    for size, g in rows.sort_values(["cache_ram", "load"]).groupby("cache_ram", sort=True):
        inner = "; ".join((f"{_load(r.load)}: " if many_loads else "") + f"{_pts(r.mean)} {_ci(r.lo, r.hi)}"
                          for r in g.itertuples())
        parts.append(f"{_mib(size)} ({inner})")
    return ", ".join(parts)


def _cells_list(rows: pd.DataFrame, many_loads: bool) -> str:
    if not many_loads:
        return ", ".join(_mib(s) for s in sorted(rows["cache_ram"].unique()))
    parts = []
    for size, g in rows.sort_values(["cache_ram", "load"]).groupby("cache_ram", sort=True):
        parts.append(f"{_mib(size)} ({', '.join(_load(x) for x in g['load'])})")
    return ", ".join(parts)


def _join(names: Sequence[str]) -> str:
    names = [f"`{n}`" for n in names]
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " and " + names[-1]


def findings(cells: pd.DataFrame, baseline: str, oracle: str) -> dict[tuple[str, str], list[str]]:
    """(workload, cache_hit) -> the generated sentences about it."""
    diffs = paired(cells, PRIMARY, baseline, scale=100.0)
    ttft = paired(cells, "ttft_p90_s", baseline)
    absolute = summarize_metric(cells, PRIMARY, scale=100.0)
    ok = cells[cells["status"] == "ok"]
    out: dict[tuple[str, str], list[str]] = {}
    many_loads = ok["load"].nunique() > 1
    for (wl, hit), d in diffs.groupby(["workload", "cache_hit"], sort=False):
        s: list[str] = []
        n_cells = d.groupby(["cache_ram", "load"]).ngroups
        online = d[d["evict"] != oracle]
        ident = [p for p, g in online.groupby("evict", sort=False) if g["identical"].all()]
        if ident:
            s.append(f"{_join(ident)} gave results identical to `{baseline}` in all {n_cells} cells "
                     f"(every size, load and seed).")
        sub = ok[(ok["workload"] == wl) & (ok["cache_hit"] == hit)]
        no_evict = sorted(size for size, g in sub.groupby("cache_ram") if (g["evictions"] == 0).all())
        if no_evict:
            s.append(f"At {', '.join(_mib(x) for x in no_evict)} no policy evicted an entry in any run, so every "
                     f"policy is the same there.")
        for p, g in online.groupby("evict", sort=False):
            if p in ident:
                continue
            win = g[g["significant"] & (g["mean"] > 0)]
            lose = g[g["significant"] & (g["mean"] < 0)]
            flat = g[~g["significant"]]
            bits = []
            if len(win):
                best = win.loc[win["mean"].idxmax()]
                bits.append(f"beats `{baseline}` in {len(win)} of {len(g)} cells, by up to {_pts(best['mean'])} "
                            f"points {_ci(best['lo'], best['hi'])} at {_mib(best['cache_ram'])}"
                            + (f", {_load(best['load'])}" if many_loads else "")
                            + f"; where it wins: {_where(win, many_loads)}")
            if len(lose):
                worst = lose.loc[lose["mean"].idxmin()]
                bits.append(f"is worse than `{baseline}` in {len(lose)} of {len(g)} cells, by up to {_pts(worst['mean'])} "
                            f"points {_ci(worst['lo'], worst['hi'])} at {_mib(worst['cache_ram'])}"
                            + (f", {_load(worst['load'])}" if many_loads else ""))
            if len(flat):
                bits.append(f"shows no significant difference at {_cells_list(flat, many_loads)}")
            if not len(win) and not len(lose):
                big = g.loc[g["mean"].abs().idxmax()]
                bits = [f"is never significantly different from `{baseline}` (largest mean difference "
                        f"{_pts(big['mean'])} points, at {_mib(big['cache_ram'])}"
                        + (f", {_load(big['load'])}" if many_loads else "") + ")"]
            s.append(f"`{p}` " + "; ".join(bits) + ".")
        if oracle and oracle in set(d["evict"]) and not d[d["evict"] == oracle]["identical"].all():
            od = d[d["evict"] == oracle]
            best = od.loc[od["mean"].idxmax()]

            key = (best["cache_ram"], best["load"])
            sent = (f"The oracle `{oracle}` is above `{baseline}` by up to {_pts(best['mean'])} points "
                    f"{_ci(best['lo'], best['hi'])} at {_mib(key[0])}" + (f", {_load(key[1])}" if many_loads else "")
                    + ("" if best["significant"] else " (not significant)"))
            at = online[(online["cache_ram"] == key[0]) & (online["load"] == key[1])]
            if len(at) and best["mean"] > 0:
                top = at.loc[at["mean"].idxmax()]
                if top["mean"] > best["mean"]:
                    sent += (f"; there the best online policy, `{top['evict']}`, is above the oracle "
                             f"({_pts(top['mean'])} points over `{baseline}`)")
                else:
                    share = max(0.0, top["mean"]) / best["mean"]
                    sent += (f"; there the best online policy, `{top['evict']}`, closes {100 * share:.0f}% of that "
                             f"gap ({_pts(top['mean'])} points), leaving {best['mean'] - max(0.0, top['mean']):.1f}")
            s.append(sent + ".")
            beat = []
            for r in online.itertuples():
                o = od[(od["cache_ram"] == r.cache_ram) & (od["load"] == r.load)]
                if len(o) and r.significant and r.mean > o["mean"].iloc[0] + 1e-9:
                    beat.append((r.evict, r.cache_ram, r.load, r.mean - o["mean"].iloc[0]))
            if beat:
                e, size, load, by = max(beat, key=lambda x: x[3])
                s.append(f"An online policy beats the oracle in {len(beat)} cells (most: `{e}` at {_mib(size)}"
                         + (f", {_load(load)}" if many_loads else "") + f", by {by:.1f} points in the mean): with "
                         "entries of unequal size and prefix matches, furthest-next-use is a reference, not a bound.")
        elif oracle and oracle in set(d["evict"]):
            s.append(f"The oracle `{oracle}` gave results identical to `{baseline}` in every cell: eviction order "
                     "has nothing to gain on this workload at these sizes.")
        # latency where the largest significant win is
        wins = online[online["significant"] & (online["mean"] > 0)]
        if len(wins):
            w = wins.loc[wins["mean"].idxmax()]
            t = ttft[(ttft["workload"] == wl) & (ttft["cache_hit"] == hit) & (ttft["evict"] == w["evict"])
                     & (ttft["cache_ram"] == w["cache_ram"]) & (ttft["load"] == w["load"])]
            if len(t):
                t = t.iloc[0]
                sig = "significant" if t["significant"] else "not significant"
                s.append(f"In that best cell (`{w['evict']}`, {_mib(w['cache_ram'])}"
                         + (f", {_load(w['load'])}" if many_loads else "")
                         + f") TTFT P90 changes by {t['mean']:+.3g} s [{t['lo']:+.3g}, {t['hi']:+.3g}] ({sig}).")
        base_abs = absolute[(absolute["workload"] == wl) & (absolute["cache_hit"] == hit)
                            & (absolute["evict"] == baseline)]
        if len(base_abs):
            lo, hi = base_abs["mean"].min(), base_abs["mean"].max()
            s.append(f"`{baseline}`'s token hit rate here ranges from {lo:.1f}% to {hi:.1f}% over the sizes and loads.")
        out[(wl, hit)] = s
    return out


def _table(cells: pd.DataFrame, wl: str, hit: str, baseline: str, oracle: str) -> list[str]:
    """Markdown table: rows (size, load), columns: baseline hit rate, then each policy's difference."""
    sub = cells[(cells["workload"] == wl) & (cells["cache_hit"] == hit)]
    diffs = paired(sub, PRIMARY, baseline, scale=100.0)
    absolute = summarize_metric(sub, PRIMARY, scale=100.0)
    policies = [p for p in dict.fromkeys(sub["evict"]) if p != baseline]
    head = ["cache", "load", f"`{baseline}` hit %"] + [f"`{p}` − `{baseline}`" for p in policies]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (size, load), g in absolute[absolute["evict"] == baseline].groupby(["cache_ram", "load"], sort=True):
        row = [_mib(size), f"{float(load):g}", f"{g['mean'].iloc[0]:.1f}"]
        for p in policies:
            r = diffs[(diffs["evict"] == p) & (diffs["cache_ram"] == size) & (diffs["load"] == load)]
            if not len(r):
                row.append("")
                continue
            r = r.iloc[0]
            row.append("= (identical)" if r["identical"] else
                       f"{'**' if r['significant'] else ''}{_pts(r['mean'])}{'**' if r['significant'] else ''} "
                       f"{_ci(r['lo'], r['hi'])}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def write_report(cells: pd.DataFrame, meta: Mapping[str, Any]) -> str:
    """The whole report.md text. `meta`: name, baseline, oracle, workloads (name -> description),
    n_configs, seeds, wall_s, counts, plots (file names), real (optional real-engine check rows), skipped."""
    baseline, oracle = meta["baseline"], meta.get("oracle") or ""
    ok = cells[cells["status"] == "ok"]
    n_seeds = len(meta["seeds"])
    lines = [f"# Study `{meta['name']}`", ""]
    if meta.get("description"):
        lines += [meta["description"], ""]
    wl_desc = "; ".join(f"`{k}`: {v}" for k, v in meta["workloads"].items())
    lines += [f"{len(cells)} cells ({meta['n_configs']} configurations × {n_seeds} seeds), {len(ok)} finished, "
              f"{len(cells) - len(ok)} failed. Workloads: {wl_desc}.", ""]
    for name, why in meta.get("skipped_workloads", {}).items():
        lines += [f"Workload `{name}` was skipped: {why}.", ""]
    lines += ["Metric: token hit rate = cached prompt tokens / prompt tokens (slot reuse and host-RAM cache "
              f"restores together). A difference is `policy − {baseline}` in percentage points of token hit rate, "
              f"paired by seed (same workload, seed, load, hit semantics and cache size), as the mean over "
              f"{n_seeds} seeds with a 95% Student-t interval; it is significant when the interval excludes 0. "
              + (f"The gap to the oracle is `{oracle}` − policy, in points." if oracle else ""), ""]
    found = findings(cells, baseline, oracle)
    lines += ["## Main findings", ""]
    for (wl, hit), sents in found.items():
        lines.append(f"- **{wl}, `{hit}` hits**: " + " ".join(sents))
    lines.append("")
    real = meta.get("real")
    lines += ["## Real engine", ""]
    if real:
        for r in real:
            lines.append(f"- {r}")
    else:
        lines.append("Not run (`--study-real N` replays two cells on the numpy engine).")
    lines.append("")
    for wl in dict.fromkeys(ok["workload"]):
        lines += [f"## Workload `{wl}`", "", meta["workloads"].get(wl, ""), ""]
        for hit in dict.fromkeys(ok[ok["workload"] == wl]["cache_hit"]):
            lines += [f"### `{hit}` hits", ""] + [f"- {s}" for s in found.get((wl, hit), [])] + [""]
            lines += _table(ok, wl, hit, baseline, oracle) + [""]
    if meta.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in meta["plots"]] + [""]
    c = meta.get("counts", {})
    lines += ["## Run", "",
              f"{c.get('total', len(cells))} cells: {c.get('skipped', 0)} reused from earlier runs, "
              f"{c.get('ran', 0)} run, {c.get('failed', 0)} failed; wall time {meta.get('wall_s', math.nan):.0f} s "
              f"({meta.get('runner', '')}).", ""]
    return "\n".join(lines)
