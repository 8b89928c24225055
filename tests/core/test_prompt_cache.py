"""Host-RAM prompt cache: alloc / load / update, idle-slot caching, eviction policies.

Upstream: `server_prompt_cache::alloc`, `load` and `update` (tools/server/server-task.cpp); idle slots saved
(and cleared with unified KV) after each launch in `process_single_task` (tools/server/server-context.cpp).
"""

import pytest

from engine.core import PolicyNames, Recorder
from engine.core.prompt_cache import PromptCache
from engine.core.types import KVOp
from policies import EVICTIONS
from tests.core.fakes import FakeBackend, make_core, run, task


def cache(limit_bytes=0, limit_tokens=0, policy="fifo", hit="move"):
    drops = []
    c = PromptCache(limit_bytes, limit_tokens, EVICTIONS[policy](), hit, Recorder(), drops.append)
    return c, drops


# --- alloc --------------------------------------------------------------------------------------------
def test_alloc_skips_prompt_already_contained_in_an_entry():
    c, _ = cache()
    c.alloc(list(range(100)), 100, 0.0)
    assert c.alloc(list(range(60)), 60, 1.0) is None
    assert len(c) == 1


def test_alloc_skips_entry_larger_than_byte_limit():
    c, _ = cache(limit_bytes=50)
    assert c.alloc(list(range(100)), 100, 0.0) is None


def test_alloc_drops_cached_prefixes_of_the_new_prompt():
    c, drops = cache()
    e1 = c.alloc(list(range(40)), 40, 0.0)
    c.alloc(list(range(100)), 100, 1.0)
    assert e1.id not in c.entries and drops == [e1.id]


def test_alloc_makes_room_by_evicting_oldest_first():
    c, drops = cache(limit_bytes=250)
    a = c.alloc([1] * 100, 100, 0.0)
    b = c.alloc([2] * 100, 100, 1.0)
    c.alloc([3] * 100, 100, 2.0)
    assert drops == [a.id] and b.id in c.entries and c.size_bytes() == 200


# --- load ---------------------------------------------------------------------------------------------
def test_worked_example_entry_chosen_with_fkeep_and_fsim():
    """7168-token cached entry; 8192-token request sharing 6144 -> f_keep 0.857, f_sim 0.75."""
    rec = Recorder()
    c = PromptCache(0, 0, EVICTIONS["fifo"](), "move", rec, lambda i: None)
    shared = list(range(6144))
    c.alloc(shared + [7] * 1024, 7168, 0.0)
    new = shared + [9] * 2048
    e = c.load([], new, 1.0)
    assert e is not None
    (hit,) = rec.of_kind("cache_hit")
    assert hit[2]["f_keep"] == pytest.approx(6144 / 7168, abs=1e-3) == pytest.approx(0.857, abs=1e-3)
    assert hit[2]["f_sim"] == pytest.approx(0.75)


def test_worked_example_through_the_core_gives_n_past_6144():
    """The same worked example through ServerCore: the idle slot's 7168 tokens are saved, then loaded for the
    8192-token request, which starts at n_past 6144."""
    rec = Recorder()
    core = make_core(rec, n_ctx=16384, cache_ram_mib=-1)    # auto: 4 unified slots, idle slots cached+cleared
    be = FakeBackend()
    shared = list(range(6144))
    a = core.submit(task(shared + [7] * 1024, n_predict=1), 0.0)
    run(core, be)
    assert a.n_tokens_cached == 7168
    core.submit(task(range(20000, 20100), n_predict=1), 1.0)  # its launch saves and clears the idle slot
    run(core, be, 1.0)
    t = core.submit(task(shared + [9] * 2048, n_predict=1), 2.0)
    run(core, be, 2.0)
    hit = [e for e in rec.of_kind("cache_hit") if e[2]["n_tokens"] == 7168][-1][2]
    assert (round(hit["f_keep"], 3), hit["f_sim"]) == (0.857, 0.75)
    assert t.n_prompt_cached == 6144


def test_load_ignores_entries_keeping_under_a_quarter():
    c, _ = cache()
    c.alloc(list(range(100)), 100, 0.0)
    assert c.load([], list(range(20)) + [5] * 10, 1.0) is None     # f_keep 0.2


def test_load_requires_both_fkeep_and_fsim_strictly_better_than_slot():
    c, _ = cache()
    c.alloc(list(range(50)) + [1] * 50, 100, 0.0)
    slot = list(range(60))
    assert c.load(slot, list(range(60)) + [3], 1.0) is None          # slot covers more


