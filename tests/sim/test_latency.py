"""Latency models: step costs, constant and parametric models, calibration files, fitting, the registry."""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.latency import (
    DEFAULT_CALIBRATION_PATH,
    ConstantLatency,
    JitteredLatency,
    LatencyModel,
    MeasuredOn,
    ParametricLatency,
    ScaledLatency,
    StepCost,
    TrackedLatency,
    _nnls_lawson_hanson,
    decode_only_cost,
    fit_parametric,
    load_calibration,
    save_calibration,
    step_cost_from_chunks,
    unscaled,
)
from sim.latency_physical import EngineLayout, PhysicalLatency
from sim.latency_spec import get_latency_model
from sim.roofline import HW_PRESETS, MODEL_PRESETS, RooflineLatency, model_preset

MEASURED_ON = MeasuredOn(machine="test box", cpu="test cpu", threads=2, engine="numpy", model="tiny",
                         date="2025-01-01", notes="unit test")
PARAMETRIC = ParametricLatency(a_s=0.02, b_prefill_s=1e-3, c_decode_s=2e-3, d_attn_s=5e-7,
                               e_copy_s_per_byte=1e-10, f_shift_s_per_token=4e-6, g_call_s=0.03)


# --- StepCost -------------------------------------------------------------------------------------


def test_step_cost_from_chunks_counts_tokens_and_attention_context():
    cost = step_cost_from_chunks(prefill_chunks=[(10, 4)], decode_n_past=[7, 0])
    # chunk of 4 at pos0 10: 4·10 + 4·5/2 = 50; decode tokens at n_past 7 and 0 attend 8 and 1
    assert cost == StepCost(n_prefill_tokens=4, n_decode_tokens=2, n_seqs=3, attn_ctx_tokens=59,
                            kv_read_tokens=14 + 8 + 1)


def test_kv_read_estimate_is_exact_for_decode_only_and_single_chunk():
    decode = step_cost_from_chunks(decode_n_past=[5, 100, 3000])
    chunk = step_cost_from_chunks(prefill_chunks=[(123, 64)])
    for exact in (decode, chunk):
        uncounted = StepCost(exact.n_prefill_tokens, exact.n_decode_tokens, exact.n_seqs, exact.attn_ctx_tokens)
        assert uncounted.kv_read_tokens_or_estimate() == exact.kv_read_tokens


# --- constant -------------------------------------------------------------------------------------


def test_constant_model_charges_step_plus_per_token():
    model = ConstantLatency(step_s=0.01, per_token_s=0.001)
    assert model.step_time_s(StepCost(30, 2, 3, 999)) == pytest.approx(0.01 + 0.032)


def test_constant_model_rejects_negative_time():
    with pytest.raises(ValueError, match="step_s"):
        ConstantLatency(step_s=-0.01)


# --- parametric -----------------------------------------------------------------------------------


def test_parametric_model_is_the_linear_formula():
    cost = StepCost(n_prefill_tokens=100, n_decode_tokens=4, n_seqs=5, attn_ctx_tokens=7000,
                    n_forward_calls=3, kv_copy_bytes=10**6, kv_shift_tokens=50)
    expected = 0.02 + 1e-3 * 100 + 2e-3 * 4 + 5e-7 * 7000 + 1e-10 * 10**6 + 4e-6 * 50 + 0.03 * 2
    assert PARAMETRIC.step_time_s(cost) == pytest.approx(expected, rel=1e-12)


def test_parametric_model_charges_calls_only_beyond_the_first():
    no_call = StepCost(0, 0, 0, 0, n_forward_calls=0)
    assert PARAMETRIC.step_time_s(no_call) == PARAMETRIC.a_s


def test_parametric_model_rejects_negative_coefficient():
    with pytest.raises(ValueError, match="d_attn_s"):
        ParametricLatency(a_s=0.0, b_prefill_s=0.0, c_decode_s=0.0, d_attn_s=-1e-9)


