"""Results directories of `slotlab` runs: per-request and timeline tables, the one-row summary, config and run
info; `write_run` writes one, `load_results` reads one back (layout and columns: docs/cli.md, "Results directory").

Frames are built here, once, from the plain rows the simulator collected (no pandas in the simulation loop).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from engine.core.errors import ConfigError
from engine.core.server import MSG_CTX_EXCEEDED

# Per-request columns in file order (the driver's row keys; any extra key it adds is kept after these).
REQUEST_COLUMNS = (
    "request", "session_id", "turn", "arrival_s", "launch_s", "first_token_s", "end_s", "slot",
    "n_prompt", "n_cached", "n_processed", "n_output", "n_output_target",
    "queue_s", "ttft_s", "tpot_s", "e2e_s", "finish", "error", "n_deferred", "truncated",
)
TIMELINE_COLUMNS = (
    "t_s", "busy_slots", "deferred", "queued", "cache_bytes", "cache_entries",
    "cum_prompt_cached", "cum_prompt_processed",
)
# Integer columns that may be missing for some rows (errors, open-loop requests): nullable Int64 then.
_INT_COLUMNS = ("request", "turn", "slot", "n_prompt", "n_cached", "n_processed", "n_output", "n_output_target",
                "n_deferred")
LATENCY_METRICS = ("ttft", "tpot", "e2e", "queue")
PERCENTILES = (50, 90, 99)
STATS = tuple(f"p{p}" for p in PERCENTILES) + ("mean",)    # the statistics of a latency metric, in this order

FILES = {
    "config": "config.json",
    "run": "run.json",
    "summary": "summary.csv",
    "requests": "requests.parquet",
    "requests_csv": "requests.csv",
    "timeline": "timeline.parquet",
}


# --- frames ----------------------------------------------------------------------------------------


def requests_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The per-request table: known columns first (in REQUEST_COLUMNS order), then any extra driver keys."""
    df = pd.DataFrame.from_records(list(rows)) if rows else pd.DataFrame(columns=list(REQUEST_COLUMNS))
    extra = [c for c in df.columns if c not in REQUEST_COLUMNS]
    for c in REQUEST_COLUMNS:
        if c not in df.columns:
            df[c] = None
    df = df[list(REQUEST_COLUMNS) + extra]
    for c in _INT_COLUMNS:
        df[c] = pd.to_numeric(df[c], errors="coerce")
        df[c] = df[c].astype("int64") if df[c].notna().all() else df[c].astype("Int64")
    for c in ("arrival_s", "launch_s", "first_token_s", "end_s", "queue_s", "ttft_s", "tpot_s", "e2e_s"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    df["truncated"] = df["truncated"].fillna(False).astype(bool)
    for c in ("session_id", "finish", "error"):
        df[c] = df[c].astype(object).where(df[c].notna(), None)
    return df


def timeline_frame(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """The step timeline (one row per sampled step), in TIMELINE_COLUMNS order."""
    df = pd.DataFrame.from_records(list(rows)) if rows else pd.DataFrame(columns=list(TIMELINE_COLUMNS))
    for c in TIMELINE_COLUMNS:
        if c not in df.columns:
            df[c] = 0
    df = df[list(TIMELINE_COLUMNS) + [c for c in df.columns if c not in TIMELINE_COLUMNS]]
    df["t_s"] = df["t_s"].astype("float64")
    for c in TIMELINE_COLUMNS[1:]:
        df[c] = df[c].astype("int64")
    return df


# --- summary ---------------------------------------------------------------------------------------


def latency_stats(values: pd.Series) -> dict[str, float]:
    """STATS of the finite values: P50/P90/P99 (numpy's linear interpolation) and the mean; NaN when there are
    none. The one definition the results summary, validate's aggregates and the repeat floor share."""
    v = values.to_numpy(dtype="float64", na_value=np.nan)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return dict.fromkeys(STATS, math.nan)
    return dict(zip(STATS, (float(x) for x in latency_stats_rows(v[None, :])[0])))


def latency_stats_rows(values: np.ndarray) -> np.ndarray:
    """[rows, n] -> [rows, len(STATS)]: `latency_stats` of each row (all finite), at once."""
    return np.concatenate([np.percentile(values, PERCENTILES, axis=1).T, values.mean(axis=1, keepdims=True)],
                          axis=1)


def _counter(source: Any, name: str, default: int = 0) -> int:
    """A counter from a Metrics object or a plain dict (tests and reloaded runs use dicts)."""
    if source is None:
        return default
    if isinstance(source, Mapping):
        return int(source.get(name, default))
    return int(getattr(source, name, default))


# --- errors by kind ------------------------------------------------------------------------------------
# The serving core's error messages (engine/core/server.py; upstream's texts, tools/server/server-context.cpp),
# each with what a reader of a run needs: what happened and which knob moves it.
_EXCEED = re.compile(r"^request \((\d+) tokens\) exceeds the available context size \((\d+) tokens\)")
ERROR_KINDS = ("exceed_context", "kv_full", "context_shift_disabled", "context_shift_shared", "other")
_ERROR_TEXTS = {
    "kv_full": (MSG_CTX_EXCEEDED,
                "ran out of KV cells while generating (the shared KV of -c cells was full even after halving the "
                "batch): raise -c, lower -np, or drop -kvu so that each slot has its own cells"),
    "context_shift_disabled": ("context shift is disabled",
                               "reached the end of the slot context while generating, with context shift off: pass "
                               "--context-shift, a smaller n_predict, or a larger slot context"),
    "context_shift_shared": ("context shift cannot be used for shared prompt",
                             "reached the end of the slot context while sharing a prompt (n > 1), where upstream "
                             "cannot shift: a larger slot context or a smaller n_predict"),
}


def error_kind(message: str | None) -> str:
    """The kind of one request's error message (see ERROR_KINDS); "other" for a message not listed."""
    if message is None:
        return "other"
    if _EXCEED.match(message):
        return "exceed_context"
    for kind, (text, _) in _ERROR_TEXTS.items():
        if message == text:
            return kind
    return "other"


def _exceed_hint(cfg: Any) -> str:
    """Why the slot context is what it is (ResolvedConfig), and which flags move it."""
    if cfg is None:
        return "raise -c (or lower -np when each slot has its own share)"
    base = cfg.base
    per_slot = cfg.n_ctx if cfg.kv_unified else cfg.n_ctx // cfg.n_slots
    if base.n_ctx_train > 0 and cfg.n_ctx_slot == base.n_ctx_train and per_slot > base.n_ctx_train:
        return (f"n_ctx_train {base.n_ctx_train} caps it (llama-server caps each slot at the model's training "
                f"context); pass --n-ctx-train or a model with a longer context")
    if not cfg.kv_unified and cfg.n_slots > 1:
        return (f"-c {cfg.n_ctx} split over -np {cfg.n_slots} slots; raise -c, lower -np, or pass -kvu "
                f"(one context shared by all slots)")
    return f"raise -c (now {cfg.n_ctx})"


def error_breakdown(requests: pd.DataFrame, cfg: Any = None) -> list[dict[str, Any]]:
    """The failed requests grouped by kind, most frequent first: kind, count, longest prompt among them, and a
    sentence saying what happened and which knob moves it. `cfg` is the run's ResolvedConfig (or None)."""
    failed = requests[requests["finish"] == "error"]
    groups: dict[str, list[int]] = {}
    messages: dict[str, str] = {}
    for msg, n_prompt in zip(failed["error"], failed["n_prompt"]):
        kind = error_kind(msg)
        groups.setdefault(kind, []).append(int(n_prompt))
        messages.setdefault(kind, str(msg))
    out = []
    for kind, prompts in sorted(groups.items(), key=lambda kv: (-len(kv[1]), ERROR_KINDS.index(kv[0]))):
        n = len(prompts)
        if kind == "exceed_context":
            n_ctx = int(_EXCEED.match(messages[kind]).group(2))
            text = (f"{n:,} exceed the slot context ({n_ctx} tokens; longest prompt {max(prompts):,}): "
                    f"{_exceed_hint(cfg)}")
        elif kind == "other":
            text = f"{n:,} failed with other errors (first: {messages[kind]!r})"
        else:
            text = f"{n:,} {_ERROR_TEXTS[kind][1]}"
        out.append({"kind": kind, "count": n, "longest_prompt": max(prompts), "text": text})
    return out


def _resolved(server_config: Any) -> Any:
    if server_config is None:
        return None
    try:
        return server_config.resolve()
    except ConfigError:            # a config that does not resolve never ran: no hint rather than no summary
        return None


def summarize(requests: pd.DataFrame, *, sim_s: float | None = None, cache_stats: Mapping[str, int] | None = None,
              metrics: Any = None, server_config: Any = None,
              errors: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The summary row of a run.

    Latency statistics cover finished requests (finish != "error"); TPOT only requests with > 1 output token
    (its NaNs are skipped). Throughput is over `sim_s` (simulated seconds; default: first arrival to last
    end). Hit rate = cached / (cached + processed) prompt tokens over all requests. Errors: one count per kind
    (`errors_<kind>`, ERROR_KINDS) and `errors_by_kind`, the sentences of `error_breakdown` joined by " | " (needs the run's
    `server_config`, a ServerConfig, for the hints on the slot context; or `errors`, the breakdown already made).
    """
    ok = requests[requests["finish"] != "error"]
    row: dict[str, Any] = {
        "n_requests": int(len(requests)),
        "n_finished": int(len(ok)),
        "n_errors": int(len(requests) - len(ok)),
    }
    if errors is not None:
        breakdown = errors
    else:
        breakdown = error_breakdown(requests, _resolved(server_config)) if row["n_errors"] else []
    counts = {b["kind"]: b["count"] for b in breakdown}
    for kind in ERROR_KINDS:
        row[f"errors_{kind}"] = counts.get(kind, 0)
    row["errors_by_kind"] = " | ".join(b["text"] for b in breakdown)
    for m in LATENCY_METRICS:
        st = latency_stats(ok[f"{m}_s"])
        row[f"{m}_mean_s"] = st["mean"]
        for p in PERCENTILES:
            row[f"{m}_p{p}_s"] = st[f"p{p}"]
    if sim_s is None:
        ends, arrivals = requests["end_s"].dropna(), requests["arrival_s"].dropna()
        sim_s = float(ends.max() - arrivals.min()) if len(ends) and len(arrivals) else 0.0
    n_output = int(ok["n_output"].sum())
    n_cached, n_processed = int(requests["n_cached"].sum()), int(requests["n_processed"].sum())
    row["sim_s"] = float(sim_s)
    row["throughput_rps"] = len(ok) / sim_s if sim_s > 0 else math.nan
    row["output_tokens_per_s"] = n_output / sim_s if sim_s > 0 else math.nan
    row["n_output_tokens"] = n_output
    row["n_prompt_cached"] = n_cached
    row["n_prompt_processed"] = n_processed
    row["prompt_cache_hit_rate"] = n_cached / (n_cached + n_processed) if n_cached + n_processed else math.nan
    cache_stats = cache_stats or {}
    row["evictions"] = int(cache_stats.get("evictions", 0))
    row["cache_hits"] = int(cache_stats.get("hits", 0))
    row["cache_saves"] = int(cache_stats.get("saves", 0))
    row["context_shifts"] = _counter(metrics, "n_context_shifts")
    row["deferrals"] = _counter(metrics, "n_deferrals", default=int(requests["n_deferred"].sum()))
    row["n_truncated"] = int(requests["truncated"].sum())
    return row


# --- writing ---------------------------------------------------------------------------------------


def _json_default(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, (frozenset, set)):
        return sorted(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    return repr(obj)


def _clean_floats(obj: Any) -> Any:
    """NaN/inf are not JSON: write them as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean_floats(v) for v in obj]
    return obj


def read_json(path: str | Path, what: str) -> Any:
    """The JSON value in `path`; ValueError naming the file and `what` it holds when it cannot be read."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read {what}: {exc}") from exc


def write_json(path: Path, data: Any) -> None:
    # dumps/loads once to turn dataclasses etc. into plain JSON values, then NaN/inf -> null (strict JSON)
    text = json.dumps(_clean_floats(json.loads(json.dumps(data, default=_json_default))), indent=2,
                      allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")


def new_results_dir(experiment: str, root: str | Path = "results") -> Path:
    """`root/<experiment>/<YYYYmmdd-HHMMSS>/`, suffixed -2, -3, ... when that second is taken; created."""
    base = Path(root) / experiment / time.strftime("%Y%m%d-%H%M%S")
    path, k = base, 1
    while path.exists():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    path.mkdir(parents=True)
    return path


def metrics_dict(metrics: Any) -> dict[str, Any]:
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        return dict(metrics)
    return {f.name: getattr(metrics, f.name) for f in dataclasses.fields(metrics)}


def write_run(out_dir: str | Path, result: Any, config: Mapping[str, Any], *, csv: bool = False,
              plots: bool = True, n_slots: int | None = None) -> dict[str, Any]:
    """Write a run's results directory from a `SimResult` and return its summary row.

    `config` is what the caller knows about the run (command line, versions, workload); the driver's own
    `result.config` is stored under its "sim" key.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    requests = requests_frame(result.requests)
    timeline = timeline_frame(result.timeline)
    run = dict(result.run)
    failed = bool((requests["finish"] == "error").any())
    run["errors"] = error_breakdown(requests, _resolved(config.get("server_config"))) if failed else []
    summary = summarize(requests, sim_s=run.get("sim_s"), cache_stats=result.cache_stats, metrics=result.metrics,
                        errors=run["errors"])
    load = run.get("load") or {}
    for key in ("arrival_rps", "service_rps", "backlog_at_last_arrival", "saturated"):
        if key in load:                    # offered load vs served (open loop; see Simulation._load)
            summary[key] = load[key]
    write_json(out / FILES["config"], {**config, "sim": result.config})
    write_json(out / FILES["run"], {**run, "cache_stats": dict(result.cache_stats),
                                    "metrics": metrics_dict(result.metrics)})
    pd.DataFrame([summary]).to_csv(out / FILES["summary"], index=False)
    requests.to_parquet(out / FILES["requests"], index=False)
    if csv:
        requests.to_csv(out / FILES["requests_csv"], index=False)
    timeline.to_parquet(out / FILES["timeline"], index=False)
    if plots:
        from experiments.plots import plot_run  # matplotlib only when plots are wanted

        plot_run(out, requests, timeline, n_slots=n_slots, title=config.get("label"))
    return summary


# --- reading ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Results:
    """One results directory, read back."""

    path: Path
    config: dict[str, Any]
    run: dict[str, Any]
    summary: dict[str, Any]
    requests: pd.DataFrame
    timeline: pd.DataFrame


def load_results(path: str | Path) -> Results:
    """Read a results directory written by `write_run` (requests from parquet, else from requests.csv)."""
    p = Path(path)
    if not (p / FILES["summary"]).exists():
        raise FileNotFoundError(f"{p}: not a slotlab results directory (no {FILES['summary']})")
    config = json.loads((p / FILES["config"]).read_text(encoding="utf-8"))
    run = json.loads((p / FILES["run"]).read_text(encoding="utf-8"))
    summary = pd.read_csv(p / FILES["summary"]).iloc[0].to_dict()
    if (p / FILES["requests"]).exists():
        requests = pd.read_parquet(p / FILES["requests"])
    else:
        requests = pd.read_csv(p / FILES["requests_csv"])
    timeline = pd.read_parquet(p / FILES["timeline"]) if (p / FILES["timeline"]).exists() \
        else timeline_frame([])
    return Results(p, config, run, summary, requests, timeline)
