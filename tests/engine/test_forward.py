"""The batched forward pass: every op of it within float32's bound of the float64 op on its own operands,
whatever the batching, chunking, caching, threads or BLAS kernel (`forward_check.checked_forward`), and bad
batches refused before touching the KV store.

Two float32 runs of the same model (batched and alone, chunked and whole) sum in different orders and may
differ after the logits by far more than one rounding; no tolerance between them follows from the
arithmetic. So each run is checked op by op against the GGUF's float64 weights instead (tests/numerics_bounds.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.model import BatchChunk, KVCacheFull
from engine.model.f32 import Rope
from tests import numerics_bounds as nb
from tests.engine.forward_check import checked_forward, reference_weights

PROMPT = [5, 77, 12, 200, 3, 9, 150, 33, 281, 64, 7, 120]


def _fresh(model, ids):
    """forward_logits(ids), every op checked."""
    kv = model.new_kv(1, max(1, len(ids)))
    return checked_forward(model, kv, [BatchChunk(0, ids, 0, range(len(ids)))])[0]


@pytest.mark.parametrize("arch, tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)])
def test_fresh_context_logits_match_the_float64_model(tiny_model, arch, tied):
    model = tiny_model(arch=arch, tied=tied)
    got = _fresh(model, PROMPT)
    assert got.shape == (len(PROMPT), model.hparams.n_vocab) and got.dtype == np.float32
    np.testing.assert_array_equal(got, model.forward_logits(PROMPT))     # same call, same bits


def test_the_check_notices_neox_pairing_on_llama(tiny_model, monkeypatch):
    """Guards the check itself: RoPE pairing halves instead of adjacent dims is outside the bound."""
    model = tiny_model()
    monkeypatch.setattr(model, "rope", Rope(dataclasses.replace(model.hparams, rope_type="neox")))
    with pytest.raises(AssertionError, match="layer 0 seq 0 new K cells"):
        _fresh(model, PROMPT[:4])


def test_the_check_notices_a_product_off_by_a_thousand_roundings(tiny_model, monkeypatch):
    """Guards the check: one product 1000 u too large (the output projection of every layer) fails it."""
    model = tiny_model()
    real = type(model.matmul).__call__
    wo = model.weights.layers[0].wo

    def off(self, lin, x):
        y = real(self, lin, x)
        return y * np.float32(1 + 1000 * 2.0 ** -24) if lin is wo else y
    monkeypatch.setattr(type(model.matmul), "__call__", off)
    with pytest.raises(AssertionError, match="layer 0 output projection"):
        _fresh(model, PROMPT[:4])


def test_incremental_decode_and_full_recompute_are_both_the_model(tiny_model):
    model = tiny_model()
    _fresh(model, PROMPT)
    kv = model.new_kv(1, 64)
    for pos, tok in enumerate(PROMPT):
        checked_forward(model, kv, [(0, [tok], pos, True)])


def test_chunked_prefill_and_single_chunk_are_both_the_model(tiny_model):
    model = tiny_model(arch="qwen2")
    _fresh(model, PROMPT)
    kv = model.new_kv(1, 64)
    checked_forward(model, kv, [(0, PROMPT[:5], 0, range(5))])
    checked_forward(model, kv, [(0, PROMPT[5:], 5, range(7))])


def test_batch_of_chunks_from_several_sequences_and_each_chunk_alone_are_the_model(tiny_model):
    model = tiny_model()
    prefixes = {0: PROMPT[:3], 1: PROMPT[:7], 2: [], 3: PROMPT[2:6]}
    news = {0: [44], 1: PROMPT[7:10], 2: PROMPT[:5], 3: [9]}
    batched_kv, alone_kv = model.new_kv(4, 64), model.new_kv(4, 64)
    for seq, prefix in prefixes.items():
        if prefix:
            checked_forward(model, batched_kv, [(seq, prefix, 0, False)])
            checked_forward(model, alone_kv, [(seq, prefix, 0, False)])
    chunks = [BatchChunk(seq, news[seq], len(prefixes[seq]), range(len(news[seq]))) for seq in (2, 0, 3, 1)]
    batched = checked_forward(model, batched_kv, chunks)
    for chunk, got in zip(chunks, batched):
        [alone] = checked_forward(model, alone_kv, [chunk])
        assert got.shape == alone.shape


def test_logits_only_for_requested_rows(tiny_model):
    model = tiny_model()
    kv = model.new_kv(3, 64)
    out = checked_forward(model, kv, [(0, PROMPT[:4], 0, True), (1, PROMPT[:4], 0, False),
                                      (2, PROMPT[:4], 0, [0, -1])])
    assert [o.shape for o in out] == [(1, model.hparams.n_vocab), (0, model.hparams.n_vocab), (2, model.hparams.n_vocab)]


def test_long_chunk_attention_in_query_blocks_is_the_model(tiny_model, monkeypatch):
    """Chunks are attended in blocks of queries to bound memory; every block attends its own keys."""
    import engine.model.f32 as f32
    model = tiny_model(n_ctx_train=1024)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, model.hparams.n_vocab, 300)]
    monkeypatch.setattr(f32, "_ATTN_SCORE_BUDGET", 4 * 300 * 7)      # ~7 query rows per block
    _fresh(model, ids)


def test_f16_kv_is_the_model_with_f16_cells(tiny_model):
    model = tiny_model()
    for dtype in (np.float32, np.float16):
        kv = model.new_kv(1, 64, dtype=dtype)
        checked_forward(model, kv, [(0, PROMPT[:-1], 0, False)])
        checked_forward(model, kv, [(0, PROMPT[-1:], len(PROMPT) - 1, True)])
        assert kv.dtype == dtype


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0", "Q4_1"])
def test_quantized_model_is_close_to_its_f32_original(tiny_model, tensor_type):
    """The distance measured here is the weights' rounding to 16 / 8 / 4 bits (gguf's quantizer: element-wise
    numpy arithmetic, the same bits on every machine), 1e-3 to 1e-1 of the logits; float32 summation order
    moves it by less than 1e-5 of them (the checked forwards bound every op), far inside each band. The
    bands are the quantizers' expected fidelity, not an arithmetic bound."""
    exact = _fresh(tiny_model(), PROMPT)
    approx = _fresh(tiny_model(tensor_type=tensor_type), PROMPT)
    tol = {"F16": 1e-2, "Q8_0": 5e-2, "Q4_1": 0.5}[tensor_type]
    assert np.abs(approx - exact).max() <= tol * np.abs(exact).max()