# --- calibration files ----------------------------------------------------------------------------


def test_calibration_round_trips_through_json(tmp_path):
    path = tmp_path / "cal.json"
    save_calibration(PARAMETRIC, path, MEASURED_ON)
    loaded = load_calibration(path)
    assert loaded == PARAMETRIC
    assert loaded.measured_on == MEASURED_ON
    assert loaded.source == str(path)


def test_calibration_file_records_fit_stats(tmp_path):
    rows = [(StepCost(p, d, 1 + d, 10 * p + d), 0.01 + 1e-3 * p + 2e-3 * d) for p in (0, 8, 64) for d in (0, 1, 8)]
    fit = fit_parametric(rows)
    path = tmp_path / "cal.json"
    save_calibration(fit.model, path, MEASURED_ON, fit)
    assert json.loads(path.read_text())["fit"]["n_rows"] == 9


def _good_calibration() -> dict:
    return {"kind": "parametric", "coefficients": PARAMETRIC.coefficients(),
            "measured_on": {"machine": "m", "cpu": "c", "threads": 2, "engine": "e", "model": "x",
                            "date": "2025-01-01", "notes": ""}}


def _without(data: dict, dotted: str) -> dict:
    outer, _, inner = dotted.partition(".")
    if inner:
        del data[outer][inner]
    else:
        del data[outer]
    return data


def _with(data: dict, dotted: str, value: object) -> dict:
    outer, _, inner = dotted.partition(".")
    data[outer][inner] = value
    return data


BAD_CALIBRATIONS = {
    "not json": ("{ not json", "not valid JSON"),
    "top level list": ("[]", "top level"),
    "missing coefficients": (_without(_good_calibration(), "coefficients"), "'coefficients'"),
    "missing coefficient": (_without(_good_calibration(), "coefficients.d_attn_s"), "'coefficients.d_attn_s'"),
    "negative coefficient": (_with(_good_calibration(), "coefficients.c_decode_s", -1e-3), "'coefficients.c_decode_s'"),
    "string coefficient": (_with(_good_calibration(), "coefficients.a_s", "0.1"), "'coefficients.a_s'"),
    "unknown coefficient": (_with(_good_calibration(), "coefficients.z_s", 0.1), "'coefficients.z_s'"),
    "missing measured_on": (_without(_good_calibration(), "measured_on"), "'measured_on'"),
    "missing measured_on field": (_without(_good_calibration(), "measured_on.date"), "'measured_on.date'"),
    "bad threads": (_with(_good_calibration(), "measured_on.threads", "two"), "'measured_on.threads'"),
    "bad heap reserve": (_with(_good_calibration(), "measured_on.mem_reserve_mib", -5), "'measured_on.mem_reserve_mib'"),
    "boolean heap reserve": (_with(_good_calibration(), "measured_on.mem_reserve_mib", True),
                             "'measured_on.mem_reserve_mib'"),
    "wrong kind": ({**_good_calibration(), "kind": "roofline"}, "'kind'"),
}


@pytest.mark.parametrize("content, field", BAD_CALIBRATIONS.values(), ids=BAD_CALIBRATIONS.keys())
def test_bad_calibration_file_raises_value_error_naming_file_and_field(tmp_path, content, field):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError) as excinfo:
        load_calibration(path)
    assert str(path) in str(excinfo.value)
    assert field in str(excinfo.value)


def test_the_heap_reserve_a_calibration_ran_with_is_kept_and_older_files_have_none(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_with(_good_calibration(), "measured_on.mem_reserve_mib", 1024)))
    assert load_calibration(path).measured_on.mem_reserve_mib == 1024
    path.write_text(json.dumps(_good_calibration()))
    assert load_calibration(path).measured_on.mem_reserve_mib is None


def test_missing_calibration_file_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_calibration(tmp_path / "absent.json")


