"""Simulator speed: requests and steps simulated per wall second, with and without fast-forward.

Replays the Azure 2023 conversation trace (19,366 requests) with -np 16 -c 262144 and the Mooncake synthetic
trace; prints one table. Both modes run in this one process, side by side, so the ratio is meaningful on a
shared machine. Usage:

    .venv/bin/python benchmarks/bench_sim.py [--traces-dir ../shared/traces] [--latency default] [--limit N]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from engine.core import ServerConfig
from sim.driver import Simulation
from sim.latency_spec import get_latency_model
from traces import read_trace


def run(trace, cfg, latency, ff):
    sim = Simulation(cfg, latency, fast_forward=ff)
    c0 = time.process_time()
    r = sim.run(trace).run
    r["cpu_s"] = time.process_time() - c0
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "traces"))
    ap.add_argument("--latency", default="default", help="latency model spec (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests of each trace")
    args = ap.parse_args(argv)
    d = Path(args.traces_dir)
    latency = get_latency_model(args.latency)
    print(f"python {platform.python_version()}  cpu_count {os.cpu_count()}  latency {args.latency}")
    print("the simulator is single-threaded pure Python (no BLAS); numbers are wall time of sim.run()")
    rows = []
    # Azure: -np 16 -c 262144 gives 16k-token slots, more than any Azure prompt (max 14,050).
    # Mooncake prompts reach 191k tokens: 16 slots sharing one unified pool of 2M cells (-kvu) fit them all.
    for name, cfg in [("AzureLLMInferenceTrace_conv.csv", ServerConfig(n_parallel=16, n_ctx=262144)),
                      ("mooncake_synthetic_trace.jsonl",
                       ServerConfig(n_parallel=16, n_ctx=2 * 1024 * 1024, kv_unified=True))]:
        path = d / name
        if not path.exists():
            print(f"skip {name}: not found in {d}", file=sys.stderr)
            continue
        t0 = time.perf_counter()
        tr = read_trace(path)
        if args.limit:
            tr = tr.head(args.limit)
        load_s = time.perf_counter() - t0
        for ff in (False, True):
            r = run(tr, cfg, latency, ff)
            rows.append((name, len(tr), load_s, ff, r))
    print("req/s and steps/s are per wall second; req/cpu_s per CPU second of this process (less sensitive "
          "to other processes on a shared machine)")
    print(f"{'trace':34} {'reqs':>6} {'ff':>5} {'wall_s':>8} {'cpu_s':>7} {'req/s':>7} {'req/cpu_s':>9} "
          f"{'steps':>8} {'steps/s':>8} {'ff_steps':>8} {'errors':>6} {'sim_s':>9}")
    for name, n, load_s, ff, r in rows:
        print(f"{name:34} {n:6d} {str(ff):>5} {r['wall_s']:8.2f} {r['cpu_s']:7.2f} "
              f"{r['requests_per_wall_s']:7.0f} {n / r['cpu_s']:9.0f} {r['steps']:8d} "
              f"{r['steps_per_wall_s']:8.0f} {r['ff_steps']:8d} {r['n_errors']:6d} {r['sim_s']:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
