"""`slotlab calibrate` on a tiny random-weight GGUF (--quick): the calibration file, its side files, the
plans it measures counted in the simulator's units, interleaved passes, cross-validation and the load."""

import argparse
import itertools
import json
import time
import types

import numpy as np
import pandas as pd
import pytest

from engine.core.types import ForwardCall, KVOp, Task
from engine.model import load
from experiments.calibrate import (PROBE_REPEATS, TEMPLATE_CHUNK, GridPoint, KINDS, _Bench, Measured, Measurement, MixTime, PassInfo, add_calibrate_parser, build_plan,
                                   calibration_grid, engine_layout, load_figures, measure_grid, measure_probe,
                                   probe_points, replay_sampling, run_calibrate, side_files)
from experiments.speed_probe import SpeedProbe, calibration_probe
from sim.backend import SimBackend
from sim.latency import (COEFFICIENT_NAMES, ConstantLatency, ParametricLatency, decode_only_cost,
                         load_calibration, step_cost_from_chunks)
from sim.latency_physical import TABLE_REPLACES, PhysicalLatency, load_latency_file
from sim.latency_spec import get_latency_model


def parse(*argv):
    """calibrate's arguments, the heap reserve off unless `argv` sets one (the engine runs in pytest's process, whose
    allocator a reserve would change for every later test)."""
    parser = argparse.ArgumentParser()
    add_calibrate_parser(parser.add_subparsers())
    return parser.parse_args(["calibrate", "--mem-reserve", "0", *argv])


def steady_load():
    return (0.5, 0.4, 0.3)


def cpu_of_others(cores_by_read):
    """A CPU reader whose other processes used `cores_by_read(i)` CPU seconds between read i-1 and read i
    (this process: 1 s per read)."""
    reads = itertools.count()
    total = [0.0]

    def read():
        i = next(reads)
        total[0] += cores_by_read(i)
        return (total[0] + i, float(i))
    return read


