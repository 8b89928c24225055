"""`slotlab study --study-real N`: which cells are checked, the slice of a workload, the real-engine runs on a
tiny random-weight GGUF (stored and reused), bad input, and report sentences that follow real.json."""

import json

import pandas as pd
import pytest

from experiments.cli import main
from experiments.study.real import (
    REAL_JSON,
    REQUESTS_PARQUET,
    RUNS_PARQUET,
    first_requests,
    measured_direction,
    pick_cells,
    scaled_cache_mib,
    verdict,
)
from experiments.study.report import real_section
from experiments.study.run import cells_frame
from traces import chat_sessions
from traces.synthetic.reuse import tenants

# One slot: requests are served in arrival order whatever the step times, so the cache decisions (and the
# token counts) of a real run are those of the simulated run on the same slice.
SPEC = """\
name = "tiny-real"
seeds = 3
[server]
n_parallel = 1
n_ctx = 2048
kv_unified = false
[axes]
evict = ["fifo", "lru"]
cache_hit = ["copy"]
cache_ram = [6, 12]
load = [1]
[workloads.tenants]
kind = "tenants"
n_requests = 16
n_tenants = 4
rate = 0.5
rate_s = 1.5
system_tokens = [60, 200]
user_tokens = [10, 30]
output_tokens = [4, 8]
"""


@pytest.fixture(scope="module")
def kv_model(tmp_path_factory):
    """A tiny random-weight GGUF whose KV takes 4,108 bytes per token (8 layers x 4 KV heads x 32): the
    study's 6 and 12 MiB of SmolLM2 KV scale to 1 and 2 MiB, about 256 and 512 of its tokens, so its
    entries are evicted within a few requests (the 2-layer `tiny` model's 268 bytes would need < 1 MiB)."""
    from engine.model.tiny import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "kv.gguf", n_layer=8, n_embd=128, n_head=4, n_head_kv=4,
                           n_ff=128, n_ctx_train=2048)


@pytest.fixture
def spec_file(tmp_path):
    p = tmp_path / "tiny_real.toml"
    p.write_text(SPEC)
    return p


# --- the slice ------------------------------------------------------------------------------------------


def test_first_requests_of_a_trace_keeps_arrivals_and_caps_replies():
    w = tenants(30, 4, 1.0, 0.5, system_tokens=(50, 80), user_tokens=(5, 9), output_tokens=(4, 40), seed=3)
    s = first_requests(w, 7, max_output=10)
    assert [r.arrival_s for r in s] == [r.arrival_s for r in w.requests[:7]]
    assert [r.block_hashes for r in s] == [r.block_hashes for r in w.requests[:7]]
    assert [r.n_output for r in s] == [min(10, r.n_output) for r in w.requests[:7]]
    assert [r.n_output for r in first_requests(w, 7)] == [r.n_output for r in w.requests[:7]]


def test_first_requests_of_a_chat_are_the_first_turns_by_nominal_send_time():
    w = chat_sessions(6, (2, 5), 20.0, 2, (30, 60), (5, 10), (8, 30), 40.0, seed=1)
    nominal = []
    for s in w.sessions:
        t = s.start_s
        for j, turn in enumerate(s.turns):
            t += turn.think_s if j else 0.0
            nominal.append((t, s.session_id, j))
    want = sorted(nominal)[:9]
    s = first_requests(w, 9, max_output=12)
    assert s.n_turns == 9
    got = {(x.session_id, j) for x in s.sessions for j in range(len(x.turns))}
    assert got == {(sid, j) for _, sid, j in want}
    for x in s.sessions:                       # each session keeps a prefix of its turns, replies capped
        full = w.session(x.session_id)
        assert [t.n_user for t in x.turns] == [t.n_user for t in full.turns[:len(x.turns)]]
        assert [t.n_output for t in x.turns] == [min(12, t.n_output) for t in full.turns[:len(x.turns)]]


def test_cache_size_scales_to_the_same_number_of_tokens():
    assert scaled_cache_mib(512, 23052, 23052) == 512
    assert scaled_cache_mib(1024, 23052, 268) == round(1024 * 268 / 23052)
    assert scaled_cache_mib(16, 23052, 268) == 1          # at least 1 MiB


# --- which cells ----------------------------------------------------------------------------------------