def _rope_ball(hp, x, pos):
    return nb.rope(nb.exact(x), np.asarray(pos), hp)


def test_rope_rerotation_by_delta_equals_rotation_at_the_new_position(tiny_model):
    """Both ways are within their float32 bounds of the exact rotation by theta (p - 3)."""
    for arch in ("llama", "qwen2"):
        hp = tiny_model(arch=arch).hparams
        rope = Rope(hp)
        x = np.random.default_rng(0).standard_normal((3, 2, 16)).astype(np.float32)   # [T, n_head, head_dim]
        pos = np.array([4, 9, 30])
        at_p, at_new = x.copy(), x.copy()
        cos, sin = rope.cos_sin(pos)
        rope.apply(at_p, cos[:, None], sin[:, None])
        rope.rerotate(at_p, -3)
        cos, sin = rope.cos_sin(pos - 3)
        rope.apply(at_new, cos[:, None], sin[:, None])
        two_steps = nb.rope(_rope_ball(hp, x, pos), np.full(3, -3), hp)                 # rotate, then by -3
        one_step = _rope_ball(hp, x, pos - 3)
        nb.check_within(at_p, two_steps.v, two_steps.r, f"{arch} rerotated")
        nb.check_within(at_new, one_step.v, one_step.r, f"{arch} rotated at p - 3")
        assert np.all(np.abs(two_steps.v - one_step.v) <= 1e-6 * one_step.r)   # one rotation: float64 centres agree