def test_shipped_default_calibration_loads_and_says_where_it_comes_from():
    model = load_calibration(DEFAULT_CALIBRATION_PATH)
    assert model.c_decode_s > 0 and model.a_s > 0
    assert model.measured_on is not None and model.measured_on.notes


# --- fitting --------------------------------------------------------------------------------------


def _synthetic_rows(truth: ParametricLatency, rng: np.random.Generator, n_rows: int = 200):
    rows = []
    for _ in range(n_rows):
        prefill = [(int(rng.integers(0, 2000)), int(rng.integers(1, 512))) for _ in range(rng.integers(0, 3))]
        decode = rng.integers(0, 4000, size=rng.integers(0 if prefill else 1, 32)).tolist()
        cost = step_cost_from_chunks(prefill, decode, n_forward_calls=int(rng.integers(1, 4)),
                                     kv_copy_bytes=int(rng.choice([0, rng.integers(0, 10**8)])),
                                     kv_shift_tokens=int(rng.choice([0, rng.integers(0, 4000)])))
        rows.append((cost, truth.step_time_s(cost)))
    return rows


def test_fit_recovers_known_coefficients_from_exact_data():
    fit = fit_parametric(_synthetic_rows(PARAMETRIC, np.random.default_rng(0)))
    for name, value in PARAMETRIC.coefficients().items():
        assert getattr(fit.model, name) == pytest.approx(value, rel=1e-6), name
    assert fit.r2 == pytest.approx(1.0) and fit.mape < 1e-9


def test_fit_keeps_coefficients_non_negative_on_noisy_data():
    truth = ParametricLatency(a_s=0.03, b_prefill_s=1e-3, c_decode_s=0.0, d_attn_s=0.0)
    rng = np.random.default_rng(1)
    rows = [(cost, t * rng.uniform(0.8, 1.2)) for cost, t in _synthetic_rows(truth, rng)]
    fit = fit_parametric(rows)
    assert all(v >= 0 for v in fit.model.coefficients().values())
    assert fit.model.b_prefill_s == pytest.approx(1e-3, rel=0.1)


def test_numpy_fallback_solver_fixes_negative_coefficients_at_zero():
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    y = np.array([3.0, 2.0, 1.0])  # unconstrained slope −1 → constrained: slope 0, intercept mean(y)
    assert _nnls_lawson_hanson(a, y) == pytest.approx([2.0, 0.0])


# --- decode fast-forward, for every model ---------------------------------------------------------


DECODE_MODELS = {
    "constant": ConstantLatency(0.01, 1e-4),
    "parametric": PARAMETRIC,
    "parametric-kv-read": ParametricLatency(a_s=0.004, b_prefill_s=2e-5, c_decode_s=1e-4, d_attn_s=1e-8,
                                            h_kv_read_s=3.3e-9),
    "default": load_calibration(DEFAULT_CALIBRATION_PATH),
    "physical": PhysicalLatency((1e-3, 5e-11, 8e-3, 2.4e-2, 1.8e-3, 1.2e-3, 1e-5, 6e-6, 1.5e-6, 5e-7, 1.5e-9, 2e-10, 5e-5,
                                 3e-10), EngineLayout(500_000_000, n_threads=2, n_head=9)),
    "physical-by-token": PhysicalLatency((1e-3, 5e-11, 8e-3, 2.4e-2, 1.8e-3, 1.2e-3, 1e-5, 6e-6, 1.5e-6, 5e-7, 1.5e-9,
                                          2e-10, 5e-5, 3e-10),
                                         EngineLayout(100_000_000, n_threads=2, n_head=9, decode_batch_min=0,
                                                      attend_by_token=1, attend_split_cells=114, attend_pieces=4)),
    "scaled-parametric": ScaledLatency(PARAMETRIC, 1.37),
    "scaled-physical": ScaledLatency(PhysicalLatency((1e-3, 5e-11, 8e-3, 2.4e-2, 1.8e-3, 1.2e-3, 1e-5, 6e-6, 1.5e-6,
                                                      5e-7, 1.5e-9, 2e-10, 5e-5, 0.0),
                                                     EngineLayout(500_000_000, n_threads=2, n_head=9)), 0.8),
    **{f"roofline-{m}@{hw}": RooflineLatency(MODEL_PRESETS[m], HW_PRESETS[hw])
       for m in MODEL_PRESETS for hw in ("cpu-2core", "a100-80gb", "l4")},
    "roofline-smollm2-f32@cpu-2core": RooflineLatency(model_preset("smollm2-135m", weights_dtype="f32",
                                                                   kv_dtype="f32"), HW_PRESETS["cpu-2core"]),
}


