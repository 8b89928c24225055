"""The physical latency model: the engine layout it counts, fitting, cross-validation, files, fast-forward."""

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core import PolicyNames, ServerConfig
from engine.core.types import BatchPlan, Chunk, ForwardCall, KVOp
from sim.backend import SimBackend
from sim.latency import (ConstantLatency, MeasuredOn, ParametricLatency, StepCost, _nnls_lawson_hanson, error_summary,
                         fit_parametric, held_out_predictions, load_calibration, save_calibration)
from sim.latency_physical import (PHYSICAL_TERMS, TABLE_REPLACES, EngineLayout, PhysicalLatency, chunk_blocks,
                                  estimate_calls, fit_physical, fit_table, hat_weights, held_out_table,
                                  load_latency_file, load_physical, physical_design, physical_features,
                                  save_calibration_file, table_knots)
from sim.latency_spec import get_latency_model
from tests.sim.test_driver import _compare_ff, assert_identical, small_chat
from traces import PoissonArrivals, UniformLength, open_loop

MEASURED_ON = MeasuredOn(machine="test box", cpu="test cpu", threads=2, engine="numpy", model="tiny",
                         date="2025-01-01", notes="unit test")
LAYOUT = EngineLayout(weight_bytes=500_000_000, n_threads=2, small_m_max=64, decode_batch_min=2, decode_split_min=8,
                      attn_query_block=128, attn_score_budget=1 << 22, n_head=9)
TRUTH = PhysicalLatency.from_terms({
    "step_s": 1e-3, "weights_s_per_byte": 5e-11, "one_token_call_s": 8e-3, "gemm_call_s": 2.4e-2, "token_s": 1.8e-3, "seq_s": 1.2e-3,
    "kv_read_s_per_cell": 1e-5, "kv_read_split_s_per_cell": 6e-6, "attn_pair_s": 1.5e-6,
    "attn_pair_split_s": 5e-7, "save_s_per_byte": 1.5e-9, "load_s_per_byte": 2e-10, "shift_s_per_cell": 5e-5},
    LAYOUT)
BPT = 46_084


def one_call(*chunks, **kw):
    return StepCost(0, 0, len(chunks), 0, calls=(tuple(chunks),), **kw)


def term(cost, name, layout=LAYOUT):
    return physical_features(cost, layout)[PHYSICAL_TERMS.index(name)]


# --- the layout it counts -------------------------------------------------------------------------


