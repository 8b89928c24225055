"""KV store: llama.cpp position semantics of seq_rm / seq_add / seq_cp / clear, state blobs, accounting."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from engine.model import KVCacheFull, load
from engine.model.kv import KV_STATE_MAGIC, KVStore, lazy_zeros
from tests import numerics_bounds as nb
from tests.engine.forward_check import _tensors, checked_forward

PROMPT = [5, 77, 12, 200, 3, 9, 150, 33, 281, 64, 7, 120]


def _filled(model, tokens=PROMPT, n_seq=2, n_ctx_seq=64, seq=0, **kw) -> KVStore:
    kv = model.new_kv(n_seq, n_ctx_seq, **kw)
    model.forward_batch(kv, [(seq, tokens, 0, False)])
    return kv


def _next_logits(model, kv, seq, token):
    return model.forward_batch(kv, [(seq, [token], kv.pos_max(seq) + 1, True)])[0][0]


def _checked_next(model, kv, seq, token):
    """The next token's logits, every op of the step checked against float64 on the cells seq holds."""
    return checked_forward(model, kv, [(seq, [token], kv.pos_max(seq) + 1, True)])[0][0]


def _cells(kv, seq):
    s = kv._seqs[seq]
    return s.k[:, :, :s.n].copy(), s.v[:, :, :s.n].copy()


def test_positions_are_consecutive_after_prefill(tiny_model):
    kv = _filled(tiny_model())
    assert kv.n_tokens(0) == 12 and kv.n_tokens(1) == 0
    assert (kv.pos_min(0), kv.pos_max(0), kv.pos_max(1)) == (0, 11, -1)
    np.testing.assert_array_equal(kv.positions(0), np.arange(12))


def test_seq_rm_to_the_end_truncates_and_decoding_continues_like_a_shorter_prompt(tiny_model):
    """The cells kept are the prompt's first five, bit for bit (a cell depends on its token and those before
    it only), and the next token attends exactly them (checked op by op)."""
    model = tiny_model()
    kv = _filled(model)
    k, v = _cells(kv, 0)
    kv.seq_rm(0, 5, -1)
    assert kv.n_tokens(0) == 5 and kv.pos_max(0) == 4
    k5, v5 = _cells(kv, 0)
    np.testing.assert_array_equal(k5, k[:, :, :5])
    np.testing.assert_array_equal(v5, v[:, :, :5])
    _checked_next(model, kv, 0, 99)


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


def _layer0_kv(model, tokens, pos, delta=0) -> tuple[nb.Ball, nb.Ball]:
    """Layer 0's K and V cells of `tokens` at positions `pos` (K re-rotated by `delta` after), from the GGUF's
    float64 weights: each depends only on (token, position). Balls [n_head_kv, n, head_dim] with the float32
    bound of the embedding -> rms_norm -> K/V products -> RoPE (-> re-rotation) chain."""
    hp = model.hparams
    t = _tensors(model.path)
    xn = nb.rms_norm(nb.exact(t["token_embd.weight"][tokens]), t["blk.0.attn_norm.weight"], hp.f_norm_rms_eps)
    k = nb.matmul(xn, t["blk.0.attn_k.weight"], bias=t.get("blk.0.attn_k.bias"))
    v = nb.matmul(xn, t["blk.0.attn_v.weight"], bias=t.get("blk.0.attn_v.bias"))
    shape = (len(tokens), hp.n_head_kv, hp.head_dim)
    k = nb.rope(nb.Ball(k.v.reshape(shape), k.r.reshape(shape)), np.asarray(pos), hp)
    if delta:
        k = nb.rope(k, np.full(len(tokens), delta), hp)
    return (nb.Ball(k.v.transpose(1, 0, 2), k.r.transpose(1, 0, 2)),
            nb.Ball(v.v.reshape(shape).transpose(1, 0, 2), v.r.reshape(shape).transpose(1, 0, 2)))


