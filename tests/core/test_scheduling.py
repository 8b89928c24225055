"""Slot selection, the defer queue, prompt reuse, batch building, context shift and stops.

Upstream: `get_available_slot`, `process_single_task`, `update_slots`/`pre_decode`, `process_token` and the
slot's `release` (tools/server/server-context.cpp); `server_queue::defer` and `pop_deferred_task`
(tools/server/server-queue.cpp). Worked numbers from upstream's tests in tools/server/tests/unit/: a
21-token prompt with 64 generated tokens leaves 84 tokens cached (test_slot_save.py,
`test_slot_save_restore`); 8 prompt tokens in a 256-token slot without context shift give 248 tokens
(test_ctx_shift.py, `test_ctx_shift_disabled_short_prompt`).
"""

from engine.core import PolicyNames, Recorder, ServerConfig, ServerCore, SlotState
from engine.core import step as loop_step
from engine.core.errors import ErrorType
from engine.core.types import ForwardCall, KVOp
from policies import make_policies
from tests.core.fakes import FakeBackend, make_core, run, task


def step(core, be, now):
    st = loop_step(core, be, now)
    return st.plan, st.t_end_s


# --- slot selection ---------------------------------------------------------------------------------
def test_first_request_on_fresh_server_goes_to_last_slot():
    core = make_core(n_ctx=1024)
    t = core.submit(task(range(10), n_predict=1), 0.0)
    run(core, FakeBackend())
    assert t.slot_id == 3


def test_similarity_pick_prefers_slot_with_longest_shared_prefix():
    core = make_core(n_ctx=2048, n_parallel=3, cache_ram_mib=0)
    be = FakeBackend()
    a = list(range(100, 200))
    b = list(range(300, 400))
    for p in (a, b):
        core.submit(task(p, n_predict=1), 0.0)
        run(core, be)
    t = core.submit(task(b[:80] + [7] * 20, n_predict=1), 1.0)
    run(core, be, 1.0)
    slot_of_b = [s for s in core.slots if s.tokens[:80] == b[:80]][0].id
    assert t.slot_id == slot_of_b
    assert t.n_prompt_cached == 80


def test_similarity_at_threshold_is_not_enough():
    core = make_core(n_ctx=2048, n_parallel=2, cache_ram_mib=0, slot_prompt_similarity=0.5)
    be = FakeBackend()
    core.submit(task(range(100), n_predict=1), 0.0)      # -> slot 1 (LRU, last)
    run(core, be)
    # shares exactly 50% -> not strictly above 0.5 -> LRU picks slot 0 (never used)
    t = core.submit(task(list(range(50)) + [9] * 50, n_predict=1), 1.0)
    run(core, be, 1.0)
    assert t.slot_id == 0


def test_lru_pick_takes_least_recently_used_idle_slot():
    core = make_core(n_ctx=2048, n_parallel=3, cache_ram_mib=0, slot_prompt_similarity=0.0)
    be = FakeBackend()
    used = []
    for i in range(4):
        t = core.submit(task([i] * 10, n_predict=1), float(i))
        run(core, be, float(i))
        used.append(t.slot_id)
    assert used == [2, 1, 0, 2]


def test_id_slot_picks_named_slot_and_wraps_modulo_slot_count():
    core = make_core(n_ctx=2048, n_parallel=3)
    be = FakeBackend()
    t1 = core.submit(task(range(10), n_predict=1, id_slot=1), 0.0)
    t2 = core.submit(task(range(20, 30), n_predict=1, id_slot=5), 0.0)
    run(core, be)
    assert (t1.slot_id, t2.slot_id) == (1, 2)


# --- queue -----------------------------------------------------------------------------------------
def test_task_naming_busy_slot_is_deferred_and_resumes_on_its_release():
    rec = Recorder()
    core = make_core(rec, n_ctx=2048, n_parallel=2)
    be = FakeBackend()
    t1 = core.submit(task(range(10), n_predict=3, id_slot=0), 0.0)
    t2 = core.submit(task(range(50, 60), n_predict=1, id_slot=0), 0.0)
    _, now = step(core, be, 0.0)
    assert t2 in core.deferred and core.slots[1].state == SlotState.IDLE
    run(core, be, now)
    assert t2.slot_id == 0 and t2.n_deferred == 1
    assert t2.t_launch_s >= t1.t_end_s


