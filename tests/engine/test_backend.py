"""NumpyBackend: the serving core driven on the real numpy forward pass (tiny random-weight GGUF)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backend import NumpyBackend
from engine.core import ServerConfig, ServerCore, Task, step
from engine.core.types import BatchPlan, Chunk, ForwardCall, KVOp
from engine.model.sampling import SamplingParams
from policies import make_policies

GREEDY = SamplingParams(temperature=0.0, seed=1)


def make_server(model, **cfg) -> tuple[ServerCore, NumpyBackend]:
    config = ServerConfig(**{"n_parallel": 2, "n_ctx": 512, **model.config_facts(), **cfg})
    core = ServerCore(config, make_policies(config.policies))
    backend = NumpyBackend(model, core.cfg.n_slots, core.cfg.n_ctx_slot)
    return core, backend


def drive(core: ServerCore, backend: NumpyBackend, max_steps: int = 5000) -> None:
    now = 0.0
    for _ in range(max_steps):
        if not core.has_work():
            return
        now = step(core, backend, now, lambda r, t=now: t + max(r.elapsed_s, 1e-6)).t_end_s
    raise AssertionError("core did not finish")


def greedy_by_hand(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    out = []
    for _ in range(n):
        tok = int(np.argmax(model.forward_logits(ids)[-1]))
        out.append(tok)
        ids.append(tok)
    return out


def test_greedy_generation_through_the_core_equals_the_model_greedy_continuation(tiny_model):
    model = tiny_model()
    core, backend = make_server(model)
    prompt = model.tokenize("Hello the world is")
    task = core.submit(Task(id=-1, tokens=prompt, n_predict=8, ignore_eos=True, sampling=GREEDY), 0.0)
    drive(core, backend)
    assert task.error is None
    assert task.generated == greedy_by_hand(model, prompt, 8)
    assert task.n_tokens_cached == len(prompt) + 8 - 1


def test_concurrent_requests_in_one_batch_match_their_solo_continuations(tiny_model):
    model = tiny_model()
    core, backend = make_server(model, n_parallel=3)
    prompts = [model.tokenize(t) for t in ("Hello", "the cat is on", "in and of the")]
    tasks = [core.submit(Task(id=-1, tokens=p, n_predict=5, ignore_eos=True, sampling=GREEDY), 0.0) for p in prompts]
    drive(core, backend)
    for p, t in zip(prompts, tasks):
        assert t.generated == greedy_by_hand(model, p, 5)


def test_prefix_reuse_gives_the_same_tokens_as_a_fresh_slot(tiny_model):
    model = tiny_model()
    core, backend = make_server(model, n_parallel=1)
    p1 = model.tokenize("Hello the world is in the")
    p2 = p1[:4] + model.tokenize(" and of it")
    core.submit(Task(id=-1, tokens=p1, n_predict=3, ignore_eos=True, sampling=GREEDY), 0.0)
    drive(core, backend)
    t2 = core.submit(Task(id=-1, tokens=p2, n_predict=4, ignore_eos=True, sampling=GREEDY), 1.0)
    drive(core, backend)
    assert t2.n_prompt_cached == 4
    assert t2.generated == greedy_by_hand(model, p2, 4)


def test_cache_save_then_load_round_trip_gives_identical_next_token_logits(tiny_model):
    model = tiny_model()
    backend = NumpyBackend(model, 2, 256)
    ids = model.tokenize("Hello the world is in")
    [_] = model.forward_batch(backend.kv, [(0, ids, 0, True)])
    nxt = model.tokenize(" and")
    backend.apply(KVOp("cache_save", seq=0, entry=7, n_tokens=len(ids)))
    [before] = model.forward_batch(backend.kv, [(0, nxt, len(ids), True)])
    backend.apply(KVOp("seq_rm", seq=0, p0=-1, p1=-1))
    backend.apply(KVOp("cache_load", seq=1, entry=7, keep=False))
    assert 7 not in backend.cache                      # keep=False frees the host copy (upstream "move")
    [after] = model.forward_batch(backend.kv, [(1, nxt, len(ids), True)])
    np.testing.assert_array_equal(before, after)


def test_cache_load_with_keep_leaves_the_entry_and_cache_drop_frees_it(tiny_model):
    model = tiny_model()
    backend = NumpyBackend(model, 2, 64)
    model.forward_batch(backend.kv, [(0, model.tokenize("Hello"), 0, False)])
    backend.apply(KVOp("cache_save", seq=0, entry=1, n_tokens=backend.kv.n_tokens(0)))
    backend.apply(KVOp("cache_load", seq=1, entry=1, keep=True))
    assert backend.kv.n_tokens(1) == backend.kv.n_tokens(0) and 1 in backend.cache
    backend.apply(KVOp("cache_drop", entry=1))
    assert backend.cache == {}


def test_prompt_cache_restores_an_evicted_prompt_with_the_same_continuation(tiny_model):
    model = tiny_model()
    core, backend = make_server(model, n_parallel=1, slot_prompt_similarity=0.5)
    pa = model.tokenize("Hello the world is in the and of")
    pb = model.tokenize("in it on is the cat")
    for i, p in enumerate((pa, pb)):
        core.submit(Task(id=-1, tokens=p, n_predict=2, ignore_eos=True, sampling=GREEDY), float(i))
        drive(core, backend)
    again = core.submit(Task(id=-1, tokens=pa + model.tokenize(" and"), n_predict=3, ignore_eos=True,
                             sampling=GREEDY), 5.0)
    drive(core, backend)
    assert again.n_prompt_cached >= len(pa)          # came back from the host-RAM cache
    assert again.generated == greedy_by_hand(model, again.tokens, 3)


def test_context_shift_keeps_generating_sane_tokens(tiny_model):
    model = tiny_model()
    core, backend = make_server(model, n_parallel=1, n_ctx=256, ctx_shift=True, n_keep=4)
    prompt = model.tokenize("Hello the world is")
    task = core.submit(Task(id=-1, tokens=prompt, n_predict=400, ignore_eos=True, sampling=GREEDY), 0.0)
    drive(core, backend)
    assert task.error is None and task.truncated
    assert len(task.generated) == 400
    assert all(0 <= t < model.hparams.n_vocab for t in task.generated)
    assert core.metrics.n_context_shifts >= 1
    # the KV holds exactly what the slot says it holds, at consecutive positions after the shifts
    slot = core.slots[task.slot_id]
    n = backend.kv.n_tokens(slot.id)
    assert n == len(slot.tokens)
    np.testing.assert_array_equal(backend.kv.positions(slot.id), np.arange(n))
    # the shifted cache still yields finite logits (K re-rotated, not garbage); a fresh evaluation of the kept
    # tokens would differ, since their cells were computed while the discarded tokens were visible
    [row] = model.forward_batch(backend.kv, [(slot.id, [slot.sampled], n, True)])
    assert np.all(np.isfinite(row))


def test_children_of_an_n_cmpl_task_get_seed_plus_index_plus_one(tiny_model):
    model = tiny_model()
    core, backend = make_server(model, n_parallel=3)
    params = SamplingParams(seed=42, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0)
    prompt = model.tokenize("Hello")
    parent = core.submit(Task(id=-1, tokens=prompt, n_predict=6, ignore_eos=True, n_cmpl=3, sampling=params), 0.0)
    drive(core, backend)
    seeds = [backend._sampler(t).params.seed for t in (parent, *parent.children)]
    assert seeds == [42, 43, 44]


def test_probabilities_are_reported_when_n_probs_is_positive(tiny_model):
    model = tiny_model()
    core, backend = make_server(model)
    params = SamplingParams(temperature=0.0, n_probs=3)
    task = core.submit(Task(id=-1, tokens=model.tokenize("Hello"), n_predict=1, sampling=params), 0.0)
    results = []
    now = 0.0
    while core.has_work():
        st = step(core, backend, now, lambda r, t=now: t + 1e-3)
        results.append(st.result)
        now = st.t_end_s
    [res] = [r for r in results if r.sampled]
    got = res.extra[task.slot_id]
    assert got.token == task.generated[0] and len(got.probs) == 3


def test_elapsed_time_is_measured_and_an_empty_plan_costs_nothing_to_sample(tiny_model):
    model = tiny_model()
    backend = NumpyBackend(model, 1, 64)
    res = backend.execute(BatchPlan(0.0, (ForwardCall((), 0),), 0, 0, {}))
    assert res.sampled == {} and res.elapsed_s >= 0.0


def test_model_reports_the_facts_the_server_config_needs(tiny_model):
    model = tiny_model()
    backend = NumpyBackend(model, 1, 64)
    facts = model.config_facts()
    assert facts["n_ctx_train"] == 512
    hp = model.hparams
    # prompt-cache entries are sized as llama.cpp's f16 sequence state, not this engine's f32 store
    assert facts["kv_bytes_per_token"] == hp.n_layer * 2 * hp.n_head_kv * hp.head_dim * 2 + 12
    assert facts["kv_state_header_bytes"] == 20 + 24 * hp.n_layer
    assert 2 in facts["eog_ids"] and facts["add_bos_token"] is False
    assert backend.n_threads >= 0


@pytest.mark.realmodel
def test_real_model_greedy_serving_matches_forward_logits(smollm2):
    core, backend = make_server(smollm2, n_parallel=2, n_ctx=512)
    prompt = smollm2.tokenize("The capital of France is")
    task = core.submit(Task(id=-1, tokens=prompt, n_predict=4, ignore_eos=True, sampling=GREEDY), 0.0)
    drive(core, backend)
    assert task.generated == greedy_by_hand(smollm2, prompt, 4)


def test_each_step_tells_its_observer_the_page_faults_it_took(tiny_model, monkeypatch):
    import engine.backend as eb

    model = tiny_model()
    backend = NumpyBackend(model, 1, 64)
    seen = []
    backend.on_step = lambda plan, elapsed_s, minor_faults: seen.append((plan, elapsed_s, minor_faults))
    task = Task(id=0, tokens=[1, 2, 3])
    prompt = BatchPlan(0.0, (ForwardCall((Chunk(0, 0, [1, 2, 3], 0, (0,), True),), 3),), 3, 0, {0: task})
    res = backend.execute(prompt)
    (got,) = seen
    assert got[0] is prompt and got[1] == res.elapsed_s                   # the plan and the time it took
    assert isinstance(got[2], int) and got[2] >= 0
    readings = iter([1000, 1017])                                  # the process's counter before and after the step
    monkeypatch.setattr(eb, "minor_faults", lambda: next(readings))
    backend.kv.seq_rm(0, -1, -1)
    backend.execute(prompt)
    assert seen[-1][2] == 17
    monkeypatch.setattr(eb, "minor_faults", lambda: None)          # a platform without getrusage
    backend.kv.seq_rm(0, -1, -1)
    backend.execute(prompt)
    assert seen[-1][2] is None and len(seen) == 3
