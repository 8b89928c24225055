"""`slotlab calibrate` on a tiny random-weight GGUF (--quick): the calibration file, its side files, and the
plans it measures counted in the simulator's units."""

import argparse
import json

import pandas as pd
import pytest

from engine.core.types import ForwardCall, Task
from experiments.calibrate import (GridPoint, KINDS, add_calibrate_parser, build_plan, calibration_grid,
                                   run_calibrate, side_files)
from sim.backend import SimBackend
from sim.latency import (COEFFICIENT_NAMES, ConstantLatency, ParametricLatency, decode_only_cost,
                         load_calibration, step_cost_from_chunks)
from sim.latency_spec import get_latency_model


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_calibrate_parser(parser.add_subparsers())
    return parser.parse_args(["calibrate", *argv])


@pytest.fixture(scope="module")
def calibrated(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "calib.json"
    rc = run_calibrate(parse("-m", tiny, "--threads", "1", "--quick", "--quiet", "--out", str(out)))
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


def test_latency_spec_parametric_loads_the_calibration(calibrated):
    model = get_latency_model(f"parametric:{calibrated[1]}")
    assert isinstance(model, ParametricLatency)
    assert model.coefficients() == load_calibration(calibrated[1]).coefficients()
    assert set(model.coefficients()) == set(COEFFICIENT_NAMES)


def test_steps_table_has_one_row_per_shape_with_prediction(calibrated):
    steps_csv, png = side_files(calibrated[1])
    steps = pd.read_csv(steps_csv)
    assert len(steps) == len(calibration_grid(quick=True))
    assert set(steps["kind"]) == set(KINDS)
    assert (steps["measured_s"] > 0).all() and (steps["min_s"] <= steps["measured_s"]).all()
    model = load_calibration(calibrated[1])
    row = steps.iloc[0]
    assert row["predicted_s"] == pytest.approx(model.step_time_s(decode_only_cost(
        int(row["n_decode_tokens"]), int(row["attn_ctx_tokens"]))))
    assert png.stat().st_size > 0


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


def test_full_grid_covers_the_shapes_the_core_produces():
    grid = calibration_grid()
    decodes = {len(p.decode) for p in grid if p.kind == "decode"}
    contexts = {c for p in grid if p.kind == "decode" for c in p.decode}
    chunks = {n for p in grid if p.kind == "prefill" for _, n in p.prompt}
    assert {1, 16} <= decodes and {64, 2048} <= contexts and {16, 512} <= chunks
    assert {p.kind for p in grid} == set(KINDS)