def _cells(deltas):
    """fifo and lru cells of workload w over 4 seeds; `deltas` maps size -> (lru - fifo points per seed)."""
    recs = []
    for size, per_seed in deltas.items():
        for seed, d in enumerate(per_seed):
            for evict, hr in (("fifo", 0.4 + 0.01 * seed), ("lru", 0.4 + 0.01 * seed + d / 100)):
                recs.append({"key": f"{size}{seed}{evict}", "status": "ok",
                             "config": {"study": "t", "workload": {"name": "w", "kind": "tenants", "seed": seed,
                                                                   "load": 1.0},
                                        "evict": evict, "cache_hit": "copy", "cache_ram": size, "latency": "default",
                                        "server": {}, "code": "x"},
                             "row": {"token_hit_rate": hr, "ttft_p90_s": 1.0, "evictions": 5 if size < 4096 else 0}})
    return cells_frame(recs)


def test_picks_the_largest_significant_difference_and_a_no_difference_cell():
    cells = _cells({64: [-3.0, -2.5, -3.5, -2.0],      # significant, lru worse
                    256: [9.0, -8.0, 7.0, -6.0],        # larger |mean| would be +0.5, not significant
                    1024: [1.0, -1.0, 0.5, -0.5],       # not significant, decisions differ, evictions
                    4096: [0.0, 0.0, 0.0, 0.0]})        # identical, nothing evicted
    largest, nodiff = pick_cells(cells, "fifo")
    assert (largest["role"], largest["cache_ram"], largest["study"]["direction"]) == ("largest", 64, "worse")
    assert largest["seed"] == 2 and largest["study"]["seed_diff"] == pytest.approx(-3.5)   # most negative seed
    assert largest["study"]["significant"] and largest["study"]["mean"] == pytest.approx(-2.75)
    assert (nodiff["role"], nodiff["study"]["direction"]) == ("no-difference", "same")
    # among the not significant ones: decisions differ and fifo evicted; the smallest |mean| of those
    assert nodiff["cache_ram"] == 1024 and nodiff["seed"] == 2          # |0.5| at seeds 2 and 3: the first


def test_without_a_significant_difference_the_largest_mean_is_picked():
    largest, nodiff = pick_cells(_cells({64: [2.0, -1.0, 3.0, -2.5], 1024: [0.1, -0.1, 0.0, 0.0]}), "fifo")
    assert largest["cache_ram"] == 64 and not largest["study"]["significant"]
    assert largest["study"]["direction"] == "same" and nodiff["cache_ram"] == 1024


def test_direction_and_verdict():
    assert [measured_direction(x) for x in (0.0, 1e-9, -2.0)] == ["same", "better", "worse"]
    assert verdict("worse", "worse", 3) == "holds"
    assert verdict("worse", "same", 3) == "does not hold"
    assert verdict("worse", "same", 0) == "untested"


# --- the report follows real.json -----------------------------------------------------------------------


def _run(hr, evictions=4, ttft=(0.5, 0.9), saturated=False):
    return {"metrics": {"token_hit_rate": hr, "evictions": evictions, "ttft_p50_s": ttft[0], "ttft_p90_s": ttft[1]},
            "cache_ram_mib": 512, "load": {"arrival_rps": 0.2, "service_rps": 0.05 if saturated else 0.4,
                                           "saturated": saturated}}


def _real(study_dir, study_mean, fifo, lru, sim_fifo, sim_lru, evictions=4):
    real_d, sim_d = 100 * (lru - fifo), 100 * (sim_lru - sim_fifo)
    cell = {"role": "largest", "workload": "tenants", "cache_hit": "copy", "cache_ram": 512, "cache_ram_real": 512,
            "load": 1.0, "seed": 1, "n_requests": 20, "workload_requests": 150,
            "study": {"mean": study_mean, "lo": study_mean - 1, "hi": study_mean + 1, "n": 5,
                      "significant": study_dir != "same", "identical": False, "direction": study_dir,
                      "seed_diff": study_mean},
            "runs": {"fifo": {"real": _run(fifo, evictions), "sim": _run(sim_fifo)},
                     "lru": {"real": _run(lru, evictions), "sim": _run(sim_lru)}},
            "real_diff": real_d, "sim_diff": sim_d, "real_direction": measured_direction(real_d),
            "sim_direction": measured_direction(sim_d), "real_evictions": 2 * evictions,
            "verdict": verdict(study_dir, measured_direction(real_d), 2 * evictions),
            "agrees_with_sim": measured_direction(real_d) == measured_direction(sim_d), "sim_longer": None}
    cell["holds"] = cell["verdict"] == "holds"
    return {"n_requests": 20, "max_output": 16, "model": "/m/SmolLM2.gguf", "threads": 2,
            "threads_desc": "2 compute threads", "baseline": "fifo", "other": "lru",
            "kv_bytes_per_token": {"study": 23052, "model": 23052}, "cells": [cell], "wall_s": 100.0,
            "reused_real_runs": 0}