def test_context_shift_then_attend_equals_fresh_prompt_at_the_new_positions(tiny_model):
    """llama-server's context shift: keep n_keep, drop n_discard, slide the rest down. With one layer the
    cached K/V of a token depend only on (token, position): the kept cells stay bit for bit, the slid ones
    hold K rotated at the old position then back by n_discard, within float32's bound of the K a fresh
    prefill of the kept tokens computes at the new positions; the next token attends exactly them."""
    model = tiny_model(n_layer=1)
    n_keep, n_discard = 4, 4
    kv = _filled(model)
    k, v = _cells(kv, 0)
    kv.seq_rm(0, n_keep, n_keep + n_discard)
    kv.seq_add(0, n_keep + n_discard, -1, -n_discard)
    np.testing.assert_array_equal(kv.positions(0), np.arange(len(PROMPT) - n_discard))
    k2, v2 = _cells(kv, 0)
    np.testing.assert_array_equal(k2[:, :, :n_keep], k[:, :, :n_keep])
    np.testing.assert_array_equal(v2, np.concatenate([v[:, :, :n_keep], v[:, :, n_keep + n_discard:]], axis=2))
    moved = PROMPT[n_keep + n_discard:]
    old_pos = np.arange(n_keep + n_discard, len(PROMPT))
    shifted, _ = _layer0_kv(model, moved, old_pos, -n_discard)
    fresh, _ = _layer0_kv(model, moved, old_pos - n_discard)
    assert np.all(np.abs(shifted.v - fresh.v) <= 1e-6 * shifted.r)     # one rotation: float64 centres agree
    nb.check_within(k2[0, :, n_keep:], shifted.v, shifted.r, "shifted K")
    _checked_next(model, kv, 0, 99)


def test_seq_add_rerotates_cached_keys_by_the_delta(tiny_model):
    model = tiny_model(n_layer=1)
    shifted = _filled(model, tokens=PROMPT[:5])
    shifted.seq_add(0, -1, -1, 7)                     # positions 7..11
    np.testing.assert_array_equal(shifted.positions(0), np.arange(7, 12))
    padded = _filled(model, tokens=PROMPT[5:12] + PROMPT[:5])   # same tokens at 7..11 after 7 others
    got, want = shifted._seqs[0], padded._seqs[0]
    # both within float32's bound of the exact K at 7..11 (rotated at 0..4 then by 7, or at 7..11 directly)
    rerotated, v = _layer0_kv(model, PROMPT[:5], np.arange(5), 7)
    direct, _ = _layer0_kv(model, PROMPT[:5], np.arange(7, 12))
    assert np.all(np.abs(rerotated.v - direct.v) <= 1e-6 * direct.r)   # one rotation: float64 centres agree
    nb.check_within(got.k[0, :, :5], rerotated.v, rerotated.r, "re-rotated K")
    nb.check_within(want.k[0, :, 7:12], direct.v, direct.r, "K prefilled at 7..11")
    nb.check_within(got.v[0, :, :5], v.v, v.r, "V of the shifted cells")
    nb.check_within(want.v[0, :, 7:12], v.v, v.r, "V prefilled at 7..11")


def test_seq_add_moving_cells_below_zero_removes_them(tiny_model):
    kv = _filled(tiny_model())
    kv.seq_add(0, 0, 6, -3)
    np.testing.assert_array_equal(kv.positions(0), [0, 1, 2, 6, 7, 8, 9, 10, 11])


