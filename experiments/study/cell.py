"""One cell of a study: build its workload (once per workload x seed x load, in the parent) and simulate one
configuration on it, returning the cell's metrics."""

from __future__ import annotations

import hashlib
import math
import os
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from engine.core import PolicyNames, ServerConfig
from sim.driver import Simulation
from sim.latency_spec import get_latency_model
from traces import chat_sessions, read_trace
from traces.synthetic.reuse import tenants, zipf_conversations

CELL_VERSION = 1
SMOLLM2_N_CTX_TRAIN = 8192
SMOLLM2_KV_BYTES_PER_TOKEN = 23052
ROOT = Path(__file__).resolve().parents[2]
# what a cell's result depends on besides its config: the serving core, policies, simulator, workloads
_CODE_DIRS = ("engine/core", "policies", "sim", "traces")
_CODE_FILES = ("experiments/study/cell.py",)


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of the source files a cell's result depends on: part of every cell's key, so results
    computed by other code are never reused (a changed policy reruns its cells)."""
    h = hashlib.sha256()
    files = sorted(p for d in _CODE_DIRS for p in (ROOT / d).rglob("*.py")) + [ROOT / f for f in _CODE_FILES]
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def _length(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def trace_search_dirs(spec_dir: str | None = None, traces_dir: str | None = None) -> list[Path]:
    """Where a trace workload's relative path is looked for, in order."""
    dirs = [Path(d) for d in (traces_dir, os.environ.get("SLOTLAB_TRACES_DIR"), spec_dir) if d]
    return dirs + [Path.cwd(), Path.cwd().parent / "shared" / "traces", ROOT.parent / "shared" / "traces"]


def find_trace(path: str, spec_dir: str | None = None, traces_dir: str | None = None) -> Path | None:
    p = Path(path)
    if p.is_absolute():
        return p if p.is_file() else None
    for d in trace_search_dirs(spec_dir, traces_dir):
        if (d / p).is_file():
            return (d / p).resolve()
    return None


def build_workload(kind: str, params: dict[str, Any], seed: int, load: float, trace_path: str | None = None) -> Any:
    """The workload of one (workload spec, seed, load). `load` multiplies the arrival rate (open loop) or
    divides think times and the start spread (chat: the same users come back `load` times as fast)."""
    if kind == "chat":

        return chat_sessions(n_users=params["users"], turns_per_user=_length(params["turns"]),
                             think_time_s=params["think_time"] / load,
                             system_prompt_pool=params["system_prompt_pool"],
                             system_prompt_len=_length(params["system_prompt_len"]),
                             user_tokens=_length(params["user_tokens"]), output_tokens=_length(params["output_tokens"]),
                             start_spread_s=params["start_spread"] / load, seed=seed)
    if kind == "zipf_conversations":

        return zipf_conversations(params["n_requests"], params["n_conversations"], params["zipf_s"],
                                  params["rate"] * load, system_tokens=_length(params["system_tokens"]),
                                  user_tokens=_length(params["user_tokens"]),
                                  assistant_tokens=_length(params["assistant_tokens"]),
                                  output_tokens=_length(params["output_tokens"]), max_context=params["max_context"],
                                  seed=seed)
    if kind == "tenants":

        return tenants(params["n_requests"], params["n_tenants"], params["rate_s"], params["rate"] * load,
                       system_tokens=_length(params["system_tokens"]), user_tokens=_length(params["user_tokens"]),
                       output_tokens=_length(params["output_tokens"]), seed=seed)
    if kind == "trace":

        if trace_path is None:
            raise FileNotFoundError(params["path"])
        trace = read_trace(trace_path).head(params["max_requests"])
        # seeds vary the stand-in tokens only (the trace's arrivals and prefix blocks are its own)
        if params["rate"] > 0:
            trace = trace.scaled(target_rps=params["rate"] * load)
        elif load != 1.0:
            trace = trace.scaled(time_scale=1.0 / load)
        return trace
    raise ValueError(f"unknown workload kind {kind!r}")


@lru_cache(maxsize=4)
def _latency(spec: str) -> Any:

    return get_latency_model(spec)


def server_config(config: dict[str, Any]) -> ServerConfig:
    server = {"n_ctx_train": SMOLLM2_N_CTX_TRAIN, "kv_bytes_per_token": SMOLLM2_KV_BYTES_PER_TOKEN, **config["server"]}
    return ServerConfig(**server, cache_ram_mib=config["cache_ram"], cache_hit=config["cache_hit"],
                        policies=PolicyNames(eviction=config["evict"]))


def _pct(values: list[float], q: float) -> float:
    v = [x for x in values if x == x and math.isfinite(x)]
    return float(np.percentile(v, q)) if v else math.nan


def metrics_of(result: Any, wall_s: float) -> dict[str, Any]:
    """A cell's metrics from a `SimResult`."""
    rows = result.requests
    ok = [r for r in rows if r["finish"] != "error"]
    n_prompt = sum(r["n_prompt"] for r in rows)
    n_cached = sum(r["n_cached"] for r in rows)
    cs = result.cache_stats
    lookups = cs.get("hits", 0) + cs.get("misses", 0)
    ttft = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    sim_s = float(result.run["sim_s"])
    return {
        "token_hit_rate": n_cached / n_prompt if n_prompt else math.nan,
        "entry_hit_rate": cs.get("hits", 0) / lookups if lookups else math.nan,
        "evictions": int(cs.get("evictions", 0)),
        "cache_hits": int(cs.get("hits", 0)),
        "cache_misses": int(cs.get("misses", 0)),
        "cache_saves": int(cs.get("saves", 0)),
        "bytes_to_cache": int(cs.get("bytes_saved", 0)),
        "bytes_from_cache": int(cs.get("bytes_loaded", 0)),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "e2e_p50_s": _pct(e2e, 50), "e2e_p90_s": _pct(e2e, 90),
        "throughput_rps": len(ok) / sim_s if sim_s > 0 else math.nan,
        "output_tokens_per_s": sum(r["n_output"] for r in ok) / sim_s if sim_s > 0 else math.nan,
        "n_requests": len(rows), "n_errors": len(rows) - len(ok),
        "n_prompt_tokens": n_prompt, "n_cached_tokens": n_cached,
        "sim_s": sim_s, "wall_s": wall_s,
    }


def run_cell(config: dict[str, Any], workload: Any) -> dict[str, Any]:
    """Simulate one cell (module-level: the sweep runner pickles it by reference)."""

    cfg = server_config(config)
    t0 = time.perf_counter()
    result = Simulation(cfg, _latency(config["latency"]), seed=config["workload"]["seed"]).run(workload)
    return metrics_of(result, time.perf_counter() - t0)