def test_rope_rotation_of_a_batch_equals_the_pairwise_formula(tiny_model):
    """`rotate(x, rotation(pos))` (complex64 products for NORM pairs, cos/sin for NEOX) equals the real
    formula x0' = x0 cos - x1 sin, x1' = x0 sin + x1 cos on the mode's pairs, written out here in float64,
    within the float32 bound of the tables and the two products."""
    for arch, mode in (("llama", "norm"), ("qwen2", "neox")):
        hp = tiny_model(arch=arch).hparams
        rope = Rope(hp)
        assert rope.mode == mode and rope.complex_pairs == (mode == "norm")
        x = np.random.default_rng(1).standard_normal((4, 3, 16)).astype(np.float32)   # [T, n_heads, head_dim]
        pos = np.array([0, 5, 77, 1000])
        got = x.copy()
        rope.rotate(got, rope.rotation(pos))
        half = rope.n_rot // 2
        i0 = np.arange(0, rope.n_rot, 2) if mode == "norm" else np.arange(half)
        i1 = i0 + 1 if mode == "norm" else i0 + half
        ang = pos[:, None].astype(np.float64) * hp.rope_freq_base ** (-2.0 * np.arange(half) / hp.n_rot)
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        want = x.astype(np.float64)
        want[..., i0], want[..., i1] = x[..., i0] * c - x[..., i1] * s, x[..., i0] * s + x[..., i1] * c
        bound = _rope_ball(hp, x, pos)
        assert np.all(np.abs(bound.v - want) <= 1e-6 * bound.r)                    # the helper is this formula
        nb.check_within(got, want, bound.r, arch)
        assert np.abs(got - x).max() > 1e4 * bound.r.max()                          # it did rotate

# --- bad batches change nothing -------------------------------------------------------------------------

def _state(kv, n_seq):
    return [kv.state_save(s) for s in range(n_seq)]


def test_kv_full_raises_before_any_cell_changes(tiny_model):
    model = tiny_model()
    kv = model.new_kv(2, 8)
    model.forward_batch(kv, [(0, PROMPT[:6], 0, False)])
    before = _state(kv, 2)
    with pytest.raises(KVCacheFull):
        model.forward_batch(kv, [(1, [1, 2], 0, True), (0, PROMPT[6:9], 6, True)])
    assert _state(kv, 2) == before


@pytest.mark.parametrize("chunks, message", [
    ([(0, [5], 3, True)], "positions must stay consecutive"),
    ([(0, [5], 4, True), (0, [6], 5, True)], "appears twice"),
    ([(1, [100000], 0, True)], "token id out of range"),
    ([(1, [], 0, True)], "empty chunk"),
    ([(7, [1], 0, True)], "out of range"),
])
def test_invalid_batch_is_rejected_without_changes(tiny_model, chunks, message):
    model = tiny_model()
    kv = model.new_kv(2, 16)
    model.forward_batch(kv, [(0, PROMPT[:4], 0, False)])
    before = _state(kv, 2)
    with pytest.raises(ValueError, match=message):
        model.forward_batch(kv, chunks)
    assert _state(kv, 2) == before


# --- the real model ------------------------------------------------------------------------------------

# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n" in SmolLM2's vocabulary
FRANCE_PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def _greedy(model, prompt, n):
    kv = model.new_kv(1, len(prompt) + n)
    [logits] = model.forward_batch(kv, [(0, prompt, 0, True)])
    out = []
    for i in range(n):
        out.append(int(logits[-1].argmax()))
        [logits] = model.forward_batch(kv, [(0, [out[-1]], len(prompt) + i, True)])
    return out


@pytest.mark.realmodel
def test_smollm2_greedy_answer_is_sane_and_stable(smollm2):
    first = _greedy(smollm2, FRANCE_PROMPT, 8)
    assert first == [504, 3575, 282, 4649, 314, 7042, 30, 2]    # "The capital of France is Paris.<|im_end|>"
    assert _greedy(smollm2, FRANCE_PROMPT, 8) == first