@pytest.mark.parametrize("model", DECODE_MODELS.values(), ids=DECODE_MODELS.keys())
@settings(max_examples=40, deadline=None)
@given(n_seqs=st.integers(1, 128), extra_ctx=st.integers(0, 2_000_000), k=st.integers(0, 60))
def test_decode_only_times_equal_repeated_step_times(model, n_seqs, extra_ctx, k):
    attn_ctx0 = n_seqs + extra_ctx
    expected = [model.step_time_s(decode_only_cost(n_seqs, attn_ctx0 + i * n_seqs)) for i in range(k)]
    assert model.decode_only_times_s(n_seqs, attn_ctx0, k) == pytest.approx(expected, rel=1e-12)


coefficient = st.floats(0, 1e-2, allow_subnormal=False)
parametric_models = st.builds(ParametricLatency, a_s=coefficient, b_prefill_s=coefficient, c_decode_s=coefficient,
                              d_attn_s=st.floats(0, 1e-7), e_copy_s_per_byte=coefficient,
                              f_shift_s_per_token=coefficient, g_call_s=coefficient, h_kv_read_s=st.floats(0, 1e-7))


@settings(max_examples=200, deadline=None)
@given(model=parametric_models, n_seqs=st.integers(1, 256), extra_ctx=st.integers(0, 10_000_000),
       k=st.integers(0, 200))
def test_parametric_decode_times_are_bit_equal_to_step_times(model, n_seqs, extra_ctx, k):
    """The simulator's exact fast-forward and its decode-only shortcut rest on these being the same floats
    (not just close): the Python path (short stretches), the numpy path (long ones) and the scalar one."""
    attn_ctx0 = n_seqs + extra_ctx
    expected = [model.step_time_s(decode_only_cost(n_seqs, attn_ctx0 + i * n_seqs)) for i in range(k)]
    assert model.decode_only_times_s(n_seqs, attn_ctx0, k) == expected
    assert [model.decode_step_time_s(n_seqs, attn_ctx0 + i * n_seqs) for i in range(k)] == expected


@pytest.mark.parametrize("model", DECODE_MODELS.values(), ids=DECODE_MODELS.keys())
def test_decode_only_times_reject_fewer_attended_cells_than_sequences(model):
    with pytest.raises(ValueError, match="attn_ctx0"):
        model.decode_only_times_s(4, 3, 10)


@pytest.mark.parametrize("model", DECODE_MODELS.values(), ids=DECODE_MODELS.keys())
def test_every_model_is_a_latency_model_with_json_description(model):
    assert isinstance(model, LatencyModel)
    json.dumps(model.describe())


# --- scaled ---------------------------------------------------------------------------------------


PHYSICAL = DECODE_MODELS["physical"]
STEPS = [step_cost_from_chunks([(0, 64)]), step_cost_from_chunks([(100, 7)], [5, 300], n_forward_calls=2,
                                                                 kv_copy_bytes=4096, kv_shift_tokens=9),
         step_cost_from_chunks(decode_n_past=[255] * 4)]


@pytest.mark.parametrize("base", [PARAMETRIC, PHYSICAL, ConstantLatency(0.01, 1e-4)], ids=["simple", "physical",
                                                                                       "constant"])
