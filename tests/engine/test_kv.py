"""KV store: llama.cpp position semantics of seq_rm / seq_add / seq_cp / clear, state blobs, accounting."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from engine.model import KVCacheFull
from engine.model.kv import KV_STATE_MAGIC, KVStore

PROMPT = [5, 77, 12, 200, 3, 9, 150, 33, 281, 64, 7, 120]


def _filled(model, tokens=PROMPT, n_seq=2, n_ctx_seq=64, seq=0, **kw) -> KVStore:
    kv = model.new_kv(n_seq, n_ctx_seq, **kw)
    model.forward_batch(kv, [(seq, tokens, 0, False)])
    return kv


def _next_logits(model, kv, seq, token):
    return model.forward_batch(kv, [(seq, [token], kv.pos_max(seq) + 1, True)])[0][0]


def test_positions_are_consecutive_after_prefill(tiny_model):
    kv = _filled(tiny_model())
    assert kv.n_tokens(0) == 12 and kv.n_tokens(1) == 0
    assert (kv.pos_min(0), kv.pos_max(0), kv.pos_max(1)) == (0, 11, -1)
    np.testing.assert_array_equal(kv.positions(0), np.arange(12))


def test_seq_rm_to_the_end_truncates_and_decoding_continues_like_a_shorter_prompt(tiny_model):
    model = tiny_model()
    kv = _filled(model)
    kv.seq_rm(0, 5, -1)
    assert kv.n_tokens(0) == 5 and kv.pos_max(0) == 4
    np.testing.assert_allclose(_next_logits(model, kv, 0, 99), model.forward_logits(PROMPT[:5] + [99])[-1], atol=1e-5)


def test_seq_rm_in_the_middle_leaves_a_position_gap(tiny_model):
    kv = _filled(tiny_model())
    kv.seq_rm(0, 3, 6)
    np.testing.assert_array_equal(kv.positions(0), [0, 1, 2, 6, 7, 8, 9, 10, 11])


def test_seq_rm_negative_bounds_mean_the_whole_range(tiny_model):
    kv = _filled(tiny_model())
    kv.seq_rm(0, -1, 4)
    np.testing.assert_array_equal(kv.positions(0), np.arange(4, 12))
    kv.seq_rm(0, -1, -1)
    assert kv.n_tokens(0) == 0 and kv.pos_max(0) == -1


def test_seq_rm_with_negative_seq_clears_the_range_in_every_sequence(tiny_model):
    model = tiny_model()
    kv = _filled(model)
    model.forward_batch(kv, [(1, PROMPT[:6], 0, False)])
    kv.seq_rm(-1, 2, -1)
    assert (kv.n_tokens(0), kv.n_tokens(1)) == (2, 2)


def test_context_shift_then_attend_equals_fresh_prompt_at_the_new_positions(tiny_model):
    """llama-server's context shift: keep n_keep, drop n_discard, slide the rest down. With one layer the
    cached K/V of a token depend only on (token, position), so the shifted cache must equal a fresh
    prefill of the kept tokens at their new positions."""
    model = tiny_model(n_layer=1)
    n_keep, n_discard = 4, 4
    kv = _filled(model)
    kv.seq_rm(0, n_keep, n_keep + n_discard)
    kv.seq_add(0, n_keep + n_discard, -1, -n_discard)
    np.testing.assert_array_equal(kv.positions(0), np.arange(len(PROMPT) - n_discard))
    kept = PROMPT[:n_keep] + PROMPT[n_keep + n_discard:]
    got = _next_logits(model, kv, 0, 99)
    want = model.forward_logits(kept + [99])[-1]
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_seq_add_rerotates_cached_keys_by_the_delta(tiny_model):
    model = tiny_model(n_layer=1)
    shifted = _filled(model, tokens=PROMPT[:5])
    shifted.seq_add(0, -1, -1, 7)                     # positions 7..11
    np.testing.assert_array_equal(shifted.positions(0), np.arange(7, 12))
    padded = _filled(model, tokens=PROMPT[5:12] + PROMPT[:5])   # same tokens at 7..11 after 7 others
    got = shifted._seqs[0]
    want = padded._seqs[0]
    np.testing.assert_allclose(got.k[:, :, :5], want.k[:, :, 7:12], atol=1e-5)
    np.testing.assert_allclose(got.v[:, :, :5], want.v[:, :, 7:12], atol=1e-6)


def test_seq_add_moving_cells_below_zero_removes_them(tiny_model):
    kv = _filled(tiny_model())
    kv.seq_add(0, 0, 6, -3)
    np.testing.assert_array_equal(kv.positions(0), [0, 1, 2, 6, 7, 8, 9, 10, 11])


def test_seq_cp_copies_a_sequence_that_then_decodes_identically(tiny_model):
    model = tiny_model()
    kv = _filled(model, n_seq=3)
    kv.seq_cp(0, 2, -1, -1)
    assert kv.n_tokens(2) == 12
    np.testing.assert_allclose(_next_logits(model, kv, 2, 42), _next_logits(model, kv, 0, 42), atol=1e-6)


def test_seq_cp_of_a_range_replaces_only_that_range_in_the_destination(tiny_model):
    model = tiny_model()
    kv = _filled(model)
    model.forward_batch(kv, [(1, [1, 2, 3, 4, 5, 6], 0, False)])
    kv.seq_cp(0, 1, 0, 3)
    np.testing.assert_array_equal(kv.positions(1), np.arange(6))
    np.testing.assert_array_equal(kv._seqs[1].k[:, :, :3], kv._seqs[0].k[:, :, :3])


def test_clear_empties_every_sequence(tiny_model):
    model = tiny_model()
    kv = _filled(model)
    model.forward_batch(kv, [(1, PROMPT[:3], 0, False)])
    kv.clear()
    assert kv.n_cells_used == 0 and kv.pos_max(0) == -1 and kv.pos_max(1) == -1


def test_cells_beyond_the_initial_capacity_keep_their_contents(tiny_model):
    model = tiny_model()
    ids = [int(i) for i in np.random.default_rng(3).integers(0, model.hparams.n_vocab, 150)]
    kv = model.new_kv(1, 200)
    for a in range(0, 150, 50):                       # grows 64 -> 128 -> 256 on the way
        model.forward_batch(kv, [(0, ids[a:a + 50], a, False)])
    np.testing.assert_allclose(_next_logits(model, kv, 0, 7), model.forward_logits(ids + [7])[-1], atol=1e-4)


# --- state blobs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_state_load_of_state_save_restores_cells_and_next_logits(tiny_model, dtype):
    model = tiny_model()
    src = _filled(model, dtype=dtype)
    blob = src.state_save(0)
    dst = model.new_kv(3, 64, dtype=dtype)
    dst.state_load(2, blob)
    assert dst.state_save(2) == blob
    np.testing.assert_array_equal(dst.positions(2), src.positions(0))
    np.testing.assert_allclose(_next_logits(model, dst, 2, 9), _next_logits(model, src, 0, 9), atol=1e-6)


def test_state_size_is_header_plus_bytes_per_token(tiny_model):
    kv = _filled(tiny_model())
    assert kv.bytes_per_token == 4 + 2 * 2 * 2 * 16 * 4       # pos + K,V x n_layer x n_head_kv x head_dim x f32
    assert len(kv.state_save(0)) == kv.state_size(0) == 28 + 12 * kv.bytes_per_token
    assert kv.state_save(1) == struct.pack("<4sIIIIII", KV_STATE_MAGIC, 1, 0, 2, 2, 16, 0)


def _corrupt(blob: bytes, how: str) -> bytes:
    if how == "magic":
        return b"XXXX" + blob[4:]
    if how == "version":
        return blob[:4] + struct.pack("<I", 99) + blob[8:]
    if how == "short":
        return blob[:-1]
    if how == "long":
        return blob + b"\0"
    if how == "n_tokens":
        return blob[:8] + struct.pack("<I", 13) + blob[12:]
    if how == "shape":
        return blob[:12] + struct.pack("<I", 3) + blob[16:]
    if how == "dtype":
        return blob[:24] + struct.pack("<I", 7) + blob[28:]
    if how == "header":
        return blob[:10]
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["magic", "version", "short", "long", "n_tokens", "shape", "dtype", "header"])
def test_corrupt_state_raises_value_error_and_changes_nothing(tiny_model, how):
    model = tiny_model()
    kv = _filled(model)
    model.forward_batch(kv, [(1, PROMPT[:3], 0, False)])
    before = kv.state_save(1)
    with pytest.raises(ValueError):
        kv.state_load(1, _corrupt(kv.state_save(0), how))
    assert kv.state_save(1) == before


# --- accounting -----------------------------------------------------------------------------------------

def test_non_unified_sequence_cannot_exceed_n_ctx_seq(tiny_model):
    model = tiny_model()
    kv = model.new_kv(2, 8)
    model.forward_batch(kv, [(0, PROMPT[:8], 0, False)])
    with pytest.raises(KVCacheFull):
        model.forward_batch(kv, [(0, [1], 8, True)])


def test_unified_sequences_share_one_pool(tiny_model):
    model = tiny_model()
    kv = model.new_kv(2, 8, unified=True)              # pool of 16 cells
    model.forward_batch(kv, [(0, PROMPT, 0, False)])    # 12 > n_ctx_seq: fine in a shared pool
    assert kv.n_cells_used == 12 and kv.seq_limit(1) == 4
    model.forward_batch(kv, [(1, PROMPT[:4], 0, False)])
    with pytest.raises(KVCacheFull):
        model.forward_batch(kv, [(1, [1], 4, True)])
    kv.seq_rm(0, 6, -1)
    model.forward_batch(kv, [(1, [1], 4, True)])
    assert kv.n_cells_used == 11


def test_state_load_that_does_not_fit_raises_kv_full(tiny_model):
    model = tiny_model()
    blob = _filled(model).state_save(0)
    small = model.new_kv(1, 8)
    with pytest.raises(KVCacheFull):
        small.state_load(0, blob)
    assert small.n_tokens(0) == 0


@pytest.mark.realmodel
def test_smollm2_bytes_per_token(smollm2):
    assert smollm2.new_kv(1, 16).bytes_per_token == 4 + 2 * 30 * 3 * 64 * 4         # 46084
    assert smollm2.new_kv(1, 16, dtype=np.float16).bytes_per_token == 4 + 2 * 30 * 3 * 64 * 2
