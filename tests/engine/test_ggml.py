"""numerics="ggml": llama.cpp's CPU arithmetic. Scalar references of ggml's algorithms, values recorded from
llama.cpp (llama-cpp-python 0.3.36, x86 AVX-512 build, SmolLM2 Q4_1), and the mode's own invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from engine.model import BatchChunk, load
from engine.model.kv import KVStore
from engine.model import ggml as G
from engine.model import numerics as N
from engine.model.tiny import tiny_tensors
from tests import numerics_bounds as nb
from tests.engine.fma_cases import double_rounded, fma_exact, fma_inputs, near_midpoint_inputs

PROMPT = [5, 77, 12, 200, 3, 9, 150, 33, 281, 64, 7, 120]


def f32(h: str) -> np.float32:
    return np.float32(float.fromhex(h))


# --- fma: one rounding, as _mm256_fmadd_ps ----------------------------------------------------------------------

def test_fma_is_correctly_rounded():
    """G._fma against exact rational arithmetic, bit for bit (signs of zero included), on near-midpoint,
    exact-tie, cancelling, wide-exponent, subnormal, signed-zero and overflowing operands."""
    a, b, c = fma_inputs(np.random.default_rng(7))
    want = np.array([fma_exact(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    with np.errstate(over="ignore"):
        got = G._fma(a, b, c)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    one = G._fma(np.float32(3.0), np.float32(0.5), np.float32(-0.25))           # scalars: a 0-d result
    assert one.shape == () and float(one) == 1.25


@pytest.mark.parametrize("subnormal", [False, True], ids=["normal", "subnormal"])
def test_fma_inputs_near_midpoints_tell_one_rounding_from_two(subnormal):
    """The near-midpoint operands are where a float64 sum rounded again to float32 (the double rounding this
    mode used before) goes the other way: each one a test that the double rounding fails."""
    a, b, c = near_midpoint_inputs(np.random.default_rng(8), 1000, subnormal=subnormal)
    want = np.array([fma_exact(x, y, z) for x, y, z in zip(a, b, c)], np.float32)
    assert np.array_equal(G._fma(a, b, c), want)
    wrong = double_rounded(a, b, c) != want
    assert wrong.sum() >= (900 if not subnormal else 500), wrong.sum()
    # the crafted tie of the kernel test: 1 + (2^-24 + 2^-54) is just past the midpoint of 1 and 1 + 2^-23
    x, y, z = np.float32(6605), np.float32(162565 * 2.0 ** -54), np.float32(1.0)
    assert G._fma(x, y, z) == np.float32(1 + 2 ** -23) and double_rounded(
        np.array([x]), np.array([y]), np.array([z]))[0] == np.float32(1.0)


@pytest.mark.skipif(not hasattr(math, "fma"), reason="math.fma needs Python 3.13")
def test_fma_matches_math_fma():
    """An independent oracle: math.fma is the float64 fma, and rounding it to float32 is the float32 fma
    wherever it is not a float32 midpoint (28 low fraction bits zero), i.e. everywhere a second rounding
    cannot go wrong."""
    a, b, c = fma_inputs(np.random.default_rng(9))
    r = np.array([math.fma(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)])
    safe = (r.view(np.int64) & ((1 << 28) - 1)) != 0
    with np.errstate(over="ignore"):
        assert np.array_equal(G._fma(a, b, c)[safe], r[safe].astype(np.float32))


# --- activation quantizers against scalar references ---------------------------------------------------------

def scalar_q8_1(x: list[float]) -> tuple[list[int], float, float]:
    """ggml-cpu x86 quantize_row_q8_1 for one block, element by element: (q, fp16 d, fp16 s)."""
    xs = [np.float32(v) for v in x]
    amax = np.float32(0)
    for v in xs:
        amax = max(amax, np.float32(abs(v)))
    d = np.float32(amax / np.float32(127))
    inv = np.float32(np.float32(127) / amax) if amax != 0 else np.float32(0)
    q = [round(float(np.float32(v * inv))) for v in xs]          # Python round(): half to even
    s = np.float16(np.float32(d * np.float32(sum(q))))
    return q, float(np.float16(d)), float(s)


VECTORS = [
    np.random.default_rng(1).normal(0, 1, 64).astype(np.float32),
    np.random.default_rng(2).normal(0, 30, 32).astype(np.float32),
    np.zeros(32, np.float32),                                        # amax 0: d = 0, q = 0
    np.array([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] + [0.0] * 24, np.float32),   # exact halves: to even
]


@pytest.mark.parametrize("vec", VECTORS, ids=["normal", "wide", "zeros", "ties"])
def test_q8_1_quantizer_matches_scalar_reference(vec):
    xq, s = G.quantize_q8_1(vec[None, :])
    q, d, _ = G._q8_blocks(vec[None, :])
    for b in range(vec.size // 32):
        rq, rd, rs = scalar_q8_1(list(vec[32 * b:32 * b + 32]))
        assert q[0, b].astype(int).tolist() == rq
        assert float(np.float16(d[0, b])) == rd and float(s[0, b]) == rs
        np.testing.assert_array_equal(xq[0, 32 * b:32 * b + 32], np.float32(rd) * np.array(rq, np.float32))


def test_q8_ties_round_to_even():
    q, _, _ = G._q8_blocks(VECTORS[3][None, :])
    assert q[0, 0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 4]


def test_q8_0_and_q8_k_match_scalar_references():
    x = np.random.default_rng(3).normal(0, 2, (2, 256)).astype(np.float32)
    got = G.quantize_q8_0(x)
    for r in range(2):
        for b in range(8):
            q, d, _ = scalar_q8_1(list(x[r, 32 * b:32 * b + 32]))
            np.testing.assert_array_equal(got[r, 32 * b:32 * b + 32], np.float32(d) * np.array(q, np.float32))
    got_k = G.quantize_q8_k(x)
    for r in range(2):                                               # quantize_row_q8_K_ref
        row = x[r]
        i = int(np.argmax(np.abs(row)))
        iscale = np.float32(np.float32(-127) / row[i])
        q = [min(127, round(float(np.float32(iscale * v)))) for v in row]
        d = np.float32(np.float32(1) / iscale)
        assert d < 0 or row[i] < 0                                   # the sign convention: d*q has x's sign
        np.testing.assert_array_equal(got_k[r], d * np.array(q, np.float32))


# --- weights and the exact Q4_1 x Q8_1 dot product -----------------------------------------------------------

@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_1"])
def test_block_params_reproduce_the_dequantized_weight(type_name):
    qtype = GGMLQuantizationType[type_name]
    w = np.random.default_rng(4).normal(0, 0.1, (48, 96)).astype(np.float32)
    data = gguf_quants.quantize(w, qtype)
    q, d, m = G.block_params(data, qtype, w.shape)
    assert q.min() >= 0 and q.max() <= (15 if type_name == "Q4_1" else 31) and np.all(q == np.round(q))
    rebuilt = np.repeat(d, 32, axis=1) * q + np.repeat(m, 32, axis=1)
    np.testing.assert_array_equal(rebuilt, gguf_quants.dequantize(data, qtype))
    # the layout the exact kernels read holds the same quants, scales and minimums
    lin = G.qlinear([(None, qtype, G.exact_part(data, qtype, w.shape))])
    [part] = lin.parts
    assert isinstance(part, G.Q8_1DotPart) and part.nib == (type_name == "Q4_1")
    np.testing.assert_array_equal(part.qw, np.ascontiguousarray(q.T.reshape(96 // 4, 4, 48)))
    np.testing.assert_array_equal(part.d, d.T)
    np.testing.assert_array_equal(part.m, m.T)


def _fma32(a: float, b: float, c: float) -> np.float32:
    return fma_exact(np.float32(a), np.float32(b), np.float32(c))


def scalar_vec_dot_q4_1_q8_1(q_w, d_w, m_w, x) -> np.float32:
    """ggml_vec_dot_q4_1_q8_1 (x86 AVX2 path) for one row, written out lane by lane."""
    acc = [np.float32(0)] * 8
    summs = np.float32(0)
    for b in range(x.size // 32):
        qx, dx, sx = scalar_q8_1(list(x[32 * b:32 * b + 32]))
        summs = _fma32(m_w[b], sx, summs)
        d0d1 = np.float32(np.float32(d_w[b]) * np.float32(dx))
        for lane in range(8):
            xy = sum(int(q_w[32 * b + 4 * lane + j]) * qx[4 * lane + j] for j in range(4))
            acc[lane] = _fma32(d0d1, xy, acc[lane])
    r = [np.float32(acc[i + 4] + acc[i]) for i in range(4)]
    return np.float32(np.float32(np.float32(r[0] + r[2]) + np.float32(r[1] + r[3])) + summs)


def test_q4_1_dot_matches_the_scalar_kernel_bit_for_bit():
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.05, (24, 128)).astype(np.float32)
    qtype = GGMLQuantizationType.Q4_1
    data = gguf_quants.quantize(w, qtype)
    lin = G.qlinear([(None, qtype, G.exact_part(data, qtype, w.shape))])
    [part] = lin.parts
    assert isinstance(part, G.Q8_1DotPart)
    q, d, m = G.block_params(data, qtype, w.shape)
    x = rng.normal(0, 1, (3, 128)).astype(np.float32)
    got = G.dot_q8_1(part, x)
    want = np.array([[scalar_vec_dot_q4_1_q8_1(q[o], d[o], m[o], x[r]) for o in range(24)] for r in range(3)])
    np.testing.assert_array_equal(got, want)
    xq, s = G.quantize_q8_1(x)                                         # same math, BLAS's summation order
    dq = np.repeat(d, 32, axis=1) * q                                   # exact in float32: fp16 d x 4-bit q
    blas = xq @ dq.T + s @ m.T
    # both are float32 evaluations of sum_i xq_i dq_i + sum_b s_b m_b (ggml's with d_w d_x rounded once per
    # block, then integer sums, fma chains and an 8-lane sum): each within gamma_(n_in + 1) of it, any order
    exact64 = xq.astype(np.float64) @ dq.T.astype(np.float64) + s.astype(np.float64) @ m.T.astype(np.float64)
    bound = nb.dot_bound(np.abs(xq.astype(np.float64)), np.abs(dq.T.astype(np.float64)), 128 + 1) + nb.dot_bound(
        np.abs(s.astype(np.float64)), np.abs(m.T.astype(np.float64)), 128 + 1)
    nb.check_within(got, exact64, bound, "ggml kernel")
    nb.check_within(blas, exact64, bound, "BLAS")
    assert not np.array_equal(got, blas.astype(np.float32))


# --- values recorded from llama.cpp ------------------------------------------------------------------------------

# SmolLM2 layer 0, head 0, query 7 of an 8-token prompt: KQ row (before the scale) and llama.cpp's soft_max
KQ_ROW = ["0x1.2bfc32p+3", "0x1.41ebd4p+3", "0x1.416ce4p+2", "0x1.08f3d0p+4", "0x1.e38884p+2", "0x1.63683ap+3",
          "0x1.213418p+4", "0x1.31466cp+3"]
SOFTMAX_ROW = ["0x1.6f5112p-4", "0x1.902dd6p-4", "0x1.aa6214p-5", "0x1.c2e134p-3", "0x1.2499bap-4",
               "0x1.c81a1ap-4", "0x1.107764p-2", "0x1.76fc5cp-4"]
# layer 0 ffn_gate / ffn_up / ffn_swiglu, token 3, first 16 units
GATE = ["-0x1.cd6da4p-2", "-0x1.e18fb8p-3", "-0x1.bc823ap-2", "0x1.edbdd0p-3", "-0x1.2df5ecp-2", "0x1.8f6b00p-5",
        "0x1.002dd0p-5", "0x1.6c7a00p-5", "0x1.8e7994p-3", "0x1.baafe0p-7", "-0x1.6ed258p-4", "-0x1.f9f744p-3",
        "0x1.ed3720p-5", "-0x1.a36576p-2", "-0x1.41faf6p-3", "-0x1.4c725cp-2"]
UP = ["-0x1.3937e8p-4", "-0x1.021558p-2", "-0x1.3911a0p-6", "0x1.5a244ep-3", "-0x1.8f3050p-5", "-0x1.8d0af8p-3",
      "-0x1.a4d560p-5", "-0x1.1c50acp-4", "-0x1.e692b0p-4", "0x1.66c6c0p-4", "0x1.2c01eep-4", "-0x1.7f855ap-2",
      "-0x1.1bba2ap-4", "0x1.071bacp-3", "-0x1.449b4ap-2", "0x1.5d3260p-6"]
SWIGLU = ["0x1.b778c4p-7", "0x1.acaa28p-6", "0x1.ab6ef0p-9", "0x1.75d74cp-6", "0x1.91ee70p-8", "-0x1.3d49b2p-8",
          "-0x1.abb63ep-11", "-0x1.9dcb12p-10", "-0x1.9f68fcp-7", "0x1.384d3cp-11", "-0x1.9aa4c6p-9",
          "0x1.4c6bbep-5", "-0x1.198afcp-9", "-0x1.57fc1ap-6", "0x1.783de8p-6", "-0x1.7c80a0p-9"]


def test_softmax_matches_llama_cpp_bit_for_bit():
    row = np.array([f32(h) for h in KQ_ROW]) * G.attention_scale(64)
    padded = np.concatenate([row, np.full(8, -np.inf, np.float32)])     # masked cells, as in the KV padding
    got = G.softmax_rows(padded[None])[0]
    np.testing.assert_array_equal(got[:8], [f32(h) for h in SOFTMAX_ROW])
    assert np.all(got[8:] == 0)
    plain = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
    assert not np.array_equal(plain.astype(np.float32), got[:8])        # float32 numpy differs in the last bits


def test_swiglu_matches_llama_cpp_bit_for_bit():
    gu = np.array([[f32(h) for h in GATE + UP]])
    np.testing.assert_array_equal(G.swiglu(gu, 16)[0], [f32(h) for h in SWIGLU])


def test_expf_is_close_to_exp_and_saturates():
    """G.expf is element-wise IEEE arithmetic (correctly rounded fmas; no libm, no
    SIMD-dependent ufunc), so its bits are the same on every machine; rtol 4e-7 (6.7 u) is ggml's polynomial's accuracy
    over this range, measured once, not a machine-dependent margin."""
    x = np.linspace(-87, 88, 20001, dtype=np.float32)                 # normal float32 results
    got = G.expf(x).astype(np.float64)
    np.testing.assert_allclose(got, np.exp(x.astype(np.float64)), rtol=4e-7)
    assert G.expf(np.array([-np.inf, -200.0, 200.0], np.float32)).tolist() == [0.0, 0.0, np.inf]


# --- the mode end to end on tiny models ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_pair(tiny_gguf):
    def make(**kw):
        path = tiny_gguf(**kw)
        return load(path, n_threads=1), load(path, n_threads=1, numerics="ggml")
    return make


@pytest.mark.parametrize("tensor_type", ["Q4_1", "Q8_0"])
def test_ggml_mode_is_close_to_f32_mode_but_not_identical(tiny_pair, tensor_type):
    f32_model, ggml_model = tiny_pair(tensor_type=tensor_type)
    assert ggml_model.numerics == "ggml" and ggml_model.new_kv(1, 8).dtype == np.float16
    a, b = f32_model.forward_logits(PROMPT), ggml_model.forward_logits(PROMPT)
    assert b.shape == a.shape and b.dtype == np.float32
    assert not np.array_equal(a, b)
    # a modelling band, not an arithmetic bound: ggml mode quantizes every activation to 8 bits (relative
    # steps of ~1/254 per product, compounding over the layers), which moves the logits by ~1e-2 of their
    # range; float32 summation order moves either mode by less than 1e-5 of it (test_forward), far inside
    assert np.abs(b - a).max() <= 0.05 * np.abs(a).max()
    assert (a.argmax(1) == b.argmax(1)).mean() >= 0.75


def test_ggml_mode_is_deterministic(tiny_pair):
    _, model = tiny_pair(tensor_type="Q4_1")
    np.testing.assert_array_equal(model.forward_logits(PROMPT), model.forward_logits(PROMPT))


def _logits_and_head_bound(model, kv, chunks):
    """forward_batch(kv, chunks), the head's input rows (the final hidden states, before their 8-bit
    quantization) and, per logit, the largest difference two float32 summation orders of the head can make.

    The head is a float32 dot product of length K = n_embd between the quantized hidden state a (the values
    `quantize_activations` gives; llama.cpp's Q8_0 blocks times their fp16 scale, exact in float32) and a
    weight row w_j. Any summation order gives the exact dot to within gamma_K * sum_i |a_i| |w_ji| (Higham,
    "Accuracy and Stability of Numerical Algorithms", 3.1), so two orders differ by at most twice that."""
    head = model.weights.output
    [part] = head.parts
    seen = []
    real = type(model.matmul).__call__

    def spy(self, lin, x):
        if lin is head:
            seen.append(x.copy())
        return real(self, lin, x)
    type(model.matmul).__call__ = spy
    try:
        out = model.forward_batch(kv, chunks)
    finally:
        type(model.matmul).__call__ = real
    [x] = seen
    if isinstance(part, G.Q8_0DotPart):                                           # replayed exactly: no bound
        return out, x, np.zeros((x.shape[0], part.n_out))
    a = np.abs(G.quantize_activations(part.act, x).astype(np.float64))          # [R, K]
    w = np.abs(part.lin.t.astype(np.float64))                                     # [K, n_vocab]
    return out, x, 2 * nb.dot_bound(a, w)


def test_ggml_mode_batching_and_chunking_are_exact(tiny_gguf):
    """Every row's arithmetic depends only on its own sequence: two sequences in one batch, or a prompt cut
    into two chunks of 2+ tokens, give the same bits as one chunk alone in the whole KV cache. The logits
    differ only by the output head, which BLAS sums in an order that depends on the row count and on the CPU
    kernel OpenBLAS picks: they are held to the bound that float32 summation guarantees for any order."""
    path = tiny_gguf(tensor_type="Q4_1", arch="qwen2")
    model = load(path, n_threads=1, numerics="ggml")
    other = [9, 8, 7, 6, 5]
    n = len(PROMPT)
    kv1 = model.new_kv(1, 32)
    [alone], h_alone, bound = _logits_and_head_bound(model, kv1, [BatchChunk(0, PROMPT, 0, range(n))])
    kv = model.new_kv(2, 32)
    both, h_both, _ = _logits_and_head_bound(model, kv, [BatchChunk(0, PROMPT, 0, range(n)),
                                                         BatchChunk(1, other, 0, range(len(other)))])
    assert kv.state_save(0) == kv1.state_save(0)
    np.testing.assert_array_equal(h_both[:n], h_alone)                  # the head's input: the same bits
    nb.check_within(both[0], alone, bound, "batched")
    kv2 = model.new_kv(1, 32)
    [first], h_first, _ = _logits_and_head_bound(model, kv2, [BatchChunk(0, PROMPT[:5], 0, range(5))])
    [second], h_second, _ = _logits_and_head_bound(model, kv2, [BatchChunk(0, PROMPT[5:], 5, range(n - 5))])
    assert kv2.state_save(0) == kv1.state_save(0)
    np.testing.assert_array_equal(np.concatenate([h_first, h_second]), h_alone)
    nb.check_within(np.concatenate([first, second]), alone, bound, "chunked")
    [step] = model.forward_batch(kv2, [BatchChunk(0, [42], len(PROMPT), True)])   # one-token (decode) path
    assert np.all(np.isfinite(step))
    assert bound.max() < 1e-2 * np.abs(alone).max()    # the bound is tight enough to catch a wrong product


@pytest.mark.parametrize("n_threads", [1, 2])
def test_ggml_q8_0_head_is_exact_in_batches_and_chunks(tiny_gguf, n_threads):
    """A Q8_0 head is replayed as ggml_vec_dot_q8_0_q8_0 (`Q8_0DotPart`): each logit depends only on its own
    row, so a sequence batched with another, or its prompt cut into chunks, gives the same logits bit for bit,
    and the compiled kernels give the numpy reference's bits."""
    path = tiny_gguf(tensor_type="Q8_0", arch="qwen2")
    model = load(path, n_threads=n_threads, numerics="ggml")
    ref = load(path, n_threads=n_threads, numerics=N.GGML_REFERENCE)
    assert isinstance(model.weights.output.parts[0], G.Q8_0DotPart)
    other = [9, 8, 7, 6, 5]
    n = len(PROMPT)
    [alone] = model.forward_batch(model.new_kv(1, 32), [BatchChunk(0, PROMPT, 0, range(n))])
    both = model.forward_batch(model.new_kv(2, 32), [BatchChunk(0, PROMPT, 0, range(n)),
                                                     BatchChunk(1, other, 0, range(len(other)))])
    np.testing.assert_array_equal(both[0], alone)
    kv = model.new_kv(1, 32)
    [first] = model.forward_batch(kv, [BatchChunk(0, PROMPT[:5], 0, range(5))])
    [second] = model.forward_batch(kv, [BatchChunk(0, PROMPT[5:], 5, range(n - 5))])
    np.testing.assert_array_equal(np.concatenate([first, second]), alone)
    ref_both = ref.forward_batch(ref.new_kv(2, 32), [BatchChunk(0, PROMPT, 0, range(n)),
                                                     BatchChunk(1, other, 0, range(len(other)))])
    for got, want in zip(both, ref_both):
        np.testing.assert_array_equal(got, want)


def test_ggml_weights_use_the_exact_kernel_for_q4_1(tiny_pair):
    _, model = tiny_pair(tensor_type="Q4_1")
    lw = model.weights.layers[0]
    for lin in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down):
        assert all(isinstance(p, G.Q8_1DotPart) for p in lin.parts)
    assert isinstance(model.weights.output.parts[0], G.BlasPart)         # the head: approximate on purpose
    written = tiny_tensors(tensor_type="Q4_1")["blk.0.attn_q.weight"].values
    assert model.weights.layers[0].wqkv.parts[0].qw.shape == (written.shape[1] // 4, 4, lw.wqkv.n_out)


def test_unknown_numerics_is_refused(tiny_gguf):
    with pytest.raises(ValueError, match="numerics"):
        load(tiny_gguf(), numerics="exact")


# --- SmolLM2 against logits recorded from llama.cpp ----------------------------------------------------------------

SMOLLM2_IDS = [504, 1463, 282, 260, 33059, 314, 253, 1463]             # the validation text's first 8 tokens
SMOLLM2_ARGMAX = [29, 282, 260, 5594, 506, 5076, 21651, 282]
SMOLLM2_MAX = ["0x1.b28436p+4", "0x1.f1026cp+4", "0x1.8fb962p+3", "0x1.0d4c40p+3", "0x1.02b702p+4", "0x1.675840p+4",
               "0x1.607032p+4", "0x1.a7b58ep+4"]


@pytest.mark.realmodel
def test_smollm2_ggml_mode_reproduces_llama_cpp(smollm2_path):
    ggml_model = load(smollm2_path, n_threads=1, numerics="ggml")
    n = len(SMOLLM2_IDS)
    [logits], _, bound = _logits_and_head_bound(ggml_model, ggml_model.new_kv(1, n),
                                                [BatchChunk(0, SMOLLM2_IDS, 0, range(n))])
    want = np.array([f32(h) for h in SMOLLM2_MAX])
    assert logits.argmax(1).tolist() == SMOLLM2_ARGMAX
    # the tied Q8_0 head is replayed too (ggml_vec_dot_q8_0_q8_0): llama.cpp's logits, bit for bit
    assert isinstance(ggml_model.weights.output.parts[0], G.Q8_0DotPart) and not bound.any()
    np.testing.assert_array_equal(logits.max(1), want)
    f32_model = load(smollm2_path, n_threads=1)
    assert np.abs(f32_model.forward_logits(SMOLLM2_IDS).max(1) - want).max() > 1e-2   # what f32 mode does


def test_ggml_decode_steps_of_several_sequences_match_one_thread(tiny_gguf):
    """One-token chunks of several sequences, attended one by one and spread over the threads: the same logits
    and KV cells, bit for bit, as on one thread and as each sequence stepped alone (a Q8_0 model: its head is
    exact too, where a BLAS head's order would depend on the row count)."""
    path = tiny_gguf(tensor_type="Q8_0")
    prompts = [PROMPT, PROMPT[:7], [9, 8, 7, 6, 5]]
    runs = []
    for n_threads, together in ((1, True), (2, True), (2, False)):
        model = load(path, n_threads=n_threads, numerics="ggml")
        kv = model.new_kv(len(prompts), 32)
        for s, p in enumerate(prompts):
            model.forward_batch(kv, [BatchChunk(s, p, 0, False)])
        steps = [BatchChunk(s, [40 + s], len(p), True) for s, p in enumerate(prompts)]
        out = (model.forward_batch(kv, steps) if together
               else [model.forward_batch(kv, [c])[0] for c in steps])
        runs.append((out, [kv.state_save(s) for s in range(len(prompts))]))
    for out, states in runs[1:]:
        for got, want in zip(out, runs[0][0]):
            np.testing.assert_array_equal(got, want)
        assert states == runs[0][1]


def _shadow_is_current(kv) -> int:
    """Every allocated float32 shadow's current cells equal the store's fp16 values; returns how many were checked."""
    checked = 0
    for seq in range(kv.n_seq):
        s = kv._seqs[seq]
        if s.shadow is None:
            continue
        for il in range(kv.n_layer):
            n = min(int(s.shadow.valid[il]), s.n)
            want_k = s.k[il][:, :n].astype(np.float32).transpose(0, 2, 1)
            assert np.array_equal(s.shadow.kt[il][:, :, :n], want_k)
            assert np.array_equal(s.shadow.v[il][:, :n], s.v[il][:, :n].astype(np.float32))
            checked += n
    return checked


@pytest.mark.parametrize("n_threads", [1, 2])
def test_ggml_kv_shadow_follows_every_kv_operation(tiny_gguf, n_threads):
    """The compiled attention reads the cells' float32 shadow, converted once when written: through removals,
    shifts (re-rotated K), re-sorting, copies, state save/restore, clearing and capacity growth its logits stay
    the numpy reference's (which converts every cell each step) bit for bit, and the shadow equals the cells."""
    path = tiny_gguf(tensor_type="Q8_0")
    models = [load(path, n_threads=n_threads, numerics="ggml"),
              load(path, n_threads=n_threads, numerics=N.GGML_REFERENCE)]
    kvs = [m.new_kv(3, 160) for m in models]
    n_checked = [0]

    def run(*chunks):
        outs = [m.forward_batch(kv, [BatchChunk(*c) for c in chunks]) for m, kv in zip(models, kvs)]
        for got, want in zip(*outs):
            np.testing.assert_array_equal(got, want)
        n_checked[0] += _shadow_is_current(kvs[0])
        assert kvs[1].shadow_bytes == 0                   # the reference never asks for one

    def both(op, *args):
        return [getattr(kv, op)(*args) for kv in kvs]

    def nxt(seq):
        return kvs[0].pos_max(seq) + 1

    run((0, PROMPT, 0, True), (1, PROMPT[:5], 0, True))
    run((0, [40], nxt(0), True), (1, [41], nxt(1), True))
    both("seq_rm", 0, 3, 6)                               # cells in the middle removed: the rest move down
    run((0, [42], nxt(0), True), (1, [43], nxt(1), True))
    both("seq_add", 0, 6, -1, -3)                         # context shift: K re-rotated in place
    run((0, [44], nxt(0), True))
    both("seq_add", 1, 0, 3, 20)                          # a range moved past its neighbours: re-sorted
    run((1, [45], nxt(1), True))
    both("seq_cp", 0, 1)                                  # dst's cells replaced
    run((0, [46], nxt(0), True), (1, [47], nxt(1), True), (2, PROMPT[:3], 0, True))
    blob = kvs[0].state_save(0)
    assert kvs[1].state_save(0) == blob
    for kv in kvs:
        kv.state_load(2, blob)                            # restore into another sequence
    run((2, [48, 49], nxt(2), [0, 1]), (0, [50], nxt(0), True))
    both("seq_rm", 1, -1, -1)
    run((1, PROMPT * 6, 0, [0, 40, 71]))                  # 72 cells: past the first capacity (64), the pool grows
    run((0, [51], nxt(0), True), (1, [52], nxt(1), True), (2, [53], nxt(2), True))
    assert kvs[0].pool_cap == 160 and kvs[0]._seqs[2].shadow.v.shape[2] == 160   # the arrays' capacity
    run((0, PROMPT * 5, nxt(0), [0, 59]))
    both("clear")
    run((0, PROMPT[:4], 0, True))
    assert n_checked[0] > 0
    # sequences with arrays of their own (no pool: pool_max_bytes 0) regrow them by doubling, and their shadow
    # with them, its current cells kept
    hp = models[0].hparams
    kvs[:] = [KVStore(2, 200, hp.n_layer, hp.n_head_kv, hp.head_dim, m.rope, dtype=np.float16, pool_max_bytes=0)
              for m in models]
    run((0, PROMPT * 4, 0, True))
    assert kvs[0]._seqs[0].shadow.v.shape[2] == 64 and not kvs[0]._seqs[0].pooled
    run((0, PROMPT * 2, nxt(0), [0, 23]))                 # 72 cells: arrays and shadow doubled
    assert kvs[0]._seqs[0].shadow.v.shape[2] == 128 and kvs[0].n_tokens(0) == 72
    assert kvs[0].shadow_bytes > 0


def test_shadow_current_converts_every_cell_and_changes_no_logit(tiny_gguf):
    """`Model.shadow_current` leaves a sequence's shadow as its decoding would have left it: every layer current
    through the last cell (equal to the fp16 cells), so a following step converts only its own cells; the step's
    logits are the same bits as without it. Other modes: a no-op."""
    path = tiny_gguf(tensor_type="Q8_0")
    model = load(path, n_threads=1, numerics="ggml")
    kvs = [model.new_kv(2, 160) for _ in range(2)]
    for kv in kvs:
        model.forward_batch(kv, [BatchChunk(0, PROMPT * 3, 0, True)])
        kv.state_load(1, kv.state_save(0))                # a loaded sequence: nothing of its shadow is current
    s = kvs[0].seq_kv(1)
    assert s.shadow is None or int(s.shadow.valid.max()) == 0
    model.shadow_current(kvs[0], 1)
    assert (s.shadow.valid == s.n).all() and _shadow_is_current(kvs[0]) >= s.n * kvs[0].n_layer
    n = s.n
    outs = [model.forward_batch(kv, [BatchChunk(1, [7], n, True)]) for kv in kvs]
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    f32 = load(path, n_threads=1)
    kv = f32.new_kv(1, 64)
    f32.forward_batch(kv, [BatchChunk(0, PROMPT, 0, True)])
    f32.shadow_current(kv, 0)
    assert kv.shadow_bytes == 0