def test_report_says_the_direction_holds_when_the_measured_runs_agree():
    text = " ".join(real_section(_real("worse", -2.7, 0.50, 0.46, 0.52, 0.49)))
    assert "holds on the measured runs in 1, does not hold in 0." in text
    assert "the study finds `lru` worse than `fifo`: -2.7 points [-3.7, -1.7] over 5 seeds" in text
    assert "the real engine measured `fifo` 50.0% and `lru` 46.0% token hit rate (-4.0 points: `lru` worse" in text
    assert "the simulator predicted 52.0% and 49.0% for the same slice (-3.0 points: `lru` worse" in text
    assert "The direction of the study's finding holds on the measured runs." in text
    assert "agree in direction with the simulator's prediction" in text
    assert "so the cache sizes are the study's" in text
    assert "Measured − predicted token hit rate: `fifo` -2.0, `lru` -3.0 points." in text


def test_report_says_the_direction_does_not_hold_when_the_measured_runs_disagree():
    text = " ".join(real_section(_real("worse", -2.7, 0.46, 0.50, 0.52, 0.49)))
    assert "holds on the measured runs in 0, does not hold in 1." in text
    assert ("does not hold on the measured runs: the study finds `lru` worse than `fifo`, the measured runs "
            "show `lru` better than `fifo`") in text
    assert "differ in direction from the simulator's prediction" in text
    assert "The direction of the study's finding holds" not in text


def test_report_says_untested_when_no_real_run_evicted():
    text = " ".join(real_section(_real("worse", -2.7, 0.5, 0.5, 0.5, 0.5, evictions=0)))
    assert "1 could not be tested (no entry evicted in the first 20 requests)" in text
    assert "cannot test the study's finding (untested)" in text
    assert "Measured − predicted" not in text                 # the same hit rates as predicted
    assert "same cache decisions" not in text and "saturated" not in text
    text = " ".join(real_section(_real("worse", -2.7, 0.48, 0.5, 0.5, 0.5, evictions=0)))
    assert "With no eviction both policies made the same cache decisions, so this difference comes from" in text


def test_report_says_when_the_engine_was_saturated():
    r = _real("worse", -2.7, 0.50, 0.46, 0.52, 0.49)
    r["cells"][0]["runs"]["lru"]["real"] = _run(0.46, saturated=True)
    text = " ".join(real_section(r))
    assert ("The engine was saturated in the real `lru` run: requests arrived at 0.2 req/s and it served "
            "0.05 req/s while requests waited (the simulator: 0.4 req/s)") in text


def test_report_states_scaled_cache_sizes_and_failures():
    r = _real("same", 0.1, 0.5, 0.5, 0.5, 0.5)
    r["kv_bytes_per_token"] = {"study": 23052, "model": 268}
    r["cells"][0]["cache_ram_real"] = 6
    text = " ".join(real_section(r))
    assert "the study's sizes are for 23,052 KV bytes per token and the model's take 268" in text
    assert "512 MiB → 6 MiB" in text
    assert "holds on the measured runs in 1" in text            # no difference found, none measured
    assert real_section(None) == ["Not run (`--study-real N` runs two cells' first N requests on the numpy engine)."]
    assert "failed: RuntimeError: boom" in real_section({"error": "RuntimeError: boom"})[0]


# --- end to end on the tiny GGUF ------------------------------------------------------------------------


