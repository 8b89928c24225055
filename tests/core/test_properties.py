"""Property tests over random request streams and configurations (hypothesis)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core import PolicyNames, Recorder, ServerConfig, ServerCore, Task, step
from engine.core.tokens import common_prefix
from policies import make_policies
from tests.core.fakes import FakeBackend

EOS = 3


def token_for(task, k):
    # deterministic per (prompt, k); EOS now and then
    h = (task.tokens[0] * 7919 + len(task.tokens) * 104729 + k * 15485863 + task.child_index) % 1009
    return EOS if h < 12 else 10 + h


configs = st.builds(
    ServerConfig,
    n_parallel=st.sampled_from([-1, 1, 2, 3]),
    n_ctx=st.sampled_from([256, 512, 1024]),
    kv_unified=st.sampled_from([None, True, False]),
    n_batch=st.sampled_from([16, 64, 2048]),
    cache_ram_mib=st.sampled_from([0, -1, 1]),
    kv_bytes_per_token=st.sampled_from([1024, 4096]),
    ctx_shift=st.booleans(),
    n_cache_reuse=st.sampled_from([0, 4]),
    slot_prompt_similarity=st.sampled_from([0.0, 0.1, 0.5]),
    cont_batching=st.booleans(),
    eog_ids=st.just(frozenset({EOS})),
    cache_hit=st.sampled_from(["move", "copy"]),
    policies=st.builds(PolicyNames,
                       slot_selection=st.sampled_from(["lcp_lru", "lru", "round_robin"]),
                       queue_order=st.sampled_from(["fifo", "shortest_prompt", "most_cached"]),
                       batch_building=st.sampled_from(["decode_first", "prefill_first", "token_budget:48"]),
                       eviction=st.sampled_from(["fifo", "lru", "lfu", "gdsf"])),
)

prefixes = [list(range(1000 + 100 * i, 1000 + 100 * i + 150)) for i in range(3)]
requests = st.lists(
    st.tuples(
        st.floats(0, 2.0),                              # arrival time
        st.integers(0, 2), st.integers(0, 200),         # shared prefix id, prefix length used
        st.integers(0, 120), st.integers(0, 99),        # own suffix length, suffix seed
        st.integers(0, 60),                             # n_predict
        st.sampled_from([-1, -1, -1, 0, 1]),            # id_slot
        st.sampled_from([1, 1, 1, 2]),                  # n_cmpl
        st.booleans(),                                  # ignore_eos
    ),
    min_size=1, max_size=12)


def simulate(cfg, reqs, token_arrays=False, be=None):
    resolved = cfg.resolve()
    rec = Recorder()
    core = ServerCore(resolved, make_policies(cfg.policies), rec, token_arrays=token_arrays)
    be = be if be is not None else FakeBackend(step_s=0.01, tokens_for=token_for)
    pending = sorted(enumerate(reqs), key=lambda x: (x[1][0], x[0]))
    tasks = []
    now = 0.0
    steps = 0
    while pending or core.has_work():
        while pending and pending[0][1][0] <= now:
            _, (t, pid, plen, slen, sseed, n_predict, id_slot, n_cmpl, ign) = pending.pop(0)
            toks = prefixes[pid][:plen] + [5000 + (sseed * 31 + j) % 997 for j in range(slen)]
            n_cmpl = min(n_cmpl, resolved.n_slots)
            tasks.append(core.submit(Task(id=-1, tokens=toks, n_predict=n_predict, id_slot=id_slot,
                                          n_cmpl=n_cmpl, ignore_eos=ign), now))
        if not core.has_work():
            now = pending[0][1][0]
            continue
        now = step(core, be, now, lambda r, t=now: t + (r.elapsed_s or 0.01)).t_end_s   # an empty plan: 10 ms
        check_invariants(core, resolved, be)
        steps += 1
        assert steps < 20000, "did not terminate"
    return core, rec, tasks


def check_invariants(core, r, be):
    for s in core.slots:
        assert len(s.tokens) <= r.n_ctx_slot
    if r.kv_unified:
        assert core.kv_cells_used() <= r.n_ctx
    c = core.cache
    if c is not None:
        if c.limit_bytes > 0:
            assert c.size_bytes() <= c.limit_bytes
        ents = list(c.entries.values())
        for a in ents:
            for b in ents:
                if a is not b:
                    assert common_prefix(a.tokens, b.tokens) < len(a.tokens), "an entry is a prefix of another"
        assert set(be.cache) == set(c.entries)        # backend holds exactly the core's entries


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, requests)
def test_random_streams_keep_invariants_and_every_request_ends(cfg, reqs):
    core, rec, tasks = simulate(cfg, reqs)
    all_tasks = [t for p in tasks for t in (p, *p.children)]
    assert all(t.done for t in all_tasks)
    assert not core.deferred and not core.queue
    for t in all_tasks:
        # no token lost or duplicated: exactly the backend's samples, in order
        assert t.generated == [token_for(t, k) for k in range(len(t.generated))]
        if t.error is None and t.tokens:
            assert t.stop_type in ("eos", "limit", "word")
            if t.stop_type == "limit" and not t.truncated:
                assert t.n_decoded == max(1, t.n_predict)
    m = core.metrics
    assert m.n_tokens_predicted_total == sum(t.n_decoded for t in all_tasks)


@settings(max_examples=30, deadline=None)
@given(configs, requests)
def test_same_inputs_give_same_decision_log(cfg, reqs):
    _, rec1, _ = simulate(cfg, reqs)
    _, rec2, _ = simulate(cfg, reqs)
    assert rec1.events == rec2.events


def _outcome(t):
    return (t.id, t.slot_id, list(t.tokens), list(t.generated), t.stop_type, t.truncated, t.n_prompt_cached,
            t.n_prompt_processed, t.n_tokens_cached, t.n_deferred, t.t_launch_s, t.t_start_s, t.t_prompt_last_s,
            t.t_end_s, None if t.error is None else t.error.message)


def _program(plan):
    return [(p.kind, *p[1:]) if hasattr(p, "kind") else
            [(c.seq, c.task_id, list(c.tokens), c.pos0, c.sample_for, c.is_prompt) for c in p.chunks]
            for p in plan.program]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, requests)
def test_token_arrays_decide_exactly_as_lists(cfg, reqs):
    """The core keeping its token sequences as array('i') (the simulator's choice) takes the same decisions,
    emits the same KV operations and forward calls, and leaves every task and slot as with lists."""
    be_l, be_a = (FakeBackend(step_s=0.01, tokens_for=token_for) for _ in range(2))
    core_l, rec_l, tasks_l = simulate(cfg, reqs, be=be_l)
    core_a, rec_a, tasks_a = simulate(cfg, reqs, token_arrays=True, be=be_a)
    assert rec_a.events == rec_l.events
    assert [_outcome(t) for p in tasks_a for t in (p, *p.children)] == \
        [_outcome(t) for p in tasks_l for t in (p, *p.children)]
    assert [list(s.tokens) for s in core_a.slots] == [list(s.tokens) for s in core_l.slots]
    assert all(type(s.tokens).__name__ == "array" for s in core_a.slots)
    assert [_program(p) for p in be_a.plans] == [_program(p) for p in be_l.plans]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs, requests)
def test_batch_census_bounds_give_the_full_counts(cfg, reqs):
    """The batch census's upper bound of every slot's tokens holds at the fit check and gives the answer the
    count over every slot gives; commit's n_tokens_max over the slots a one-call plan gave tokens (and those
    launched since) is, commit by commit, the maximum over every slot."""
    from unittest import mock

    from engine.core.kv_cells import KVCells

    fits_as_is, commit = KVCells.fits_as_is, ServerCore.commit
    bounded, forwarded = [], []

    def checked_fits(kv, n_bound=-1):
        if n_bound >= 0:
            assert n_bound >= max(len(s.tokens) for s in kv.slots)
            bounded.append(n_bound)
        got = fits_as_is(kv, n_bound)
        assert got == fits_as_is(kv)
        return got

    def runs(full):
        seen = []

        def recorded_commit(core, plan, result, now_s):
            if full:
                core._n_built_max = -1           # the count over every slot
            out = commit(core, plan, result, now_s)
            seen.append(core.metrics.n_tokens_max)
            forwarded.append(bool(plan.forwards))
            return out

        with mock.patch.object(KVCells, "fits_as_is", checked_fits), \
                mock.patch.object(ServerCore, "commit", recorded_commit):
            simulate(cfg, reqs)
        return seen

    assert runs(False) == runs(True)
    # per-slot KV and a forward call planned (a draw may have none: every prompt refused as longer than its slot,
    # or only empty prompts): the bound was used
    if not cfg.resolve().kv_unified and any(forwarded):
        assert bounded