@pytest.mark.parametrize("factor", [1.45, 0.7, 1.0])
def test_scaled_model_multiplies_every_step_time_exactly(base, factor):
    model = ScaledLatency(base, factor)
    for cost in STEPS:
        assert model.step_time_s(cost) == factor * base.step_time_s(cost)          # the same float, not close
    assert model.decode_only_times_s(3, 900, 60) == [factor * t for t in base.decode_only_times_s(3, 900, 60)]


def test_scaled_physical_model_keeps_the_layout_and_passes_the_sequences_on():
    model = ScaledLatency(PHYSICAL, 2.0)
    assert model.wants_layout is True and ScaledLatency(PARAMETRIC, 2.0).wants_layout is False
    decode = [(0, 100), (3, 700)]
    assert model.decode_only_times_s(2, 802, 5, decode) == [2.0 * t for t in PHYSICAL.decode_only_times_s(2, 802, 5,
                                                                                                       decode)]


def test_scaled_model_forwards_the_calibrations_record(tmp_path):
    path = tmp_path / "cal.json"
    save_calibration(PARAMETRIC, path, MEASURED_ON)
    base = load_calibration(path)
    model = ScaledLatency(ScaledLatency(base, 2.0), 1.5)
    assert model.measured_on == MEASURED_ON and model.source == str(path) and unscaled(model) is base
    desc = model.describe()
    assert desc["kind"] == "scaled" and desc["factor"] == 1.5 and desc["base"]["factor"] == 2.0
    assert desc["source"] == str(path) and desc["base"]["base"] == base.describe()


@pytest.mark.parametrize("factor", [0.0, -1.0, math.inf, math.nan, True])
def test_scaled_model_rejects_a_factor_that_is_not_positive_and_finite(factor):
    with pytest.raises(ValueError, match="factor must be a finite number > 0"):
        ScaledLatency(PARAMETRIC, factor)


def test_scaled_model_needs_a_latency_model():
    with pytest.raises(ValueError, match="base must be a latency model"):
        ScaledLatency(0.01, 2.0)


# --- tracked (a factor that follows the clock) ------------------------------------------------------


def tracked(base=PARAMETRIC, times=(0.0, 10.0, 30.0), factors=(1.0, 2.0, 0.5), now=0.0):
    model = TrackedLatency(base, times, factors)
    clock = [now]
    model.bind_clock(lambda: clock[0])
    return model, clock


def test_tracked_factor_is_linear_between_knots_and_constant_outside():
    model, _ = tracked()
    assert [model.factor_at(t) for t in (-5.0, 0.0, 5.0, 10.0, 20.0, 30.0, 99.0)] == \
        [1.0, 1.0, 1.5, 2.0, 1.25, 0.5, 0.5]


def test_tracked_step_time_is_the_factor_at_the_bound_clock_times_the_base():
    model, clock = tracked()
    cost = STEPS[0]
    for now, f in ((0.0, 1.0), (5.0, 1.5), (20.0, 1.25), (40.0, 0.5)):
        clock[0] = now
        assert model.step_time_s(cost) == f * PARAMETRIC.step_time_s(cost)
    assert TrackedLatency(PARAMETRIC, (0.0,), (3.0,)).step_time_s(cost) == 3.0 * PARAMETRIC.step_time_s(cost)


@pytest.mark.parametrize("now", [0.0, 9.9, 25.0])
def test_tracked_decode_stretch_places_each_step_after_the_ones_before_it(now):
    model, clock = tracked(now=now)
    base = PARAMETRIC.decode_only_times_s(3, 900, 400)
    got = model.decode_only_times_s(3, 900, 400)
    # step i is placed at now + f(now) * (sum of the base times before it) and priced at the factor there
    at, expected = now, []
    for b in base:
        expected.append(model.factor_at(at) * b)
        at += model.factor_at(now) * b
    assert got == pytest.approx(expected, rel=1e-12)
    assert len({round(g / b, 9) for g, b in zip(got, base)}) > 1       # the stretch crossed a knot: factors differ
    assert model.decode_only_times_s(3, 900, 0) == []