def test_deferred_tasks_resume_only_when_a_slot_is_released():
    core = make_core(n_ctx=2048, n_parallel=1)
    be = FakeBackend()
    t1 = core.submit(task(range(10), n_predict=4), 0.0)
    t2 = core.submit(task(range(20, 30), n_predict=1), 0.0)
    now = 0.0
    for _ in range(3):
        _, now = step(core, be, now)
        assert t2 in core.deferred
    run(core, be, now)
    assert t2.t_launch_s == t1.t_end_s


def test_released_slot_prefers_deferred_task_that_named_it():
    core = make_core(n_ctx=2048, n_parallel=1)
    be = FakeBackend()
    core.submit(task(range(10), n_predict=2), 0.0)
    step(core, be, 0.0)
    older = core.submit(task(range(20, 30), n_predict=1), 0.0)
    named = core.submit(task(range(40, 50), n_predict=1, id_slot=0), 0.0)
    run(core, be)
    assert named.t_launch_s < older.t_launch_s


def test_cancel_removes_task_from_queues_and_releases_slot():
    core = make_core(n_ctx=2048, n_parallel=1)
    be = FakeBackend()
    t1 = core.submit(task(range(10), n_predict=100), 0.0)
    t2 = core.submit(task(range(20, 30), n_predict=100), 0.0)
    _, now = step(core, be, 0.0)
    core.cancel(t1, now)
    assert core.slots[0].state == SlotState.IDLE and t1.cancelled
    core.cancel(t2, now)
    assert not core.deferred and not core.queue
    assert not core.has_work()


# --- prompt reuse ----------------------------------------------------------------------------------
def test_identical_prompt_evaluates_one_token():
    core = make_core(n_ctx=2048, n_parallel=1)
    be = FakeBackend()
    p = list(range(21))
    core.submit(task(p, n_predict=64), 0.0)
    run(core, be)
    t = core.submit(task(p, n_predict=1), 10.0)
    run(core, be, 10.0)
    assert (t.n_prompt_processed, t.n_prompt_cached) == (1, 20)


def test_shared_prefix_is_reused_and_rest_processed():
    core = make_core(n_ctx=2048, n_parallel=1)
    be = FakeBackend()
    core.submit(task(range(21), n_predict=4), 0.0)
    run(core, be)
    t = core.submit(task(list(range(15)) + [99] * 6, n_predict=1), 10.0)
    run(core, be, 10.0)
    assert (t.n_prompt_cached, t.n_prompt_processed) == (15, 6)


def test_cache_prompt_false_processes_whole_prompt():
    core = make_core(n_ctx=2048, n_parallel=1)
    be = FakeBackend()
    core.submit(task(range(21), n_predict=1), 0.0)
    run(core, be)
    t = core.submit(task(range(21), n_predict=1, cache_prompt=False), 10.0)
    run(core, be, 10.0)
    assert (t.n_prompt_cached, t.n_prompt_processed) == (0, 21)


def test_tokens_cached_is_prompt_plus_generated_minus_one():
    core = make_core(n_ctx=2048, n_parallel=1)
    t = core.submit(task(range(21), n_predict=64), 0.0)
    run(core, FakeBackend())
    assert t.n_tokens_cached == 84


def test_cache_reuse_shifts_matching_chunk_left():
    core = make_core(n_ctx=2048, n_parallel=1, n_cache_reuse=4)
    be = FakeBackend(tokens_for=lambda t, k: 7)
    a = list(range(10))
    b = list(range(100, 120))
    core.submit(task(a + [50, 51] + b, n_predict=1), 0.0)
    run(core, be)
    t = core.submit(task(a + b + [200], n_predict=1), 10.0)   # gap [50, 51] removed
    plan = core.schedule(10.0)
    kv = [p for p in plan.program if isinstance(p, KVOp)]
    assert KVOp("seq_rm", seq=0, p0=10, p1=12) in kv
    assert KVOp("seq_add", seq=0, p0=12, p1=32, delta=-2) in kv
    assert t.n_prompt_cached == 30



