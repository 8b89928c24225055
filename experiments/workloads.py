"""The workload of a run from its options: a trace file (rescaled, cut) or a generator (chat sessions, Poisson or
gamma arrivals), and its JSON description for config.json."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from experiments.flags import CHAT_DEFAULTS, OPEN_LOOP_DEFAULTS, WORKLOAD_DESTS, UsageError, flag_names
from traces import (DEFAULT_CHAT, ChatWorkload, GammaArrivals, PoissonArrivals, Trace, chat_sessions,
                    default_chat_workload, open_loop, read_trace)

# The workload options each kind of workload uses.
APPLICABLE = {
    "trace": {"trace", "trace_format", "skip_bad_rows", "time_scale", "rate", "max_requests"},
    "chat": {"workload", "users", "turns", "think_time", "user_tokens", "output_tokens"},
    "poisson": {"workload", "rate", "requests", "prompt_tokens", "output_tokens", "max_requests"},
    "gamma": {"workload", "rate", "requests", "prompt_tokens", "output_tokens", "max_requests", "cv"},
}


def _set_workload_options(values: Mapping[str, Any]) -> list[str]:
    return [d for d in WORKLOAD_DESTS if values.get(d) not in (None, False)]


def _check_applicable(values: Mapping[str, Any], kind: str) -> None:
    """Options that the chosen workload would ignore are errors (a silently ignored flag misleads)."""
    bad = [d for d in _set_workload_options(values) if d not in APPLICABLE[kind]]
    if bad:
        what = "--trace" if kind == "trace" else f"--workload {kind}"
        raise UsageError(f"{flag_names(bad)} does not apply to {what}")
    if kind == "trace" and values.get("time_scale") and values.get("rate"):
        raise UsageError("give at most one of --time-scale and --rate")


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_workload(values: Mapping[str, Any]) -> tuple[Trace | ChatWorkload, dict[str, Any]]:
    """The workload the options describe, and a JSON description of it for config.json."""
    seed = values["seed"]
    if values.get("trace"):
        _check_applicable(values, "trace")
        path = values["trace"]
        if not Path(path).is_file():
            raise UsageError(f"trace file not found: {path}")
        trace = read_trace(path, values.get("trace_format"), bool(values.get("skip_bad_rows")))
        if values.get("time_scale"):
            trace = trace.scaled(time_scale=values["time_scale"])
        if values.get("max_requests"):
            trace = trace.head(values["max_requests"])
        if values.get("rate"):
            trace = trace.scaled(target_rps=values["rate"])
        desc = {"kind": "trace", "path": str(Path(path).resolve()), "sha256": _file_digest(path),
                "format": trace.format, "n_skipped": trace.n_skipped, "skipped_errors": list(trace.errors)}
    else:
        kind = values.get("workload") or "chat"
        _check_applicable(values, kind)
        if kind == "chat":
            p = {k: values.get(k) if values.get(k) is not None else v for k, v in CHAT_DEFAULTS.items()}
            if p == CHAT_DEFAULTS:
                wl = default_chat_workload(seed)
                return wl, {"kind": "chat", "generator": "default_chat_workload", "seed": seed, **p,
                            "n_requests": wl.n_turns}
            wl = chat_sessions(n_users=p["users"], turns_per_user=p["turns"], think_time_s=p["think_time"],
                               system_prompt_pool=DEFAULT_CHAT["system_prompt_pool"],
                               system_prompt_len=DEFAULT_CHAT["system_prompt_len"], user_tokens=p["user_tokens"],
                               output_tokens=p["output_tokens"], start_spread_s=DEFAULT_CHAT["start_spread_s"],
                               seed=seed)
            return wl, {"kind": "chat", "generator": "chat_sessions", "seed": seed, **p,
                        "system_prompt_pool": DEFAULT_CHAT["system_prompt_pool"],
                        "system_prompt_len": DEFAULT_CHAT["system_prompt_len"],
                        "start_spread_s": DEFAULT_CHAT["start_spread_s"], "n_requests": wl.n_turns}
        p = {k: values.get(k) if values.get(k) is not None else v for k, v in OPEN_LOOP_DEFAULTS.items()}
        arrivals = PoissonArrivals(p["rate"]) if kind == "poisson" else GammaArrivals(p["rate"], p["cv"])
        trace = open_loop(p["requests"], arrivals, p["prompt_tokens"], p["output_tokens"], seed)
        if values.get("max_requests"):
            trace = trace.head(values["max_requests"])
        desc = {"kind": kind, "generator": trace.source, "seed": seed, **p}
    desc.update(n_requests=len(trace), duration_s=trace.duration_s, mean_rps=trace.mean_rps,
                time_scale=values.get("time_scale"), target_rps=values.get("rate"),
                max_requests=values.get("max_requests"))
    return trace, desc
