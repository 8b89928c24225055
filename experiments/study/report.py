"""report.md of a study: every sentence is computed from the cells (paired-by-seed differences against the
baseline, the gap to the oracle), so a changed policy or workload changes the report. Nothing in it is
written in advance except the frame of each sentence."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
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


def _dir_phrase(direction: str, other: str, baseline: str, study: bool = False) -> str:
    return {"better": f"`{other}` better than `{baseline}`", "worse": f"`{other}` worse than `{baseline}`",
            "same": "no significant difference" if study else "no difference",
            }.get(direction, "no measurement")


def _secs(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def _real_cell(c: Mapping[str, Any], real: Mapping[str, Any]) -> str:
    """One checked configuration, from its real.json entry."""
    base, other = real["baseline"], real["other"]
    st = c["study"]
    role = "Largest difference" if c["role"] == "largest" else "No-difference cell"
    where = f"{c['workload']}, `{c['cache_hit']}` hits, {_mib(c['cache_ram'])}, {_load(c['load'])}"
    if st["identical"]:
        found = f"the study finds `{other}` identical to `{base}` in every seed"
    else:
        found = (f"the study finds {_dir_phrase(st['direction'], other, base, study=True)}: {_pts(st['mean'])} "
                 f"points {_ci(st['lo'], st['hi'])} over {st['n']} seeds")
    runs = c["runs"]
    hr = {(e, k): 100 * runs[e][k]["metrics"]["token_hit_rate"] for e in (base, other) for k in ("real", "sim")}
    s = (f"**{role}** ({where}): {found} (seed {c['seed']}: {_pts(st['seed_diff'])}). On the first "
         f"{c['n_requests']} requests of seed {c['seed']} the real engine measured `{base}` {hr[base, 'real']:.1f}% "
         f"and `{other}` {hr[other, 'real']:.1f}% token hit rate ({_pts(c['real_diff'])} points: "
         f"{_dir_phrase(c['real_direction'], other, base)}); the simulator predicted {hr[base, 'sim']:.1f}% and "
         f"{hr[other, 'sim']:.1f}% for the same slice ({_pts(c['sim_diff'])} points: "
         f"{_dir_phrase(c['sim_direction'], other, base)}). ")
    v = c["verdict"]
    if v == "holds":
        s += "The direction of the study's finding holds on the measured runs. "
    elif v == "does not hold":
        s += (f"The direction of the study's finding does not hold on the measured runs: the study finds "
              f"{_dir_phrase(st['direction'], other, base, study=True)}, the measured runs show "
              f"{_dir_phrase(c['real_direction'], other, base)}. ")
    else:
        s += ("Neither real run evicted an entry in these requests, so the slice cannot test the study's "
              "finding (untested). ")
    s += ("The measured runs agree in direction with the simulator's prediction for this slice." if c["agrees_with_sim"]
          else "The measured runs differ in direction from the simulator's prediction for this slice.")
    ev = [runs[e]["real"]["metrics"]["evictions"] for e in (base, other)]
    if not any(ev) and c["real_diff"] != 0:
        s += (" With no eviction both policies made the same cache decisions, so this difference comes from the "
              "measured step times (which requests were in flight together).")
    sat = [e for e in (base, other) if (runs[e]["real"].get("load") or {}).get("saturated")]
    if sat:
        ld = runs[sat[0]]["real"]["load"]
        sim_mu = (runs[sat[0]]["sim"].get("load") or {}).get("service_rps")
        s += (f" The engine was saturated in the real {' and '.join(f'`{e}`' for e in sat)} run"
              f"{'s' if len(sat) > 1 else ''}: requests arrived at {ld['arrival_rps']:.3g} req/s and it served "
              f"{ld['service_rps']:.3g} req/s while requests waited"
              + (f" (the simulator: {sim_mu:.3g} req/s)" if sim_mu else "")
              + ", so queueing, not the eviction policy alone, decided which requests shared the cache.")
    gap = {e: hr[e, "real"] - hr[e, "sim"] for e in (base, other)}
    if any(gap.values()):
        s += (f" Measured − predicted token hit rate: `{base}` {_pts(gap[base])}, `{other}` {_pts(gap[other])} "
              "points.")
    longer = c.get("sim_longer")
    if st["direction"] != "same" and c["sim_direction"] != st["direction"]:
        if longer:
            s += (f" The simulator shows the study's direction on this seed from the first {longer['n']} requests "
                  f"on ({_pts(longer['diff'])} points), of slices doubling from {c['n_requests']}: a larger N "
                  f"would test it.")
        else:
            s += (f" The simulator does not show the study's direction on this seed on any slice doubling from "
                  f"{c['n_requests']} up to the workload's {c.get('workload_requests', '?')} requests.")
    t = {(e, k): (runs[e][k]["metrics"]["ttft_p50_s"], runs[e][k]["metrics"]["ttft_p90_s"])
         for e in (base, other) for k in ("real", "sim")}
    s += (f" TTFT P50 / P90: measured `{base}` {_secs(t[base, 'real'][0])} / {_secs(t[base, 'real'][1])} s, "
          f"`{other}` {_secs(t[other, 'real'][0])} / {_secs(t[other, 'real'][1])} s; simulated `{base}` "
          f"{_secs(t[base, 'sim'][0])} / {_secs(t[base, 'sim'][1])} s, `{other}` {_secs(t[other, 'sim'][0])} / "
          f"{_secs(t[other, 'sim'][1])} s.")
    return s


def real_section(real: Mapping[str, Any] | None) -> list[str]:
    """The report's "Real engine" lines, from real.json's content (None: the check was not run)."""
    if not real:
        return ["Not run (`--study-real N` runs two cells' first N requests on the numpy engine)."]
    if real.get("error"):
        return [f"The real-engine check failed: {real['error']} (the simulated results above are complete; "
                "`real.json` has the traceback)."]
    cells = real["cells"]
    if not cells:
        return ["No cell pairs `lru` with the baseline, so nothing was run on the real engine."]
    base, other = real["baseline"], real["other"]
    kv = real.get("kv_bytes_per_token", {})
    counts = {v: sum(c["verdict"] == v for c in cells) for v in ("holds", "does not hold", "untested")}
    cap = (f"replies capped at {real['max_output']} generated tokens" if real["max_output"]
           else "replies at their workload lengths")
    if kv.get("study") == kv.get("model"):
        sizes = (f"the model's KV takes {kv.get('model', 0):,} bytes per token, as in the simulated cells, so the "
                 "cache sizes are the study's")
    else:
        sizes = (f"the study's sizes are for {kv.get('study', 0):,} KV bytes per token and the model's take "
                 f"{kv.get('model', 0):,}, so each size was scaled to hold the same number of tokens ("
                 + ", ".join(f"{_mib(c['cache_ram'])} → {_mib(c['cache_ram_real'])}" for c in cells)
                 + ", whole MiB)")
    lines = [f"Of {len(cells)} checked cells, the direction of the study's finding holds on the measured runs in "
             f"{counts['holds']}, does not hold in {counts['does not hold']}"
             + (f", and {counts['untested']} could not be tested (no entry evicted in the first "
                f"{real['n_requests']} requests)" if counts["untested"] else "") + ".", "",
             f"The first {real['n_requests']} requests of one seed of {len(cells)} configurations ({cap}) ran on "
             f"the numpy engine (`{Path(real['model']).name}`, {real.get('threads_desc', '')}) once with "
             f"`{base}` and once with `{other}`, with the study's server settings, and the simulator predicted "
             f"the same slice with the same settings; {sizes}. The direction of a measured pair is the sign of "
             f"`{other}` − `{base}` in token hit rate (the same token counts = no difference); the study's is the "
             f"sign of its mean where significant. Real-engine time {real.get('wall_s', math.nan):.0f} s "
             f"({real.get('reused_real_runs', 0)} of {2 * len(cells)} real runs reused from an earlier run).", ""]
    lines += [f"- {_real_cell(c, real)}" for c in cells]
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
    lines += ["## Real engine", ""] + real_section(meta.get("real")) + [""]
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
