"""`slotlab replay` and `slotlab generate` on a tiny random-weight GGUF (no download)."""

import json
import re

import pandas as pd

from experiments.cli import main

WORKLOAD = ["--workload", "poisson", "--rate", "20", "--requests", "6", "--prompt-tokens", "10-40",
            "--output-tokens", "3-8", "-np", "2", "-c", "512", "--seed", "5"]


def test_replay_writes_the_simulate_layout_with_measured_times(tiny, tmp_path):
    out = tmp_path / "r"
    assert main(["replay", "-m", tiny, "--threads", "1", "--quiet", "--no-plots", "--out", str(out), *WORKLOAD]) == 0
    rows = pd.read_parquet(out / "requests.parquet")
    assert len(rows) == 6 and (rows["finish"] == "limit").all()
    assert (rows["n_output"] == rows["n_output_target"]).all()      # ignore_eos: trace lengths are honoured
    assert (rows["ttft_s"] > 0).all()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["backend"] == "numpy" and cfg["threads"] == 1
    assert cfg["threads_desc"] == json.loads((out / "run.json").read_text())["threads_desc"] == "1 compute thread (BLAS 1)"


def test_replay_records_the_heap_reserve_and_the_heap_around_the_run(tiny, tmp_path):
    """By default no reserve (llama-server's allocator); `--mem-reserve N` (in a child: it changes the allocator
    of the whole process) is recorded with the heap's size before and after the run, which it covers."""
    import platform
    import subprocess
    import sys
    out = tmp_path / "r"
    assert main(["replay", "-m", tiny, "--threads", "1", "--quiet", "--no-plots", "--out", str(out), *WORKLOAD]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mem_reserve_mib"] == 0
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return
    child = ("import sys; from experiments.cli import main; sys.exit(main(sys.argv[1:]))")
    res = subprocess.run([sys.executable, "-c", child, "replay", "-m", tiny, "--threads", "1", "--quiet",
                          "--no-plots", "--mem-reserve", "64", "--out", str(tmp_path / "m"), *WORKLOAD],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["mem_reserve_mib"] == 64
    assert cfg["heap_mib_start"] >= 64 and cfg["heap_mib_end"] - cfg["heap_mib_start"] < 1   # no new memory
    assert "grew" not in res.stderr


def test_a_negative_heap_reserve_is_a_usage_error(tiny, tmp_path, capsys):
    assert main(["replay", "-m", tiny, "--mem-reserve", "-1", "--out", str(tmp_path / "o"), *WORKLOAD]) == 2
    assert "--mem-reserve: expected a size in MiB >= 0, got -1" in capsys.readouterr().err


def test_replay_runs_the_numerics_asked_for_and_records_it(tiny, tmp_path):
    """ggml (llama.cpp's arithmetic, as serve's) unless told otherwise; `--numerics f32` runs and records the float32
    reference, with the same requests and lengths."""
    runs = {}
    for numerics in ("f32", "ggml"):
        out = tmp_path / numerics
        extra = [] if numerics == "ggml" else ["--numerics", numerics]
        assert main(["replay", "-m", tiny, "--threads", "1", "--quiet", "--no-plots", "--out", str(out), *extra,
                     *WORKLOAD]) == 0
        assert json.loads((out / "config.json").read_text())["numerics"] == numerics
        runs[numerics] = pd.read_parquet(out / "requests.parquet")
    cols = ["request", "n_prompt", "n_output"]
    assert runs["f32"][cols].equals(runs["ggml"][cols])


def test_replay_prints_its_summary_and_thread_settings(tiny, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["replay", "-m", tiny, "--threads", "2", "--no-plots", "--out", str(out), *WORKLOAD]) == 0
    printed = capsys.readouterr().out
    assert "requests: 6 (0 errors)" in printed
    assert f"results: {out}/   (numpy engine, 2 compute threads (matmuls split over Python threads, BLAS 1))" in printed


def test_replay_and_simulate_see_the_same_requests(tiny, tmp_path):
    assert main(["replay", "-m", tiny, "--threads", "1", "--quiet", "--no-plots", "--out", str(tmp_path / "r"),
                 *WORKLOAD]) == 0
    assert main(["simulate", "--quiet", "--no-plots", "--out", str(tmp_path / "s"), *WORKLOAD]) == 0
    r = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    s = pd.read_parquet(tmp_path / "s" / "requests.parquet")
    cols = ["request", "arrival_s", "n_prompt", "n_output_target"]
    pd.testing.assert_frame_equal(r[cols], s[cols])


def test_replay_with_missing_model_is_a_usage_error(tmp_path, capsys):
    assert main(["replay", "-m", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o"), *WORKLOAD]) == 2
    assert "model file not found" in capsys.readouterr().err


def test_generate_prints_text_and_stats(tiny, capsys):
    assert main(["generate", "-m", tiny, "-p", "hello world", "-n", "5", "--temp", "0", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "5 generated" in err and "1 compute thread (BLAS 1)" in err
    assert re.search(r"warm-up \d+\.\d\d s\]", err)                    # reported apart from the timing


def test_the_replays_kv_is_resident_unless_the_server_is_unified(tiny):
    """A unified server's slots each get n_ctx cells in the engine (n_slots x the cells in use at once): its store
    stays lazy; a per-slot one is allocated and written whole before the first step, as llama.cpp's KV cache."""
    from engine.core import ServerConfig
    from engine.model import load
    from experiments.replay import engine_simulation
    model = load(tiny, n_threads=1)
    for n_parallel, resident in ((-1, False), (2, True)):
        sim, cfg = engine_simulation(model, ServerConfig(n_parallel=n_parallel, n_ctx=256), seed=0, temp=0.0)
        assert cfg.resolve().kv_unified is not resident
        assert sim.backend.kv.resident is resident and (sim.backend.kv.pool_k is not None) is resident