def test_a_flat_track_equals_the_scaled_model():
    model, clock = tracked(times=(0.0, 50.0), factors=(1.3, 1.3), now=12.0)
    scaled = ScaledLatency(PARAMETRIC, 1.3)
    for cost in STEPS:
        assert model.step_time_s(cost) == scaled.step_time_s(cost)
    assert model.decode_only_times_s(2, 500, 60) == pytest.approx(scaled.decode_only_times_s(2, 500, 60), rel=1e-15)


def test_tracked_model_keeps_the_layout_and_the_calibrations_record(tmp_path):
    path = tmp_path / "cal.json"
    save_calibration(PARAMETRIC, path, MEASURED_ON)
    base = load_calibration(path)
    model = TrackedLatency(base, (0.0, 1.0), (1.0, 1.1))
    assert model.measured_on == MEASURED_ON and model.source == str(path) and unscaled(model) is base
    assert TrackedLatency(PHYSICAL, (0.0,), (1.0,)).wants_layout is True and model.wants_layout is False
    desc = model.describe()
    assert desc["kind"] == "tracked" and desc["times_s"] == [0.0, 1.0] and desc["factors"] == [1.0, 1.1]
    assert desc["base"] == base.describe() and desc["source"] == str(path)
    decode = [(0, 100), (3, 700)]
    phys = TrackedLatency(PHYSICAL, (0.0,), (2.0,))
    assert phys.decode_only_times_s(2, 802, 5, decode) == [2.0 * t for t in PHYSICAL.decode_only_times_s(2, 802, 5,
                                                                                                         decode)]


def test_a_step_with_prompt_tokens_takes_the_prompt_factor():
    model = TrackedLatency(PARAMETRIC, (0.0, 10.0), (1.0, 2.0), prompt_factors=(3.0, 5.0))
    model.bind_clock(lambda: 5.0)
    prompt, decode = step_cost_from_chunks([(0, 64)]), decode_only_cost(4, 1000)
    mixed = step_cost_from_chunks([(0, 16)], [100, 200])
    assert model.step_time_s(prompt) == 4.0 * PARAMETRIC.step_time_s(prompt)
    assert model.step_time_s(mixed) == 4.0 * PARAMETRIC.step_time_s(mixed)
    assert model.step_time_s(decode) == 1.5 * PARAMETRIC.step_time_s(decode)
    assert model.decode_only_times_s(4, 1000, 1) == pytest.approx([1.5 * PARAMETRIC.step_time_s(decode)], rel=1e-15)
    assert model.describe()["prompt_factors"] == [3.0, 5.0]
    assert TrackedLatency(PARAMETRIC, (0.0,), (2.0,)).describe()["prompt_factors"] == [2.0]   # default: the same
    with pytest.raises(ValueError, match="prompt factors"):
        TrackedLatency(PARAMETRIC, (0.0, 1.0), (1.0, 1.0), prompt_factors=(1.0,))
    with pytest.raises(ValueError, match="factors must be finite numbers > 0"):
        TrackedLatency(PARAMETRIC, (0.0,), (1.0,), prompt_factors=(-1.0,))


@pytest.mark.parametrize("times, factors, match", [
    ((), (), "at least one"),
    ((0.0, 1.0), (1.0,), "as many factors as times"),
    ((1.0, 0.0), (1.0, 1.0), "non-decreasing"),
    ((0.0, math.nan), (1.0, 1.0), "finite and non-decreasing"),
    ((0.0,), (0.0,), "factors must be finite numbers > 0"),
    ((0.0,), (math.inf,), "factors must be finite numbers > 0"),
])
def test_tracked_model_rejects_bad_knots(times, factors, match):
    with pytest.raises(ValueError, match=match):
        TrackedLatency(PARAMETRIC, times, factors)


