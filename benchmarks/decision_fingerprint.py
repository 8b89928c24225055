"""Fingerprints of the simulator's decisions: run this before and after a change that must not change results.

Ten simulations (Azure conv head at -np 16 and at -np 4 -kvu -c 32768 -cram 64; Mooncake head with -kvu; the
built-in chat; chat at -np 2 -kvu -c 4096 -cram 4; each with fast-forward on and off) print a hash of the
whole decision log (`Recorder` events) and of the per-request rows. Equal output = identical decisions and
timings. Reads the public traces from --traces-dir (default ../shared/traces); runs without them on the chat
cases only.

    .venv/bin/python benchmarks/decision_fingerprint.py > before.txt   # then again after, and diff
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from engine.core import Recorder, ServerConfig
from sim.driver import Simulation
from sim.latency_spec import get_latency_model
from traces import default_chat_workload, read_trace


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "traces"))
    args = ap.parse_args(argv)
    d = Path(args.traces_dir)
    lat = get_latency_model("default")
    cases = []
    azure, mooncake = d / "AzureLLMInferenceTrace_conv.csv", d / "mooncake_synthetic_trace.jsonl"
    if azure.exists():
        az = read_trace(azure).head(3000)
        cases.append(("azure np16", az, ServerConfig(n_parallel=16, n_ctx=262144)))
        cases.append(("azure np4 kvu c32k cram64", az.head(800),
                      ServerConfig(n_parallel=4, n_ctx=32768, kv_unified=True, cache_ram_mib=64)))
    if mooncake.exists():
        cases.append(("mooncake kvu", read_trace(mooncake).head(300),
                      ServerConfig(n_parallel=16, n_ctx=2 * 1024 * 1024, kv_unified=True)))
    cases.append(("chat default", default_chat_workload(), ServerConfig(n_ctx_train=8192)))
    cases.append(("chat np2 c4096 kvu", default_chat_workload(),
                  ServerConfig(n_parallel=2, n_ctx=4096, kv_unified=True, cache_ram_mib=4)))
    for name, wl, cfg in cases:
        for ff in (True, False):
            rec = Recorder()
            r = Simulation(cfg, lat, fast_forward=ff, recorder=rec).run(wl)
            print(f"{name:28s} ff={ff:d} log={digest(rec.events)} rows={digest(r.requests)} n_events={len(rec.events)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