def test_move_hit_takes_entry_out_of_cache():
    c, _ = cache(hit="move")
    c.alloc(list(range(100)), 100, 0.0)
    assert c.load([], list(range(100)) + [1], 1.0) is not None
    assert len(c) == 0


def test_copy_hit_keeps_entry_and_refreshes_recency():
    c, _ = cache(hit="copy", policy="lru")
    e = c.alloc(list(range(100)), 100, 0.0)
    c.load([], list(range(100)) + [1], 5.0)
    assert e.id in c.entries and e.t_used_s == 5.0 and e.n_hits == 1


# --- update -------------------------------------------------------------------------------------------
def test_update_token_limit_is_total_context_without_byte_limit():
    c, drops = cache(limit_bytes=0, limit_tokens=256)
    c.alloc([1] * 200, 200, 0.0)
    c.alloc([2] * 100, 100, 1.0)
    c.update(2.0)
    assert c.n_tokens() == 100 and len(drops) == 1


def test_update_raises_token_limit_to_bytes_per_token():
    c, drops = cache(limit_bytes=10_000, limit_tokens=256)
    c.alloc([1] * 200, 2000, 0.0)
    c.alloc([2] * 200, 2000, 1.0)
    c.update(2.0)                      # 400 tokens > 256, but 10000 B / 10 B per token = 1000 allowed
    assert len(c) == 2 and not drops


# --- eviction policies ----------------------------------------------------------------------------------
def _fill_and_hit(policy, hit):
    c, drops = cache(limit_bytes=300, policy=policy, hit=hit)
    a = c.alloc([1] * 100, 100, 0.0)
    b = c.alloc([2] * 100, 100, 1.0)
    c.alloc([3] * 100, 100, 2.0)
    c.load([], [1] * 100 + [0], 3.0)   # hit a
    c.alloc([4] * 100, 100, 4.0)       # needs room
    return a, b, c, drops


def test_fifo_and_lru_evict_alike_under_move_hits():
    for policy in ("fifo", "lru"):
        a, b, c, drops = _fill_and_hit(policy, "move")
        assert a.id not in c.entries and b.id in c.entries and drops == []   # a left by the hit, no eviction


def test_fifo_and_lru_differ_under_copy_hits():
    a, b, c, drops = _fill_and_hit("fifo", "copy")
    assert drops == [a.id]             # FIFO evicts the oldest even though it was just hit
    a, b, c, drops = _fill_and_hit("lru", "copy")
    assert drops == [b.id]             # LRU keeps the recently hit entry


def test_lfu_evicts_least_hit_entry():
    a, b, c, drops = _fill_and_hit("lfu", "copy")
    assert drops == [b.id]


def test_gdsf_prefers_keeping_long_prompts_of_equal_size_per_token():
    c, drops = cache(limit_bytes=3000, policy="gdsf", hit="copy")
    short = [c.alloc([i] * 100, 100 * 10, float(i)) for i in range(1, 3)]
    long_ = c.alloc([9] * 100 + list(range(10)), 110 * 10, 5.0)
    c.alloc([7] * 50, 50 * 10, 6.0)
    assert long_.id in c.entries and drops and drops[0] in {e.id for e in short}


# --- through the core --------------------------------------------------------------------------------
def test_lru_slot_pick_saves_old_prompt_and_restores_matching_entry():
    rec = Recorder()
    core = make_core(rec, n_ctx=4096, n_parallel=1)
    be = FakeBackend()
    a = list(range(100, 400))
    b = list(range(500, 800))
    for p in (a, b):
        core.submit(task(p, n_predict=2), 0.0)
        run(core, be)
    t = core.submit(task(a + [1, 2, 3], n_predict=1), 5.0)
    plan = core.schedule(5.0)
    kinds = [p.kind for p in plan.program if isinstance(p, KVOp)]
    assert kinds[:2] == ["cache_save", "cache_load"]
    run_rest = be.execute(plan)
    core.commit(plan, run_rest, 6.0)
    assert t.n_prompt_cached == 300   # the saved entry is a + 1 generated token; the new prompt shares a


def test_cache_idle_slots_saves_idle_slots_after_launch():
    core = make_core(n_ctx=4096, n_parallel=2)
    be = FakeBackend()
    core.submit(task(range(100), n_predict=1), 0.0)
    run(core, be)
    core.submit(task(range(1000, 1100), n_predict=1), 1.0)
    plan = core.schedule(1.0)
    assert any(isinstance(p, KVOp) and p.kind == "cache_save" for p in plan.program)
    assert len(core.cache) == 1