def test_a_simulation_binds_its_clock_to_a_tracked_model():
    """Two requests, one before and one long after a knot that doubles the step times: the second takes twice
    as long in every phase (both alone on the server, same lengths)."""
    from engine.core import ServerConfig
    from sim.driver import Simulation
    from traces import Trace, TraceRequest
    reqs = [TraceRequest(0, 0.0, 40, 8), TraceRequest(1, 100.0, 40, 8)]
    model = TrackedLatency(ConstantLatency(0.01, 1e-4), (50.0, 50.001), (1.0, 2.0))
    rows = Simulation(ServerConfig(n_ctx=1024, n_parallel=1, cache_prompt=False), model).run(
        Trace(reqs, "native", "test")).requests
    first, second = sorted(rows, key=lambda r: r["request"])
    for col in ("ttft_s", "e2e_s"):
        assert second[col] == pytest.approx(2 * first[col], rel=1e-6), col


# --- jittered (each step's time times a drawn factor) -----------------------------------------------


def test_jitter_of_zero_leaves_every_time_as_the_base_gives_it():
    model = JitteredLatency(PARAMETRIC, (0.0,), (0.0,), seed=1)
    for cost in STEPS:
        assert model.step_time_s(cost) == PARAMETRIC.step_time_s(cost)
    assert model.decode_only_times_s(3, 900, 60) == PARAMETRIC.decode_only_times_s(3, 900, 60)
    assert model.decode_only_times_s(3, 900, 0) == []


def test_each_path_draws_from_its_own_values():
    model = JitteredLatency(PARAMETRIC, (math.log(2.0),), (math.log(0.5),), seed=0)
    prompt, mixed, decode = STEPS[0], step_cost_from_chunks([(0, 16)], [100, 200]), decode_only_cost(4, 1000)
    assert model.step_time_s(prompt) == pytest.approx(2.0 * PARAMETRIC.step_time_s(prompt), rel=1e-15)
    assert model.step_time_s(mixed) == pytest.approx(2.0 * PARAMETRIC.step_time_s(mixed), rel=1e-15)
    assert model.step_time_s(decode) == pytest.approx(0.5 * PARAMETRIC.step_time_s(decode), rel=1e-15)
    assert model.decode_only_times_s(4, 1000, 3) == pytest.approx(
        [0.5 * t for t in PARAMETRIC.decode_only_times_s(4, 1000, 3)], rel=1e-15)


def test_jitter_draws_once_per_step_and_is_seeded():
    values = (-0.1, 0.0, 0.1)
    allowed = {round(math.exp(v), 9) for v in values}

    def times(seed):
        model = JitteredLatency(PARAMETRIC, values, values, seed=seed)
        one = [model.step_time_s(STEPS[0]) for _ in range(60)]
        return one, model.decode_only_times_s(2, 500, 200)

    one, stretch = times(5)
    assert (one, stretch) == times(5) and (one, stretch) != times(6)
    base_one = PARAMETRIC.step_time_s(STEPS[0])
    assert {round(t / base_one, 9) for t in one} == allowed           # every value drawn, nothing else
    ratios = {round(t / b, 9) for t, b in zip(stretch, PARAMETRIC.decode_only_times_s(2, 500, 200))}
    assert ratios == allowed                                          # the stretch draws per step, not once


def test_jitter_forwards_the_clock_the_layout_and_the_record(tmp_path):
    tracked = TrackedLatency(PHYSICAL, (0.0, 10.0), (1.0, 2.0))
    model = JitteredLatency(tracked, (0.0,), (0.0,), seed=0)
    model.bind_clock(lambda: 10.0)
    assert model.step_time_s(STEPS[0]) == 2.0 * PHYSICAL.step_time_s(STEPS[0])
    assert model.wants_layout is True and unscaled(model) is PHYSICAL
    decode = [(0, 100), (3, 700)]
    assert model.decode_only_times_s(2, 802, 5, decode) == tracked.decode_only_times_s(2, 802, 5, decode)
    JitteredLatency(PARAMETRIC, (0.0,), (0.0,)).bind_clock(lambda: 1.0)     # a base without a clock: nothing to do
    path = tmp_path / "cal.json"
    save_calibration(PARAMETRIC, path, MEASURED_ON)
    base = load_calibration(path)
    rec = JitteredLatency(base, (0.1, -0.1), (0.0,), seed=3)
    assert rec.measured_on == MEASURED_ON and rec.source == str(path) and rec.wants_layout is False
    desc = rec.describe()
    assert desc["kind"] == "jittered" and desc["n_prompt"] == 2 and desc["n_decode"] == 1 and desc["seed"] == 3
    assert desc["base"] == base.describe() and desc["source"] == str(path)