@pytest.mark.realmodel
def test_smollm2_batched_decode_and_prefill_are_the_model(smollm2):
    """One step of two pooled sequences decoding together (batched attention) and a third one prefilling:
    every op of the 30 layers within its float32 bound (the engine's own float32 weights as reference; the
    tiny models check loading)."""
    kv = smollm2.new_kv(3, 64)
    smollm2.forward_batch(kv, [(0, FRANCE_PROMPT, 0, False), (1, FRANCE_PROMPT[:9], 0, False)])
    ref = reference_weights(smollm2, from_engine=True)
    checked_forward(smollm2, kv, [(0, [504], len(FRANCE_PROMPT), True), (1, [29], 9, True),
                                  (2, FRANCE_PROMPT[:5], 0, True)], ref)


@pytest.mark.parametrize("n_threads", [1, 3])
def test_matmul_layouts_and_thread_splits_agree_for_every_row_count(tiny_model, monkeypatch, n_threads):
    import engine.model.matmul as matmul_mod
    monkeypatch.setattr(matmul_mod, "_SPLIT_MIN_MACS", 0)     # split even tiny products
    lin = tiny_model().weights.layers[0].w_gate_up
    assert lin.blocks.shape[0] > 1
    x = np.random.default_rng(0).standard_normal((70, 64)).astype(np.float32)
    w = lin.weight.astype(np.float64)
    want = x.astype(np.float64) @ w.T
    bound = nb.dot_bound(np.abs(x.astype(np.float64)), np.abs(w.T))     # any order, layout, split
    matmul = matmul_mod.Matmul(n_threads)
    for m in (1, 2, 5, 64, 65, 70):
        nb.check_within(matmul(lin, x[:m]), want[:m], bound[:m], f"{m} rows")
    matmul.close()


def test_split_threading_gives_the_same_logits_as_one_thread(tiny_gguf, monkeypatch):
    import engine.model.f32 as f32
    import engine.model.matmul as matmul_mod
    from engine.model import load
    monkeypatch.setattr(matmul_mod, "_SPLIT_MIN_MACS", 0)     # split every matmul,
    monkeypatch.setattr(f32, "_ATTN_QUERY_BLOCK", 16)         # attention query blocks
    monkeypatch.setattr(matmul_mod, "_ELEMENTWISE_ROWS", 8)   # and SwiGLU rows over the threads
    one, two = load(tiny_gguf(), n_threads=1), load(tiny_gguf(), n_threads=2)
    assert (two.n_threads, two.blas_threads, two.threading) == (2, 1, "split")
    assert two.threads_desc == "2 compute threads (matmuls split over Python threads, BLAS 1)"
    assert one.threads_desc == "1 compute thread (BLAS 1)"
    ids = [int(i) for i in np.random.default_rng(5).integers(0, one.hparams.n_vocab, 100)]
    _fresh(two, ids)
    _fresh(one, ids)


def test_blas_threading_hands_the_threads_to_openblas(tiny_gguf):
    from engine.model import load
    model = load(tiny_gguf(), n_threads=2, threading="blas")
    assert (model.n_threads, model.blas_threads, model.matmul.n_threads) == (2, 2, 1)
    assert model.threads_desc == "2 compute threads (BLAS's own threads)"


def test_bad_logit_rows_are_rejected_without_changes(tiny_model):
    model = tiny_model()
    kv = model.new_kv(1, 16)
    with pytest.raises(ValueError, match="logit rows"):
        model.forward_batch(kv, [(0, PROMPT[:3], 0, [3])])
    assert kv.n_tokens(0) == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_partial_rotary_rotates_only_the_first_n_rot_dims(tiny_model, arch):
    hp = dataclasses.replace(tiny_model(arch=arch).hparams, n_rot=8)     # head_dim 16
    rope = Rope(hp)
    x = np.random.default_rng(0).standard_normal((2, 1, 16)).astype(np.float32)
    y = x.copy()
    cos, sin = rope.cos_sin(np.array([3, 7]))
    rope.apply(y, cos[:, None], sin[:, None])
    np.testing.assert_array_equal(y[..., 8:], x[..., 8:])
    want = _rope_ball(hp, x, [3, 7])
    nb.check_within(y, want.v, want.r, "partial rotary")
    assert np.abs(y[..., :8] - x[..., :8]).max() > 1e4 * want.r.max()
