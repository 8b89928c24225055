"""ServerConfig: llama-server's defaults and start-up resolution.

Upstream: defaults in `common_params` (common/common.h) with `-np` auto (-1) for the server
(`common_params_parser_init`, common/arg.cpp); auto resolved to 4 slots + unified KV at start-up
(tools/server/server.cpp); n_ctx padding and per-slot context in the `llama_context` constructor
(src/llama-context.cpp); the rest in `server_context_impl::load_model` and `init`
(tools/server/server-context.cpp).
"""

import pytest

from engine.core import ConfigError, ServerConfig


def test_defaults_are_upstream():
    c = ServerConfig()
    assert (c.n_parallel, c.n_batch, c.n_ubatch, c.cache_ram_mib) == (-1, 2048, 512, 8192)
    assert c.slot_prompt_similarity == pytest.approx(0.10)
    assert (c.n_cache_reuse, c.cache_prompt, c.cont_batching, c.ctx_shift) == (0, True, True, False)
    assert (c.n_keep, c.cache_idle_slots, c.n_predict) == (0, True, -1)
    assert c.policies.eviction == "fifo" and c.cache_hit == "move"


def test_auto_parallel_means_four_slots_with_unified_kv():
    r = ServerConfig(n_ctx=4096).resolve()
    assert r.n_slots == 4 and r.kv_unified
    assert r.n_ctx_slot == 4096 == r.n_ctx


def test_explicit_parallel_keeps_kv_split_and_pads_per_slot_context():
    r = ServerConfig(n_parallel=3, n_ctx=1000).resolve()
    assert not r.kv_unified
    assert r.n_ctx_slot == 512              # pad256(pad256(1000) // 3) = pad256(341)
    assert r.n_ctx == 512 * 3


def test_explicit_parallel_with_kv_unified_shares_all_cells():
    r = ServerConfig(n_parallel=2, n_ctx=1000, kv_unified=True).resolve()
    assert r.kv_unified and r.n_ctx == 1024 == r.n_ctx_slot


def test_ctx_zero_uses_model_training_context():
    assert ServerConfig(n_ctx=0, n_ctx_train=8192, n_parallel=1).resolve().n_ctx_slot == 8192
    with pytest.raises(ConfigError, match="n_ctx_train is unknown"):
        ServerConfig(n_ctx=0).resolve()


def test_slot_context_capped_at_training_context():
    assert ServerConfig(n_ctx=8192, n_ctx_train=2048, n_parallel=1).resolve().n_ctx_slot == 2048


def test_effective_batch_sizes():
    r = ServerConfig(n_ctx=256, n_parallel=1).resolve()
    assert r.n_batch == 256 and r.n_ubatch == 256


def test_cache_idle_slots_disabled_without_cache_ram():
    r = ServerConfig(n_ctx=512, cache_ram_mib=0).resolve()
    assert not r.base.cache_idle_slots and not r.cache_enabled


def test_cache_ram_minus_one_means_no_byte_limit():
    r = ServerConfig(n_ctx=512, cache_ram_mib=-1).resolve()
    assert r.cache_enabled and r.cache_limit_bytes == 0


def test_memory_that_cannot_shift_disables_cache_reuse_and_shift():
    r = ServerConfig(n_ctx=512, n_cache_reuse=8, ctx_shift=True, can_shift=False).resolve()
    assert r.base.n_cache_reuse == 0 and not r.base.ctx_shift


@pytest.mark.parametrize("kw, field", [
    ({"n_parallel": 0}, "n_parallel"), ({"n_parallel": -2}, "n_parallel"), ({"n_batch": 0}, "n_batch"),
    ({"cache_ram_mib": -5}, "cache_ram_mib"), ({"slot_prompt_similarity": 1.5}, "slot_prompt_similarity"),
    ({"n_keep": -2}, "n_keep"), ({"n_predict": -3}, "n_predict"), ({"cache_hit": "steal"}, "cache_hit"),
    ({"n_cache_reuse": -1}, "n_cache_reuse"),
])
def test_invalid_values_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        ServerConfig(n_ctx=512, **kw).resolve()
