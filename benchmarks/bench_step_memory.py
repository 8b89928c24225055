"""A long prompt right after a kept prompt-cache save against one after none: step time and page faults, this tree
against another checkout (A/B), worker processes alternated.

    .venv/bin/python benchmarks/bench_step_memory.py [--base /path/to/other/tree] [--threads 2] [--rounds 3]
        [--pairs 12] [--prompt 400] [--blob-cells 500]

A serving process's prompt cache keeps the blobs it saves. The engine's forward pass allocates its intermediate
arrays afresh in every step, so a kept blob takes the memory the previous step freed, and the next long prompt's
arrays then get memory new to the process, which the kernel supplies page by page (minor page faults) inside the
step; its replay, right after, does not pay them, and the simulator does not see them (docs/validation_sim.md §16;
§17 measures a tree whose layers kept their arrays from step to step). A worker (`--worker`, run with PYTHONPATH set
to its tree) loads SmolLM2 in ggml mode, prefills one sequence of `--blob-cells` cells, then runs `--pairs` pairs: a
`--prompt`-token prompt into an emptied sequence right after a save of that sequence (the blob kept, as the cache
keeps it), and the same prompt after no save; the order within a pair alternates. Prints, per tree, the median step
time and page faults of each kind of prompt and their ratio; the ratio of the trees' prompts; the thread settings
and the load averages. Without `--base`, this tree alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args: argparse.Namespace) -> dict[str, list[float]]:
    import numpy as np

    from engine.backend import NumpyBackend, minor_faults
    from engine.core.types import Task
    from engine.model import default_model_path, load
    from experiments.calibrate import mix_plan, replay_sampling

    model = load(args.model or default_model_path(), n_threads=args.threads, numerics="ggml")
    model.warm_up()
    rng = np.random.default_rng(0)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, model.hparams.n_vocab, n).tolist()

    n_seq = 9                                            # sequence 0 is saved; 1..8 take the prompts in turn
    tasks = [Task(id=s, tokens=[0]) for s in range(n_seq)]
    backend = NumpyBackend(model, n_seq, max(args.blob_cells, args.prompt) + 64,
                           default_sampling=replay_sampling(model, 0.0, 1))
    backend.execute(mix_plan((((0, 0, args.blob_cells, True, True),),), tokens, tasks))
    kept: list[memoryview] = []
    out: dict[str, list[float]] = {"after_save": [], "after_none": [], "after_save_faults": [],
                                   "after_none_faults": []}
    for i in range(2 * args.pairs + 2):                 # the first pair warms up and is not counted
        save = (i % 2 == 0) == ((i // 2) % 2 == 0)       # save first in even pairs, last in odd ones
        if save:
            kept.append(backend.kv.state_save(0))
        seq = 1 + i % (n_seq - 1)
        backend.kv.seq_rm(seq, -1, -1)
        f0, t0 = minor_faults(), time.perf_counter()
        backend.execute(mix_plan((((seq, 0, args.prompt, True, True),),), tokens, tasks))
        elapsed, faulted = time.perf_counter() - t0, minor_faults() - f0
        if i >= 2:
            key = "after_save" if save else "after_none"
            out[key].append(elapsed)
            out[key + "_faults"].append(float(faulted))
    out["blob_bytes"] = [float(len(kept[-1]))]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="the other tree (e.g. a worktree of main); without it, this tree alone")
    ap.add_argument("--model", default=None, help="GGUF file (default: the installed SmolLM2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="worker processes per tree (default 3)")
    ap.add_argument("--pairs", type=int, default=12, help="prompts after a save and after none, per worker "
                                                          "(default 12 of each)")
    ap.add_argument("--prompt", type=int, default=400, help="prompt tokens (default 400)")
    ap.add_argument("--blob-cells", type=int, default=500, help="cells of the saved sequence (default 500: "
                                                                "a ~12 MB blob for SmolLM2)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    trees = {"this": HERE}
    if args.base:
        if not os.path.isdir(os.path.join(args.base, "engine")):
            raise SystemExit(f"--base {args.base}: not a checkout of the project (no engine/ in it)")
        trees = {"base": os.path.abspath(args.base), "this": HERE}
    print(f"trees {trees}; --threads {args.threads} (split mode: BLAS 1 thread); load average at start "
          f"{os.getloadavg()}", flush=True)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--threads", str(args.threads), "--pairs",
            str(args.pairs), "--prompt", str(args.prompt), "--blob-cells", str(args.blob_cells),
            *(["--model", args.model] if args.model else [])]
    res: dict[str, list[dict[str, list[float]]]] = {name: [] for name in trees}
    for rnd in range(args.rounds):
        names = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
        for name in names:
            env = {**os.environ, "PYTHONPATH": trees[name]}
            got = json.loads(subprocess.run(argv, env=env, check=True, capture_output=True, text=True,
                                            cwd=trees[name]).stdout.strip().splitlines()[-1])
            res[name].append(got)
            print(f"round {rnd} {name}: after a save {1e3 * statistics.median(got['after_save']):.1f} ms "
                  f"({statistics.median(got['after_save_faults']):.0f} faults), after none "
                  f"{1e3 * statistics.median(got['after_none']):.1f} ms "
                  f"({statistics.median(got['after_none_faults']):.0f}); load {os.getloadavg()[0]:.2f}", flush=True)
    print(f"\n{args.prompt}-token prompt; blobs of {res['this'][0]['blob_bytes'][0] / 1e6:.1f} MB kept")
    print("| tree | after a kept save, ms (faults) | after none, ms (faults) | save / none |")
    print("|---|---|---|---|")
    med = {}
    for name, runs in res.items():
        s = statistics.median(statistics.median(g["after_save"]) for g in runs)
        n = statistics.median(statistics.median(g["after_none"]) for g in runs)
        fs = statistics.median(x for g in runs for x in g["after_save_faults"])
        fn = statistics.median(x for g in runs for x in g["after_none_faults"])
        ratios = [statistics.median(g["after_save"]) / statistics.median(g["after_none"]) for g in runs]
        med[name] = (s, n)
        print(f"| {name} | {1e3 * s:.1f} ({fs:.0f}) | {1e3 * n:.1f} ({fn:.0f}) | {statistics.median(ratios):.3f} "
              f"(runs {min(ratios):.3f}-{max(ratios):.3f}) |")
    if "base" in med:
        print(f"this / base: after a save {med['this'][0] / med['base'][0]:.3f}, after none "
              f"{med['this'][1] / med['base'][1]:.3f}")
    print(f"load average at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