def test_study_real_runs_two_cells_on_the_engine_and_a_rerun_reuses_them(spec_file, kv_model, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["study", str(spec_file), "--out", str(out), "-j", "1", "--quiet", "--no-plots", "--study-real", "6",
            "-m", kv_model, "--threads", "1"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "real engine 1/4:" in err and "real engine 4/4:" in err
    real = json.loads((out / REAL_JSON).read_text())
    assert [c["role"] for c in real["cells"]] == ["largest", "no-difference"]
    kv = real["kv_bytes_per_token"]
    assert kv["study"] == 23052 and kv["model"] == 4108
    runs = pd.read_parquet(out / RUNS_PARQUET)
    assert len(runs) == 8 and set(runs["backend"]) == {"numpy", "sim"}
    reqs = pd.read_parquet(out / REQUESTS_PARQUET)
    assert len(reqs) == 8 * 6 and (reqs["ttft_s"] > 0).all() and (reqs["n_output"] <= 16).all()
    for c in real["cells"]:
        assert c["n_requests"] == 6
        assert c["cache_ram_real"] == scaled_cache_mib(c["cache_ram"], kv["study"], kv["model"])
        mine = runs[runs["role"] == c["role"]].set_index(["evict", "backend"])
        hr = mine["token_hit_rate"]
        assert c["real_diff"] == pytest.approx(100 * (hr["lru", "numpy"] - hr["fifo", "numpy"]))
        assert c["real_evictions"] == mine.xs("numpy", level="backend")["evictions"].sum() > 0
        assert set(real["cells"][0]["runs"]["fifo"]["real"]["load"]) >= {"arrival_rps", "service_rps", "saturated"}
        assert c["verdict"] == verdict(c["study"]["direction"], measured_direction(c["real_diff"]),
                                       c["real_evictions"])
        # one slot: the engine's measured step times cannot change a decision, so the counts are predicted
        for evict in ("fifo", "lru"):
            assert mine.loc[(evict, "numpy"), "n_cached_tokens"] == mine.loc[(evict, "sim"), "n_cached_tokens"]
    report = (out / "report.md").read_text()
    section = report[report.index("## Real engine"):report.index("## Workload")]
    for line in real_section(real):
        assert line in section
    assert "The first 6 requests of one seed of 2 configurations" in section
    info = json.loads((out / "study.json").read_text())
    assert info["real"]["cells"][0]["verdict"] == real["cells"][0]["verdict"] and REAL_JSON in info["files"]
    # a rerun with the same settings runs nothing on the engine and loads no model
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "real engine 1/4" not in err and "loaded" not in err
    again = json.loads((out / REAL_JSON).read_text())
    assert again["reused_real_runs"] == 4
    assert [c["real_diff"] for c in again["cells"]] == [c["real_diff"] for c in real["cells"]]
    # other settings (the reply cap) are new runs
    assert main([*argv, "--real-max-output", "4"]) == 0
    assert "real engine 4/4:" in capsys.readouterr().err
    assert json.loads((out / REAL_JSON).read_text())["max_output"] == 4


@pytest.mark.parametrize("extra, message", [
    (["--study-real", "-1"], "--study-real N: N is a number of requests (>= 1; 0 = no real-engine check), got -1"),
    (["--study-real", "3", "-m", "MISSING"], "--study-real needs a model: model file not found"),
    (["--study-real", "3", "--threads", "0"], "--threads must be >= 1"),
])
def test_bad_study_real_input_is_an_error_before_any_cell(spec_file, tiny, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    extra = [str(tmp_path / "nope.gguf") if x == "MISSING" else x for x in extra]
    if "-m" not in extra:
        extra += ["-m", tiny]
    assert main(["study", str(spec_file), "--out", str(out), "-j", "1", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_study_real_needs_lru_and_the_baseline(tmp_path, tiny, capsys):
    p = tmp_path / "s.toml"
    p.write_text(SPEC.replace('evict = ["fifo", "lru"]', 'evict = ["fifo", "slru"]'))
    assert main(["study", str(p), "--out", str(tmp_path / "o"), "--study-real", "3", "-m", tiny, "--quiet"]) == 2
    assert "--study-real compares `lru` with the baseline `fifo`" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_engine_failure_keeps_the_simulated_study(spec_file, tiny, tmp_path, monkeypatch, capsys):
    import experiments.study.real as real_mod

    def boom(*a, **k):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(real_mod, "_run_one", boom)
    out = tmp_path / "out"
    assert main(["study", str(spec_file), "--out", str(out), "-j", "1", "--quiet", "--no-plots",
                 "--study-real", "3", "-m", tiny]) == 1
    assert "the real-engine check failed: RuntimeError: engine exploded" in capsys.readouterr().err
    assert len(pd.read_parquet(out / "cells.parquet")) == 3 * 2 * 2       # seeds x policies x sizes
    assert "The real-engine check failed: RuntimeError: engine exploded" in (out / "report.md").read_text()
