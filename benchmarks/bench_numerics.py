"""Speed of the engine's numerics modes, f32 (default) vs ggml (llama.cpp's CPU arithmetic), in one process.

    .venv/bin/python benchmarks/bench_numerics.py [--model PATH] [--threads 1] [--prompt 512] [--steps 8] [--reps 2]
        [--modes f32,ggml-numpy,ggml] [--numpy-reps N]

The models are loaded once; each repetition measures, for each mode in turn (interleaved, so a change of the
machine's load hits all): prefill of a `--prompt`-token prompt in one chunk (logits of the last row only),
then `--steps` single-sequence decode steps after it. "ggml" is the mode on its numba kernels, "ggml-numpy"
the same arithmetic on its numpy reference (`numerics.GGML_REFERENCE`, minutes per prefill: `--numpy-reps`
limits its repetitions, default 1). Prints the median of the repetitions (and every rep's figures), BLAS
threads in force (threadpoolctl) and the load average before, during and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
from threadpoolctl import threadpool_info

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.model import BatchChunk, default_model_path, load  # noqa: E402
from engine.model.numerics import GGML_REFERENCE  # noqa: E402

NUMERICS = {"f32": "f32", "q": "q", "ggml": "ggml", "ggml-numpy": GGML_REFERENCE}


def measure(model, prompt: list[int], n_steps: int) -> tuple[float, float, float, float]:
    """(prefill seconds, median decode-step seconds, and the process CPU time of each: prefill seconds, CPU
    seconds per decode step) on a fresh KV store. CPU time counts every thread of the process: with one thread it
    is the work done whatever the machine's load, with more it is the sum over them."""
    kv = model.new_kv(1, len(prompt) + n_steps + 1)
    c0 = time.process_time()
    t0 = time.perf_counter()
    [row] = model.forward_batch(kv, [BatchChunk(0, prompt, 0, True)])
    t_prefill = time.perf_counter() - t0
    c_prefill = time.process_time() - c0
    steps = []
    tok = int(np.argmax(row[-1]))
    c0 = time.process_time()
    for i in range(n_steps):
        t0 = time.perf_counter()
        [row] = model.forward_batch(kv, [BatchChunk(0, [tok], len(prompt) + i, True)])
        steps.append(time.perf_counter() - t0)
        tok = int(np.argmax(row[-1]))
    c_step = (time.process_time() - c0) / max(1, n_steps)
    return t_prefill, statistics.median(steps), c_prefill, c_step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="f32,ggml-numpy,ggml", help=f"comma-separated, of {tuple(NUMERICS)}")
    ap.add_argument("--numpy-reps", type=int, default=1, help="repetitions of ggml-numpy (slow), at most --reps")
    args = ap.parse_args()
    if not args.model:
        raise SystemExit("model not found; pass --model")
    modes = args.modes.split(",")
    if any(m not in NUMERICS for m in modes):
        raise SystemExit(f"--modes: each of {tuple(NUMERICS)}, got {args.modes!r}")
    models = {m: load(args.model, n_threads=args.threads, numerics=NUMERICS[m]) for m in modes}
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 40000, args.prompt).tolist()
    first = next(iter(models.values()))
    with first.compute_threads():
        blas = [(lib["internal_api"], lib["num_threads"]) for lib in threadpool_info() if lib["user_api"] == "blas"]
    for model in models.values():                      # compile / load the numba cache, warm the caches
        measure(model, prompt[:16], 1)
    print(f"model {os.path.basename(args.model)}, --threads {args.threads} (split mode: BLAS threads in compute "
          f"{blas}, matmul threads {first.n_threads}), load average before {os.getloadavg()}")
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in models}
    for rep in range(args.reps):
        for mode, model in models.items():
            if mode == "ggml-numpy" and rep >= args.numpy_reps:
                continue
            results[mode].append(measure(model, prompt, args.steps))
            pre, dec, cpre, cdec = results[mode][-1]
            print(f"  rep {rep} {mode}: prefill {pre:.2f} s (CPU {cpre:.2f} s), decode step {dec * 1e3:.1f} ms "
                  f"(CPU {cdec * 1e3:.1f} ms) (load average {os.getloadavg()[0]:.2f})", flush=True)
    print(f"| mode | prefill {args.prompt} tokens | prefill tok/s | decode step (median of {args.steps}) | decode tok/s "
          f"| CPU: prefill / decode step |")
    print("|---|---|---|---|---|---|")
    med = {m: tuple(statistics.median(r[i] for r in rs) for i in range(4)) for m, rs in results.items()}
    for mode, (pre, dec, cpre, cdec) in med.items():
        print(f"| {mode} | {pre:.2f} s | {args.prompt / pre:.0f} | {dec * 1e3:.1f} ms | {1 / dec:.1f} "
              f"| {cpre:.2f} s / {cdec * 1e3:.1f} ms |")
    if "f32" in med:
        for mode in med:
            if mode != "f32":
                print(f"{mode} / f32: prefill {med[mode][0] / med['f32'][0]:.2f}x, "
                      f"decode {med[mode][1] / med['f32'][1]:.2f}x (CPU: {med[mode][2] / med['f32'][2]:.2f}x, "
                      f"{med[mode][3] / med['f32'][3]:.2f}x)")
    print(f"load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
