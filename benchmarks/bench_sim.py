"""Simulator speed: requests and steps simulated per wall second, with and without fast-forward.

Replays the Azure 2023 conversation trace (19,366 requests) with -np 16 -c 262144 and the Mooncake synthetic
trace (-np 16 -kvu -c 2097152) at the default latency (a saturated server: the queue grows all along), and
Azure again on a GPU roofline with 64 slots (a server that keeps up: short stretches between arrivals), in
one process, side by side; prints one table. `--scaling` adds the cost curve over generated requests
(10k / 100k [/ 1M with --max-n 1000000]) and over -np (16 / 64 / 256), each point in its own process so that
its peak memory (max RSS) is its own. Usage:

    .venv/bin/python benchmarks/bench_sim.py [--traces-dir ../shared/traces] [--latency default] [--limit N]
        [--keepup-latency roofline:llama-3-8b@a100-80gb] [--scaling [--max-n N]]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

from engine.core import ServerConfig
from sim.driver import Simulation
from sim.latency_spec import get_latency_model
from traces import read_trace

KEEPUP = "roofline:llama-3-8b@a100-80gb"
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def run(trace, cfg, latency, ff):
    sim = Simulation(cfg, latency, fast_forward=ff)
    c0 = time.process_time()
    r = sim.run(trace).run
    r["cpu_s"] = time.process_time() - c0
    return r


def header(latencies: str) -> None:
    threads = " ".join(f"{v}={os.environ.get(v, 'unset')}" for v in THREAD_VARS)
    print(f"python {platform.python_version()}  cpu_count {os.cpu_count()}  load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}  latency {latencies}")
    print(f"the simulator is single-threaded pure Python (numpy only for prompt tokens and stretch timing, no "
          f"BLAS calls); {threads}")


def table(rows) -> None:
    print("req/s and steps/s are per wall second; req/cpu_s per CPU second of this process (less sensitive "
          "to other processes on a shared machine)")
    print(f"{'trace':34} {'config':18} {'reqs':>6} {'ff':>5} {'wall_s':>8} {'cpu_s':>7} {'req/s':>7} "
          f"{'req/cpu_s':>9} {'steps':>8} {'steps/s':>8} {'ff_steps':>8} {'errors':>6} {'sim_s':>9} {'sat':>4}")
    for name, conf, n, ff, r in rows:
        print(f"{name:34} {conf:18} {n:6d} {str(ff):>5} {r['wall_s']:8.2f} {r['cpu_s']:7.2f} "
              f"{r['requests_per_wall_s']:7.0f} {n / r['cpu_s']:9.0f} {r['steps']:8d} "
              f"{r['steps_per_wall_s']:8.0f} {r['ff_steps']:8d} {r['n_errors']:6d} {r['sim_s']:9.0f} "
              f"{'yes' if r.get('load', {}).get('saturated') else 'no':>4}")


# --- scaling: one point per process -------------------------------------------------------------------

def scaling_point(n: int, n_parallel: int, latency: str) -> dict:
    """Generated open-loop requests (Poisson 5 req/s, prompts 100-2000, outputs 10-400 tokens) on
    -np n_parallel with 16k-token slots; what one run costs and its peak memory."""
    from traces import PoissonArrivals, UniformLength, open_loop

    tr = open_loop(n, PoissonArrivals(5.0), UniformLength(100, 2000), UniformLength(10, 400), seed=0)
    cfg = ServerConfig(n_parallel=n_parallel, n_ctx=n_parallel * 16384)
    r = run(tr, cfg, get_latency_model(latency), True)
    return {"n": n, "np": n_parallel, "latency": latency, "wall_s": r["wall_s"], "cpu_s": r["cpu_s"],
            "steps": r["steps"], "ff_steps": r["ff_steps"], "saturated": r.get("load", {}).get("saturated"),
            "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "load": os.getloadavg()[0]}


def scaling(max_n: int) -> None:
    points = [(n, 64, KEEPUP) for n in (10_000, 100_000, 1_000_000) if n <= max_n]
    points += [(min(20_000, max_n), p, lat) for p in (16, 64, 256) for lat in (KEEPUP, "default")]
    print("\nscaling (generated Poisson 5 req/s, prompts 100-2000, outputs 10-400; 16k-token slots; "
          "fast-forward on; one process per point)")
    print(f"{'requests':>9} {'np':>4} {'latency':32} {'wall_s':>8} {'cpu_s':>8} {'req/cpu_s':>9} {'steps':>9} "
          f"{'us/step':>8} {'ff%':>5} {'sat':>4} {'maxrss_MiB':>10} {'load':>5}")
    for n, p, lat in points:
        out = subprocess.run([sys.executable, __file__, "--point", json.dumps([n, p, lat])], capture_output=True,
                             text=True, check=True,
                             env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[1])})
        d = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{d['n']:9d} {d['np']:4d} {d['latency']:32} {d['wall_s']:8.2f} {d['cpu_s']:8.2f} "
              f"{d['n'] / d['cpu_s']:9.0f} {d['steps']:9d} {1e6 * d['cpu_s'] / d['steps']:8.2f} "
              f"{100 * d['ff_steps'] / d['steps']:5.1f} {'yes' if d['saturated'] else 'no':>4} "
              f"{d['max_rss_mib']:10.0f} {d['load']:5.2f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "traces"))
    ap.add_argument("--latency", default="default", help="latency model spec (default: %(default)s)")
    ap.add_argument("--keepup-latency", default=KEEPUP,
                    help="latency of the Azure run on -np 64 that keeps up ('' to skip; default: %(default)s)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests of each trace")
    ap.add_argument("--no-step", action="store_true", help="skip the step-by-step (--no-fast-forward) runs")
    ap.add_argument("--scaling", action="store_true", help="also print the cost curve over requests and -np")
    ap.add_argument("--max-n", type=int, default=100_000, help="largest generated trace for --scaling")
    ap.add_argument("--point", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.point:
        print(json.dumps(scaling_point(*json.loads(args.point))))
        return 0
    d = Path(args.traces_dir)
    header(args.latency + (f", keep-up {args.keepup_latency}" if args.keepup_latency else ""))
    latency = get_latency_model(args.latency)
    rows = []
    # Azure: -np 16 -c 262144 gives 16k-token slots, more than any Azure prompt (max 14,050).
    # Mooncake prompts reach 191k tokens: 16 slots sharing one unified pool of 2M cells (-kvu) fit them all.
    cases = [("AzureLLMInferenceTrace_conv.csv", "np16", ServerConfig(n_parallel=16, n_ctx=262144), latency),
             ("mooncake_synthetic_trace.jsonl", "np16 kvu",
              ServerConfig(n_parallel=16, n_ctx=2 * 1024 * 1024, kv_unified=True), latency)]
    if args.keepup_latency:
        cases.append(("AzureLLMInferenceTrace_conv.csv", "np64 keep-up",
                      ServerConfig(n_parallel=64, n_ctx=64 * 16384), get_latency_model(args.keepup_latency)))
    for name, conf, cfg, lat in cases:
        path = d / name
        if not path.exists():
            print(f"skip {name}: not found in {d}", file=sys.stderr)
            continue
        tr = read_trace(path)
        if args.limit:
            tr = tr.head(args.limit)
        for ff in ((True,) if args.no_step else (False, True)):
            rows.append((name, conf, len(tr), ff, run(tr, cfg, lat, ff)))
    table(rows)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.scaling:
        scaling(args.max_n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