@pytest.fixture(scope="module")
def calibrated(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "calib.json"
    rc = run_calibrate(parse("-m", tiny, "--threads", "1", "--quick", "--quiet", "--out", str(out)),
                       load_reader=steady_load, cpu_reader=cpu_of_others(lambda i: 0.0))
    return rc, out


def ones(k):
    return [1] * k


TASKS = [Task(id=i, tokens=[0]) for i in range(8)]


def test_calibrate_writes_a_loadable_file_with_non_negative_coefficients(calibrated):
    rc, out = calibrated
    assert rc == 0
    model = load_calibration(out)
    assert all(v >= 0 for v in model.coefficients().values())
    assert model.step_time_s(decode_only_cost(1, 17)) > 0


def test_calibration_file_records_fit_stats_and_where_it_was_measured(calibrated):
    data = json.loads(calibrated[1].read_text())
    assert {"r2", "mape", "max_ape", "rmse_s", "n_rows"} <= set(data["fit"])
    assert data["fit"]["n_rows"] == len(calibration_grid(quick=True))
    on = data["measured_on"]
    assert on["threads"] == 1 and on["model"] == "tiny.gguf" and on["engine"].startswith("slotlab numpy")
    assert "load average" in on["notes"]
    assert on["mem_reserve_mib"] == 0                    # as asked (parse): the allocator's defaults


def test_latency_spec_parametric_loads_the_table_model_and_the_others_stay_selectable(calibrated):
    model = get_latency_model(f"parametric:{calibrated[1]}")
    assert isinstance(model, PhysicalLatency) and model.call_table
    assert all(v >= 0 for v in model.coefficients) and model.measured_on.model == "tiny.gguf"
    assert model == get_latency_model(f"table:{calibrated[1]}")
    physical = get_latency_model(f"physical:{calibrated[1]}")
    assert isinstance(physical, PhysicalLatency) and not physical.call_table
    # the table replaces the per-call matmul terms: the table fit leaves them at zero
    assert all(model.terms()[name] == 0.0 for name in TABLE_REPLACES)
    # the quick grid's calls are of 1, 4, 8, 10, 24, 32, 34 and 96 tokens: every size of 1..16 is a knot
    assert [m for m, _ in model.call_table if m <= 16] == [1, 4, 8, 10]
    simple = get_latency_model(f"simple:{calibrated[1]}")
    assert isinstance(simple, ParametricLatency)
    assert simple.coefficients() == load_calibration(calibrated[1]).coefficients()
    assert set(simple.coefficients()) == set(COEFFICIENT_NAMES)


def test_calibration_file_reports_held_out_errors_per_kind_for_both_models(calibrated):
    data = json.loads(calibrated[1].read_text())
    errors = data["cross_validation"]["errors"]
    for model in ("simple", "physical", "table"):
        for validation in ("in_sample", "loso", "group"):
            per_kind = errors[model][validation]
            assert set(per_kind) == {"all", *KINDS}
            assert all(0 <= e["median_ape"] <= e["max_ape"] and e["mape"] <= e["max_ape"] for e in per_kind.values())
        assert errors[model]["in_sample"]["all"]["mape"] == pytest.approx(data[
            "fit" if model == "simple" else f"fit_{model}"]["mape"])
    assert data["measurement"]["passes"] == 2 and len(data["samples"]) == len(calibration_grid(quick=True))


def test_steady_load_is_recorded_and_not_marked(calibrated):
    data = json.loads(calibrated[1].read_text())
    assert data["load_moved"] is False
    load = data["load"]
    assert load["before"] == [0.5, 0.4, 0.3] and load["load1_moved_by"] == 0.0 and len(load["passes"]) == 2
    assert load["criterion"] == "others_cpu" and [p["others_cpu"] for p in load["passes"]] == [0.0, 0.0]


def test_the_speed_probe_is_stored_in_the_calibration_file(calibrated):
    data = json.loads(calibrated[1].read_text())
    probe = calibration_probe(calibrated[1])
    assert probe == SpeedProbe.from_dict(data["probe"], "calib.json")
    assert [s.label for s in probe.shapes] == [p.label for p in probe_points()]
    for shape in probe.shapes:
        assert len(shape.samples_s) == PROBE_REPEATS and shape.median_s == sorted(shape.samples_s)[PROBE_REPEATS // 2]
        assert shape.grid_median_s is None                  # the quick grid has none of the probe's shapes
    assert probe.threads == 1 and probe.model == "tiny.gguf" and probe.load_before == (0.5, 0.4, 0.3)
    assert probe.when[:4].isdigit() and probe.wall_s > 0


def test_a_probe_shape_the_grid_measured_keeps_the_grids_median(tiny):
    model = load(tiny, n_threads=1)
    grid = Measurement([Measured(probe_points()[0], None, (0.25, 0.5, 0.75), (0.0,) * 3)], [], (0.0,), (0.0,), 1.0,
                       False)
    probe = measure_probe(model, replay_sampling(model, 0.0, 0), repeats=2, grid=grid, load_reader=steady_load,
                          cpu_reader=lambda: None)
    assert [s.grid_median_s for s in probe.shapes] == [0.5, None, None]
    assert all(len(s.samples_s) == 2 for s in probe.shapes)


def test_steps_table_has_one_row_per_shape_with_every_model(calibrated):
    steps_csv, png = side_files(calibrated[1])
    steps = pd.read_csv(steps_csv)
    assert len(steps) == len(calibration_grid(quick=True))
    assert set(steps["kind"]) == set(KINDS)
    assert (steps["measured_s"] > 0).all() and (steps["min_s"] <= steps["measured_s"]).all()
    row = steps.iloc[0]                                  # decode of one sequence: its layout is exact
    cost = decode_only_cost(int(row["n_decode_tokens"]), int(row["attn_ctx_tokens"]))
    assert row["predicted_s"] == pytest.approx(load_latency_file(calibrated[1], "physical").step_time_s(cost))
    assert row["predicted_simple_s"] == pytest.approx(load_calibration(calibrated[1]).step_time_s(cost))
    assert row["predicted_table_s"] == pytest.approx(load_latency_file(calibrated[1]).step_time_s(cost))
    for col in ("loso_s", "group_s", "loso_simple_s", "group_simple_s", "loso_table_s", "group_table_s", "spread"):
        assert steps[col].notna().all()
    assert png.stat().st_size > 0


def test_other_processes_starting_mid_run_are_warned_about_and_marked(tiny, tmp_path, capsys):
    out = tmp_path / "moved.json"
    args = parse("-m", tiny, "--threads", "1", "--quick", "--quiet", "--no-plots", "--out", str(out))
    # reads 0, 1 bracket pass 1 (others idle), reads 2, 3 pass 2: others use 1000 CPU seconds
    assert run_calibrate(args, load_reader=steady_load, cpu_reader=cpu_of_others(lambda i: 1000.0 * (i == 3))) == 0
    assert "load moved" in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["load_moved"] is True and data["load"]["criterion"] == "others_cpu"
    first, second = (p["others_cpu"] for p in data["load"]["passes"])
    assert first == 0.0 and second > 0.5 and data["load"]["moved_by"] == second
    assert get_latency_model(f"parametric:{out}").load_moved is True


def test_own_threads_raising_the_load_average_are_not_a_moving_load(tiny, tmp_path, capsys):
    rising = (x / 10 for x in itertools.count())         # +0.1 per reading, others idle
    out = tmp_path / "own.json"
    args = parse("-m", tiny, "--threads", "1", "--quick", "--quiet", "--no-plots", "--out", str(out))
    assert run_calibrate(args, load_reader=lambda: (next(rising), 0.0, 0.0),
                         cpu_reader=cpu_of_others(lambda i: 0.0)) == 0
    assert "load moved" not in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["load_moved"] is False and data["load"]["load1_moved_by"] > 1.0


def test_without_proc_stat_the_load_average_is_the_criterion(tiny, tmp_path, capsys):
    rising = (x / 10 for x in itertools.count())
    out = tmp_path / "noproc.json"
    args = parse("-m", tiny, "--threads", "1", "--quick", "--quiet", "--no-plots", "--out", str(out))
    assert run_calibrate(args, load_reader=lambda: (next(rising), 0.0, 0.0), cpu_reader=lambda: None) == 0
    assert "load moved" in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["load_moved"] is True and data["load"]["criterion"] == "load1"


def _measurement(load1s, others=None, before=0.0, after=0.0):
    point = Measured(GridPoint("decode", decode=(1,)), None, (0.1,) * len(load1s), tuple(load1s))
    passes = [PassInfo(1.0, (before,), (after,), o) for o in (others or [None] * len(load1s))]
    return Measurement([point], passes, (before, 0, 0), (after, 0, 0), 1.0, False)


@pytest.mark.parametrize("load1s, moved", [((1.0, 1.5, 2.0), False), ((1.0, 2.1), True), ((3.0,), True)])
def test_without_cpu_figures_load_moved_is_the_range_of_every_load_reading(load1s, moved):
    info = load_figures(_measurement(load1s, before=1.0, after=1.0), threshold=1.0)
    assert info["moved"] is moved and info["criterion"] == "load1"
    assert info["load1_moved_by"] == pytest.approx(max(load1s + (1.0,)) - min(load1s + (1.0,)))


@pytest.mark.parametrize("others, moved", [((0.2, 0.6, 0.4), False), ((0.2, 0.71), True), ((1.5, 1.5, 1.5), False)])
def test_load_moved_is_the_range_of_other_processes_cores_over_passes(others, moved):
    info = load_figures(_measurement((5.0,) * len(others), others=list(others)), threshold=0.5)
    assert info["moved"] is moved and info["moved_by"] == pytest.approx(max(others) - min(others))


def test_time_budget_keeps_at_least_three_passes(tiny):
    model = load(tiny, n_threads=1)
    grid = calibration_grid(quick=True)[:3]
    m = measure_grid(model, grid, replay_sampling(model, 0.0, 0), repeats=6, max_seconds=1e-9,
                     load_reader=steady_load)
    assert len(m.passes) == 3 and m.stopped_by_budget
    assert all(len(p.samples_s) == 3 and p.cost.calls is not None for p in m.points)
    full = measure_grid(model, grid, replay_sampling(model, 0.0, 0), repeats=4, load_reader=steady_load)
    assert len(full.passes) == 4 and not full.stopped_by_budget


def test_each_pass_records_the_hypervisors_steal(tiny):
    """Per pass, the cores /proc/stat's steal grew by over the pass's wall time (a fake reader and clock here),
    in the file's load block; unknown steal is None."""
    model = load(tiny, n_threads=1)
    grid = calibration_grid(quick=True)[:2]
    t, stolen = [0.0], [10.0]

    def clock():
        t[0] += 0.5
        return t[0]

    def steal():
        stolen[0] += 0.1                                  # read at a pass's start and end: 0.1 s of steal
        return stolen[0]                                  # while its clock moves 0.5 s -> 0.2 cores
    m = measure_grid(model, grid, replay_sampling(model, 0.0, 0), repeats=3, load_reader=steady_load,
                     clock=clock, steal_reader=steal)
    info = load_figures(m, threshold=0.5)
    assert [p["steal_cpu"] for p in info["passes"]] == pytest.approx([0.2] * 3)
    blind = measure_grid(model, grid, replay_sampling(model, 0.0, 0), repeats=3, load_reader=steady_load,
                         steal_reader=lambda: None)
    assert all(p.steal_cpu is None for p in blind.passes)


def test_a_calibration_under_steal_time_is_warned_about(tiny, tmp_path, capsys):
    stolen = [0.0]

    def steal():                                      # a core's worth of steal per second of wall time
        stolen[0] = time.perf_counter()
        return stolen[0]
    args = parse("-m", tiny, "--threads", "1", "--quick", "--quiet", "--no-plots", "--out", str(tmp_path / "c.json"))
    assert run_calibrate(args, load_reader=steady_load, cpu_reader=cpu_of_others(lambda i: 0.0),
                         steal_reader=steal) == 0
    err = capsys.readouterr().err
    assert "steal time" in err and "hypervisor" in err
    assert json.loads((tmp_path / "c.json").read_text())["load"]["passes"][0]["steal_cpu"] == pytest.approx(1.0, rel=0.05)
    assert run_calibrate(args, load_reader=steady_load, cpu_reader=cpu_of_others(lambda i: 0.0),
                         steal_reader=lambda: 5.0) == 0
    assert "steal" not in capsys.readouterr().err


def test_template_holds_the_longest_context_in_consecutive_positions(tiny):
    model = load(tiny, n_threads=1)
    grid = [GridPoint("decode", decode=(TEMPLATE_CHUNK * 2 + 9,))]
    bench = _Bench(model, grid, replay_sampling(model, 0.0, 0), np.random.default_rng(0))
    kv = bench.backend.kv
    n = grid[0].max_cells
    assert kv.n_tokens(bench.scratch) == n and (kv.positions(bench.scratch) == np.arange(n)).all()
    bench.prepare(grid[0])
    assert kv.n_tokens(0) == n - 1


def test_a_sequence_reused_after_appends_holds_the_templates_cells(tiny):
    model = load(tiny, n_threads=1)
    grid = [GridPoint("decode", decode=(100,)), GridPoint("decode", decode=(40,)),
            GridPoint("shift", decode=(128,), shift=True)]
    bench = _Bench(model, grid, replay_sampling(model, 0.0, 0), np.random.default_rng(0))
    kv = bench.backend.kv
    for first, then in ((grid[0], grid[1]), (grid[2], grid[1])):   # after appends; after a shift
        bench.measure(first)
        bench.prepare(then)
        assert kv.state_save(0) == bench.blob(40)


def test_ggml_bench_times_a_running_slots_step_with_its_kv_shadow_current(tiny):
    """In ggml mode a decode shape's sequences hold a current float32 KV shadow when the step is timed, as a
    running slot does (the step converts only its new cells), whichever shape used the sequence before: a
    reload, or cells kept from a longer context."""
    model = load(tiny, n_threads=1, numerics="ggml")
    grid = [GridPoint("decode", decode=(100, 30)), GridPoint("decode", decode=(40,)),
            GridPoint("shift", decode=(128,), shift=True)]
    bench = _Bench(model, grid, replay_sampling(model, 0.0, 0), np.random.default_rng(0))
    kv = bench.backend.kv
    for first, then in ((grid[0], grid[1]), (grid[2], grid[1]), (grid[1], grid[0])):
        bench.measure(first)
        bench.prepare(then)
        for seq, n_past in enumerate(then.decode):
            sh = kv.seq_kv(seq).shadow
            assert sh is not None and (sh.valid == n_past).all()


def test_engine_layout_reads_the_models_constants(tiny):
    model = load(tiny, n_threads=2)
    layout = engine_layout(model)
    assert layout.weight_bytes == model.weights.n_stream_bytes
    assert layout.n_threads == 2 and layout.n_head == model.hparams.n_head
    assert layout.decode_batch_min >= 1                  # f32 numerics attends one-token chunks together


def test_missing_model_is_a_usage_error(tmp_path, capsys):
    assert run_calibrate(parse("-m", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "c.json"))) == 2
    assert "model file not found" in capsys.readouterr().err


def test_side_files_sit_next_to_the_calibration(tmp_path):
    assert side_files(tmp_path / "smollm2.json") == (tmp_path / "smollm2_steps.csv", tmp_path / "smollm2_fit.png")


def test_decode_plan_costs_what_fast_forward_charges():
    plan = build_plan(GridPoint("decode", decode=(100, 100, 100)), ones, TASKS)
    assert SimBackend(ConstantLatency(0.0), 1000).cost(plan) == decode_only_cost(3, 303)
    assert set(plan.tasks) == {0, 1, 2}          # every decoding sequence samples


def test_mixed_plan_counts_prompt_and_decode_tokens_like_step_cost_from_chunks():
    plan = build_plan(GridPoint("mixed", decode=(50,), prompt=((20, 8),)), ones, TASKS)
    cost = SimBackend(ConstantLatency(0.0), 1000).cost(plan)
    expected = step_cost_from_chunks(prefill_chunks=[(20, 8)], decode_n_past=[50])
    assert cost == expected


def test_copy_plan_charges_saved_and_loaded_bytes():
    plan = build_plan(GridPoint("copy", prompt=((64, 8),), save_tokens=32, load_tokens=64), ones, TASKS)
    kinds = [getattr(p, "kind", "forward") for p in plan.program]
    assert kinds == ["cache_save", "cache_load", "forward"]
    assert SimBackend(ConstantLatency(0.0), 1000).cost(plan).kv_copy_bytes == (32 + 64) * 1000


def test_multi_slot_save_plan_saves_each_slot_then_clears_it():
    point = GridPoint("copy", prompt=((0, 8),) * 3, save_tokens=40, save_slots=3)
    plan = build_plan(point, ones, TASKS)
    ops = [p for p in plan.program if not isinstance(p, ForwardCall)]
    assert [(op.kind, op.seq) for op in ops] == [("cache_save", 0), ("seq_rm", 0), ("cache_save", 1), ("seq_rm", 1),
                                                  ("cache_save", 2), ("seq_rm", 2)]
    assert len({op.entry for op in ops if op.kind == "cache_save"}) == 3        # three entries, none overwritten
    assert SimBackend(ConstantLatency(0.0), 1000).cost(plan).kv_copy_bytes == 3 * 40 * 1000
    assert point.label == "prompt 8, prompt 8, prompt 8, save 3x40" and point.group == point.label


def test_save_slots_beyond_the_prompts_or_without_tokens_are_refused():
    with pytest.raises(ValueError, match="save_slots"):
        GridPoint("copy", prompt=((0, 8),), save_tokens=40, save_slots=2)
    with pytest.raises(ValueError, match="save_slots"):
        GridPoint("copy", prompt=((0, 8),) * 2, save_slots=2)


def test_a_multi_slot_save_point_runs_on_the_bench_and_leaves_the_slots_cleared(tiny):
    model = load(tiny, n_threads=1)
    point = GridPoint("copy", prompt=((0, 8),) * 2, save_tokens=30, save_slots=2)
    bench = _Bench(model, [point], replay_sampling(model, 0.0, 0), np.random.default_rng(0))
    for _ in range(2):                                   # the second run prepares from the first's state
        cost, seconds = bench.measure(point)
        assert cost.kv_save_bytes == 2 * 30 * model.config_facts()["kv_bytes_per_token"] and seconds > 0
        assert [bench.backend.kv.n_tokens(s) for s in (0, 1)] == [8, 8]    # cleared, then the new chunk
        assert not bench.backend.cache                  # the saved entries do not pile up across passes


def test_a_save_point_first_writes_and_frees_as_much_memory_as_its_saves_take(tiny, monkeypatch):
    """Outside the timing, so that the saves' blobs land in pages the process has just used, as a serving
    process's do (pages new to it cost ~2 ns a byte on a VM: the grid's save shapes were bimodal)."""
    import experiments.calibrate as C
    model = load(tiny, n_threads=1)
    points = [GridPoint("copy", prompt=((0, 8),) * 2, save_tokens=30, save_slots=2),
              GridPoint("copy", prompt=((20, 8),), save_tokens=20, load_tokens=20),
              GridPoint("copy", prompt=((20, 8),), load_tokens=20), GridPoint("prefill", prompt=((0, 16),))]
    bench = _Bench(model, points, replay_sampling(model, 0.0, 0), np.random.default_rng(0))
    freed, execute = [], bench.backend.execute

    def timed(plan):
        freed.append("execute")
        return execute(plan)
    monkeypatch.setattr(C, "recently_freed", freed.append)
    monkeypatch.setattr(bench.backend, "execute", timed)
    for p in points:
        bench.measure(p)
    state = {n: len(bench.blob(n)) for n in (20, 30)}              # bytes of a sequence state of n cells
    assert freed == [2 * state[30], "execute", state[20], "execute", "execute", "execute"]


def test_full_grid_saves_several_slots_in_one_step():
    grid = calibration_grid()
    multi = [p for p in grid if p.save_slots > 1]
    assert multi and max(p.save_slots * p.save_tokens for p in multi) >= 4096


def test_shift_plan_discards_half_and_decodes_after_the_kept_cells():
    plan = build_plan(GridPoint("shift", decode=(100,), shift=True), ones, TASKS)
    rm, add, call = plan.program
    assert (rm.kind, rm.p0, rm.p1) == ("seq_rm", 0, 50)
    assert (add.kind, add.p0, add.p1, add.delta) == ("seq_add", 50, 100, -50)
    assert call.chunks[0].pos0 == 50
    assert SimBackend(ConstantLatency(0.0), 1000).cost(plan).kv_shift_tokens == 50


def test_split_plan_cuts_like_the_core_and_only_the_last_part_samples():
    plan = build_plan(GridPoint("split", decode=(10,), prompt=((0, 20),), split=5), ones, TASKS)
    first, second = [p for p in plan.program if isinstance(p, ForwardCall)]
    assert (first.n_tokens, second.n_tokens) == (5, 16)
    assert first.chunks[-1].sample_for == () and second.chunks[0].pos0 == 4
    assert second.chunks[0].sample_for == (1,)
    assert SimBackend(ConstantLatency(0.0), 1000).cost(plan).n_forward_calls == 2


def test_cross_validation_groups_hold_out_a_batch_size_or_a_chunk_length():
    grid = calibration_grid()
    groups = {p.group for p in grid}
    assert {"decode n=1", "decode n=16", "prefill L=512", "mixed n=8"} <= groups
    assert len({p.group for p in grid if p.kind == "prefill" and p.prompt[0][1] == 512}) == 1
    assert all(p.group == p.label for p in grid if p.kind in ("copy", "shift", "split"))


def test_full_grid_covers_the_shapes_the_core_produces():
    grid = calibration_grid()
    decodes = {len(p.decode) for p in grid if p.kind == "decode"}
    contexts = {c for p in grid if p.kind == "decode" for c in p.decode}
    chunks = {n for p in grid if p.kind == "prefill" for _, n in p.prompt}
    assert {1, 16} <= decodes and {64, 2048} <= contexts and {16, 512} <= chunks
    assert {p.kind for p in grid} == set(KINDS)


# --- the probe during a real run ----------------------------------------------------------------------------


def test_in_run_probe_takes_one_pass_each_interval_at_the_runs_clock(tiny):
    from experiments.calibrate import InRunProbe, probe_points, replay_sampling
    model = load(tiny, n_threads=1)
    wall, run_clock = [100.0], [3.0]
    probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 5.0, clock=lambda: wall[0],
                       load_reader=lambda: (0.25, 0.2, 0.1))
    probe.start(lambda: run_clock[0])
    for t in (100.0, 104.9):                        # less than every_s since the start: no pass
        wall[0] = t
        probe(None, 0.1)
    assert probe.passes == []
    wall[0] = 105.0
    probe(None, 0.1)                                # at its start (run_clock 3.0), a step of 0.1 s ended
    (first,) = probe.passes
    assert first.clock_s == pytest.approx(3.1) and first.wall_s == 5.0 and first.load1 == 0.25
    assert sorted(first.shapes_s) == sorted(p.label for p in probe_points())
    assert all(s > 0 for s in first.shapes_s.values())
    wall[0], run_clock[0] = 109.0, 7.0
    probe(None, 0.2)                                # the next pass is due every_s after the last one ended
    assert len(probe.passes) == 1
    wall[0] = 110.0
    probe(None, 0.2)
    assert [p.clock_s for p in probe.track().passes] == pytest.approx([3.1, 7.2]) and probe.track().every_s == 5.0
    with pytest.raises(ValueError, match="every_s must be > 0"):
        InRunProbe(model, replay_sampling(model, 0.0, 0), 0.0)