def test_cache_reuse_of_two_chunks_leaves_cells_at_exactly_the_prompt_positions():
    """llama-server's reuse loop over two separated matching chunks, the first one not at position 0: each
    chunk's gap is removed and the chunk shifted left; the fully cached prompt then re-evaluates its last
    token. The fake backend tracks cell positions, so the forward is checked against cells 0..6. (No
    prompt cache, so that the slot's own cells are reused rather than first saved.)"""
    core = make_core(n_ctx=2048, n_parallel=1, n_cache_reuse=4, cache_ram_mib=0)
    be = FakeBackend(tokens_for=lambda t, k: 7)
    first = list(range(1000, 1104)) + list(range(5062, 5097))              # 139 tokens
    core.submit(task(first, n_predict=0), 0.0)
    run(core, be)
    t = core.submit(task(list(range(1100, 1104)) + list(range(5093, 5097)), n_predict=1), 10.0)
    plan = core.schedule(10.0)
    kv = [p for p in plan.program if isinstance(p, KVOp)]
    assert kv == [KVOp("seq_rm", seq=0, p0=0, p1=100), KVOp("seq_add", seq=0, p0=100, p1=104, delta=-100),
                  KVOp("seq_rm", seq=0, p0=4, p1=135), KVOp("seq_add", seq=0, p0=135, p1=139, delta=-131),
                  KVOp("seq_rm", seq=0, p0=7, p1=-1)]
    (fc,) = plan.forwards
    assert [(c.pos0, list(c.tokens)) for c in fc.chunks] == [(7, [5096])]
    be.execute(plan)                                                           # asserts cells 0..6 first
    assert be.pos[0] == list(range(8)) and t.n_prompt_cached == 7

# --- batch building ----------------------------------------------------------------------------------
def test_decode_tokens_come_before_prompt_chunks_in_slot_order():
    core = make_core(n_ctx=4096, n_parallel=3)
    be = FakeBackend()
    core.submit(task(range(10), n_predict=10), 0.0)
    _, now = step(core, be, 0.0)
    core.submit(task(range(20, 30), n_predict=10), now)
    core.submit(task(range(40, 45), n_predict=10), now)
    plan = core.schedule(now)
    (fc,) = plan.forwards
    assert [c.is_prompt for c in fc.chunks] == [False, True, True]
    assert [c.seq for c in fc.chunks[1:]] == sorted(c.seq for c in fc.chunks[1:])


def test_prompt_chunks_fill_up_to_n_batch():
    core = make_core(n_ctx=4096, n_parallel=2, n_batch=64)
    be = FakeBackend()
    t = core.submit(task(range(150), n_predict=1), 0.0)
    sizes = []
    now = 0.0
    while core.has_work():
        plan, now = step(core, be, now)
        sizes.append(plan.n_prompt_tokens)
    assert sizes == [64, 64, 22] and t.n_decoded == 1


def test_without_cont_batching_prefill_waits_for_an_empty_batch():
    core = make_core(n_ctx=4096, n_parallel=2, cont_batching=False)
    be = FakeBackend()
    core.submit(task(range(10), n_predict=3), 0.0)
    _, now = step(core, be, 0.0)
    core.submit(task(range(20, 30), n_predict=1), now)
    plan = core.schedule(now)
    assert plan.n_decode_tokens == 1 and plan.n_prompt_tokens == 0


def test_prefill_first_policy_pauses_decodes_while_prompts_pend():
    from engine.core import PolicyNames
    core = make_core(n_ctx=4096, n_parallel=2, policies=PolicyNames(batch_building="prefill_first"))
    be = FakeBackend()
    core.submit(task(range(10), n_predict=3), 0.0)
    _, now = step(core, be, 0.0)
    core.submit(task(range(20, 30), n_predict=1), now)
    plan = core.schedule(now)
    assert plan.n_decode_tokens == 0 and plan.n_prompt_tokens == 10


def test_token_budget_policy_caps_batch_size():
    from engine.core import PolicyNames
    core = make_core(n_ctx=4096, n_parallel=2, policies=PolicyNames(batch_building="token_budget:32"))
    be = FakeBackend()
    core.submit(task(range(10), n_predict=5), 0.0)
    _, now = step(core, be, 0.0)
    core.submit(task(range(100, 200), n_predict=1), now)
    plan = core.schedule(now)
    assert plan.n_decode_tokens + plan.n_prompt_tokens == 32


# --- stops and context ---------------------------------------------------------------------------------
def test_n_predict_zero_still_yields_one_token():
    core = make_core(n_ctx=1024, n_parallel=1)
    t = core.submit(task(range(5), n_predict=0), 0.0)
    run(core, FakeBackend())
    assert t.n_decoded == 1 and t.stop_type == "limit"


