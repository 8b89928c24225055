"""`slotlab study`: spec checking, a tiny study end to end, resuming, the Dask path, and a report whose
sentences follow the data."""

import json
import math

import pandas as pd
import pytest

from experiments.cli import main
from experiments.study.report import findings
from experiments.study.run import cells_frame, plan_study
from experiments.study.spec import SpecError, load_spec, parse_spec, quick_version
from experiments.sweep import Cell, CellStore, run_cells

TINY = """\
name = "tiny"
seeds = 2
[server]
n_parallel = 2
n_ctx = 16384
kv_unified = false
[axes]
evict = ["fifo", "lru", "belady"]
cache_hit = ["move", "copy"]
cache_ram = [16, 256]
load = [1]
[workloads.chat]
kind = "chat"
users = 4
turns = [2, 3]
think_time = 5.0
output_tokens = [4, 12]
start_spread = 5.0
[workloads.tenants]
kind = "tenants"
n_requests = 20
n_tenants = 4
rate = 0.3
"""


@pytest.fixture
def tiny(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text(TINY)
    return p


def _rows(out):
    return pd.read_parquet(out / "cells.parquet")


# --- spec errors -----------------------------------------------------------------------------------------


def _line(text):
    return TINY.splitlines().index(text) + 1


@pytest.mark.parametrize("edit, key", [
    (("users = 4", "userz = 4"), "workloads.chat.userz"),
    (('evict = ["fifo", "lru", "belady"]', 'evict = ["fifo", "lur"]'), "axes.evict"),
    (("n_parallel = 2", "n_paralel = 2"), "server.n_paralel"),
    (("seeds = 2", "seeds = 0"), "seeds"),
    (('kind = "tenants"', 'kind = "tenant"'), "workloads.tenants.kind"),
    (("cache_ram = [16, 256]", "cache_ram = [16, -1]"), "axes.cache_ram"),
    (("[axes]", "[axes"), "(syntax)"),
])
def test_spec_error_names_file_line_and_key(tmp_path, edit, key):
    line = _line(edit[0])
    p = tmp_path / "bad.toml"
    p.write_text(TINY.replace(*edit))
    with pytest.raises(SpecError) as e:
        load_spec(str(p))
    assert (e.value.source, e.value.line, e.value.key) == (str(p), line, key)
    assert str(e.value).startswith(f"{p}:{line}: key '{key}'")


def test_bad_spec_runs_no_cell_and_writes_nothing(tmp_path, capsys):
    p = tmp_path / "bad.toml"
    p.write_text(TINY.replace("n_tenants = 4", "n_tenants = 4\ncolour = 1"))
    out = tmp_path / "out"
    assert main(["study", str(p), "--out", str(out), "-j", "1", "--quiet"]) == 2
    assert f"{p}:{_line('n_tenants = 4') + 1}: key 'workloads.tenants.colour': unknown key" in capsys.readouterr().err
    assert not out.exists()


def test_missing_trace_is_an_error_unless_optional(tmp_path):
    spec = TINY + '[workloads.mc]\nkind = "trace"\npath = "no_such_trace.jsonl"\n'
    with pytest.raises(SpecError, match="workloads.mc.path"):
        plan_study(parse_spec(spec, "s.toml"))
    plan = plan_study(parse_spec(spec + "optional = true\n", "s.toml"))
    assert "mc" in plan.skipped and {c.config["workload"]["name"] for c in plan.cells} == {"chat", "tenants"}


def test_builtin_study_has_the_axes_of_the_issue():
    s = load_spec("fifo-vs-lru")
    assert len(s.seeds) >= 5 and len(s.axes["load"]) >= 2 and set(s.axes["cache_hit"]) == {"move", "copy"}
    assert {"fifo", "lru", "lfu", "gdsf", "largest", "slru", "clock", "belady"} <= set(s.axes["evict"])
    sizes = s.axes["cache_ram"]
    assert all(b / a == sizes[1] / sizes[0] for a, b in zip(sizes, sizes[1:]))    # log-spaced
    assert quick_version(s).n_cells < s.n_cells / 4


# --- running, resuming -----------------------------------------------------------------------------------


def test_tiny_study_writes_everything_and_a_rerun_skips_every_cell(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["study", str(tiny), "--out", str(out), "-j", "1", "--quiet"]) == 0
    first = _rows(out)
    assert len(first) == 3 * 2 * 2 * 1 * 2 * 2 and (first["status"] == "ok").all()
    for f in ("report.md", "study.json", "hit_rate_vs_size.png", "ttft_p90_vs_size.png", "gap_to_oracle.png",
              "small_multiples.png"):
        assert (out / f).is_file(), f
    info = json.loads((out / "study.json").read_text())
    assert info["counts"] == {"total": 48, "skipped": 0, "ran": 48, "failed": 0}
    assert info["rerun"].startswith("slotlab study")
    # FIFO == LRU under move, cell by cell
    m = first[first["cache_hit"] == "move"].set_index(["workload", "seed", "cache_ram", "evict"])["token_hit_rate"]
    assert (m.xs("fifo", level="evict") == m.xs("lru", level="evict")).all()
    capsys.readouterr()
    assert main(["study", str(tiny), "--out", str(out), "-j", "1", "--quiet", "--no-plots"]) == 0
    assert "48 of 48 cells already finished (skipped); running 0" in capsys.readouterr().err
    pd.testing.assert_frame_equal(first, _rows(out))


def test_a_failed_cell_is_recorded_and_rerun(tmp_path):
    cells = [Cell(f"k{i}", {"i": i}, "w") for i in range(4)]
    calls = []

    def fn(config, workload):
        calls.append(config["i"])
        if config["i"] == 2 and len(calls) <= 4:
            raise RuntimeError("boom")
        return {"x": config["i"] * workload}

    store = CellStore(tmp_path / "cells")
    recs, counts = run_cells(cells, fn, {"w": 10}, store, jobs=1, progress=False, log=lambda m: None)
    assert counts == {"total": 4, "skipped": 0, "ran": 4, "failed": 1}
    assert [r["status"] for r in recs] == ["ok", "ok", "error: RuntimeError: boom", "ok"]
    recs, counts = run_cells(cells, fn, {"w": 10}, store, jobs=1, progress=False, log=lambda m: None)
    assert counts["skipped"] == 3 and counts["failed"] == 0 and recs[2]["row"] == {"x": 20}


# --- Dask ------------------------------------------------------------------------------------------------


def _without_wall(records):
    return [{**r, "row": {k: v for k, v in r["row"].items() if k != "wall_s"}} for r in records]


def test_dask_local_cluster_gives_the_same_cells_as_the_pool(tiny, tmp_path):
    from distributed import Client, LocalCluster

    from experiments.study.cell import run_cell

    plan = plan_study(load_spec(str(tiny)))
    cells = plan.cells[:12]
    pool, _ = run_cells(cells, run_cell, plan.workloads, CellStore(tmp_path / "a"), jobs=2, progress=False,
                        log=lambda m: None)
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        dask, counts = run_cells(cells, run_cell, plan.workloads, CellStore(tmp_path / "b"), dask=client,
                                 progress=False, log=lambda m: None)
    assert counts["failed"] == 0
    assert _without_wall(pool) == _without_wall(dask)


def test_unreachable_dask_scheduler_is_a_clear_error_and_writes_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["study", str(tiny), "--out", str(out), "--dask", "tcp://127.0.0.1:9", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the Dask scheduler at tcp://127.0.0.1:9" in err
    assert not out.exists()


# --- the report follows the data -------------------------------------------------------------------------


def _cells(lru_minus_fifo):
    """Cells of one workload/hit: fifo, lru and belady at 64 and 1024 MiB over 5 seeds, with the given
    lru - fifo hit-rate difference (points) per size; belady 10 points above fifo."""
    recs = []
    for seed in range(5):
        for size, delta in lru_minus_fifo.items():
            base = 0.40 + 0.01 * seed
            for evict, hr in (("fifo", base), ("lru", base + delta / 100 + 0.001 * (seed - 2) * (delta != 0)),
                              ("belady", base + 0.10)):
                recs.append({"key": f"{seed}{size}{evict}", "status": "ok",
                             "config": {"study": "t", "workload": {"name": "w", "kind": "tenants", "seed": seed,
                                                                   "load": 1.0},
                                        "evict": evict, "cache_hit": "copy", "cache_ram": size, "latency": "default",
                                        "server": {}, "code": "x"},
                             "row": {"token_hit_rate": hr, "ttft_p90_s": 1.0 - hr, "evictions": 5}})
    return cells_frame(recs)


def test_report_sentences_follow_the_cells():
    wins = " ".join(findings(_cells({64: 10.0, 1024: 0.0}), "fifo", "belady")[("w", "copy")])
    assert "`lru` beats `fifo` in 1 of 2 cells, by up to +10.0 points" in wins
    assert "shows no significant difference at 1024 MiB" in wins
    assert "The oracle `belady` is above `fifo` by up to +10.0 points" in wins
    assert "closes 100% of that gap" in wins
    loses = " ".join(findings(_cells({64: -6.0, 1024: 0.0}), "fifo", "belady")[("w", "copy")])
    assert "`lru` is worse than `fifo` in 1 of 2 cells, by up to -6.0 points" in loses
    assert "beats `fifo`" not in loses
    same = " ".join(findings(_cells({64: 0.0, 1024: 0.0}), "fifo", "belady")[("w", "copy")])
    assert "`lru` gave results identical to `fifo` in all 2 cells" in same


def test_paired_ci_is_the_t_interval():
    from experiments.study.stats import mean_ci

    m, lo, hi = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.776 * math.sqrt(2.5) / math.sqrt(5)
    assert m == 3.0 and lo == pytest.approx(3 - half) and hi == pytest.approx(3 + half)


def test_a_quick_study_on_dask_writes_the_cells_parquet_of_the_process_pool(tiny, tmp_path):
    """The whole command, `--quick`, once on a 2-process pool and once on `--dask local` (a LocalCluster
    of 2 worker processes): the same rows, every column but the wall time."""
    pool, dask = tmp_path / "pool", tmp_path / "dask"
    assert main(["study", str(tiny), "--quick", "--out", str(pool), "-j", "2", "--quiet", "--no-plots"]) == 0
    assert main(["study", str(tiny), "--quick", "--out", str(dask), "--dask", "local", "-j", "2", "--quiet",
                 "--no-plots"]) == 0
    a, b = (_rows(d).drop(columns=["wall_s"]).sort_values("key").reset_index(drop=True) for d in (pool, dask))
    assert len(a) == quick_version(load_spec(str(tiny))).n_cells and (a["status"] == "ok").all()
    pd.testing.assert_frame_equal(a, b)
    assert json.loads((dask / "study.json").read_text())["runner"] == "Dask local"