def test_probe_passes_during_a_replay_change_none_of_its_steps(tiny, tmp_path):
    """Every request arrives at t = 0 (decisions follow from the order of events alone): the same plans with a
    probe pass after every step as without, and the run's clock (clock_s) never includes a pass's time."""
    from experiments.calibrate import InRunProbe, replay_sampling
    from experiments.replay import run_replay
    from experiments.steplog import read_steps
    from experiments.workloads import build_workload
    from experiments.flags import option_values
    from tests.experiments.test_validate import parse as parse_validate
    from tests.experiments.test_validate_speed import write_trace
    args = parse_validate("-m", tiny, "--threads", "1", "--quiet", "--no-plots", "--trace",
                          str(write_trace(tmp_path / "t.jsonl")), "-np", "2", "-c", "512", "--seed", "5",
                          "--latency", "constant:0.01")
    values = option_values(args)
    workload, desc = build_workload(values)
    model = load(tiny, n_threads=1)
    probe = InRunProbe(model, replay_sampling(model, 0.0, 5), 1e-9)         # a pass after every step
    runs = {}
    for name, p in (("plain", None), ("probed", probe)):
        run_replay(values, workload, tiny, 1, 0.0, str(tmp_path / name), {"command": "test"}, csv=False,
                   plots=False, loaded=model, probe=p)
        runs[name] = read_steps(tmp_path / name)
    plain, probed = runs["plain"], runs["probed"]
    cols = ["kind", "n_prefill_tokens", "n_decode_tokens", "n_seqs", "attn_ctx_tokens", "kv_copy_bytes", "calls"]
    pd.testing.assert_frame_equal(plain[cols], probed[cols])
    assert len(probe.passes) == len(probed)
    # the run's clock: each step starts where the one before it ended (all arrivals at 0: no idle gap)
    ends = (probed["clock_s"] + probed["elapsed_s"]).to_numpy()
    assert probed["clock_s"].iloc[0] == 0.0
    np.testing.assert_allclose(probed["clock_s"].to_numpy()[1:], ends[:-1], rtol=0, atol=2e-9)
    np.testing.assert_allclose([p.clock_s for p in probe.passes], ends, rtol=0, atol=2e-9)


