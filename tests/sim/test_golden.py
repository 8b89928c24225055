"""Golden results: the simulator's per-request rows and metrics on the public traces, pinned as they were
before the speed work of issue 12 (any change to what the simulator decides shows up here).

Reads the traces from ../shared/traces beside the checkout (or $SLOTLAB_TRACES) and skips when they are
absent. Heads of the traces keep it to a few seconds: a saturated server (the default latency, the issue's
benchmark configurations) and one that keeps up (a GPU roofline with enough slots).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import pytest

from engine.core import ServerConfig
from sim.driver import Simulation
from sim.latency_spec import get_latency_model
from traces import read_trace

TRACES = Path(os.environ.get("SLOTLAB_TRACES") or Path(__file__).resolve().parents[2].parent / "shared" / "traces")
AZURE, MOONCAKE = "AzureLLMInferenceTrace_conv.csv", "mooncake_synthetic_trace.jsonl"
GPU = "roofline:llama-3-8b@a100-80gb"


def _h(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


CASES = {
    "azure-default-np16": (AZURE, 6000, dict(n_parallel=16, n_ctx=262144), "default",
                           dict(n_errors=0, sim_s=18508.951620463, steps=95125, rows="eb5aa5cd559641be",
                                metrics="4cbb0679bd3c7542", cache={"evictions": 5710, "hits": 0, "saves": 5984})),
    "mooncake-default-np16-kvu": (MOONCAKE, 1000, dict(n_parallel=16, n_ctx=2 * 1024 * 1024, kv_unified=True), "default",
                                  dict(n_errors=0, sim_s=124186.918438736, steps=13240, rows="d3f5b746883dd5b1",
                                       metrics="936559fe6c8e0cf3", cache={"evictions": 946, "hits": 4, "saves": 983})),
    "azure-gpu-np64": (AZURE, 3000, dict(n_parallel=64, n_ctx=64 * 16384), GPU,
                       dict(n_errors=0, sim_s=637.625248169, steps=20827, rows="4e8aead0a45c84e7",
                            metrics="2279afb5b47e8a81")),
    "mooncake-gpu-np16-kvu": (MOONCAKE, 500, dict(n_parallel=16, n_ctx=2 * 1024 * 1024, kv_unified=True), GPU,
                              dict(n_errors=0, sim_s=1016.307759544, steps=6776, rows="2b967fb00ed99d1b",
                                   metrics="eb19c2738e01dae4")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_golden_summary(case):
    name, n, cfg, latency, want = CASES[case]
    path = TRACES / name
    if not path.exists():
        pytest.skip(f"public trace {path} not present")
    r = Simulation(ServerConfig(**cfg), get_latency_model(latency)).run(read_trace(path).head(n))
    got = dict(n_errors=r.run["n_errors"], sim_s=r.run["sim_s"], steps=r.run["steps"], rows=_h(r.requests),
               metrics=_h(dataclasses.asdict(r.metrics)))
    if "cache" in want:
        got["cache"] = {k: r.cache_stats[k] for k in want["cache"]}
    assert got == want