def test_cache_idle_slots_clears_idle_slots_when_unified():
    core = make_core(n_ctx=4096)   # auto: 4 slots, unified
    be = FakeBackend()
    core.submit(task(range(100), n_predict=1), 0.0)
    run(core, be)
    core.submit(task(range(1000, 1100), n_predict=1), 1.0)
    core.schedule(1.0)
    idle = [s for s in core.slots if not s.is_processing]
    assert all(not s.tokens for s in idle) and len(core.cache) == 1


def test_cleared_slot_recovers_prompt_from_ram():
    core = make_core(n_ctx=4096)   # unified: idle slots are cleared after each launch
    be = FakeBackend()
    a = list(range(100, 400))
    core.submit(task(a, n_predict=1), 0.0)
    run(core, be)
    core.submit(task(range(1000, 1100), n_predict=1), 1.0)
    run(core, be, 1.0)
    t = core.submit(task(a + [5], n_predict=1), 2.0)
    run(core, be, 2.0)
    assert t.n_prompt_cached == 300


def test_cache_disabled_with_zero_cache_ram():
    core = make_core(n_ctx=4096, n_parallel=1, cache_ram_mib=0)
    assert core.cache is None
    core.submit(task(range(100), n_predict=1), 0.0)
    core.submit(task(range(200, 300), n_predict=1), 0.0)
    run(core, FakeBackend())


def test_eviction_policy_is_chosen_by_name():
    core = make_core(n_ctx=4096, policies=PolicyNames(eviction="lru"), cache_hit="copy")
    assert type(core.cache.policy).__name__ == "Lru" and core.cache.hit_mode == "copy"


def test_largest_first_evicts_biggest_entry():
    c, drops = cache(limit_bytes=300, policy="largest")
    big = c.alloc([1] * 150, 150, 0.0)
    c.alloc([2] * 100, 100, 1.0)
    c.alloc([3] * 100, 100, 2.0)
    assert drops == [big.id]


def test_entry_size_is_llama_cpp_sequence_state_size():
    """n * (23040 + 12) + 740 + 4 * n_stream: 5,832,900 bytes for 253 tokens with -kvu (llama-server's log)."""
    core = make_core(n_ctx=4096, kv_unified=True, n_parallel=4)
    assert core.cfg.state_size_bytes(253) == 5_832_900
    split = make_core(n_ctx=4096, n_parallel=2)
    assert split.cfg.state_size_bytes(253) == 5_832_900 + 4


def test_entry_just_over_the_byte_limit_is_skipped():
    # 182 tokens with 4 MiB: 182 * 23052 + 744 = 4,196,208 > 4,194,304 -> upstream skips it
    rec = Recorder()
    core = make_core(rec, n_ctx=1024, n_parallel=1, cache_ram_mib=4)
    be = FakeBackend()
    core.submit(task(range(100, 277), n_predict=6), 0.0)      # 177 + 6 - 1 = 182 tokens cached
    run(core, be)
    core.submit(task(range(1000, 1020), n_predict=1), 1.0)
    run(core, be, 1.0)
    assert [e[2]["reason"] for e in rec.of_kind("cache_skip")] == ["exceeds_limit"]
    assert len(core.cache) == 0


def test_unified_restore_without_free_cells_fails_and_keeps_the_entry():
    """np2 -c 512 -kvu: slot 1 holds 260 tokens, user A's 253-token entry cannot be restored into slot 0."""
    rec = Recorder()
    core = make_core(rec, n_ctx=512, n_parallel=2, kv_unified=True)
    be = FakeBackend()
    a = list(range(1000, 1248))                               # 248 + 6 - 1 = 253 cached tokens
    core.submit(task(a, n_predict=6), 0.0)                     # slot 1
    run(core, be)
    core.submit(task(range(5000, 5255), n_predict=6), 1.0)    # slot 0; A's slot saved + cleared after launch
    run(core, be, 1.0)
    assert len(core.cache) >= 1
    core.submit(task(range(7000, 7100), n_predict=1), 2.0)    # fills slot 1 again (260 cells in use)
    run(core, be, 2.0)
    core.slots[1].tokens = list(range(9000, 9260))
    be.cells[1] = 260
    t = core.submit(task(a + [11] * 22, n_predict=1, id_slot=0), 3.0)
    run(core, be, 3.0)
    assert rec.of_kind("cache_load_failed")
    assert t.n_prompt_cached == 0 and t.n_prompt_processed == 270
    assert any(len(e.tokens) == 253 for e in core.cache.entries.values())   # the entry stays
