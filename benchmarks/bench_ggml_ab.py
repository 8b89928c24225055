"""numerics="ggml" speed of this tree against another checkout of the project (A/B), worker processes alternated.

    .venv/bin/python benchmarks/bench_ggml_ab.py --base /path/to/other/tree [--threads 1,2] [--rounds 3]
        [--prompt 512] [--steps 8] [--seqs 1,4,16] [--n-past 64] [--profile]

Each round runs, for each thread count, one worker process per tree (base first, then this tree; the order
alternates between rounds), so a change of the machine's load hits both. A worker (`--worker`, run with
PYTHONPATH set to its tree) loads SmolLM2 in ggml mode, warms the kernels' cache, then measures: prefill of a
`--prompt`-token prompt in one chunk (last logit only), and decode steps with 1, 4, 16 sequences of `--n-past`
cached tokens (the sequences copied from one prefilled state; median of `--steps` steps). `--profile`: the wall
time spent in each `gkernels` function called from Python, summed per phase (meaningful with one thread).
Prints every run (wall time, and the process CPU time: with one thread the work done whatever the machine's load),
the medians per tree, the ratio new/base, the load averages (before / after each run) and the thread settings
(split mode: BLAS 1 thread, `--threads` matmul threads).
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


_ENTRY_POINTS = ("dot_nib", "dot_byte", "dot_q8_0", "quantize_q8", "q8_values", "rms_norm", "silu_mul",
                 "attend_block", "kv_values", "kv_values_t", "kv_shadow", "f16_round_array")


def _profile_kernels() -> dict[str, float]:
    """Wrap every public function of `gkernels` with a wall-time accumulator (the engine calls them through the
    module, so the wrappers see every call)."""
    from engine.model import ggml
    k = ggml.kernels()
    totals: dict[str, float] = {}

    def wrap(name, fn):
        def timed(*a):
            t0 = time.perf_counter()
            r = fn(*a)
            totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
            return r
        return timed
    for name in _ENTRY_POINTS:                      # kernels called from Python only (no kernel calls them)
        if hasattr(k, name):
            setattr(k, name, wrap(name, getattr(k, name)))
    return totals


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    from threadpoolctl import threadpool_info

    from engine.model import BatchChunk, default_model_path, load
    model = load(args.model or default_model_path(), n_threads=args.threads, numerics="ggml")
    totals = _profile_kernels() if args.profile else {}
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 40000, args.prompt).tolist()
    past = rng.integers(100, 40000, args.n_past).tolist()
    seqs = [int(s) for s in args.seqs.split(",")]
    kv = model.new_kv(1, 32)
    model.forward_batch(kv, [BatchChunk(0, prompt[:16], 0, True)])        # compile / load the cache
    model.forward_batch(kv, [BatchChunk(0, [7], 16, True)])
    with model.compute_threads():
        blas = [(lib["internal_api"], lib["num_threads"]) for lib in threadpool_info() if lib["user_api"] == "blas"]
    out: dict = {"threads": args.threads, "blas": blas, "load_before": os.getloadavg()[0], "profile": {}}
    totals.clear()
    kv = model.new_kv(1, args.prompt + 8)
    c0 = time.process_time()
    t0 = time.perf_counter()
    model.forward_batch(kv, [BatchChunk(0, prompt, 0, True)])
    out["prefill"] = time.perf_counter() - t0
    out["cpu_prefill"] = time.process_time() - c0
    out["profile"]["prefill"] = dict(totals)
    base_kv = model.new_kv(1, args.n_past + args.steps + 8)
    model.forward_batch(base_kv, [BatchChunk(0, past, 0, True)])
    state = base_kv.state_save(0)
    for n in seqs:
        kv = model.new_kv(n, args.n_past + args.steps + 8)
        for s in range(n):
            kv.state_load(s, state)
        times = []
        totals.clear()
        c0 = time.process_time()
        for step in range(args.steps):
            chunks = [BatchChunk(s, [int(rng.integers(100, 1000))], args.n_past + step, True) for s in range(n)]
            t0 = time.perf_counter()
            model.forward_batch(kv, chunks)
            times.append(time.perf_counter() - t0)
        out[f"decode{n}"] = statistics.median(times)
        out[f"cpu_decode{n}"] = (time.process_time() - c0) / args.steps
        out["profile"][f"decode{n}"] = {k: v / args.steps for k, v in totals.items()}
    out["load_after"] = os.getloadavg()[0]
    print(json.dumps(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="the other tree (e.g. a worktree of main)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seqs", default="1,4,16")
    ap.add_argument("--n-past", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.threads = int(args.threads)
        worker(args)
        return 0
    if not args.base:
        raise SystemExit("--base DIR is required")
    trees = {"base": os.path.abspath(args.base), "new": HERE}
    keys = ["prefill"] + [f"decode{n}" for n in args.seqs.split(",")]
    keys += [f"cpu_{k}" for k in keys]
    res: dict[tuple[str, int], list[dict]] = {}
    print(f"base {trees['base']}, new {trees['new']}; load average at start {os.getloadavg()}")
    for rnd in range(args.rounds):
        for th in [int(t) for t in args.threads.split(",")]:
            order = ["base", "new"] if rnd % 2 == 0 else ["new", "base"]
            for name in order:
                cmd = [sys.executable, os.path.join(HERE, "benchmarks", "bench_ggml_ab.py"), "--worker",
                       "--threads", str(th), "--prompt", str(args.prompt), "--steps", str(args.steps),
                       "--seqs", args.seqs, "--n-past", str(args.n_past)] + (["--profile"] if args.profile else [])
                if args.model:
                    cmd += ["--model", args.model]
                env = dict(os.environ, PYTHONPATH=trees[name])
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=trees[name])
                if r.returncode:
                    raise SystemExit(f"{name} worker failed:\n{r.stderr}")
                fig = json.loads(r.stdout.strip().splitlines()[-1])
                res.setdefault((name, th), []).append(fig)
                print(f"round {rnd} --threads {th} {name}: " + ", ".join(
                    f"{k} {fig[k] * (1 if k.endswith('prefill') else 1e3):.{2 if k.endswith('prefill') else 1}f}"
                    f"{' s' if k.endswith('prefill') else ' ms'}" for k in keys)
                    + f" (load {fig['load_before']:.2f} -> {fig['load_after']:.2f}; BLAS {fig['blas']})", flush=True)
                if args.profile:
                    for phase, tot in fig["profile"].items():
                        top = sorted(tot.items(), key=lambda kv: -kv[1])[:6]
                        print(f"    {phase}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in top))
    print("| --threads | figure | base (median) | new (median) | new / base |")
    print("|---|---|---|---|---|")
    for th in [int(t) for t in args.threads.split(",")]:
        for k in keys:
            b = statistics.median(f[k] for f in res[("base", th)])
            n = statistics.median(f[k] for f in res[("new", th)])
            unit, scale = ("s", 1) if k.endswith("prefill") else ("ms", 1e3)
            print(f"| {th} | {k} | {b * scale:.2f} {unit} | {n * scale:.2f} {unit} | {n / b:.3f} |")
    print(f"load average at end {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
