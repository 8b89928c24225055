"""SimPy driver: open/closed loop, determinism, and exact fast-forward (same results as single steps)."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core import PolicyNames, Recorder, ServerConfig
from sim.driver import Simulation
from sim.latency import ConstantLatency, ParametricLatency
from traces import (ChatSession, ChatWorkload, ConstantLength, PoissonArrivals, Trace, TraceRequest, Turn,
                    UniformLength, open_loop)


def small_chat(seed=0, n_users=6):
    sessions = tuple(
        ChatSession(f"u{i}", start_s=0.3 * i, system_prompt_id=i % 2,
                    turns=tuple(Turn(n_user=20 + 5 * k, n_output=10 + 3 * k, think_s=0.0 if k == 0 else 0.5)
                                for k in range(3)))
        for i in range(n_users))
    return ChatWorkload(sessions, (120, 80), seed)


def param_latency():
    return ParametricLatency(a_s=0.004, b_prefill_s=2e-5, c_decode_s=1e-4, d_attn_s=1e-8)


def test_open_loop_trace_serves_every_request():
    tr = open_loop(30, PoissonArrivals(5.0), UniformLength(10, 200), UniformLength(1, 40), seed=1)
    r = Simulation(ServerConfig(n_ctx=4096, n_parallel=2), ConstantLatency(0.01)).run(tr)
    assert r.run["n_requests"] == 30 and r.run["n_errors"] == 0
    for row in r.requests:
        assert row["n_output"] == max(1, row["n_output_target"])
        assert row["ttft_s"] >= 0 and row["e2e_s"] >= row["ttft_s"]


def test_request_arriving_at_a_step_start_is_seen_by_that_step():
    reqs = [TraceRequest(0, 0.0, 10, 5), TraceRequest(1, 0.02, 10, 5)]
    tr = Trace(reqs, "native", "test")
    r = Simulation(ServerConfig(n_ctx=4096, n_parallel=2), ConstantLatency(0.01), fast_forward=False).run(tr)
    second = r.requests[1]
    assert second["launch_s"] == 0.02 and second["queue_s"] == 0.0


def test_closed_loop_next_turn_extends_previous_prompt_and_reply():
    wl = small_chat()
    r = Simulation(ServerConfig(n_ctx=8192, n_parallel=2, cache_ram_mib=-1), ConstantLatency(0.01)).run(wl)
    rows = [x for x in r.requests if x["session_id"] == "u0"]
    assert [x["turn"] for x in rows] == [0, 1, 2]
    for a, b in zip(rows, rows[1:]):
        assert b["n_prompt"] == a["n_prompt"] + a["n_output"] + (b["n_prompt"] - a["n_prompt"] - a["n_output"])
        assert b["arrival_s"] >= a["end_s"] + 0.5 - 1e-9          # think time after the reply
    assert sum(x["n_cached"] for x in r.requests) > 0               # multi-turn prefixes are reused


def test_a_pinned_turn_arrives_at_its_time_but_never_before_the_previous_reply():
    """`Turn.send_at_s` (validate --arrivals real) replaces the think time: the turn is sent at that time, or
    when the previous reply ends if that is later."""
    turns = (Turn(20, 10, 0.0), Turn(10, 5, 9.0, send_at_s=3.0), Turn(10, 5, 9.0, send_at_s=0.05))
    wl = ChatWorkload((ChatSession("u", 0.0, 0, turns),), (50,), 0)
    rows = Simulation(ServerConfig(n_ctx=4096, n_parallel=1), ConstantLatency(0.01)).run(wl).requests
    assert rows[0]["end_s"] < 3.0
    assert rows[1]["arrival_s"] == 3.0                                  # pinned, not end + 9 s of thinking
    assert rows[2]["arrival_s"] == rows[1]["end_s"] > 0.05             # its time passed: right after the reply


def test_closed_loop_session_ends_at_first_error():
    wl = ChatWorkload((ChatSession("u", 0.0, 0, (Turn(100, 10, 0.0), Turn(300, 10, 1.0), Turn(5, 5, 1.0))),),
                      (50,), 0)
    r = Simulation(ServerConfig(n_ctx=256, n_parallel=1), ConstantLatency(0.01)).run(wl)
    assert [x["finish"] for x in r.requests] == ["limit", "error"]
    assert r.sessions_ended_early == ["u"]


def test_same_seed_same_results():
    wl = small_chat()
    runs = [Simulation(ServerConfig(n_ctx=8192, n_parallel=2), param_latency(), seed=3).run(wl).requests
            for _ in range(2)]
    assert runs[0] == runs[1]


def _compare_ff(cfg, workload, latency):
    rec_a, rec_b = Recorder(), Recorder()
    a = Simulation(cfg, latency, fast_forward=False, recorder=rec_a).run(workload)
    b = Simulation(cfg, latency, fast_forward=True, recorder=rec_b).run(workload)
    return a, b, rec_a, rec_b


def _same(x, y):
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


def assert_identical(a, b, rec_a, rec_b):
    assert len(a.requests) == len(b.requests)
    for ra, rb in zip(a.requests, b.requests):
        assert all(_same(ra[k], rb[k]) for k in ra), (ra, rb)
    assert a.run["sim_s"] == b.run["sim_s"] and a.run["steps"] == b.run["steps"]
    assert rec_a.events == rec_b.events
    ma, mb = a.metrics, b.metrics
    assert (ma.n_decode_total, ma.n_tokens_predicted_total, ma.n_busy_slots_total, ma.n_deferrals) == \
           (mb.n_decode_total, mb.n_tokens_predicted_total, mb.n_busy_slots_total, mb.n_deferrals)


def test_fast_forward_is_used_and_changes_nothing_on_chat():
    a, b, ra, rb = _compare_ff(ServerConfig(n_ctx=8192, n_parallel=2), small_chat(), param_latency())
    assert b.run["ff_steps"] > 0
    assert_identical(a, b, ra, rb)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_parallel=st.sampled_from([-1, 1, 2, 4]), n_ctx=st.sampled_from([512, 1024, 4096]),
       rate=st.floats(0.5, 50), ctx_shift=st.booleans(), seed=st.integers(0, 1000),
       batch=st.sampled_from(["decode_first", "prefill_first", "token_budget:64"]),
       step=st.sampled_from([0.01, 0.0123]))
def test_fast_forward_equals_single_stepping_on_random_open_loop(n_parallel, n_ctx, rate, ctx_shift, seed,
                                                                 batch, step):
    tr = open_loop(25, PoissonArrivals(rate), UniformLength(5, 300), UniformLength(1, 120), seed=seed)
    cfg = ServerConfig(n_parallel=n_parallel, n_ctx=n_ctx, ctx_shift=ctx_shift,
                       policies=PolicyNames(batch_building=batch))
    latency = ParametricLatency(a_s=step, b_prefill_s=1e-5, c_decode_s=3e-4, d_attn_s=1e-7)
    assert_identical(*_compare_ff(cfg, tr, latency))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_users=st.integers(1, 8), n_parallel=st.sampled_from([-1, 1, 3]), seed=st.integers(0, 100),
       evict=st.sampled_from(["fifo", "lru"]), hit=st.sampled_from(["move", "copy"]))
def test_fast_forward_equals_single_stepping_on_random_chat(n_users, n_parallel, seed, evict, hit):
    cfg = ServerConfig(n_parallel=n_parallel, n_ctx=4096, cache_ram_mib=1, kv_bytes_per_token=1024,
                       policies=PolicyNames(eviction=evict), cache_hit=hit)
    assert_identical(*_compare_ff(cfg, small_chat(seed, n_users), param_latency()))
    _pending_vs_written(cfg, small_chat(seed, n_users), param_latency())   # (closed loop: below)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_parallel=st.sampled_from([1, 2, 4]), n_batch=st.sampled_from([16, 64, 200]), kvu=st.booleans(),
       n_ctx=st.sampled_from([2048, 8192]), rate=st.floats(0.5, 50), seed=st.integers(0, 1000),
       batch=st.sampled_from(["decode_first", "prefill_first", "token_budget:40"]), cram=st.sampled_from([0, 1]))
def test_prefill_fast_forward_equals_single_stepping(n_parallel, n_batch, kvu, n_ctx, rate, seed, batch, cram):
    """Long prompts in small batches: stretches of prompt chunks (with or without decodes) fast-forwarded."""
    tr = open_loop(25, PoissonArrivals(rate), UniformLength(5, 1500), UniformLength(1, 150), seed=seed)
    cfg = ServerConfig(n_parallel=n_parallel, n_ctx=n_ctx, n_batch=n_batch, kv_unified=kvu, cache_ram_mib=cram,
                       kv_bytes_per_token=1024, policies=PolicyNames(batch_building=batch))
    latency = ParametricLatency(a_s=0.01, b_prefill_s=1e-5, c_decode_s=3e-4, d_attn_s=1e-7, h_kv_read_s=1e-8)
    a, b, ra, rb = _compare_ff(cfg, tr, latency)
    assert_identical(a, b, ra, rb)
    assert a.metrics == b.metrics


def test_prefill_chunks_are_fast_forwarded():
    tr = open_loop(40, PoissonArrivals(20.0), ConstantLength(3000), ConstantLength(50), seed=1)
    cfg = ServerConfig(n_parallel=4, n_ctx=16384, n_batch=128)
    a, b, ra, rb = _compare_ff(cfg, tr, param_latency())
    assert b.run["ff_steps"] > 0.8 * b.run["steps"]
    assert_identical(a, b, ra, rb)
    assert a.metrics == b.metrics


def test_admission_steps_are_fast_forwarded():
    """A saturated server admits each request in a step that also decodes the other slots: that step and the
    decode steps after it are applied as one stretch, so fewer steps run normally than there are requests."""
    n = 80
    tr = open_loop(n, PoissonArrivals(50.0), UniformLength(20, 150), UniformLength(5, 100), seed=2)
    for cfg in (ServerConfig(n_ctx=16384, n_parallel=4),
                ServerConfig(n_ctx=16384, n_parallel=4, kv_unified=True, cache_ram_mib=1, kv_bytes_per_token=1024),
                ServerConfig(n_ctx=16384, n_parallel=4, policies=PolicyNames(batch_building="token_budget:200"))):
        a, b, ra, rb = _compare_ff(cfg, tr, param_latency())
        assert b.run["steps"] - b.run["ff_steps"] < n / 4
        assert_identical(a, b, ra, rb)
        assert a.metrics == b.metrics


def test_admission_steps_with_several_prompts_are_fast_forwarded():
    """Long prompts in small batches: the step that ends one prompt hands the rest of the budget to the next
    prompt (begun there); that step and the prompt-chunk steps after it are one stretch too."""
    n = 80
    tr = open_loop(n, PoissonArrivals(50.0), UniformLength(20, 600), UniformLength(5, 100), seed=2)
    for cfg in (ServerConfig(n_ctx=16384, n_parallel=4, n_batch=128),
                ServerConfig(n_ctx=16384, n_parallel=4, n_batch=128, kv_unified=True, cache_ram_mib=1,
                             kv_bytes_per_token=1024)):
        a, b, ra, rb = _compare_ff(cfg, tr, param_latency())
        assert b.run["steps"] - b.run["ff_steps"] < n / 4
        assert_identical(a, b, ra, rb)
        assert a.metrics == b.metrics


def test_saturated_open_loop_fast_forwards_through_deferred_arrivals():
    tr = open_loop(60, PoissonArrivals(50.0), ConstantLength(20), ConstantLength(100), seed=0)
    a, b, ra, rb = _compare_ff(ServerConfig(n_ctx=8192, n_parallel=2), tr, ConstantLatency(0.01))
    assert b.run["ff_steps"] > 0.8 * b.run["steps"]
    assert_identical(a, b, ra, rb)


def _lazy_vs_eager(cfg, tr, latency, ff):
    lazy = Simulation(cfg, latency, fast_forward=ff)
    eager = Simulation(cfg, latency, fast_forward=ff)
    eager._lazy_prompts = False
    assert lazy._lazy_prompts
    a, b = eager.run(tr), lazy.run(tr)
    assert len(a.requests) == len(b.requests)
    for ra, rb in zip(a.requests, b.requests):
        assert all(_same(ra[k], rb[k]) for k in ra), (ra, rb)
    assert a.run["sim_s"] == b.run["sim_s"] and a.run["steps"] == b.run["steps"]
    assert a.metrics == b.metrics and a.cache_stats == b.cache_stats


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_parallel=st.sampled_from([1, 2, 4]), n_ctx=st.sampled_from([512, 4096]), kvu=st.booleans(),
       rate=st.floats(0.5, 80), seed=st.integers(0, 1000), cram=st.sampled_from([0, 1]), ff=st.booleans(),
       batch=st.sampled_from(["decode_first", "prefill_first", "token_budget:64"]))
def test_prompts_drawn_when_a_slot_may_take_them_change_nothing(n_parallel, n_ctx, kvu, rate, seed, cram, ff,
                                                                 batch):
    """Without a recorder, a waiting request's prompt is drawn only when its task may get a slot: same rows,
    times, metrics and cache counts as drawing every prompt on arrival (prompts over the context included)."""
    tr = open_loop(40, PoissonArrivals(rate), UniformLength(0, 700), UniformLength(1, 80), seed=seed)
    cfg = ServerConfig(n_parallel=n_parallel, n_ctx=n_ctx, kv_unified=kvu, cache_ram_mib=cram, kv_bytes_per_token=1024,
                       policies=PolicyNames(batch_building=batch))
    _lazy_vs_eager(cfg, tr, param_latency(), ff)


def _pending_vs_written(cfg, workload, latency):
    """The same run with generating slots' stretch tokens kept pending (ServerCore.lazy_tokens) and written
    out every step: same rows, times, step counts, metrics, cache counts and final slot tokens."""
    lazy = Simulation(cfg, latency)
    eager = Simulation(cfg, latency)
    assert lazy._lazy_tokens and lazy.core._lz is not None
    eager._lazy_tokens = False
    eager.core.lazy_tokens(None)
    a, b = eager.run(workload), lazy.run(workload)
    assert len(a.requests) == len(b.requests)
    for ra, rb in zip(a.requests, b.requests):
        assert all(_same(ra[k], rb[k]) for k in ra), (ra, rb)
    assert a.run["sim_s"] == b.run["sim_s"] and a.run["steps"] == b.run["steps"]
    assert a.run["ff_steps"] == b.run["ff_steps"]
    assert a.metrics == b.metrics and a.cache_stats == b.cache_stats
    assert [s.tokens for s in eager.core.slots] == [s.tokens for s in lazy.core.slots]
    assert [s.sampled for s in eager.core.slots] == [s.sampled for s in lazy.core.slots]
    assert lazy.core._lz_n == 0
    return lazy, b


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_parallel=st.sampled_from([1, 2, 4, 8]), n_ctx=st.sampled_from([512, 1024, 4096]), kvu=st.booleans(),
       rate=st.floats(0.5, 80), ctx_shift=st.booleans(), seed=st.integers(0, 1000), cram=st.sampled_from([0, 1]),
       n_batch=st.sampled_from([64, 2048]),
       batch=st.sampled_from(["decode_first", "prefill_first", "token_budget:64"]))
def test_stretch_tokens_kept_pending_change_nothing(n_parallel, n_ctx, kvu, rate, ctx_shift, seed, cram, n_batch,
                                                    batch):
    tr = open_loop(40, PoissonArrivals(rate), UniformLength(1, 700), UniformLength(1, 200), seed=seed)
    cfg = ServerConfig(n_parallel=n_parallel, n_ctx=n_ctx, kv_unified=kvu, ctx_shift=ctx_shift, n_batch=n_batch,
                       cache_ram_mib=cram, kv_bytes_per_token=1024,
                       policies=PolicyNames(batch_building=batch))
    _pending_vs_written(cfg, tr, param_latency())


def test_stretch_tokens_are_kept_pending_on_a_saturated_server():
    """Saturated, every stretch starts with an admission: the slots that do not stop keep their tokens pending
    across stretches (the lock step advances further than any one stretch)."""
    tr = open_loop(80, PoissonArrivals(50.0), UniformLength(20, 150), UniformLength(5, 100), seed=2)
    sim = Simulation(ServerConfig(n_ctx=16384, n_parallel=4), param_latency())
    seen = []
    ff = sim.core.fast_forward

    def spy(*a, **kw):
        out = ff(*a, **kw)
        pending = max((sim.core._lk - s.lk0 for s in sim.core.slots if s.lk0 >= 0), default=0)
        seen.append(pending > len(a[2]))          # more than this stretch's steps: from earlier ones too
        return out
    sim.core.fast_forward = spy
    sim.run(tr)
    assert sum(seen) > len(seen) / 2


def test_recorded_replies_turn_pending_tokens_off_and_change_nothing():
    """A recorded reply may hold an EOG, which stretches must see: when the first recorded request arrives the
    pending tokens are written out and every later stretch writes its own, with the same results."""
    import dataclasses
    eog = 2
    cfg = ServerConfig(n_ctx=16384, n_parallel=4, eog_ids=frozenset({eog}))
    tr = open_loop(60, PoissonArrivals(50.0), UniformLength(20, 150), UniformLength(5, 100), seed=4)
    reqs = list(tr.requests)
    for i in (30, 45):                 # an EOS after 3 tokens, though n_output allows 50
        reqs[i] = dataclasses.replace(reqs[i], output_tokens=(7, 8, 9, eog), n_output=50)
    tr = dataclasses.replace(tr, requests=reqs)
    sim, r = _pending_vs_written(cfg, tr, param_latency())
    assert r.requests[30]["finish"] == "eos" and r.requests[30]["n_output"] == 4
    assert not sim._lazy_tokens and sim.core._lz is None