def test_server_n_predict_is_the_default_and_request_value_is_not_capped():
    core = make_core(n_ctx=1024, n_parallel=1, n_predict=3)
    t1 = core.submit(task(range(5)), 0.0)
    t2 = core.submit(task(range(10, 15), n_predict=6), 0.0)
    run(core, FakeBackend())
    assert (t1.n_decoded, t2.n_decoded) == (3, 6)


def test_eos_stops_generation_unless_ignored():
    core = make_core(n_ctx=1024, n_parallel=2, eog_ids=frozenset({2}))
    be = FakeBackend(tokens_for=lambda t, k: 2 if k == 3 else 50)
    t1 = core.submit(task(range(5), n_predict=10), 0.0)
    t2 = core.submit(task(range(10, 15), n_predict=10, ignore_eos=True), 0.0)
    run(core, be)
    assert (t1.stop_type, t1.n_decoded) == ("eos", 4)
    assert (t2.stop_type, t2.n_decoded) == ("limit", 10)


def test_text_hook_stop_word_ends_task_with_word_stop():
    class Hook:
        def __init__(self):
            self.n = 0

        def push(self, tok):
            self.n += 1
            return ("STOP" if self.n == 2 else None), f"piece {self.n}"

    core = make_core(n_ctx=1024, n_parallel=1)
    t = core.submit(task(range(5), n_predict=10, text_hook=Hook()), 0.0)
    events = []
    run(core, FakeBackend(), on_step=lambda st: events.extend(st.tokens))
    assert (t.stop_type, t.stopping_word, t.n_decoded) == ("word", "STOP", 2)
    # what the hook released travels with each token in the step's result
    assert [(e.task, e.token, e.out) for e in events] == [(t, t.generated[0], "piece 1"), (t, t.generated[1], "piece 2")]


def test_streaming_core_reports_every_token_of_hookless_tasks():
    core = ServerCore(ServerConfig(n_ctx=1024, n_parallel=2), make_policies(PolicyNames()), stream_tokens=True)
    a = core.submit(task(range(5), n_predict=3), 0.0)
    b = core.submit(task(range(50, 58), n_predict=2), 0.0)
    events = []
    run(core, FakeBackend(), on_step=lambda st: events.extend(st.tokens))
    assert [e.token for e in events if e.task is a] == a.generated and len(a.generated) == 3
    assert [e.token for e in events if e.task is b] == b.generated and all(e.out is None for e in events)


def test_prompt_at_slot_context_is_rejected_with_exceed_context_error():
    core = make_core(n_ctx=256, n_parallel=1)
    t = core.submit(task(range(256), n_predict=1), 0.0)
    ok = core.submit(task(range(255), n_predict=1), 0.0)
    run(core, FakeBackend())
    assert t.error.type == ErrorType.EXCEED_CONTEXT_SIZE and t.error.http_status == 400
    assert t.error.extra == {"n_prompt_tokens": 256, "n_ctx": 256}
    assert "exceeds the available context size (256 tokens)" in t.error.message
    assert ok.error is None


def test_ctx_shift_off_stops_at_context_limit_truncated():
    core = make_core(n_ctx=256, n_parallel=1)
    t = core.submit(task(range(8), n_predict=1000), 0.0)
    run(core, FakeBackend())
    assert t.n_decoded == 248 and t.truncated and t.stop_type == "limit"


def test_ctx_shift_on_keeps_n_keep_discards_half_and_continues():
    rec = Recorder()
    core = make_core(rec, n_ctx=256, n_parallel=1, ctx_shift=True, n_keep=10)
    be = FakeBackend()
    t = core.submit(task(range(8), n_predict=400), 0.0)
    run(core, be)
    assert t.n_decoded == 400 and t.truncated and t.stop_type == "limit"
    shifts = rec.of_kind("context_shift")
    assert shifts and shifts[0][2]["n_keep"] == 10
    assert shifts[0][2]["n_discard"] == (255 - 10) // 2
    assert max(be.cells.values()) <= 256


