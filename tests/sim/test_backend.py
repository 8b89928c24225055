"""SimBackend: a plan's StepCost counts what step_cost_from_chunks counts, and the decode-only shortcut of
execute() charges exactly what the full path charges."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.types import BatchPlan, Chunk, ForwardCall, KVOp
from sim.backend import SimBackend
from sim.latency import ParametricLatency, step_cost_from_chunks

chunk = st.tuples(st.integers(0, 5000), st.booleans(), st.integers(1, 300))   # pos0, is_prompt, n_tokens


def _plan(chunks, ops=()):
    cs = tuple(Chunk(i, i, tuple(range(n)) if prompt else (7,), pos0, (), prompt)
               for i, (pos0, prompt, n) in enumerate(chunks))
    return BatchPlan(0.0, (*ops, ForwardCall(cs, sum(len(c.tokens) for c in cs))), 0, 0, {})


@settings(max_examples=200, deadline=None)
@given(st.lists(chunk, min_size=1, max_size=20), st.integers(0, 3))
def test_cost_counts_prefill_chunks_and_decode_tokens(chunks, n_saved):
    ops = (KVOp("cache_save", seq=0, entry=1, n_tokens=10),) * n_saved
    got = SimBackend(ParametricLatency(0.01, 1e-4, 1e-3, 1e-8), 100).cost(_plan(chunks, ops))
    want = step_cost_from_chunks([(p, n) for p, prompt, n in chunks if prompt],
                                 [p for p, prompt, _ in chunks if not prompt], kv_copy_bytes=10 * n_saved * 100)
    for f in ("n_prefill_tokens", "n_decode_tokens", "n_seqs", "attn_ctx_tokens", "n_forward_calls",
              "kv_copy_bytes", "kv_shift_tokens"):
        assert getattr(got, f) == getattr(want, f), f
    if got.kv_read_tokens is not None:
        assert got.kv_read_tokens == want.kv_read_tokens


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 100_000), min_size=1, max_size=64),
       st.floats(0, 1e-2), st.floats(0, 1e-2), st.floats(0, 1e-7), st.floats(0, 1e-7))
def test_decode_only_shortcut_charges_the_full_paths_time(pos, a, c, d, h):
    lat = ParametricLatency(a, 1e-4, c, d, h_kv_read_s=h)
    be = SimBackend(lat, 100)
    plan = _plan([(p, False, 1) for p in pos])
    assert be.execute(plan).elapsed_s == lat.step_time_s(be.cost(plan))


class _Layout(ParametricLatency):
    """A parametric model that asks for the layout (StepCost.calls / kv_save_bytes)."""

    wants_layout = True


op = st.sampled_from([KVOp("cache_save", seq=0, entry=1, n_tokens=10), KVOp("cache_load", seq=1, entry=2, n_tokens=7),
                      KVOp("seq_add", seq=0, p0=5, p1=9, delta=-3), KVOp("seq_rm", seq=2, p0=4, p1=-1),
                      KVOp("cache_drop", entry=3)])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=20),
       st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 300)), min_size=1, max_size=4),
       st.lists(op, max_size=4), st.booleans())
def test_admission_cost_is_the_cost_of_its_plan(dec_pos, prompts, ops, layout):
    """The first step of an admission stretch (decode tokens, then prompt chunks, after KV operations) is
    priced exactly as `cost()` prices the plan the core would have built for it."""
    lat = (_Layout if layout else ParametricLatency)(0.01, 1e-4, 1e-3, 1e-8)
    be = SimBackend(lat, 100)
    seqs = list(range(len(prompts), len(prompts) + len(dec_pos)))
    chunks = tuple(Chunk(s, s, (7,), p, (s,), False) for s, p in zip(seqs, dec_pos))
    chunks += tuple(Chunk(i, i, tuple(range(n)), pos0, (i,), True) for i, (pos0, n) in enumerate(prompts))
    n_prompt = sum(n for _, n in prompts)
    plan = BatchPlan(0.0, (*ops, ForwardCall(chunks, len(dec_pos) + n_prompt)), n_prompt, len(dec_pos), {})
    got = be.admission_cost(ops, dec_pos, seqs, [(i, pos0, n) for i, (pos0, n) in enumerate(prompts)])
    assert got == be.cost(plan)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=20),
       st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 300)), min_size=1, max_size=4),
       st.lists(op, max_size=4), st.floats(0, 1e-2), st.floats(0, 1e-4), st.floats(0, 1e-2), st.floats(0, 1e-7),
       st.floats(0, 1e-9), st.floats(0, 1e-6), st.floats(0, 1e-7))
def test_admission_time_is_the_time_of_its_cost(dec_pos, prompts, ops, a, b, c, d, e, f, h):
    """The admission step priced from its counts (the decode positions' sum, no StepCost) charges, bit for
    bit, what the model charges for `admission_cost`, KV copies and shifts included."""
    lat = ParametricLatency(a, b, c, d, e_copy_s_per_byte=e, f_shift_s_per_token=f, h_kv_read_s=h)
    be = SimBackend(lat, 100)
    assert be.fast_admission
    seqs = list(range(len(prompts), len(prompts) + len(dec_pos)))
    chunks = [(i, pos0, n) for i, (pos0, n) in enumerate(prompts)]
    want = lat.step_time_s(be.admission_cost(ops, dec_pos, seqs, chunks))
    assert be.admission_time_s(ops, len(dec_pos), sum(dec_pos), chunks) == want
    assert not SimBackend(_Layout(a, b, c, d), 100).fast_admission


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 100_000), max_size=20), st.integers(0, 100_000), st.integers(1, 2048),
       st.integers(0, 40), st.floats(0, 1e-2), st.floats(0, 1e-4), st.floats(0, 1e-2), st.floats(0, 1e-7),
       st.floats(0, 1e-7), st.booleans())
def test_prefill_stretch_times_are_the_times_of_its_costs(dec_pos, pos0, take, k, a, b, c, d, h, layout):
    """The shortcut that prices a prefill stretch from its counts charges, bit for bit, what the latency model
    charges for each step's StepCost."""
    lat = (_Layout if layout else ParametricLatency)(a, b, c, d, h_kv_read_s=h)
    be = SimBackend(lat, 100)
    seqs = list(range(1, len(dec_pos) + 1))
    want = [lat.step_time_s(x) for x in be.prefill_stretch_costs(dec_pos, pos0, take, k, seqs, 0)]
    assert be.prefill_stretch_times_s(dec_pos, pos0, take, k, seqs, 0) == want
