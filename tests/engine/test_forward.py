"""The batched forward pass: agrees with a plain per-token reference, with itself across batching and
caching, and refuses bad batches before touching the KV store."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.model import BatchChunk, KVCacheFull
from engine.model.f32 import Rope
from engine.model.tiny import tiny_tensors

PROMPT = [5, 77, 12, 200, 3, 9, 150, 33, 281, 64, 7, 120]


def reference_logits(t: dict[str, np.ndarray], hp, ids: list[int]) -> np.ndarray:
    """Textbook llama/qwen2 in float64, one token at a time, straight from the GGUF tensors."""
    n_head, n_head_kv, head_dim = hp.n_head, hp.n_head_kv, hp.head_dim

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x) + hp.f_norm_rms_eps) * w

    def rope(vec, p):
        out = vec.copy()
        for i in range(hp.n_rot // 2):
            theta = p * hp.rope_freq_base ** (-2.0 * i / hp.n_rot)
            a, b = (2 * i, 2 * i + 1) if hp.rope_type == "norm" else (i, i + hp.n_rot // 2)
            out[a] = vec[a] * np.cos(theta) - vec[b] * np.sin(theta)
            out[b] = vec[a] * np.sin(theta) + vec[b] * np.cos(theta)
        return out

    t = {k: v.astype(np.float64) for k, v in t.items()}
    head = t.get("output.weight", t["token_embd.weight"])
    keys = [[] for _ in range(hp.n_layer)]
    values = [[] for _ in range(hp.n_layer)]
    logits = []
    for p, tok in enumerate(ids):
        x = t["token_embd.weight"][tok].copy()
        for il in range(hp.n_layer):
            def g(name):
                return t.get(f"blk.{il}.{name}")
            xn = norm(x, g("attn_norm.weight"))
            q, k, v = g("attn_q.weight") @ xn, g("attn_k.weight") @ xn, g("attn_v.weight") @ xn
            if g("attn_q.bias") is not None:
                q, k, v = q + g("attn_q.bias"), k + g("attn_k.bias"), v + g("attn_v.bias")
            q = [rope(h, p) for h in q.reshape(n_head, head_dim)]
            keys[il].append([rope(h, p) for h in k.reshape(n_head_kv, head_dim)])
            values[il].append(list(v.reshape(n_head_kv, head_dim)))
            out = []
            for h in range(n_head):
                kv_head = h // (n_head // n_head_kv)
                scores = np.array([kk[kv_head] @ q[h] for kk in keys[il]]) / np.sqrt(head_dim)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out.append(sum(wt * vv[kv_head] for wt, vv in zip(weights, values[il])))
            x = x + g("attn_output.weight") @ np.concatenate(out)
            xn = norm(x, g("ffn_norm.weight"))
            gate, up = g("ffn_gate.weight") @ xn, g("ffn_up.weight") @ xn
            x = x + g("ffn_down.weight") @ (gate / (1.0 + np.exp(-gate)) * up)
        logits.append(head @ norm(x, t["output_norm.weight"]))
    return np.array(logits)


@pytest.mark.parametrize("arch, tied", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)])
def test_fresh_context_logits_match_reference(tiny_model, arch, tied):
    model = tiny_model(arch=arch, tied=tied)
    written = {name: tt.values for name, tt in tiny_tensors(arch=arch, tied=tied).items()}
    want = reference_logits(written, model.hparams, PROMPT)
    got = model.forward_logits(PROMPT)
    assert got.shape == (len(PROMPT), model.hparams.n_vocab) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max())


def test_reference_would_notice_neox_pairing_on_llama(tiny_model):
    """Guards the reference itself: pairing halves instead of adjacent dims changes the logits."""
    model = tiny_model()
    written = {name: tt.values for name, tt in tiny_tensors().items()}
    wrong_hp = dataclasses.replace(model.hparams, rope_type="neox")
    wrong = reference_logits(written, wrong_hp, PROMPT[:4])
    assert np.abs(model.forward_logits(PROMPT[:4]) - wrong).max() > 1e-2


def test_incremental_decode_equals_full_recompute(tiny_model):
    model = tiny_model()
    full = model.forward_logits(PROMPT)
    kv = model.new_kv(1, 64)
    rows = [model.forward_batch(kv, [(0, [tok], pos, True)])[0][0] for pos, tok in enumerate(PROMPT)]
    np.testing.assert_allclose(np.array(rows), full, atol=1e-4)


def test_chunked_prefill_equals_single_chunk(tiny_model):
    model = tiny_model(arch="qwen2")
    full = model.forward_logits(PROMPT)
    kv = model.new_kv(1, 64)
    a = model.forward_batch(kv, [(0, PROMPT[:5], 0, range(5))])[0]
    b = model.forward_batch(kv, [(0, PROMPT[5:], 5, range(7))])[0]
    np.testing.assert_allclose(np.concatenate([a, b]), full, atol=1e-4)


def test_batch_of_chunks_from_several_sequences_equals_each_chunk_alone(tiny_model):
    model = tiny_model()
    prefixes = {0: PROMPT[:3], 1: PROMPT[:7], 2: [], 3: PROMPT[2:6]}
    news = {0: [44], 1: PROMPT[7:10], 2: PROMPT[:5], 3: [9]}
    batched_kv, alone_kv = model.new_kv(4, 64), model.new_kv(4, 64)
    for seq, prefix in prefixes.items():
        if prefix:
            model.forward_batch(batched_kv, [(seq, prefix, 0, False)])
            model.forward_batch(alone_kv, [(seq, prefix, 0, False)])
    chunks = [BatchChunk(seq, news[seq], len(prefixes[seq]), range(len(news[seq]))) for seq in (2, 0, 3, 1)]
    batched = model.forward_batch(batched_kv, chunks)
    for chunk, got in zip(chunks, batched):
        [alone] = model.forward_batch(alone_kv, [chunk])
        np.testing.assert_allclose(got, alone, atol=1e-5)


def test_logits_only_for_requested_rows(tiny_model):
    model = tiny_model()
    kv = model.new_kv(3, 64)
    out = model.forward_batch(kv, [(0, PROMPT[:4], 0, True), (1, PROMPT[:4], 0, False), (2, PROMPT[:4], 0, [0, -1])])
    assert [o.shape for o in out] == [(1, model.hparams.n_vocab), (0, model.hparams.n_vocab), (2, model.hparams.n_vocab)]
    full = model.forward_logits(PROMPT[:4])
    np.testing.assert_allclose(out[0][0], full[3], atol=1e-5)
    np.testing.assert_allclose(out[2], full[[0, 3]], atol=1e-5)


def test_long_chunk_attention_in_query_blocks_equals_reference_blocks(tiny_model, monkeypatch):
    """Chunks are attended in blocks of queries to bound memory; block size must not change results."""
    import engine.model.f32 as f32
    model = tiny_model(n_ctx_train=1024)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, model.hparams.n_vocab, 300)]
    whole = model.forward_logits(ids)
    monkeypatch.setattr(f32, "_ATTN_SCORE_BUDGET", 4 * 300 * 7)      # ~7 query rows per block
    np.testing.assert_allclose(model.forward_logits(ids), whole, atol=1e-4)


def test_f16_kv_is_close_to_f32_kv(tiny_model):
    model = tiny_model()
    results = []
    for dtype in (np.float32, np.float16):
        kv = model.new_kv(1, 64, dtype=dtype)
        model.forward_batch(kv, [(0, PROMPT[:-1], 0, False)])
        results.append(model.forward_batch(kv, [(0, PROMPT[-1:], len(PROMPT) - 1, True)])[0])
    np.testing.assert_allclose(results[1], results[0], atol=1e-2 * np.abs(results[0]).max())


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0", "Q4_1"])
def test_quantized_model_is_close_to_its_f32_original(tiny_model, tensor_type):
    exact = tiny_model().forward_logits(PROMPT)
    approx = tiny_model(tensor_type=tensor_type).forward_logits(PROMPT)
    tol = {"F16": 1e-2, "Q8_0": 5e-2, "Q4_1": 0.5}[tensor_type]
    assert np.abs(approx - exact).max() <= tol * np.abs(exact).max()


def test_rope_rerotation_by_delta_equals_rotation_at_the_new_position(tiny_model):
    for arch in ("llama", "qwen2"):
        rope = Rope(tiny_model(arch=arch).hparams)
        x = np.random.default_rng(0).standard_normal((3, 2, 16)).astype(np.float32)   # [T, n_head, head_dim]
        pos = np.array([4, 9, 30])
        at_p, at_new = x.copy(), x.copy()
        cos, sin = rope.cos_sin(pos)
        rope.apply(at_p, cos[:, None], sin[:, None])
        rope.rerotate(at_p, -3)
        cos, sin = rope.cos_sin(pos - 3)
        rope.apply(at_new, cos[:, None], sin[:, None])
        np.testing.assert_allclose(at_p, at_new, atol=1e-5)



def test_rope_rotation_of_a_batch_equals_the_pairwise_formula(tiny_model):
    """`rotate(x, rotation(pos))` (complex64 products for NORM pairs, cos/sin for NEOX) equals the real
    formula x0' = x0 cos - x1 sin, x1' = x0 sin + x1 cos on the mode's pairs, written out here."""
    for arch, mode in (("llama", "norm"), ("qwen2", "neox")):
        rope = Rope(tiny_model(arch=arch).hparams)
        assert rope.mode == mode and rope.complex_pairs == (mode == "norm")
        x = np.random.default_rng(1).standard_normal((4, 3, 16)).astype(np.float32)   # [T, n_heads, head_dim]
        pos = np.array([0, 5, 77, 1000])
        got = x.copy()
        rope.rotate(got, rope.rotation(pos))
        half = rope.n_rot // 2
        i0 = np.arange(0, rope.n_rot, 2) if mode == "norm" else np.arange(half)
        i1 = i0 + 1 if mode == "norm" else i0 + half
        ang = pos[:, None].astype(np.float64) * rope.inv_freq[None, :]                  # [T, n_rot/2]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        want = x.astype(np.float64)
        want[..., i0], want[..., i1] = x[..., i0] * c - x[..., i1] * s, x[..., i0] * s + x[..., i1] * c
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert not np.allclose(got, x, atol=1e-3)                                       # it did rotate

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
def test_smollm2_batched_decode_matches_single_sequence(smollm2):
    kv = smollm2.new_kv(2, 64)
    out = smollm2.forward_batch(kv, [(0, FRANCE_PROMPT, 0, True), (1, FRANCE_PROMPT[:9], 0, True)])
    alone = smollm2.new_kv(1, 64)
    [want] = smollm2.forward_batch(alone, [(0, FRANCE_PROMPT[:9], 0, True)])
    np.testing.assert_allclose(out[1], want, atol=1e-3)


@pytest.mark.parametrize("n_threads", [1, 3])
def test_matmul_layouts_and_thread_splits_agree_for_every_row_count(tiny_model, monkeypatch, n_threads):
    import engine.model.matmul as matmul_mod
    monkeypatch.setattr(matmul_mod, "_SPLIT_MIN_MACS", 0)     # split even tiny products
    lin = tiny_model().weights.layers[0].w_gate_up
    assert lin.blocks.shape[0] > 1
    x = np.random.default_rng(0).standard_normal((70, 64)).astype(np.float32)
    want = x.astype(np.float64) @ lin.weight.T.astype(np.float64)
    matmul = matmul_mod.Matmul(n_threads)
    for m in (1, 2, 5, 64, 65, 70):
        np.testing.assert_allclose(matmul(lin, x[:m]), want[:m], rtol=1e-5, atol=1e-5)
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
    np.testing.assert_allclose(two.forward_logits(ids), one.forward_logits(ids), atol=1e-5)


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
    assert np.abs(y[..., :8] - x[..., :8]).max() > 1e-3
    np.testing.assert_allclose(np.linalg.norm(y[..., :8], axis=-1), np.linalg.norm(x[..., :8], axis=-1), rtol=1e-5)