def test_shift_ops_remove_then_move_tail():
    core = make_core(n_ctx=256, n_parallel=1, ctx_shift=True)
    be = FakeBackend()
    core.submit(task(range(8), n_predict=300), 0.0)
    now = 0.0
    while True:
        plan, now = step(core, be, now)
        kv = [p for p in plan.program if isinstance(p, KVOp)]
        if kv:
            break
    assert kv == [KVOp("seq_rm", seq=0, p0=0, p1=127), KVOp("seq_add", seq=0, p0=127, p1=255, delta=-127)]


# --- n_cmpl ----------------------------------------------------------------------------------------------
def test_n_cmpl_children_wait_then_share_parent_prompt():
    core = make_core(n_ctx=1024, n_parallel=3)
    be = FakeBackend()
    parent = core.submit(task(range(30), n_predict=4, n_cmpl=3), 0.0)
    plan = core.schedule(0.0)
    states = sorted(s.state for s in core.slots)
    assert states == [SlotState.DONE_PROMPT, SlotState.DONE_PROMPT, SlotState.DONE_PROMPT]
    kinds = [p.kind for p in plan.program if isinstance(p, KVOp)]
    assert kinds.count("seq_cp") == 2
    assert isinstance(plan.program[0], ForwardCall)   # copies come after the parent's prompt decode
    res = be.execute(plan)
    core.commit(plan, res, res.elapsed_s)
    run(core, be, res.elapsed_s)
    for t in [parent, *parent.children]:
        assert t.n_decoded == 4 and t.n_prompt_processed == 30
    assert len({t.slot_id for t in [parent, *parent.children]}) == 3
    assert all(not s.tokens for s in core.slots if s.id != parent.slot_id)   # children keep no context


def test_n_cmpl_defers_until_enough_idle_slots():
    core = make_core(n_ctx=1024, n_parallel=2)
    be = FakeBackend()
    core.submit(task(range(5), n_predict=3), 0.0)
    _, now = step(core, be, 0.0)
    p = core.submit(task(range(30), n_predict=1, n_cmpl=2), now)
    _, now = step(core, be, now)
    assert p in core.deferred
    run(core, be, now)
    assert p.done and all(c.done for c in p.children)


def test_context_shift_refused_for_shared_prompt():
    core = make_core(n_ctx=256, n_parallel=2, ctx_shift=True)
    p = core.submit(task(range(8), n_predict=400, n_cmpl=2), 0.0)
    run(core, FakeBackend())
    assert p.error and "shared prompt" in p.error.message and p.error.http_status == 500


# --- front-end hooks for slot actions -----------------------------------------------------------------
def test_take_pending_ops_hands_over_ops_decided_between_steps():
    core = make_core(n_ctx=2048, n_parallel=2)
    be = FakeBackend()
    parent = core.submit(task(range(10), n_predict=50, n_cmpl=2), 0.0)
    _, now = step(core, be, 0.0)
    child_slot = parent.children[0].slot_id
    core.cancel(parent, now)                        # a released child slot keeps no context: seq_rm queued
    ops = core.take_pending_ops()
    assert KVOp("seq_rm", seq=child_slot, p0=-1, p1=-1) in ops
    assert core.take_pending_ops() == []
    core.submit(task(range(30, 40), n_predict=1), now)
    plan = core.schedule(now)
    assert KVOp("seq_rm", seq=child_slot, p0=-1, p1=-1) not in plan.program


def test_take_pending_ops_refused_between_schedule_and_commit():
    import pytest
    core = make_core(n_ctx=2048, n_parallel=1)
    core.submit(task(range(10), n_predict=5), 0.0)
    core.schedule(0.0)
    with pytest.raises(RuntimeError):
        core.take_pending_ops()


def test_set_slot_tokens_declares_restored_kv_and_is_reused():
    core = make_core(n_ctx=2048, n_parallel=1)
    be = FakeBackend()
    core.set_slot_tokens(0, list(range(100)))
    be.cells[0] = 100
    t = core.submit(task(list(range(100)) + [7], n_predict=1), 0.0)
    run(core, be)
    assert t.n_prompt_cached == 100


def test_set_slot_tokens_refuses_a_busy_slot():
    import pytest
    core = make_core(n_ctx=2048, n_parallel=1)
    core.submit(task(range(10), n_predict=5), 0.0)
    step(core, FakeBackend(), 0.0)
    with pytest.raises(RuntimeError, match="processing"):
        core.set_slot_tokens(0, [])