def reference_blocks(pos0, m, layout):
    """f32.attend's query blocks, one by one: (blocks, pairs, cells read)."""
    block = max(1, min(m, layout.attn_query_block, layout.attn_score_budget // (layout.n_head * (pos0 + m))))
    starts = range(0, m, block)
    pairs = sum((min(m, a + block) - a) * (pos0 + min(m, a + block)) for a in starts)
    reads = sum(pos0 + min(m, a + block) for a in starts)
    return len(starts), pairs, reads


@given(pos0=st.integers(0, 20_000), m=st.integers(2, 3000))
def test_chunk_blocks_count_the_engines_query_blocks(pos0, m):
    assert chunk_blocks(pos0, m, LAYOUT) == reference_blocks(pos0, m, LAYOUT)


def test_layout_constants_are_the_engines():
    from engine.model import f32, llama, types
    lay = EngineLayout(1)
    assert (lay.small_m_max, lay.decode_batch_min, lay.decode_split_min, lay.attn_query_block,
            lay.attn_score_budget) == (types.SMALL_M_MAX, llama._DECODE_BATCH_MIN, f32._DECODE_SPLIT_MIN,
                                       f32._ATTN_QUERY_BLOCK, f32._ATTN_SCORE_BUDGET)


def test_decode_batch_reads_every_row_up_to_the_longest_context():
    short_long = one_call((0, 63, 1), (1, 2047, 1))
    assert term(short_long, "kv_read_s_per_cell") == 2 * 2048           # padded: both rows to 2048 keys
    gap = one_call((0, 99, 1), (3, 99, 1))                             # rows 0..3 of the pool range
    assert term(gap, "kv_read_s_per_cell") == 4 * 100
    alone = one_call((2, 99, 1))
    assert term(alone, "kv_read_s_per_cell") == 100
    assert term(alone, "one_token_call_s") == 1 and term(gap, "one_token_call_s") == 0


def test_decode_batch_of_eight_rows_is_split_over_the_threads_only_with_threads():
    cost = one_call(*[(s, 511, 1) for s in range(8)])
    assert term(cost, "kv_read_split_s_per_cell") == 8 * 512 and term(cost, "kv_read_s_per_cell") == 0
    one_thread = EngineLayout(LAYOUT.weight_bytes, n_threads=1, n_head=9)
    assert term(cost, "kv_read_s_per_cell", one_thread) == 8 * 512
    no_batch = EngineLayout(LAYOUT.weight_bytes, n_threads=2, decode_batch_min=0, n_head=9)
    mixed = one_call((0, 9, 1), (1, 99, 1))
    assert term(mixed, "kv_read_s_per_cell", no_batch) == 10 + 100    # each alone: its own cells


def test_prompt_chunk_of_several_blocks_runs_them_on_the_threads():
    small, big = one_call((0, 0, 128)), one_call((0, 512, 300))
    assert term(small, "attn_pair_s") == 128 * 128 and term(small, "attn_pair_split_s") == 0
    _, pairs, reads = chunk_blocks(512, 300, LAYOUT)
    assert term(big, "attn_pair_split_s") == pairs and term(big, "kv_read_split_s_per_cell") == reads
    assert term(big, "token_s") == 300 and term(big, "seq_s") == 1
    assert term(big, "gemm_call_s") == 1 and term(one_call((0, 0, 64)), "gemm_call_s") == 0


BY_TOKEN = EngineLayout(LAYOUT.weight_bytes, n_threads=2, decode_batch_min=0, n_head=9, attend_by_token=1,
                        attend_split_cells=114, attend_pieces=4)


@pytest.mark.parametrize("n_head, pieces, threads, share", [
    (9, 4, 2, 5 / 9),        # ranges 2, 2, 2, 3: the thread free first takes the next, the busiest ends with 2 + 3
    (8, 4, 2, 4 / 8),        # 2, 2, 2, 2: even
    (9, 4, 1, 1.0),          # one thread takes every range
    (3, 8, 4, 1 / 3),        # fewer heads than pieces: one head per range, no thread gets two
    (9, 1, 2, 1.0),          # one range: one thread
])
def test_head_share_is_the_busiest_threads_share_of_the_query_heads(n_head, pieces, threads, share):
    lay = EngineLayout(1, n_threads=threads, n_head=n_head, attend_by_token=1, attend_pieces=pieces)
    assert lay.head_share == pytest.approx(share, rel=1e-15)


def test_by_token_attention_goes_to_the_threads_by_heads_or_by_tokens():
    """The compiled kernels' layout (gdecode.decode_layer): one token's cells split by query heads, several
    tokens' by tokens (a token never cut), below attend_split_cells on one thread. The *_split terms count the
    busiest thread's cells and pairs, so an unsplit call counts all of them there."""
    lone = one_call((0, 999, 1))
    assert term(lone, "kv_read_split_s_per_cell", BY_TOKEN) == pytest.approx(1000 * 5 / 9, rel=1e-15)
    assert term(lone, "kv_read_s_per_cell", BY_TOKEN) == 0
    short = one_call((0, 100, 1))                    # 101 cells < 114: unsplit, one thread reads them all
    assert term(short, "kv_read_split_s_per_cell", BY_TOKEN) == 101
    assert term(short, "kv_read_s_per_cell", BY_TOKEN) == 0
    even = one_call((0, 499, 1), (5, 499, 1))                          # no rows x keys padding, halves
    assert term(even, "kv_read_split_s_per_cell", BY_TOKEN) == 500
    uneven = one_call((0, 15, 1), (1, 2047, 1))                        # the 2048-cell token is one thread's
    assert term(uneven, "kv_read_split_s_per_cell", BY_TOKEN) == 2048
    mixed = one_call((0, 999, 1), (1, 0, 100))     # 1000 decode cells; the chunk: 5050 pairs, its 100 keys read once
    total = 1000 + 100 * 101 // 2
    assert term(mixed, "kv_read_split_s_per_cell", BY_TOKEN) == pytest.approx((1000 + 100) * (total / 2) / total)
    assert term(mixed, "attn_pair_split_s", BY_TOKEN) == pytest.approx(5050 * (total / 2) / total)
    assert term(mixed, "attn_pair_s", BY_TOKEN) == 0                   # no query blocks in this layout
    one_thread = EngineLayout(**{**BY_TOKEN.to_dict(), "n_threads": 1})
    assert term(mixed, "kv_read_split_s_per_cell", one_thread) == 1000 + 100
    assert term(mixed, "attn_pair_split_s", one_thread) == 5050
    continued = one_call((0, 512, 4))                                  # keys 513..516, 4 tokens over 2 threads
    assert term(continued, "attn_pair_split_s", BY_TOKEN) == pytest.approx((4 * 512 + 10) / 2)
    assert term(continued, "kv_read_split_s_per_cell", BY_TOKEN) == pytest.approx(516 / 2)


def test_squared_cells_count_each_one_token_chunk_alone():
    cost = one_call((0, 9, 1), (1, 99, 1), (2, 0, 50))                 # the prompt chunk adds nothing
    assert term(cost, "kv_read_sq_s_per_cell2") == 10 ** 2 + 100 ** 2
    assert term(cost, "kv_read_sq_s_per_cell2", BY_TOKEN) == 10 ** 2 + 100 ** 2


def test_compiled_attention_layout_constants_are_the_engines():
    import math
    from types import SimpleNamespace

    from engine.model import gdecode, ggml
    lay = ggml.attend_layout(2, SimpleNamespace(n_head=9, head_dim=64))
    assert lay == {"attend_by_token": 1, "attend_split_cells": math.ceil(gdecode.ATTEND_SPLIT_MIN / (9 * 64)),
                   "attend_pieces": 2 * ggml._SPIN_PIECES_PER_THREAD}


def test_weights_are_streamed_once_per_call_and_saves_priced_apart_from_loads():
    cost = StepCost(0, 0, 2, 0, n_forward_calls=2, kv_copy_bytes=10 * BPT, calls=(((0, 5, 1),), ((1, 5, 1),)),
                    kv_save_bytes=4 * BPT)
    assert term(cost, "weights_s_per_byte") == 2 * LAYOUT.weight_bytes
    assert term(cost, "one_token_call_s") == 2
    assert (term(cost, "save_s_per_byte"), term(cost, "load_s_per_byte")) == (4 * BPT, 6 * BPT)


def test_sim_backend_counts_the_layout_of_a_plan_for_a_model_that_wants_it():
    plan = BatchPlan(0.0, (
        KVOp("cache_save", seq=2, entry=1, n_tokens=30), KVOp("cache_load", seq=2, entry=2, n_tokens=50, keep=True),
        KVOp("seq_add", seq=0, p0=10, p1=20, delta=-10),
        ForwardCall((Chunk(0, 0, (7,), 40, (0,), False), Chunk(2, 2, (1, 2, 3), 50, (), True)), 4),
        ForwardCall((Chunk(2, 2, (4, 5), 53, (2,), True),), 2)), 5, 1, {})
    physical = SimBackend(TRUTH, BPT).cost(plan)
    simple = SimBackend(ParametricLatency(0.01, 0, 0, 0), BPT).cost(plan)
    assert physical.calls == (((0, 40, 1), (2, 50, 3)), ((2, 53, 2),))
    assert physical.kv_save_bytes == 30 * BPT
    assert simple.calls is None and simple.kv_save_bytes is None
    agg = ("n_prefill_tokens", "n_decode_tokens", "n_seqs", "attn_ctx_tokens", "n_forward_calls", "kv_copy_bytes",
           "kv_shift_tokens", "kv_read_tokens")
    assert [getattr(physical, f) for f in agg] == [getattr(simple, f) for f in agg]


def test_estimated_layout_is_exact_for_equal_decodes_and_a_single_chunk():
    assert estimate_calls(StepCost(0, 3, 3, 3 * 101)) == (((0, 100, 1), (1, 100, 1), (2, 100, 1)),)
    chunk = StepCost(64, 0, 1, 64 * 200 + 64 * 65 // 2, kv_read_tokens=264)
    assert estimate_calls(chunk) == (((0, 200, 64),),)


# --- decode fast-forward ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(pasts=st.lists(st.integers(0, 5000), min_size=1, max_size=20), gap=st.integers(0, 6),
       k=st.integers(0, 40), threads=st.sampled_from([1, 2]), batch_min=st.sampled_from([0, 2]),
       by_token=st.sampled_from([0, 1]))
def test_decode_only_times_equal_the_step_times_of_their_layout(pasts, gap, k, threads, batch_min, by_token):
    lay = EngineLayout(LAYOUT.weight_bytes, n_threads=threads, decode_batch_min=0 if by_token else batch_min, n_head=9,
                       attend_by_token=by_token, attend_split_cells=114 * by_token, attend_pieces=4)
    model = PhysicalLatency(TRUTH.coefficients[:-1] + (3e-10,), lay)
    decode = [(i + (gap if i else 0), p) for i, p in enumerate(pasts)]
    n, attn0 = len(pasts), sum(p + 1 for p in pasts)
    expected = [model.step_time_s(StepCost(0, n, n, attn0 + i * n, calls=(tuple((s, p + i, 1) for s, p in decode),)))
                for i in range(k)]
    assert model.decode_only_times_s(n, attn0, k, decode) == expected          # bit-equal: fast-forward is exact
    bare = [model.step_time_s(StepCost(0, n, n, attn0 + i * n)) for i in range(k)]
    assert model.decode_only_times_s(n, attn0, k) == bare


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_parallel=st.sampled_from([1, 3, 8]), n_batch=st.sampled_from([64, 2048]), rate=st.floats(0.5, 30),
       seed=st.integers(0, 1000), cram=st.sampled_from([0, 1]))
def test_fast_forward_equals_single_stepping_with_the_physical_model(n_parallel, n_batch, rate, seed, cram):
    tr = open_loop(20, PoissonArrivals(rate), UniformLength(5, 700), UniformLength(1, 100), seed=seed)
    cfg = ServerConfig(n_parallel=n_parallel, n_ctx=4096, n_batch=n_batch, cache_ram_mib=cram,
                       kv_bytes_per_token=1024, policies=PolicyNames(batch_building="decode_first"))
    a, b, ra, rb = _compare_ff(cfg, tr, TRUTH)
    assert_identical(a, b, ra, rb)


def test_fast_forward_is_used_with_the_physical_model_on_chat():
    a, b, ra, rb = _compare_ff(ServerConfig(n_ctx=8192, n_parallel=3), small_chat(), TRUTH)
    assert b.run["ff_steps"] > 0
    assert_identical(a, b, ra, rb)


# --- fitting and cross-validation ----------------------------------------------------------------


def synthetic_costs(rng, n_rows=300):
    """Random steps of every kind the core produces, with their layout."""
    costs = []
    for _ in range(n_rows):
        calls, n_pre, n_dec, attn, read = [], 0, 0, 0, 0
        decode_only = rng.random() < 0.4                                   # the most common steps
        for _c in range(1 if decode_only else int(rng.integers(1, 3))):
            chunks, seqs = [], rng.permutation(20)[:int(rng.integers(1, 5 if decode_only else 12))].tolist()
            for s in seqs:
                if decode_only or rng.random() < 0.6:
                    p = int(rng.integers(0, 3000))
                    chunks.append((s, p, 1))
                    n_dec, attn, read = n_dec + 1, attn + p + 1, read + p + 1
                else:
                    p, m = int(rng.integers(0, 2000)), int(rng.integers(2, 600))
                    chunks.append((s, p, m))
                    n_pre, attn, read = n_pre + m, attn + m * p + m * (m + 1) // 2, read + p + m
            calls.append(tuple(chunks))
        save, load, shift = (0, 0, 0) if decode_only else (int(rng.choice([0, rng.integers(1, 2048)])) for _ in range(3))
        costs.append(StepCost(n_pre, n_dec, sum(map(len, calls)), attn, len(calls), (save + load) * BPT,
                              shift, read, tuple(calls), save * BPT))
    return costs


def test_fit_recovers_known_terms_from_exact_timings():
    costs = synthetic_costs(np.random.default_rng(0))
    fit = fit_physical([(c, TRUTH.step_time_s(c)) for c in costs], LAYOUT)
    assert fit.model.coefficients == pytest.approx(TRUTH.coefficients, rel=1e-6)
    assert fit.mape < 1e-9


def test_fit_recovers_terms_within_what_the_noise_allows():
    """Timings off by up to ±10%: the truth is feasible, so the weighted residual of the fit is at most the
    truth's (r_fit <= r_true), hence ||A_w(c_fit − c_true)|| <= 2·r_true and each coefficient is within
    2·r_true·||row j of A_w⁺|| of the truth."""
    rng = np.random.default_rng(1)
    costs = synthetic_costs(rng)
    t_true = np.array([TRUTH.step_time_s(c) for c in costs])
    t = t_true * rng.uniform(0.9, 1.1, size=len(t_true))
    fit = fit_physical(list(zip(costs, t.tolist())), LAYOUT)
    a_w = physical_design(costs, LAYOUT) / t[:, None]
    c_true, c_fit = np.array(TRUTH.coefficients), np.array(fit.model.coefficients)
    r_true = np.linalg.norm(a_w @ c_true - 1.0)
    r_fit = np.linalg.norm(a_w @ c_fit - 1.0)
    assert r_fit <= r_true * (1 + 1e-9)
    bound = 2 * r_true * np.linalg.norm(np.linalg.pinv(a_w), axis=1)        # [n_terms]
    assert np.all(np.abs(c_fit - c_true) <= bound * (1 + 1e-6))


def test_lawson_hanson_meets_the_optimality_conditions():
    rng = np.random.default_rng(2)
    for _ in range(30):
        a = rng.normal(size=(40, 8))
        a[:, 3] = a[:, 2] + 1e-3 * rng.normal(size=40)                    # nearly collinear columns
        b = rng.normal(size=40)
        x = _nnls_lawson_hanson(a, b)
        g = a.T @ (a @ x - b)                                              # gradient of ½||ax − b||²
        assert np.all(x >= 0)
        assert np.all(g >= -1e-8) and np.all(np.abs(g[x > 0]) <= 1e-8)


def test_cross_validation_holds_out_whole_groups():
    """Only the 'shift' group has shifted cells: in sample the fit prices them exactly; held out, nothing
    teaches it the shift term, so the held-out error of those rows is exactly their shift cost."""
    costs = [c for c in synthetic_costs(np.random.default_rng(3))]
    costs = [StepCost(c.n_prefill_tokens, c.n_decode_tokens, c.n_seqs, c.attn_ctx_tokens, c.n_forward_calls,
                      c.kv_copy_bytes, c.kv_shift_tokens if i % 5 == 0 else 0, c.kv_read_tokens, c.calls,
                      c.kv_save_bytes) for i, c in enumerate(costs)]
    groups = ["shift" if c.kv_shift_tokens else f"row{i}" for i, c in enumerate(costs)]
    kinds = ["shift" if c.kv_shift_tokens else "other" for c in costs]
    x = physical_design(costs, LAYOUT)
    t = x @ np.array(TRUTH.coefficients)
    pred = held_out_predictions(x, t, groups)
    summary = error_summary(pred, t, kinds)
    assert summary["other"]["max_ape"] < 1e-6
    shift = np.array([k == "shift" for k in kinds])
    expected = TRUTH.terms()["shift_s_per_cell"] * x[shift, PHYSICAL_TERMS.index("shift_s_per_cell")] / t[shift]
    assert np.abs(pred[shift] - t[shift]) / t[shift] == pytest.approx(expected, rel=1e-6)
    assert summary["shift"]["mape"] == pytest.approx(expected.mean(), rel=1e-6)


def test_cross_validation_needs_more_than_one_group():
    with pytest.raises(ValueError, match="single group"):
        held_out_predictions(np.ones((3, 1)), np.ones(3), ["a", "a", "a"])


# --- files and selection --------------------------------------------------------------------------


def both_fits():
    costs = synthetic_costs(np.random.default_rng(4), 80)
    rows = [(c, TRUTH.step_time_s(c)) for c in costs]
    return fit_parametric(rows), fit_physical(rows, LAYOUT)


def test_calibration_file_holds_both_models_and_names_the_default(tmp_path):
    simple, physical = both_fits()
    path = tmp_path / "cal.json"
    save_calibration_file(path, simple, MEASURED_ON, physical=physical, extra={"load_moved": True})
    loaded = load_latency_file(path)
    assert isinstance(loaded, PhysicalLatency) and loaded == physical.model
    assert loaded.load_moved is True and loaded.measured_on == MEASURED_ON
    assert load_latency_file(path, "simple") == simple.model == load_calibration(path)
    assert get_latency_model(f"parametric:{path}") == physical.model
    assert get_latency_model(f"simple:{path}") == simple.model
    assert get_latency_model(f"physical:{path}") == physical.model
    json.dumps(loaded.describe())


def test_simple_default_and_old_files_load_the_simple_model(tmp_path):
    simple, physical = both_fits()
    path = tmp_path / "cal.json"
    save_calibration_file(path, simple, MEASURED_ON, physical=physical, model="simple")
    assert get_latency_model(f"parametric:{path}") == simple.model
    old = tmp_path / "old.json"
    save_calibration(simple.model, old, MEASURED_ON)
    assert get_latency_model(f"parametric:{old}") == simple.model
    with pytest.raises(ValueError, match="no field 'physical'"):
        get_latency_model(f"physical:{old}")


def test_files_written_before_the_by_token_layout_and_squared_cells_price_as_before(tmp_path):
    simple, physical = both_fits()
    path = tmp_path / "cal.json"
    save_calibration_file(path, simple, MEASURED_ON, physical=physical)
    data = json.loads(path.read_text())
    data["physical"]["terms"].pop("kv_read_sq_s_per_cell2")
    for name in ("attend_by_token", "attend_split_cells", "attend_pieces"):
        data["physical"]["layout"].pop(name)
    path.write_text(json.dumps(data))
    old = load_physical(path)
    assert old.terms()["kv_read_sq_s_per_cell2"] == 0 and old.layout.attend_by_token == 0
    unsquared = PhysicalLatency(physical.model.coefficients[:-1] + (0.0,), physical.model.layout)
    for cost in synthetic_costs(np.random.default_rng(3))[:40]:
        assert old.step_time_s(cost) == unsquared.step_time_s(cost)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["physical"]["terms"].pop("token_s"), "missing field 'physical.terms.token_s'"),
    (lambda d: d["physical"]["terms"].update(token_s=-1.0), "physical.terms.token_s"),
    (lambda d: d["physical"]["terms"].update(bogus=1.0), "unknown field 'physical.terms.bogus'"),
    (lambda d: d["physical"]["layout"].update(n_threads=0), "physical.layout"),
    (lambda d: d["physical"].pop("layout"), "missing field 'physical.layout'"),
    (lambda d: d.update(model="fancy"), "field 'model' must be one of"),
])
def test_bad_physical_block_names_file_and_field(tmp_path, edit, message):
    simple, physical = both_fits()
    path = tmp_path / "cal.json"
    save_calibration_file(path, simple, MEASURED_ON, physical=physical)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as err:
        load_latency_file(path) if "model" in message else load_physical(path)
    assert str(path) in str(err.value)


