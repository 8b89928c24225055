"""Speed of the engine's numerics modes, f32 (default) vs ggml (llama.cpp's CPU arithmetic), in one process.

    .venv/bin/python benchmarks/bench_numerics.py [--model PATH] [--threads 1] [--prompt 512] [--steps 8] [--reps 2]

Both models are loaded once; each repetition measures, for each mode in turn (interleaved, so a change of the
machine's load hits both): prefill of a `--prompt`-token prompt in one chunk (logits of the last row only),
then `--steps` single-sequence decode steps after it. Prints the median of the repetitions, BLAS threads in
force (threadpoolctl) and the load average before and after.
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


def measure(model, prompt: list[int], n_steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode-step seconds) on a fresh KV store."""
    kv = model.new_kv(1, len(prompt) + n_steps + 1)
    t0 = time.perf_counter()
    [row] = model.forward_batch(kv, [BatchChunk(0, prompt, 0, True)])
    t_prefill = time.perf_counter() - t0
    steps = []
    tok = int(np.argmax(row[-1]))
    for i in range(n_steps):
        t0 = time.perf_counter()
        [row] = model.forward_batch(kv, [BatchChunk(0, [tok], len(prompt) + i, True)])
        steps.append(time.perf_counter() - t0)
        tok = int(np.argmax(row[-1]))
    return t_prefill, statistics.median(steps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if not args.model:
        raise SystemExit("model not found; pass --model")
    models = {m: load(args.model, n_threads=args.threads, numerics=m) for m in ("f32", "ggml")}
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 40000, args.prompt).tolist()
    with models["f32"].compute_threads():
        blas = [(lib["internal_api"], lib["num_threads"]) for lib in threadpool_info() if lib["user_api"] == "blas"]
    print(f"model {os.path.basename(args.model)}, --threads {args.threads} (split mode: BLAS threads in compute "
          f"{blas}, matmul threads {models['f32'].n_threads}), load average before {os.getloadavg()}")
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in models}
    for _ in range(args.reps):
        for mode, model in models.items():
            results[mode].append(measure(model, prompt, args.steps))
    print(f"| mode | prefill {args.prompt} tokens | prefill tok/s | decode step (median of {args.steps}) |")
    print("|---|---|---|---|")
    for mode, rs in results.items():
        pre = statistics.median(r[0] for r in rs)
        dec = statistics.median(r[1] for r in rs)
        print(f"| {mode} | {pre:.2f} s | {args.prompt / pre:.0f} | {dec * 1e3:.1f} ms |")
    f, g = results["f32"], results["ggml"]
    print(f"ggml / f32: prefill {statistics.median(r[0] for r in g) / statistics.median(r[0] for r in f):.1f}x, "
          f"decode {statistics.median(r[1] for r in g) / statistics.median(r[1] for r in f):.1f}x; "
          f"load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