def test_a_probe_pass_keeps_the_median_of_its_rounds(tiny):
    from experiments.calibrate import InRunProbe, probe_points, replay_sampling
    model = load(tiny, n_threads=1)
    wall = [0.0]
    probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 1.0, repeats=3, clock=lambda: wall[0])
    times = iter([0.05, 0.01, 0.03] * 3)            # each shape's k-th execution, in the order they run
    executed = []

    def measure(point):
        executed.append(point.label)
        return None, next(times)
    probe.bench.measure = measure
    probe.start(lambda: 0.0)
    wall[0] = 1.0
    probe(None, 0.0)
    labels = [p.label for p in probe_points()]
    assert sorted(executed) == sorted(labels * 3)                # three interleaved rounds
    assert all(sorted(executed[3 * r:3 * r + 3]) == sorted(labels) for r in range(3))
    # the times handed out in execution order: each shape's median of its three
    got = {label: [] for label in labels}
    for label, t in zip(executed, [0.05, 0.01, 0.03] * 3):
        got[label].append(t)
    assert probe.passes[0].shapes_s == {label: sorted(v)[1] for label, v in got.items()}
    assert probe.track().repeats == 3
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        InRunProbe(model, replay_sampling(model, 0.0, 0), 1.0, repeats=0)


# --- the probe's mix: the run's own steps replayed --------------------------------------------------------