def test_constant_and_simple_models_do_not_get_the_layout():
    assert not SimBackend(ConstantLatency(0.01), BPT).wants_layout
    assert SimBackend(TRUTH, BPT).wants_layout


# --- the table model ------------------------------------------------------------------------------

# a per-call cost that no linear term follows (shaped like OpenBLAS's f32 products: 2 and 3 rows dearer than 4)
CALL_COST = {1: 0.036, 2: 0.080, 3: 0.081, 4: 0.059, 5: 0.078, 6: 0.084, 7: 0.080, 8: 0.074}
TABLE_TRUTH = PhysicalLatency(
    tuple(0.0 if name in TABLE_REPLACES else v for name, v in zip(PHYSICAL_TERMS, TRUTH.coefficients)), LAYOUT,
    call_table=(*CALL_COST.items(), (16, 0.1), (64, 0.15), (65, 0.2), (512, 0.9)))


@given(knots=st.lists(st.integers(1, 600), min_size=1, max_size=12, unique=True), m=st.integers(1, 2000))
def test_hat_weights_interpolate_between_the_knots_around_m(knots, m):
    knots = sorted(knots)
    pairs = hat_weights(m, knots)
    assert sum(w for _, w in pairs) == pytest.approx(1.0)
    line = [3.0 * k + 7.0 for k in knots]                           # a line is reproduced, inside and beyond
    value = sum(w * line[i] for i, w in pairs)
    if len(knots) == 1 or m <= knots[0]:
        assert pairs == [(0, 1.0)]
    else:
        assert value == pytest.approx(3.0 * m + 7.0)
    if m in knots:
        assert value == pytest.approx(3.0 * m + 7.0)