@pytest.mark.parametrize("numerics", ["f32", "ggml"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_seq_add_rerotates_layer_by_layer_exactly_as_one_rotation_of_the_whole_range(tiny_gguf, numerics, dtype):
    """A context shift re-rotates one layer's cells at a time (bounded temporaries, below); the rotation is
    elementwise, so the cells equal the rotator applied once to the whole range's float32 values, bit for bit."""
    model = load(tiny_gguf(n_layer=3), n_threads=1, numerics=numerics)
    kv = _filled(model, tokens=PROMPT * 2, dtype=dtype)
    lo, delta = 5, -5
    want = kv._seqs[0].k[:, :, lo:kv.n_tokens(0)].astype(np.float32)
    kv.rotator.rerotate(want, delta)
    kv.seq_rm(0, 0, lo)
    kv.seq_add(0, lo, -1, delta)
    np.testing.assert_array_equal(kv.positions(0), np.arange(2 * len(PROMPT) - lo))
    got = kv._seqs[0].k[:, :, :kv.n_tokens(0)]
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, want.astype(dtype))


@pytest.mark.parametrize("numerics", ["f32", "ggml"])
def test_a_context_shift_allocates_temporaries_of_one_layer_not_of_all(tiny_gguf, numerics):
    """Re-rotating the whole range at once allocated float32 (and, for ggml's fma, float64) copies of every
    layer's shifted K: 24 MB at 1024 cells of SmolLM2, new memory in the step (page faults, 60 ms). Layer by
    layer, the most held at once is a few copies of one layer's range: with 12 layers, less than the whole
    range's float32 copy alone (numpy's allocations are traced by tracemalloc)."""
    import tracemalloc
    n_layer = 12
    model = load(tiny_gguf(n_layer=n_layer), n_threads=1, numerics=numerics)
    kv = _filled(model, tokens=PROMPT * 10, n_ctx_seq=128, dtype=np.float16)
    n = kv.n_tokens(0)
    n_discard = n // 2
    whole_f32 = n_layer * kv.n_head_kv * (n - n_discard) * kv.head_dim * 4
    tracemalloc.start()
    try:
        kv.seq_rm(0, 0, n_discard)                     # llama-server's shift with n_keep 0: drop half, slide the rest
        kv.seq_add(0, n_discard, -1, -n_discard)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kv.n_tokens(0) == n - n_discard
    assert 0 < peak < whole_f32, (peak, whole_f32)


def test_seq_cp_copies_a_sequence_that_then_decodes_identically(tiny_model):
    model = tiny_model()
    kv = _filled(model, n_seq=3)
    kv.seq_cp(0, 2, -1, -1)
    assert kv.n_tokens(2) == 12
    # the copy holds the same bits at the same positions, and a one-token chunk alone runs the same calls on
    # arrays of the same shapes: the same kernels in the same order give the same bits
    np.testing.assert_array_equal(_next_logits(model, kv, 2, 42), _next_logits(model, kv, 0, 42))


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
    for a in range(0, 150, 50):                       # grows 64 -> 128 -> 256 on the way; each step checks
        checked_forward(model, kv, [(0, ids[a:a + 50], a, False)])   # that the earlier cells survived
    assert kv._seqs[0].k.shape[2] > 128
    _checked_next(model, kv, 0, 7)


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
    # the same bits in cells of the same capacity: the same calls, the same kernels, the same result
    np.testing.assert_array_equal(_next_logits(model, dst, 2, 9), _next_logits(model, src, 0, 9))


def test_state_size_is_header_plus_bytes_per_token(tiny_model):
    kv = _filled(tiny_model())
    assert kv.bytes_per_token == 4 + 2 * 2 * 2 * 16 * 4       # pos + K,V x n_layer x n_head_kv x head_dim x f32
    assert len(kv.state_save(0)) == kv.state_size(0) == 28 + 12 * kv.bytes_per_token
    assert kv.state_save(1) == struct.pack("<4sIIIIII", KV_STATE_MAGIC, 1, 0, 2, 2, 16, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_state_blob_is_the_documented_layout_and_a_copy(tiny_model, dtype):
    model = tiny_model()
    kv = _filled(model, n_seq=3, dtype=dtype)           # three sequences share the pool: seq 0 is a strided view
    model.forward_batch(kv, [(1, PROMPT[:5], 0, False)])
    s = kv._seq(0)
    n = s.n
    expected = (struct.pack("<4sIIIIII", KV_STATE_MAGIC, 1, n, 2, 2, 16, 0 if dtype == np.float32 else 1)
                + s.pos[:n].astype("<i4").tobytes()
                + np.ascontiguousarray(s.k[:, :, :n]).tobytes() + np.ascontiguousarray(s.v[:, :, :n]).tobytes())
    blob = kv.state_save(0)
    assert blob.readonly and len(blob) == kv.state_size(0)
    assert bytes(blob) == expected
    kv.seq_add(0, 0, -1, 3)                              # moves and re-rotates the cells the blob came from
    _next_logits(model, kv, 0, 9)
    assert bytes(blob) == expected


def _corrupt(blob: bytes | memoryview, how: str) -> bytes:
    blob = bytes(blob)
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


@pytest.mark.parametrize("shape, dtype", [((3,), np.float32), ((30, 4, 512, 64), np.float16), ((2, 1000), np.int32)])
def test_lazy_zeros_is_a_writable_zeroed_array_whose_untouched_pages_stay_virtual(shape, dtype):
    a = lazy_zeros(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.writeable and a.flags.c_contiguous
    assert not a.any()
    a[..., -1] = 7
    assert a[..., -1].all() and int(a.sum(dtype=np.int64)) == 7 * a[..., -1].size


def test_lazy_zeros_pages_are_resident_only_where_written():
    """A 64 MB mapping with one byte written adds far less than 64 MB to this process's resident memory
    (read from /proc/self/statm; skipped where it is missing)."""
    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    try:
        before = resident()
    except OSError:
        pytest.skip("no /proc/self/statm")
    a = lazy_zeros((64 << 20,), np.uint8)
    a[len(a) // 2] = 1
    assert resident() - before < 8 << 20
    del a


# --- resident cells (llama.cpp allocates and clears its KV buffers when the context is created) ---------------


def test_a_unified_store_stays_lazy(tiny_gguf):
    """Unified, the pool holds up to 2 x n_ctx_seq cells a sequence (n_seq times more than can be used at once):
    only the cells in use become resident."""
    from engine.model import load
    kv = load(tiny_gguf(), n_threads=1, numerics="ggml").new_kv(4, 16, unified=True)
    assert not kv.resident and kv.pool_k is None


def test_the_engines_kv_is_allocated_whole_before_any_step(tiny_gguf):
    from engine.model import load
    for numerics, shadows in (("f32", False), ("ggml", True)):
        model = load(tiny_gguf(), n_threads=1, numerics=numerics)
        kv = model.new_kv(3, 32)
        assert kv.resident and kv.pool_k is not None and kv.pool_cap == 32
        assert all(s.n == 0 and s.k.shape[2] == 32 for s in kv._seqs)
        assert all((s.shadow is not None and s.shadow.v.shape[2] == 32) == shadows for s in kv._seqs)
        lazy = model.new_kv(3, 32, resident=False)
        assert not lazy.resident and lazy.pool_k is None and all(s.shadow is None for s in lazy._seqs)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="needs Linux /proc")
@pytest.mark.parametrize("resident", [True, False])
def test_a_resident_store_holds_its_pages_from_the_start_a_lazy_one_on_first_write(resident):
    # fp16 cells of 8 KiB (8 layers x 4 heads x 64 x 2 x 2 bytes), 4 x 2048 of them: 64 MiB; shadows twice that
    before = _rss_bytes()
    kv = KVStore(4, 2048, 8, 4, 64, rotator=None, dtype=np.float16, resident=resident, shadows=True)
    grown = _rss_bytes() - before
    expected = 64 << 20
    expected += 2 * expected                      # the float32 shadows
    if resident:
        assert grown >= 0.95 * expected, grown
    else:
        assert grown < 0.05 * expected, grown
    del kv


def test_a_resident_store_computes_what_a_lazy_one_does_and_clear_keeps_its_buffers(tiny_gguf):
    """The same steps on both stores give the same logits bit for bit, through a sequence that outgrows the pool
    (a pool capped by pool_max_bytes: a longer sequence gets arrays of its own) and a clear."""
    from engine.model import load
    model = load(tiny_gguf(), n_threads=1, numerics="ggml")
    hp = model.hparams
    cell = 2 * hp.n_layer * hp.n_head_kv * hp.head_dim * 2                  # fp16 K and V bytes a cell

    def store(resident):
        return KVStore(4, 64, hp.n_layer, hp.n_head_kv, hp.head_dim, model.rope, dtype=np.float16,
                       pool_max_bytes=4 * 32 * cell, resident=resident, shadows=True)    # a pool of 32 cells
    stores = [store(True), store(False)]
    assert stores[0].resident and stores[0].pool_cap == 32
    long = [(i * 37) % 250 + 1 for i in range(36)]          # 36 cells > the pool's 32
    outs = []
    for kv in stores:
        got = [model.forward_batch(kv, [(0, PROMPT, 0, True)])]
        got.append(model.forward_batch(kv, [(2, long, 0, True)]))
        assert not kv._seqs[2].pooled
        kv.seq_cp(0, 3, -1, -1)
        got.append(model.forward_batch(kv, [(3, [9], 12, True), (0, [11], 12, True)]))
        pool = kv.pool_k
        kv.clear()
        assert all(s.n == 0 and s.pooled for s in kv._seqs)
        if kv.resident:
            assert kv.pool_k is pool and all(s.shadow is not None for s in kv._seqs)   # the buffers kept
        got.append(model.forward_batch(kv, [(2, PROMPT, 0, True)]))
        outs.append(got)
    for a, b in zip(*outs):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


def test_a_resident_store_too_large_for_the_machine_stays_lazy_and_says_so(monkeypatch):
    import engine.model.kv as kvmod
    # 4 x 2048 cells of 8 KiB fp16 + 16 KiB shadow: 192 MiB; the machine offers 256 MiB, half of it is 128
    monkeypatch.setattr(kvmod, "available_memory_bytes", lambda: 256 << 20)
    with pytest.warns(RuntimeWarning, match=r"KV cells of 192 MiB exceed 50% of the available memory \(256 MiB\)"):
        kv = KVStore(4, 2048, 8, 4, 64, rotator=None, dtype=np.float16, resident=True, shadows=True)
    assert kv.pool_k is None and all(s.shadow is None for s in kv._seqs)
    monkeypatch.setattr(kvmod, "available_memory_bytes", lambda: 512 << 20)
    kv = KVStore(4, 2048, 8, 4, 64, rotator=None, dtype=np.float16, resident=True, shadows=True)
    assert kv.pool_k is not None and all(s.shadow is not None for s in kv._seqs)
    monkeypatch.setattr(kvmod, "available_memory_bytes", lambda: None)       # unknown: resident
    assert KVStore(2, 64, 2, 2, 8, rotator=None, resident=True).pool_k is not None


def test_available_memory_is_read_from_proc_meminfo():
    from engine.model.kv import available_memory_bytes
    got = available_memory_bytes()
    if __import__("os").path.exists("/proc/meminfo"):
        assert got is not None and got > 1 << 20
    else:
        assert got is None