def test_a_steps_forward_calls_renumber_its_sequences_in_order_of_appearance():
    from engine.core.types import BatchPlan, Chunk
    from experiments.calibrate import replay_shape
    plan = build_plan(GridPoint("copy", prompt=((64, 8),), save_tokens=32, load_tokens=64), ones, TASKS)
    assert replay_shape(plan)[0] == (((0, 64, 8, True, True),),)           # the calls alone: copies are [1]
    calls = (ForwardCall((Chunk(5, 9, (1, 2, 3), 40, (), True), Chunk(2, 7, (4,), 100, (2,), False)), 4),
             ForwardCall((Chunk(5, 9, (6,), 43, (5,), True),), 1))
    plan = BatchPlan(0.0, calls, 4, 1, {})
    assert replay_shape(plan)[0] == (((0, 40, 3, False, True), (1, 100, 1, True, False)), ((0, 43, 1, True, True),))


def test_a_steps_replay_keeps_its_prompt_cache_copies_in_order_on_the_same_numbering():
    from engine.core.types import BatchPlan, Chunk
    from experiments.calibrate import replay_shape
    plan = build_plan(GridPoint("copy", prompt=((64, 8),), save_tokens=32, load_tokens=64), ones, TASKS)
    assert replay_shape(plan) == ((((0, 64, 8, True, True),),), (("save", 0, 32), ("load", 0, 64)))
    # a sequence only saved is numbered after the forwards' sequences; removals and shifts are left out
    program = (KVOp("cache_save", seq=7, entry=3, n_tokens=50), KVOp("seq_rm", seq=5, p0=10, p1=-1),
               KVOp("seq_add", seq=5, p0=10, p1=20, delta=-4), KVOp("cache_load", seq=5, entry=1, n_tokens=30),
               ForwardCall((Chunk(5, 9, (1, 2), 30, (5,), True),), 2))
    assert replay_shape(BatchPlan(0.0, program, 2, 0, {})) == ((((0, 30, 2, True, True),),),
                                                               (("save", 1, 50), ("load", 0, 30)))