@pytest.mark.parametrize("prompt, decode, match", [
    ((), (0.0,), "at least one value per path"),
    ((0.0,), (), "at least one value per path"),
    ((0.0, math.nan), (0.0,), "finite"),
    ((0.0,), (math.inf,), "finite"),
])
def test_jitter_rejects_values_it_cannot_draw(prompt, decode, match):
    with pytest.raises(ValueError, match=match):
        JitteredLatency(PARAMETRIC, prompt, decode)
    with pytest.raises(ValueError, match="base must be a latency model"):
        JitteredLatency(0.01, (0.0,), (0.0,))


# --- registry -------------------------------------------------------------------------------------


def test_get_latency_model_parses_scaled_with_any_inner_spec(tmp_path):
    assert get_latency_model("scaled:1.5:constant:0.01:0.002") == ScaledLatency(ConstantLatency(0.01, 0.002), 1.5)
    path = tmp_path / "cal.json"
    save_calibration(PARAMETRIC, path, MEASURED_ON)
    assert get_latency_model(f"scaled:0.5:parametric:{path}") == ScaledLatency(PARAMETRIC, 0.5)


def test_get_latency_model_parses_constant():
    assert get_latency_model("constant:0.01") == ConstantLatency(0.01)
    assert get_latency_model("constant:0.01:0.002") == ConstantLatency(0.01, 0.002)


def test_get_latency_model_default_is_the_shipped_calibration():
    assert get_latency_model("default") == load_calibration(DEFAULT_CALIBRATION_PATH)


def test_get_latency_model_parses_parametric_path(tmp_path):
    path = tmp_path / "cal.json"
    save_calibration(PARAMETRIC, path, MEASURED_ON)
    assert get_latency_model(f"parametric:{path}") == PARAMETRIC


def test_get_latency_model_parses_roofline_model_and_hardware():
    model = get_latency_model("roofline:llama-2-7b@a100-80gb")
    assert model == RooflineLatency(MODEL_PRESETS["llama-2-7b"], HW_PRESETS["a100-80gb"])


def test_get_latency_model_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="constant:STEP_S.*default.*parametric:PATH.*roofline:"):
        get_latency_model("lookup:foo.csv")


@pytest.mark.parametrize("spec, message", [
    ("constant:fast", "not a number"),
    ("constant:", "constant:STEP_S"),
    ("default:x", "no argument"),
    ("parametric:", "parametric:PATH"),
    ("roofline:llama-2-7b", "roofline:MODEL"),
    ("roofline:llama-2-7b@tpu-v5", "a100-80gb"),
    ("roofline:gpt-5@a100-80gb", "llama-2-7b"),
    ("roofline:llama-2-7b:f8@a100-80gb", "llama-2-7b"),
    ("scaled:1.5", "scaled:FACTOR:SPEC"),
    ("scaled::constant:0.01", "scaled:FACTOR:SPEC"),
    ("scaled:fast:constant:0.01", "FACTOR 'fast' is not a number"),
    ("scaled:0:constant:0.01", "factor must be a finite number > 0"),
    ("scaled:2:lookup:x", "unknown latency model 'lookup:x'"),
])
def test_get_latency_model_bad_argument_raises_value_error(spec, message):
    with pytest.raises(ValueError, match=message):
        get_latency_model(spec)