def test_table_model_prices_each_call_by_its_token_count():
    step = TABLE_TRUTH.step_time_s
    two = one_call((0, 99, 1), (1, 99, 1))
    three = one_call((0, 99, 1), (1, 99, 1), (2, 99, 1))
    four = one_call(*[(s, 99, 1) for s in range(4)])
    # four decodes cost less than three, as measured: the table follows it, a linear term cannot
    assert step(four) < step(three)
    base = PhysicalLatency(TABLE_TRUTH.coefficients, LAYOUT).step_time_s
    assert step(two) - base(two) == pytest.approx(CALL_COST[2])
    assert TABLE_TRUTH.breakdown(three)["call_table_s"] == pytest.approx(CALL_COST[3])
    # between knots: linear; beyond the last: the last segment's line
    chunk = one_call((0, 0, 40))
    assert step(chunk) - base(chunk) == pytest.approx(0.1 + (40 - 16) / (64 - 16) * 0.05)
    long = one_call((0, 0, 600))
    assert step(long) - base(long) == pytest.approx(0.9 + (600 - 512) / (512 - 65) * 0.7)


@settings(max_examples=40, deadline=None)
@given(pasts=st.lists(st.integers(0, 5000), min_size=1, max_size=20), k=st.integers(0, 30))
def test_table_decode_only_times_equal_the_step_times_of_their_layout(pasts, k):
    decode = list(enumerate(pasts))
    n, attn0 = len(pasts), sum(p + 1 for p in pasts)
    expected = [TABLE_TRUTH.step_time_s(StepCost(0, n, n, attn0 + i * n, calls=(tuple((s, p + i, 1)
                                                                                     for s, p in decode),)))
                for i in range(k)]
    assert TABLE_TRUTH.decode_only_times_s(n, attn0, k, decode) == pytest.approx(expected, rel=1e-12)