@pytest.mark.parametrize("point", [GridPoint("mixed", decode=(50, 70), prompt=((20, 8),)),
                                   GridPoint("prefill", prompt=((0, 40),), split=16),
                                   GridPoint("decode", decode=(100, 3, 100)),
                                   GridPoint("copy", prompt=((64, 8),), save_tokens=32, load_tokens=64)])
def test_a_replayed_shape_costs_what_the_step_it_came_from_costs(point):
    from experiments.calibrate import mix_plan, replay_shape
    plan = build_plan(point, ones, TASKS)
    calls, ops = replay_shape(plan)
    again = mix_plan(calls, ones, TASKS, ops)
    counter = SimBackend(ConstantLatency(0.0), 1000)
    assert counter.cost(again) == counter.cost(plan) and replay_shape(again) == (calls, ops)
    assert (again.n_prompt_tokens, again.n_decode_tokens) == (plan.n_prompt_tokens, plan.n_decode_tokens)
    assert set(again.tasks) == set(plan.tasks)                      # the same sequences sample


def test_the_mix_bench_brings_each_sequence_to_the_context_its_chunk_continues(tiny):
    from experiments.calibrate import _MixBench
    model = load(tiny, n_threads=1)
    bench = _MixBench(model, 2, 128, replay_sampling(model, 0.0, 0), np.random.default_rng(0))
    kv = bench.backend.kv
    two_decodes = (((0, 90, 1, True, False), (1, 30, 1, True, False)),)
    assert bench.measure(two_decodes).seconds > 0
    assert (kv.n_tokens(0), kv.n_tokens(1)) == (91, 31)                # grown to pos0, plus the step's token
    prompt = (((1, 0, 16, False, True),), ((1, 16, 8, True, True),))   # a prompt in two calls (n_batch cut)
    assert bench.measure(prompt).seconds > 0 and kv.n_tokens(1) == 24           # trimmed to 0, then the two chunks
    assert kv.n_tokens(0) == 91                                          # a sequence the shape leaves alone
    # shapes these cells cannot hold: a third sequence, or a context beyond the per-slot size
    assert bench.measure((((2, 0, 4, True, True),),)) is None
    assert bench.measure((((0, 120, 9, True, True),),)) is None and kv.n_tokens(0) == 91
    assert bench.measure(two_decodes, (("load", 0, 200),)) is None and kv.n_tokens(0) == 91


def test_the_mix_bench_times_a_steps_copies_before_its_forward_calls(tiny, monkeypatch):
    from experiments.calibrate import _MixBench
    model = load(tiny, n_threads=1)
    bench = _MixBench(model, 2, 128, replay_sampling(model, 0.0, 0), np.random.default_rng(0))
    kv = bench.backend.kv
    done, real_copy = [], bench._copy

    def copy(kind, seq, n):
        real_copy(kind, seq, n)
        done.append((kind, seq, n, kv.n_tokens(seq)))
        return 5.0                                                        # seconds it is said to take
    monkeypatch.setattr(bench, "_copy", copy)
    bench.measure((((0, 70, 1, True, False),),))                          # sequence 0 ran to 71 cells
    t = bench.measure((((0, 40, 8, True, True),),), (("save", 0, 60), ("load", 0, 40)))
    assert done == [("save", 0, 60, 60), ("load", 0, 40, 40)]            # each copy moves the cells it names
    assert t.seconds > 10.0 and kv.n_tokens(0) == 48                     # both copies timed, then the chunk
    # ... and their part of it known (with the loaded sequence's shadow conversion: a no-op in these f32 numerics)
    assert 10.0 <= t.copy_s < 10.1
    assert bench.measure((((0, 48, 1, True, False),),)).copy_s == 0.0      # a step without copies
    # a loaded sequence's float32 shadow is brought current after the copies and timed as one of them (the run's
    # step after a load converts it, and the calibration's load price holds that); another sequence's untimed
    import experiments.calibrate as calibrate
    clock, converted = [100.0], []

    def convert(kv, seq):
        converted.append(seq)
        clock[0] += 2.0                                                   # each conversion "takes" 2 s
    monkeypatch.setattr(model, "shadow_current", convert)
    monkeypatch.setattr(calibrate, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    t = bench.measure((((0, 30, 4, True, True), (1, 10, 1, True, False)),), (("load", 0, 30),))
    assert converted == [1, 0]                    # the running sequence's as calibrate's bench holds it, then the loaded
    assert t.copy_s == 5.0 + 2.0                  # the load and its conversion; the running sequence's left out
    converted.clear()
    assert bench.measure((((0, 34, 1, True, False),),)).copy_s == 0.0 and converted == [0]   # no load: untimed


class FixedReplay:
    """A mix bench stand-in: every replay takes `seconds` (no copies in these shapes), or does not fit (None) for
    the shapes in `misfit`."""

    def __init__(self, seconds, misfit=()):
        self.seconds, self.misfit, self.calls = seconds, set(misfit), []

    def measure(self, calls, ops=()):
        self.calls.append(calls)
        return None if calls in self.misfit else MixTime(self.seconds, 0.0)


def test_replays_take_the_budget_of_each_paths_step_time(tiny):
    from experiments.calibrate import InRunProbe, build_plan as plan_of, replay_shape
    model = load(tiny, n_threads=1)
    wall, run_clock = [0.0], [0.0]
    probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, clock=lambda: wall[0], budget=0.5,
                       budget_prompt=0.5)
    probe.start(lambda: run_clock[0])
    probe.mix_bench = bench = FixedReplay(0.02)
    decode = plan_of(GridPoint("decode", decode=(40, 60)), ones, TASKS)
    prompt = plan_of(GridPoint("prefill", prompt=((0, 32),)), ones, TASKS)
    steps = [(decode, 0.02)] * 4 + [(prompt, 0.1), (decode, 0.02), (prompt, 0.1)]
    for i, (plan, seconds) in enumerate(steps):
        run_clock[0] = float(i)
        probe(plan, seconds)
    # credit: budget x the path's step time so far, less its replays' time; a step is replayed when it covers it
    # a decode step's replay runs its shape twice (the first untimed, outside the budget), a prompt step's once
    assert bench.calls == [replay_shape(decode)[0]] * 4 + [replay_shape(prompt)[0]]
    assert [(m.prompt, m.clock_s, m.step_s) for m in probe._pending] == [(False, 1.02, 0.02), (False, 3.02, 0.02),
                                                                          (True, 6.1, 0.1)]
    assert {path: c.credit for path, c in probe._credit.items()} == pytest.approx({False: 0.01, True: 0.1 - 0.02})
    probe(None, 0.02)                    # a step without a plan (nothing to replay) changes nothing
    assert len(bench.calls) == 5 and probe.passes == []
    probe.finish()                       # the replays go with a pass
    (last,) = probe.passes
    assert len(last.mix) == 3 and probe._pending == []
    probe.finish()                       # nothing waiting: no pass
    assert len(probe.passes) == 1
    # a shape the bench cannot hold is not replayed, and its path keeps its credit
    probe.mix_bench = FixedReplay(0.02, misfit=[replay_shape(decode)[0]])
    probe._credit = probe._credits()
    for _ in range(3):
        probe(decode, 0.02)
    assert probe._pending == [] and probe._credit[False].credit == pytest.approx(0.03)
    with pytest.raises(ValueError, match="budget and budget_prompt must be fractions of the step time"):
        InRunProbe(model, replay_sampling(model, 0.0, 0), 10.0, budget_prompt=1.5)


