"""Eviction policies of the study: SLRU, CLOCK and the Belady oracle; FIFO and LRU (and every policy whose
order moves only on hits) evict alike when hits move the entry out, as upstream's `server_prompt_cache::load`
(tools/server/server-task.cpp) does.
"""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import PolicyNames, Recorder, ServerConfig
from engine.core.prompt_cache import PromptCache
from policies import EVICTIONS, _make
from sim.future import FutureRequests

# The textbook page-reference string (Silberschatz et al., "Operating System Concepts", 3 frames):
# FIFO 15 faults, LRU 12, OPT 9.
REFERENCES = [7, 0, 1, 2, 0, 3, 0, 4, 2, 3, 0, 3, 2, 1, 2, 0, 1, 7, 0, 1]


def page(p):
    return [p + 1] * 10          # distinct first tokens: pages share no prefix


def misses(policy_name, refs, frames=3):
    """Replay references at t = 0, 1, 2, ... through a cache of `frames` equal entries with copy hits: a
    reference loads its page, or on a miss saves it (making room by the policy)."""
    now = [0]
    policy = _make("eviction", policy_name)
    if hasattr(policy, "bind_future"):
        policy.bind_future(FutureRequests([(float(t), t, page(p)) for t, p in enumerate(refs)],
                                          lambda: now[0] * 1_000_000_000, by_time=True))
    drops = []
    c = PromptCache(100 * frames, 0, policy, "copy", Recorder(), drops.append)
    n_miss = 0
    for t, p in enumerate(refs):
        now[0] = t
        if c.load([], page(p), float(t)) is None:
            n_miss += 1
            assert c.alloc(page(p), 100, float(t)) is not None
    return n_miss, drops


def test_textbook_reference_string_fifo_lru_and_opt():
    assert misses("fifo", REFERENCES)[0] == 15
    assert misses("lru", REFERENCES)[0] == 12
    assert misses("belady", REFERENCES)[0] == 9


def test_belady_evicts_the_entry_used_furthest_ahead_and_never_used_first():
    # A B C cached; D needs room at t=3; the future is A (t=4), B (t=5), C never: C goes.
    n, drops = misses("belady", [0, 1, 2, 3, 0, 1])
    assert n == 4 and drops == [2]            # entry ids are 0, 1, 2, 3 in insertion order
    # A B C cached; D at t=3; future C (4), A (5), B (6): B (furthest) goes, then nothing else misses
    n, drops = misses("belady", [0, 1, 2, 3, 2, 0, 1])
    assert drops[0] == 1 and n == 5


def test_belady_next_use_counts_only_requests_reusing_the_share_of_the_entry():
    now = [0]
    fut = FutureRequests([(1.0, 1, [5] * 3 + [6] * 7), (2.0, 2, [5] * 10)], lambda: now[0], by_time=True)

    class E:
        id, tokens = 0, [5] * 10

    assert fut.next_use(E, 0.25) == 1.0      # request 1 shares 3 of 10 tokens >= 25%
    assert fut.next_use(E, 0.9) == 2.0       # only request 2 reuses >= 90%
    now[0] = 2_000_000_000                   # both submitted
    assert fut.next_use(E, 0.25) == math.inf


def test_unbound_belady_says_it_needs_the_simulator():
    c = PromptCache(200, 0, EVICTIONS["belady"](), "move", Recorder(), lambda i: None)
    c.alloc(page(0), 100, 0.0)
    c.alloc(page(1), 100, 1.0)
    try:
        c.alloc(page(2), 100, 2.0)
    except RuntimeError as e:
        assert "needs the future requests" in str(e)
    else:
        raise AssertionError("expected RuntimeError")


def test_slru_keeps_entries_hit_once_over_a_scan():
    c = PromptCache(300, 0, EVICTIONS["slru"](), "copy", Recorder(), lambda i: None)
    a = c.alloc(page(0), 100, 0.0)
    c.alloc(page(1), 100, 1.0)
    c.load([], page(0), 2.0)                  # A promoted to protected
    for k, p in enumerate(range(2, 6)):       # a scan of one-off prompts
        c.alloc(page(p), 100, 3.0 + k)
    assert a.id in c.entries


def test_clock_gives_a_referenced_entry_a_second_chance():
    drops = []
    c = PromptCache(300, 0, EVICTIONS["clock"](), "copy", Recorder(), drops.append)
    a = c.alloc(page(0), 100, 0.0)
    b = c.alloc(page(1), 100, 1.0)
    cc = c.alloc(page(2), 100, 2.0)
    c.load([], page(0), 3.0)                  # A referenced
    c.alloc(page(3), 100, 4.0)                # hand passes A (clearing its bit), evicts B
    assert drops == [b.id] and a.id in c.entries
    c.alloc(page(4), 100, 5.0)                # the hand moved on to C; A is behind it again
    assert drops == [b.id, cc.id] and a.id in c.entries


# --- FIFO == LRU (== SLRU == CLOCK == LFU) under move --------------------------------------------------

_tok = st.integers(0, 3)
_prompt = st.lists(_tok, min_size=1, max_size=12)
_op = st.one_of(
    st.tuples(st.just("alloc"), _prompt, st.integers(1, 120)),
    st.tuples(st.just("load"), st.lists(_tok, max_size=12), _prompt),
    st.tuples(st.just("update"), st.just(None), st.just(None)),
)


def _replay(policy: str, ops, limit_bytes: int, limit_tokens: int):
    rec = Recorder()
    drops: list[int] = []
    c = PromptCache(limit_bytes, limit_tokens, EVICTIONS[policy](), "move", rec, drops.append)
    for t, (kind, a, b) in enumerate(ops):
        if kind == "alloc":
            c.alloc(a, b, float(t))
        elif kind == "load":
            c.load(a, b, float(t))
        else:
            c.update(float(t))
    return rec.events, drops, sorted(c.entries)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_op, max_size=60), limit_bytes=st.integers(0, 400), limit_tokens=st.integers(0, 40))
def test_fifo_and_lru_evict_alike_under_move(ops, limit_bytes, limit_tokens):
    fifo = _replay("fifo", ops, limit_bytes, limit_tokens)
    for other in ("lru", "slru", "clock", "lfu"):
        assert _replay(other, ops, limit_bytes, limit_tokens) == fifo, other


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), cram=st.sampled_from([16, 48, 128]))
def test_fifo_and_lru_give_identical_simulations_under_move(seed, cram):
    from sim.driver import Simulation
    from sim.latency_spec import get_latency_model
    from traces import chat_sessions

    wl = chat_sessions(n_users=10, turns_per_user=(2, 4), think_time_s=5.0, system_prompt_pool=3,
                       system_prompt_len=(100, 400), user_tokens=(10, 60), output_tokens=(4, 16),
                       start_spread_s=10.0, seed=seed)
    rows = {}
    for pol in ("fifo", "lru"):
        cfg = ServerConfig(n_ctx_train=8192, cache_ram_mib=cram, cache_hit="move",
                           policies=PolicyNames(eviction=pol))
        rows[pol] = Simulation(cfg, get_latency_model("constant:0.01"), seed=seed).run(wl).requests
    assert rows["fifo"] == rows["lru"]