def table_costs(rng, n_rows=300):
    """synthetic_costs plus decode-only steps of 1..8 sequences and prompt chunks of 16..512 tokens, so that
    every knot of TABLE_TRUTH is supported."""
    costs = synthetic_costs(rng, n_rows)
    for n in range(1, 9):
        for past in (63, 700):
            costs.append(one_call(*[(s, past, 1) for s in range(n)]))
    for m in (16, 64, 65, 512):
        for pos0 in (0, 900):
            costs.append(StepCost(m, 0, 1, m * pos0 + m * (m + 1) // 2, 1, calls=(((0, pos0, m),),)))
    return costs


def test_table_fit_recovers_a_per_call_cost_no_linear_term_follows():
    costs = table_costs(np.random.default_rng(5))
    rows = [(c, TABLE_TRUTH.step_time_s(c)) for c in costs]
    knots = table_knots(costs)
    assert set(CALL_COST) <= set(knots) and knots[-1] >= 512
    fit = fit_table(rows, LAYOUT)
    assert fit.mape < 1e-6
    table = dict(fit.model.call_table)
    for m, sec in CALL_COST.items():
        assert table[m] == pytest.approx(sec, rel=1e-5)
    # the same timings through the physical model's linear terms: the non-monotonic part stays unexplained
    assert fit_physical(rows, LAYOUT).mape > 10 * fit.mape


def test_table_knots_keep_only_the_call_sizes_the_rows_support():
    costs = [one_call(*[(s, 10, 1) for s in range(n)]) for n in (1, 2, 4, 7)]
    costs.append(one_call((0, 0, 300)))
    knots = table_knots(costs)
    # 3, 5, 6 and 8..128 have no call between their neighbours; 256 and 512 bracket the 300-token call
    assert knots == (1, 2, 4, 7, 256, 512)


def test_held_out_call_size_is_interpolated_from_its_neighbours():
    costs = table_costs(np.random.default_rng(6), 60)
    t = np.array([TABLE_TRUTH.step_time_s(c) for c in costs])
    five = [len(c.calls) == 1 and len(c.calls[0]) == 5 and all(n == 1 for *_, n in c.calls[0])
            and c.n_prefill_tokens == 0 for c in costs]
    groups = ["five" if f else i for i, f in enumerate(five)]
    pred = held_out_table(costs, t, groups, LAYOUT)
    held = np.array(five)
    base = PhysicalLatency(TABLE_TRUTH.coefficients, LAYOUT)
    interp = (CALL_COST[4] + CALL_COST[6]) / 2                         # what the neighbours give for 5
    got = pred[held] - np.array([base.step_time_s(c) for c, h in zip(costs, held) if h])
    assert got == pytest.approx([interp] * int(held.sum()), rel=1e-3)


def test_calibration_file_holds_the_table_model(tmp_path):
    simple, physical = both_fits()
    costs = table_costs(np.random.default_rng(7), 40)
    table = fit_table([(c, TABLE_TRUTH.step_time_s(c)) for c in costs], LAYOUT)
    path = tmp_path / "cal.json"
    save_calibration_file(path, simple, MEASURED_ON, physical=physical, table=table, model="table")
    assert load_latency_file(path) == table.model == get_latency_model(f"table:{path}")
    assert get_latency_model(f"parametric:{path}") == table.model
    assert load_latency_file(path, "physical") == physical.model
    assert json.loads(path.read_text())["fit_table"]["mape"] == pytest.approx(table.mape)
    json.dumps(table.model.describe())
    no_table = tmp_path / "old.json"
    save_calibration_file(no_table, simple, MEASURED_ON, physical=physical)
    with pytest.raises(ValueError, match="no field 'table'"):
        get_latency_model(f"table:{no_table}")
    with pytest.raises(ValueError, match="needs a table fit"):
        save_calibration_file(no_table, simple, MEASURED_ON, physical=physical, model="table")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["table"].pop("call_table"), "missing field 'table.call_table'"),
    (lambda d: d["table"].update(call_table=[]), "'table.call_table' must be a non-empty list"),
    (lambda d: d["table"]["call_table"].__setitem__(0, [1, "x"]), r"'table.call_table\[0\]' must be"),
    (lambda d: d["table"]["call_table"].__setitem__(0, [1.5, 0.1]), r"'table.call_table\[0\]' must be"),
    (lambda d: d["table"]["call_table"].reverse(), "increasing integers"),
    (lambda d: d["table"]["call_table"].__setitem__(0, [1, -0.1]), "call_table"),
])
def test_bad_table_block_names_file_and_field(tmp_path, edit, message):
    simple, physical = both_fits()
    costs = table_costs(np.random.default_rng(8), 40)
    table = fit_table([(c, TABLE_TRUTH.step_time_s(c)) for c in costs], LAYOUT)
    path = tmp_path / "cal.json"
    save_calibration_file(path, simple, MEASURED_ON, physical=physical, table=table, model="table")
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as err:
        load_latency_file(path)
    assert str(path) in str(err.value)