class ColdThenWarm:
    """A mix bench stand-in whose executions alternate between a cold and a warm time."""

    def __init__(self, cold, warm):
        self.times, self.calls = [cold, warm], []

    def measure(self, calls, ops=()):
        self.calls.append(calls)
        return MixTime(self.times[(len(self.calls) - 1) % 2], 0.0)


def test_a_decode_replay_keeps_its_warm_second_execution_and_is_charged_for_it_alone(tiny):
    from experiments.calibrate import InRunProbe, build_plan as plan_of, replay_shape
    model = load(tiny, n_threads=1)
    decode = plan_of(GridPoint("decode", decode=(40, 60)), ones, TASKS)
    for warm_decode, n_calls, kept in ((True, 2, 0.010), (False, 1, 0.013)):
        probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, budget=1.0, warm_decode=warm_decode)
        probe.start(lambda: 0.0)
        probe.mix_bench = bench = ColdThenWarm(0.013, 0.010)
        probe(decode, 0.02)
        assert bench.calls == [replay_shape(decode)[0]] * n_calls
        (m,) = probe._pending
        assert m.measured_s == kept and probe._credit[False].credit == pytest.approx(0.02 - kept)



def test_a_replay_executed_again_records_its_second_time_outside_the_budget(tiny):
    from experiments.calibrate import InRunProbe, build_plan as plan_of, replay_shape
    model = load(tiny, n_threads=1)
    decode = plan_of(GridPoint("decode", decode=(40, 60)), ones, TASKS)
    prompt = plan_of(GridPoint("prefill", prompt=((0, 48),)), ones, TASKS)
    probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, budget=1.0, again=True)
    probe.start(lambda: 0.0)
    probe.mix_bench = bench = ColdThenWarm(0.013, 0.010)
    probe(decode, 0.02)                  # warm-up (untimed), the timed replay, then again
    probe(prompt, 0.1)                   # the timed replay, then again
    assert bench.calls == [replay_shape(decode)[0]] * 3 + [replay_shape(prompt)[0]] * 2
    assert [(m.prompt, m.measured_s, m.again_s, m.again_copy_s) for m in probe._pending] == [
        (False, 0.010, 0.013, 0.0), (True, 0.010, 0.013, 0.0)]
    # the budget pays for the timed replay alone, as without again
    assert {path: c.credit for path, c in probe._credit.items()} == pytest.approx({False: 0.01, True: 0.09})
    plain = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, budget=1.0)
    plain.start(lambda: 0.0)
    plain.mix_bench = ColdThenWarm(0.013, 0.010)
    plain(prompt, 0.1)
    assert [(m.again_s, m.again_copy_s) for m in plain._pending] == [(None, None)]


def test_a_decode_replay_right_after_a_replayed_step_runs_once(tiny):
    from experiments.calibrate import InRunProbe, build_plan as plan_of
    model = load(tiny, n_threads=1)
    decode = plan_of(GridPoint("decode", decode=(40, 60)), ones, TASKS)
    wall = [0.0]
    probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, budget=1.0, clock=lambda: wall[0])
    probe.start(lambda: 0.0)
    probe.mix_bench = bench = ColdThenWarm(0.013, 0.010)
    for _ in range(3):                   # every step replayed: the first warmed up, the others after a replay
        probe(decode, 0.02)
    assert len(bench.calls) == 4 and [m.measured_s for m in probe._pending] == [0.010, 0.013, 0.010]
    wall[0] = 100.0                      # a pass of the fixed shapes (on the other bench) after this step
    probe(decode, 0.02)
    assert len(probe.passes) == 1 and len(bench.calls) == 5
    probe(decode, 0.02)                  # the first replay after the pass is warmed up again
    assert len(bench.calls) == 7
    # a share of the steps: a replay whose step before was not replayed warms up
    share = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, budget=0.25, clock=lambda: 0.0)
    share.start(lambda: 0.0)
    share.mix_bench = bench = FixedReplay(0.01)
    for _ in range(8):                   # credit 0.005 a step: steps 4, 6 and 8 replayed, each after one that was not
        share(decode, 0.02)
    assert len(share._pending) == 3 and len(bench.calls) == 6


def test_replays_run_on_a_bench_of_the_runs_size_and_go_with_the_next_pass(tiny):
    from engine.backend import NumpyBackend
    from experiments.calibrate import InRunProbe, build_plan as plan_of, replay_shape
    model = load(tiny, n_threads=1)
    wall = [0.0]
    probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 5.0, clock=lambda: wall[0], budget=1.0,
                       budget_prompt=1.0)
    run = NumpyBackend(model, 4, 128)
    probe.start(lambda: 0.0, run)
    assert (probe.mix_bench.backend.n_seq, probe.mix_bench.backend.n_ctx_seq) == (4, 128)
    plans = [plan_of(GridPoint("decode", decode=(40, 60)), ones, TASKS),
             plan_of(GridPoint("prefill", prompt=((0, 32),)), ones, TASKS)]
    for plan in plans:                   # budget 1: every step is replayed (its replay takes less than it)
        probe(plan, 1.0)
    wall[0] = 5.0
    probe(plan_of(GridPoint("decode", decode=(70,)), ones, TASKS), 1.0)
    (p1,) = probe.passes
    assert [m.calls for m in p1.mix] == [replay_shape(p)[0] for p in plans] + [(((0, 70, 1, True, False),),)]
    assert [m.prompt for m in p1.mix] == [False, True, False] and all(0 < m.measured_s < 1 for m in p1.mix)
    # without a backend (or mix=False) nothing is replayed
    plain = InRunProbe(model, replay_sampling(model, 0.0, 0), 5.0, clock=lambda: wall[0], mix=False)
    plain.start(lambda: 0.0, run)
    plain(plans[0], 1.0)
    plain.finish()
    assert plain.passes == [] and plain.mix_bench is None


def test_by_default_every_step_is_replayed_the_first_too(tiny):
    from experiments.calibrate import MIX_BUDGET, MIX_BUDGET_PROMPT, InRunProbe, build_plan as plan_of
    model = load(tiny, n_threads=1)
    probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, clock=lambda: 0.0)
    probe.start(lambda: 0.0)
    probe.mix_bench = FixedReplay(0.1)
    decode = plan_of(GridPoint("decode", decode=(40,)), ones, TASKS)
    prompt = plan_of(GridPoint("prefill", prompt=((0, 32),)), ones, TASKS)
    probe(prompt, 0.5)                   # the run's first step, and a long one
    for _ in range(100):
        probe(decode, 0.1)
        probe(prompt, 0.1)
    replayed = [m.prompt for m in probe._pending]
    assert MIX_BUDGET_PROMPT == 1 and probe._pending[0].prompt and probe._pending[0].step_s == 0.5
    assert MIX_BUDGET == 1 and replayed.count(True) == 101 and replayed.count(False) == 100
    # a decode budget of 0.15 (the default before docs/validation_sim.md §25): a share of the decode steps
    share = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, clock=lambda: 0.0, budget=0.15)
    share.start(lambda: 0.0)
    share.mix_bench = FixedReplay(0.1)
    for _ in range(100):
        share(decode, 0.1)
    assert len(share._pending) == pytest.approx(15, abs=1)
    # at half the prompt time (the default before docs/validation_sim.md §24) the first step waited for a later one
    half = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, clock=lambda: 0.0, budget_prompt=0.5)
    half.start(lambda: 0.0)
    half.mix_bench = FixedReplay(0.1)
    half(prompt, 0.5)
    assert half._pending == []


def test_a_budget_of_one_replays_every_step_even_when_replays_run_longer(tiny):
    from experiments.calibrate import InRunProbe, build_plan as plan_of
    model = load(tiny, n_threads=1)
    probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, clock=lambda: 0.0, budget=0.9,
                       budget_prompt=1.0)
    probe.start(lambda: 0.0)
    probe.mix_bench = FixedReplay(0.12)                                    # 20% slower than the steps
    decode = plan_of(GridPoint("decode", decode=(40,)), ones, TASKS)
    prompt = plan_of(GridPoint("copy", prompt=((64, 8),), save_tokens=32, load_tokens=64), ones, TASKS)
    for _ in range(20):
        probe(decode, 0.1)
        probe(prompt, 0.1)
    replayed = [m.prompt for m in probe._pending]
    assert replayed.count(True) == 20 and replayed.count(False) < 16        # a budget below 1 keeps its credit
    assert {m.ops for m in probe._pending if m.prompt} == {(("save", 0, 32), ("load", 0, 64))}


# --- --refit: this version's models fitted to a file's stored samples -----------------------------------------


def test_refit_of_a_calibration_fits_the_same_models_to_its_samples(tiny, calibrated, tmp_path, capsys):
    rc, src = calibrated
    out = tmp_path / "refit.json"
    assert run_calibrate(parse("-m", tiny, "--refit", str(src), "--quiet", "--no-plots",
                               "--out", str(out))) == 0
    old, new = json.loads(src.read_text()), json.loads(out.read_text())
    for key in ("physical", "table", "coefficients", "samples", "probe", "load", "measurement", "load_moved"):
        assert new[key] == old[key], key                      # same samples, same code: the same fits
    assert new["measured_on"]["date"] == old["measured_on"]["date"]
    assert "refit" in new["measured_on"]["notes"] and new["refit"]["from"] == str(src)
    assert load_latency_file(out) == load_latency_file(src)
    assert (tmp_path / "refit_steps.csv").exists() and "wrote" in capsys.readouterr().out


def test_refit_refuses_a_file_without_samples_or_with_a_shape_it_does_not_know(tiny, calibrated, tmp_path, capsys):
    _, src = calibrated
    data = json.loads(src.read_text())
    for edit, message in ((lambda d: d.pop("samples"), "no field 'samples'"),
                          (lambda d: d["samples"][3].update(label="7x decode @9"),
                           "samples[3]: '7x decode @9' is not a shape"),
                          (lambda d: d["samples"][0].update(samples_s=[]), "samples[0].samples_s"),
                          (lambda d: d["samples"][1].update(load1=[None]), "samples[1].load1"),
                          (lambda d: d["measured_on"].update(engine="abacus"), "names no numerics")):
        bad = json.loads(json.dumps(data))
        edit(bad)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        assert run_calibrate(parse("-m", tiny, "--refit", str(path), "--out", str(tmp_path / "o.json"))) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_refit_names_the_model_the_file_was_measured_on(tiny, calibrated, tmp_path, capsys):
    _, src = calibrated
    other = tmp_path / "other.gguf"
    other.write_bytes(open(tiny, "rb").read())
    assert run_calibrate(parse("-m", str(other), "--refit", str(src), "--out", str(tmp_path / "o.json"))) == 2
    assert "was measured on model 'tiny.gguf', not 'other.gguf'" in capsys.readouterr().err


def test_the_numerics_a_calibration_was_measured_in_are_read_alike_by_refit_and_validate():
    """One reading of `measured_on.engine` for both: the numerics it names; f32 for a file of this engine written
    before the numerics had names; None (unknown) for a file not measured on this engine."""
    from experiments.calibrate import calibration_numerics
    assert calibration_numerics("slotlab numpy (numerics ggml: quantized weights, threading=split)") == "ggml"
    assert calibration_numerics("slotlab numpy (numerics f32: f32 weights, f32 KV)") == "f32"
    assert calibration_numerics("slotlab numpy (threading=split)") == "f32"        # before the numerics had names
    assert calibration_numerics("none: derived from sim.roofline.RooflineLatency") is None
    assert calibration_numerics("") is None
