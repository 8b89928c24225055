"""numerics="ggml" on its numba kernels (`engine.model.gkernels`) against the numpy reference (`engine.model.ggml`):
bit for bit (np.array_equal on the float32 results), op by op on random inputs of awkward shapes and for whole
forward passes (tiny random models, SmolLM2)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from engine.model import BatchChunk, load
from engine.model import ggml as G
from engine.model import numerics as N
from tests.engine.fma_cases import fma_inputs

K = G.kernels()
pytestmark = pytest.mark.skipif(K is None, reason="numba cannot be loaded")

RNG = np.random.default_rng(20261201)


# --- scalar primitives -----------------------------------------------------------------------------------------

def _f16_probe_values() -> np.ndarray:
    """float32 values around every fp16 rounding case: each binade from 2^-27 (below half the smallest fp16
    subnormal) to 2^17 (past the overflow to inf), with mantissas at, just below and just above the tie points
    of both the normal (13 dropped bits) and the subnormal (more dropped bits) ranges, random ones, and the
    float32 specials, both signs."""
    exps = np.arange(127 - 27, 127 + 18, dtype=np.uint32)
    ties = [0, 1, 0xFFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FE000, 0x7FEFFF, 0x7FF000, 0x7FF001, 0x7FFFFF]
    ties += [(1 << k) + d for k in range(13, 23) for d in (-1, 0, 1)]              # subnormal-range tie points
    mants = np.concatenate([np.array(ties, np.uint32), RNG.integers(0, 1 << 23, 200, dtype=np.uint32)])
    bits = ((exps[:, None] << 23) | mants[None, :]).reshape(-1)
    special = np.array([0, 1, 0x7FFFFF, 0x7F800000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001,
                        0x387FC000, 0x387FE000, 0x38800000], np.uint32)
    bits = np.concatenate([bits, special])
    bits = np.concatenate([bits, bits | np.uint32(0x80000000)])
    return bits.view(np.float32)


def test_f16_rounding_matches_numpy():
    x = _f16_probe_values()
    got = np.empty_like(x)
    K.f16_round_array(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))       # signs of zero included
    nan = np.array([np.nan], np.float32)
    K.f16_round_array(nan, nan)
    assert np.isnan(nan[0])


def test_fma_matches_numpy():
    """llvm.fma.f32 against ggml._fma (exact, tested against rational arithmetic in test_ggml.py): near-midpoint,
    tie, subnormal, signed-zero and overflowing operands, bit for bit."""
    a, b, c = fma_inputs(np.random.default_rng(11))
    got = np.empty_like(a)
    K.fma_array(a, b, c, got)
    with np.errstate(over="ignore"):
        want = G._fma(a, b, c)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("nib", [True, False], ids=["q4_1", "q5_1"])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_dot_kernels_round_each_fma_once(nib, m):
    """A lane chain built to end on a float32 tie: block 0 leaves acc = 1, block 1 adds xy * d_x * d_w =
    6605 * (162565 * 2^-30) * 2^-24 = 2^-24 + 2^-54, just past the midpoint of 1 and 1 + 2^-23 (lane 0 of block 1:
    weights 15, 15, 15, 10 and activation quants 127, 127, 127, 89). One rounding (ggml's fmadd) gives 1 + 2^-23;
    the float64 sum rounded again to float32 would give 1 (ties to even). Every output (300: 37 groups of 8 and a
    tail of 4), every row."""
    n_out, nb_ = 300, 2
    qw = np.zeros((nb_, 16 if nib else 32, n_out), np.uint8)
    qw[0, 0] = 1                                              # element 0 of block 0 (lane 0)
    qw[1, :4] = np.array([15, 15, 15, 10], np.uint8)[:, None]  # elements 0..3 of block 1 (lane 0)
    dw = np.ones((nb_, n_out), np.float32)
    dw[1] = 2.0 ** -24
    mw = np.zeros((nb_, n_out), np.float32)
    qx = np.zeros((m, 32 * nb_), np.int8)
    qx[:, 0] = 1
    qx[:, 32:36] = [127, 127, 127, 89]
    dx = np.ones((m, nb_), np.float32)
    dx[:, 1] = 162565 * 2.0 ** -30
    sx = np.zeros((m, nb_), np.float32)
    y = np.full((m, n_out), np.nan, np.float32)
    (K.dot_nib if nib else K.dot_byte)(*G.pack_blocks(qw, dw, mw), qx, dx, sx, y, 0, n_out)
    assert np.all(y == np.float32(1 + 2 ** -23)), np.unique(y)


def test_expf_matches_numpy():
    x = np.concatenate([np.linspace(-110, 100, 40001, dtype=np.float32),             # subnormal results .. inf
                        RNG.normal(0, 10, 20000).astype(np.float32),
                        np.array([0.0, -0.0, -np.inf, np.inf, -1e-30, 88.72, 88.73, -103.97, -87.34], np.float32)])
    got = np.empty_like(x)
    K.expf_array(x, got)
    assert np.array_equal(got.view(np.uint32), G.expf(x).view(np.uint32))
    nan = np.array([np.nan], np.float32)
    K.expf_array(nan, nan)
    assert np.isnan(nan[0])


# --- activation quantizers ---------------------------------------------------------------------------------------

def _activations(m: int, n: int) -> np.ndarray:
    """Rows of different scales, including an all-zero block and exact halves (ties of the rounding)."""
    x = (RNG.normal(0, 1, (m, n)) * 10.0 ** RNG.uniform(-4, 2, (m, 1))).astype(np.float32)
    x[0, :32] = 0.0
    if m > 1 and n >= 64:
        x[1, 32:40] = [127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5]
        x[1, 40:64] = 0.0
    return x


@pytest.mark.parametrize("m,n", [(1, 32), (3, 96), (17, 576), (2, 64)])
def test_q8_quantizer_matches_numpy(m, n):
    x = _activations(m, n)
    qx, d16, s = G.quantize_q8_compiled(x)
    q, _, d16_ref = G._q8_blocks(x)
    xq_ref, s_ref = G.quantize_q8_1(x)
    assert np.array_equal(qx, q.reshape(m, n))
    assert np.array_equal(d16, d16_ref) and np.array_equal(s, s_ref)
    assert qx.dtype == np.int8
    vals = np.empty(qx.shape, np.float32)
    K.q8_values(qx, d16, vals)
    assert np.array_equal(vals, xq_ref) and np.array_equal(vals, G.quantize_q8_0(x))


def test_q8_quantizer_blocks_of_extreme_values_match_numpy():
    """Blocks whose largest magnitude is a subnormal, a negative zero, the largest float32, or whose values are
    all -0.0: the largest-bit-pattern maximum is np.max's; a block holding an inf or a NaN takes the element-wise
    path and its scales are the reference's (NaN with NaN), the other blocks of its row unaffected."""
    x = _activations(3, 256)
    x[0, 0:32] = np.float32(1e-41) * RNG.normal(0, 1, 32).astype(np.float32)      # subnormals
    x[0, 32:64] = -0.0
    x[0, 64:96] = np.float32(3.4e38) * np.sign(RNG.normal(0, 1, 32)).astype(np.float32)
    x[1, 5] = np.inf
    x[1, 40] = np.nan
    x[2, 200] = -np.inf
    with np.errstate(invalid="ignore", over="ignore"):
        qx, d16, s = G.quantize_q8_compiled(x)
        q, _, d16_ref = G._q8_blocks(x)
        _, s_ref = G.quantize_q8_1(x)
    assert np.array_equal(d16, d16_ref, equal_nan=True) and np.array_equal(s, s_ref, equal_nan=True)
    finite = np.isfinite(q).reshape(x.shape)
    assert np.array_equal(qx[finite], q.reshape(x.shape)[finite])
    assert np.isnan(d16[1, 1]) and np.isinf(d16[1, 0]) and np.isinf(d16[0, 2])        # fp16(3.4e38 / 127) = inf


def test_q8_quantizer_rejects_a_row_length_that_is_not_a_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        G.quantize_q8_compiled(np.ones((2, 40), np.float32))


# --- the exact Q4_1 / Q5_1 product and GgmlMatmul -------------------------------------------------------------------

def _qlinear(type_names: list[str], n_out: list[int], n_in: int, edit=None) -> G.QLinear:
    """Random weights quantized with gguf-py, fused along the outputs (exact pieces for Q4_1/Q5_1/Q8_0; `edit`
    may change an exact piece's `quant.QPart` quants in place before the part is built)."""
    pieces = []
    for name, n in zip(type_names, n_out):
        qtype = GGMLQuantizationType[name]
        w = RNG.normal(0, 0.05, (n, n_in)).astype(np.float32)
        data = gguf_quants.quantize(w, qtype)
        if qtype in G.EXACT_DOT_TYPES | G.EXACT_Q8_0_TYPES:
            qp = G.exact_part(data, qtype, w.shape)
            if edit is not None:
                edit(qp.q)
            pieces.append((None, qtype, qp))
        else:
            pieces.append((gguf_quants.dequantize(data, qtype).astype(np.float32), qtype, None))
    return G.qlinear(pieces)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_1"])
@pytest.mark.parametrize("m", [1, 2, 4, 5, 7, 16, 17, 33])
@pytest.mark.parametrize("n_in,n_out", [(32, 1), (96, 70), (160, 300)])
def test_exact_dot_matches_numpy(type_name, m, n_in, n_out):
    lin = _qlinear([type_name], [n_out], n_in)
    [part] = lin.parts
    x = _activations(m, n_in)
    want = G.dot_q8_1(part, x)
    got = G.GgmlMatmul(1, compiled=True)(lin, x)
    assert got.dtype == np.float32 and np.array_equal(got, want)


@pytest.mark.parametrize("m", [1, 2, 5])
def test_q4_1_lane_sums_at_their_extremes(m):
    """pmaddubsw saturates its pair sums at int16: every nibble 15 and every activation quant +127 or -127 (a row
    of +-1: amax 1, q = +-127) gives pair sums of +-3810 and lane sums of +-7620, the largest there are; signs
    alternate per block so that both extremes occur. `dot_nib` gives `dot_q8_1`'s bits (neither a saturated sum
    nor one truncated to 8 bits would)."""
    def all_ones(q):
        q[:] = 255
    lin = _qlinear(["Q4_1"], [70], 96, edit=all_ones)
    [part] = lin.parts
    assert np.all(part.w.q == 255)
    x = np.ones((m, 96), np.float32)
    x[:, 32:64] = -1.0
    if m > 1:
        x[1] *= -1.0
    qx, d16, s = G.quantize_q8_compiled(x)
    assert np.abs(qx).min() == 127
    want = G.dot_q8_1(part, x)
    got = G.GgmlMatmul(1, compiled=True)(lin, x)
    assert np.all(np.isfinite(want)) and np.array_equal(got, want)


@pytest.mark.parametrize("m", [1, 3])
def test_q8_0_sign_trick_at_its_extremes(m):
    """Q8_0 weights are signed: the kernel multiplies |w| by the activation with w's sign (ggml's sign trick).
    Weights -128, 127, 0 and -1 against activation quants +-127 give pair sums up to 2 x 128 x 127 = 32512 in
    magnitude, just under pmaddubsw's saturation, and products with a zero weight; the bits are `dot_q8_1`'s."""
    def extremes(q):
        q[:] = np.array([-128, 127, 0, -1], np.int8)[np.arange(q.shape[1]) % 4][None, :, None]
        q[1] = -128
    lin = _qlinear(["Q8_0"], [70], 96, edit=extremes)
    [part] = lin.parts
    assert part.w.q.min() == -128
    x = np.ones((m, 96), np.float32)
    x[:, 1::4] = -1.0
    x[:, 32:64] *= -1.0
    want = G.dot_q8_1(part, x)
    got = G.GgmlMatmul(1, compiled=True)(lin, x)
    assert np.all(np.isfinite(want)) and np.array_equal(got, want)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 4, 33, 70])
def test_output_ranges_and_row_passes_give_the_numpy_product(type_name, m):
    """The kernels over output ranges (on groups of 16: the last group is a tail of 12 of 1100 outputs, and one
    range ends inside it) and over more rows than one pass holds (_ROWS_PER_PASS): every range gives its columns of
    `dot_q8_1`'s bits and writes nothing outside them; a range that does not start on a group is refused."""
    lin = _qlinear([type_name], [1100], 96)
    [part] = lin.parts
    x = _activations(m, 96)
    want = G.dot_q8_1(part, x)
    qx, d16, s = G.quantize_q8_compiled(x)
    q, d, mw = part.packed
    assert q.shape == (69, 3, 256 if part.nib else 512) and d.shape == mw.shape == (69, 3, 16)

    def run(y, o0, o1):
        if not part.has_m:
            K.dot_q8_0(q, d, qx, d16, y, o0, o1)
        else:
            (K.dot_nib if part.nib else K.dot_byte)(q, d, mw, qx, d16, s, y, o0, o1)
    y = np.full((m, part.n_out), np.nan, np.float32)
    for o0, o1 in ((64, 1094), (0, 64), (1088, 1100)):
        before = y.copy()
        run(y, o0, o1)
        assert np.array_equal(y[:, o0:o1], want[:, o0:o1]), (o0, o1)
        outside = np.ones(part.n_out, bool)
        outside[o0:o1] = False
        assert np.array_equal(y[:, outside], before[:, outside], equal_nan=True)
    assert np.array_equal(y, want)
    with pytest.raises(ValueError, match="not on a group"):
        run(y, 8, 64)


def _compiled_and_numpy(lin: G.QLinear, x: np.ndarray, n_threads: int) -> tuple[np.ndarray, np.ndarray]:
    """lin's product with x by the compiled `GgmlMatmul` and by the numpy one, on n_threads threads each."""
    ref, fast = G.GgmlMatmul(n_threads, compiled=False), G.GgmlMatmul(n_threads, compiled=True)
    try:
        return fast(lin, x), ref(lin, x)
    finally:
        ref.close()
        fast.close()


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("m", [1, 3, 40])
def test_ggml_matmul_matches_numpy_with_threads(n_threads, m):
    """Mixed parts (exact Q4_1 and Q8_0, F16 through BLAS, exact Q5_1), products large enough to be split over
    the threads: the compiled matmul gives the numpy one's bits."""
    n_in = 576
    lin = _qlinear(["Q4_1", "Q8_0", "F16", "Q5_1"], [1000, 64, 48, 264], n_in)
    assert [type(p).__name__ for p in lin.parts] == ["Q8_1DotPart", "Q8_0DotPart", "BlasPart", "Q8_1DotPart"]
    got, want = _compiled_and_numpy(lin, _activations(m, n_in), n_threads)
    assert got.shape == (m, lin.n_out) and np.array_equal(got, want)


# --- norm, SwiGLU ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,d", [(1, 16), (5, 100), (33, 576)])
def test_rms_norm_matches_numpy(t, d):
    x = (RNG.normal(0, 1, (t, d)) * 10.0 ** RNG.uniform(-3, 3, (t, 1))).astype(np.float32)
    w = RNG.normal(1, 0.3, d).astype(np.float32)
    assert np.array_equal(G.rms_norm_compiled(x, w, 1e-5), G.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("t,n", [(1, 24), (7, 1536)])
def test_silu_mul_matches_numpy_on_strided_views(t, n):
    gu = (RNG.normal(0, 4, (t, 2 * n))).astype(np.float32)
    gu[0, :4] = [-100.0, 100.0, 0.0, -0.0]                      # exp overflow, underflow, signed zeros
    a, b = np.empty((t, n), np.float32), np.empty((t, n), np.float32)
    G.silu_mul_compiled(gu[:, :n], gu[:, n:], a)
    G.silu_mul(gu[:, :n], gu[:, n:], b)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    c = np.empty((t, n), np.float32)
    K.silu_mul_gu(gu, n, c)                                     # the compiled layers' form: the halves in place
    assert np.array_equal(c.view(np.uint32), b.view(np.uint32))


# --- attention ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [16, 64, 144, 400])
def test_softmax_matches_numpy(n):
    """Rows of scores (with -inf padding) -> probabilities rounded to fp16, as `attend` uses them."""
    s = (RNG.normal(0, 1, (300, n)) * RNG.choice([0.3, 3.0, 30.0], (300, 1))).astype(np.float32)
    s[:, n - 5:] = -np.inf
    want = G.round_f16(G.softmax_rows(s))
    for row, w in zip(s, want):
        got = row.copy()
        K._softmax_f16(got, n)
        assert np.array_equal(got, w)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("m,n_old", [(1, 0), (1, 37), (1, 200), (2, 0), (7, 5), (8, 0), (9, 120), (20, 3)])
@pytest.mark.parametrize("n_head,n_head_kv,head_dim", [(9, 3, 64), (2, 2, 16), (4, 1, 80)])
def test_attention_matches_numpy(n_threads, m, n_old, n_head, n_head_kv, head_dim):
    """Chunks of one token (ggml_vec_dot_f16 order) and of several (tinyBLAS order, causal mask, blocks of 8),
    head_dims with and without a tail past the 64-lane steps, grouped-query heads, score scales from flat to
    peaked (probabilities that round to 0 in fp16), 2+ blocks over the threads."""
    cap = n_old + m + 5
    k = (RNG.normal(0, 1, (n_head_kv, cap, head_dim))).astype(np.float16)
    v = (RNG.normal(0, 1, (n_head_kv, cap, head_dim))).astype(np.float16)
    q = (RNG.normal(0, 1, (m, n_head, head_dim)) * RNG.choice([0.1, 1.0, 6.0], (1, n_head, 1))).astype(np.float32)
    mm = G.GgmlMatmul(n_threads)
    try:
        want = G.attend(q, k, v, n_old, mm)
        got = G.attend_compiled(q, k, v, n_old, mm)
    finally:
        mm.close()
    assert got.shape == (m, n_head * head_dim) and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_attention_with_an_f32_kv_store_uses_the_numpy_path():
    q = RNG.normal(0, 1, (3, 2, 16)).astype(np.float32)
    k = RNG.normal(0, 1, (2, 8, 16)).astype(np.float32)
    v = RNG.normal(0, 1, (2, 8, 16)).astype(np.float32)
    assert np.array_equal(G.attend_compiled(q, k, v, 2), G.attend(q, k, v, 2))


# --- whole forward passes ------------------------------------------------------------------------------------------

PROMPT = [5, 77, 12, 200, 3, 9, 150, 33, 281, 64, 7, 120, 1, 2, 3, 4, 5, 6, 7, 8]


def _run(model, prompt: list[int], steps: int) -> tuple[np.ndarray, bytes]:
    """Logits of every prompt row (the prompt in two chunks), then of `steps` greedy decode steps, and the
    KV state after them."""
    kv = model.new_kv(1, len(prompt) + steps + 1)
    cut = len(prompt) * 2 // 3
    [a] = model.forward_batch(kv, [BatchChunk(0, prompt[:cut], 0, range(cut))])
    [b] = model.forward_batch(kv, [BatchChunk(0, prompt[cut:], cut, range(len(prompt) - cut))])
    outs = [a, b]
    tok = int(b[-1].argmax())
    for i in range(steps):
        [r] = model.forward_batch(kv, [BatchChunk(0, [tok], len(prompt) + i, True)])
        outs.append(r)
        tok = int(r[-1].argmax())
    return np.concatenate(outs), kv.state_save(0)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("kw", [
    {"tensor_type": "Q4_1"},
    {"tensor_type": "Q5_1", "arch": "qwen2", "tied": False},
    {"tensor_type": "Q4_1", "n_embd": 128, "n_head": 2, "n_head_kv": 1, "n_ff": 320},   # head_dim 64, as SmolLM2
    {"tensor_type": "Q8_0"},
    {"tensor_type": "Q4_0", "arch": "qwen2"},
    {"tensor_type": "F16"},
], ids=["q4_1", "q5_1-qwen2-untied", "q4_1-hd64", "q8_0", "q4_0-qwen2", "f16"])
def test_forward_matches_numpy_on_tiny_models(tiny_gguf, kw, n_threads):
    path = tiny_gguf(**kw)
    ref = load(path, n_threads=n_threads, numerics=N.GGML_REFERENCE)
    fast = load(path, n_threads=n_threads, numerics="ggml")
    assert fast.num.compiled and not ref.num.compiled and fast.numerics == ref.numerics == "ggml"
    want_logits, want_kv = _run(ref, PROMPT, 4)
    got_logits, got_kv = _run(fast, PROMPT, 4)
    assert np.array_equal(got_logits, want_logits)
    assert got_kv == want_kv


def test_resolve_falls_back_to_f32_with_one_warning(monkeypatch):
    """Without numba, "ggml" (serve's default) resolves to "f32", with one warning that names the cause; the numpy
    reference stays available when asked for by its object."""
    monkeypatch.setattr(G, "_kernels", None)
    monkeypatch.setattr(G, "_kernels_error", "ImportError: no numba here")
    monkeypatch.setattr(G, "_warned", False)
    with pytest.warns(RuntimeWarning, match="falls back to 'f32'.*no numba here"):
        assert N.resolve("ggml") is N.NUMERICS["f32"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert N.resolve("ggml") is N.NUMERICS["f32"]                      # the warning comes once
    assert N.resolve(N.GGML_REFERENCE) is N.GGML_REFERENCE


# --- SmolLM2 ----------------------------------------------------------------------------------------------------------

@pytest.mark.realmodel
def test_smollm2_forward_matches_numpy(smollm2_path):
    """SmolLM2 (Q4_1 layers, Q8_0 tied head): an 8-token prompt and two decode steps, same bits."""
    ids = [504, 1463, 282, 260, 33059, 314, 253, 1463]
    ref = load(smollm2_path, n_threads=1, numerics=N.GGML_REFERENCE)
    want_logits, want_kv = _run(ref, ids, 2)
    del ref
    fast = load(smollm2_path, n_threads=1, numerics="ggml")
    got_logits, got_kv = _run(fast, ids, 2)
    assert np.array_equal(got_logits, want_logits)
    assert got_kv == want_kv


def test_fp16_cells_are_read_exactly():
    """Every fp16 bit pattern (normal, subnormal, zeros, inf, NaN) read as float32, as numpy's cast does."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(4, 256, 64)      # [heads, cells, hd]
    want = h.view(np.float16).astype(np.float32)
    got = np.empty((4, 200, 64), np.float32)
    K.kv_values(h, 200, got)
    got_t = np.empty((4, 64, 200), np.float32)
    K.kv_values_t(h, 200, got_t)
    w = want[:, :200]
    assert np.array_equal(got, w, equal_nan=True) and np.array_equal(got_t, w.transpose(0, 2, 1), equal_nan=True)
    finite = np.isfinite(w)
    assert np.array_equal(got.view(np.uint32)[finite], w.view(np.uint32)[finite])          # signs of zero too


@pytest.mark.parametrize("rope_type,n_rot", [("norm", 64), ("norm", 32), ("neox", 64), ("neox", 48)])
@pytest.mark.parametrize("delta", [-1, -7, -512, -100003, 3])
def test_context_shift_rerotation_of_fp16_cells_matches_numpy(rope_type, n_rot, delta):
    """`gkernels.rerotate_f16` against the numpy path (fp16 -> float32, `GgmlRope.apply`'s fma rotation, back to
    fp16): every finite fp16 bit pattern as a K value, strided cells of a 4-d [layer, head, cell, dim] view, both
    pair layouts and a partial rotation (dims past n_rot untouched), bit for bit (overflows to inf included)."""
    from engine.model.types import HParams
    hp = HParams("llama", 100, 4096, 256, 2, 512, 4, 2, 64, n_rot, rope_type, 10000.0, 1.0, 1e-5, False)
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    h = h[np.isfinite(h.view(np.float16))]                         # 63,488 finite patterns
    cells = np.resize(h, 2 * 2 * 256 * 64).reshape(2, 2, 256, 64)
    rng = np.random.default_rng(abs(delta))
    for a in cells.reshape(-1, 64):
        rng.shuffle(a)                                             # each pattern meets various partners
    store = np.zeros((2, 2, 300, 64), np.uint16)
    store[:, :, 20:276] = cells
    want = store.copy().view(np.float16)
    with np.errstate(over="ignore"):                              # values past fp16's range become inf
        G.GgmlRope(hp, compiled=False).rerotate(want[:, :, 20:276], delta)
    got = store.view(np.float16)
    G.GgmlRope(hp, compiled=True).rerotate(got[:, :, 20:276], delta)
    ok = ~np.isnan(want)
    assert np.array_equal(np.isnan(got), ~ok)
    assert np.array_equal(got.view(np.uint16)[ok], want.view(np.uint16)[ok])   # signs of zero and infs too
    assert not store[:, :, :20].any() and not store[:, :, 276:].any()      # cells outside the view
    assert np.array_equal(got[..., n_rot:].view(np.uint16)[:, :, 20:276], cells[..., n_rot:])


# --- the exact Q8_0 x Q8_0 product (output heads) ------------------------------------------------------------------

def _q8_0_head(n_out: int, n_in: int) -> G.QLinear:
    w = RNG.normal(0, 0.05, (n_out, n_in)).astype(np.float32)
    return G.exact_head(gguf_quants.quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0, w.shape)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 17])
@pytest.mark.parametrize("n_in,n_out", [(32, 1), (96, 70), (576, 4099)])
def test_q8_0_head_matches_numpy(n_threads, m, n_in, n_out):
    """`gkernels.dot_q8_0` (one row; rows in fours and pairs over output tiles) gives `ggml.dot_q8_1`'s bits for a
    `Q8_0DotPart`, with the outputs split over the threads; the result is the dequantized product up to the
    float32 rounding of the lane chains (a check that it is the right product, not only the same one)."""
    head = _q8_0_head(n_out, n_in)
    [part] = head.parts
    assert isinstance(part, G.Q8_0DotPart) and not part.has_m and part.act == "q8_0"
    x = _activations(m, n_in)
    got, want = _compiled_and_numpy(head, x, n_threads)
    assert got.shape == (m, n_out) and got.dtype == np.float32 and np.array_equal(got, want)
    xq = G.quantize_q8_0(x).astype(np.float64)
    wd = part.w.dense().astype(np.float64)                                       # [n_out, n_in]
    exact = xq @ wd.T
    # n_in/32 fmas per lane plus 3 additions, each within a relative 2^-24 of its operands' magnitudes
    k = n_in // 32 + 3
    bound = (k * 2.0 ** -24 / (1 - k * 2.0 ** -24)) * (np.abs(xq) @ np.abs(wd).T)
    assert np.all(np.abs(got - exact) <= bound)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_q8_0_kernel_rounds_each_fma_once(m):
    """The lane chain of `test_dot_kernels_round_each_fma_once` on `dot_q8_0`: 1 + 2^-24 + 2^-54 rounds once to
    1 + 2^-23 (300 outputs: groups and a tail; every row). Lane 0 of block 1: weights 127, -1 against
    activation quants 52, -1, so xy = 6604 + 1 = 6605 through both signs."""
    n_out, nb_ = 300, 2
    qw = np.zeros((nb_, 32, n_out), np.int8)
    qw[0, 0] = 1
    qw[1, :2] = np.array([127, -1], np.int8)[:, None]
    dw = np.ones((nb_, n_out), np.float32)
    dw[1] = 2.0 ** -24
    qx = np.zeros((m, 32 * nb_), np.int8)
    qx[:, 0] = 1
    qx[:, 32:34] = [52, -1]
    dx = np.ones((m, nb_), np.float32)
    dx[:, 1] = 162565 * 2.0 ** -30
    y = np.full((m, n_out), np.nan, np.float32)
    K.dot_q8_0(*G.pack_blocks(qw, dw, None)[:2], qx, dx, y, 0, n_out)
    assert np.all(y == np.float32(1 + 2 ** -23)), np.unique(y)



# --- the vector code without AVX2 --------------------------------------------------------------------------------

_ISA_CHECK = """
import sys
import numba
import numpy as np
from gguf import GGMLQuantizationType, quants
from engine.model import ggml as G, gkernels as K
run = sys.argv[1] == "run"
rng = np.random.default_rng(3)
for name, n_in, n_out, m in (("Q4_1", 96, 70, 1), ("Q5_1", 64, 37, 5), ("Q8_0", 96, 20, 3)):
    qt = GGMLQuantizationType[name]
    w = rng.normal(0, 0.05, (n_out, n_in)).astype(np.float32)
    lin = G.qlinear([(None, qt, G.exact_part(quants.quantize(w, qt), qt, w.shape))])
    x = rng.normal(0, 1, (m, n_in)).astype(np.float32)
    if run:
        got = G.GgmlMatmul(1, compiled=True)(lin, x)
        assert np.array_equal(got, G.dot_q8_1(lin.parts[0], x)), name
    else:                                   # compiled, not run: the host may lack the target's instructions
        p = lin.parts[0]
        qx, d16, s = G.quantize_q8_compiled(x)
        q, d, mw = p.packed
        y = np.empty((m, n_out), np.float32)
        args = (K._S8 if not p.has_m else K._NIB if p.nib else K._U8, q, d, mw, qx, d16, s, y, 0, n_out)
        K._dot_packed.compile(tuple(numba.typeof(a) for a in args))
asm = "".join(K._dot_packed.inspect_asm(s) for s in K._dot_packed.signatures)
print(*(k in asm for k in ("pmaddubsw", "vpdpbusd", "ymm", "zmm")))
"""


def _asm_flags(env: dict, run: bool = True) -> dict[str, bool]:
    """Which of pmaddubsw, vpdpbusd, ymm and zmm the dot kernels' code holds when compiled for env's target (a
    private cache directory: numba keys its cache by the target's features anyway); run: the kernels also ran
    and gave `dot_q8_1`'s bits for Q4_1, Q5_1 and Q8_0."""
    import os
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _ISA_CHECK, "run" if run else "compile"], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(("pmaddubsw", "vpdpbusd", "ymm", "zmm"), (v == "True" for v in out.stdout.split())))


def _host_has(*features: str) -> bool:
    from llvmlite import binding
    host = binding.get_host_cpu_features()
    return all(host.get(f, False) for f in features)


def test_dot_kernels_without_avx2_give_the_same_bits(tmp_path):
    """Compiled for baseline x86-64 (SSE2: NUMBA_CPU_NAME=x86-64, no features), the kernels take the plain
    widening multiplies instead of pmaddubsw / pmaddwd and give `dot_q8_1`'s bits for Q4_1, Q5_1 and Q8_0; the
    code has no AVX register."""
    f = _asm_flags({"NUMBA_CPU_NAME": "x86-64", "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path)})
    assert not any(f.values()), f


# Targets by their features (NUMBA_CPU_NAME + NUMBA_CPU_FEATURES), what their code must hold, and the host
# features it needs to run (otherwise it is compiled only).
_ISA_TARGETS = {
    "avx2": ("haswell", "+avx2,+fma,+avx,+sse4.2,+ssse3,+f16c", {"pmaddubsw", "ymm"}, ("avx2", "fma")),
    "avx-vnni": ("alderlake", "+avx2,+fma,+avx,+sse4.2,+ssse3,+f16c,+avxvnni", {"vpdpbusd", "ymm"},
                 ("avx2", "fma", "avxvnni")),
    "avx512vnni-256": ("icelake-server", "+avx2,+fma,+avx,+sse4.2,+ssse3,+f16c,+avx512f,+avx512vl,+avx512vnni",
                       {"vpdpbusd", "ymm"}, ("avx512f", "avx512vl", "avx512vnni")),     # no AVX512-BW: 256-bit
    "avx512bw": ("skylake-avx512", "+avx2,+fma,+avx,+sse4.2,+ssse3,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512dq",
                 {"pmaddubsw", "zmm"}, ("avx512f", "avx512bw", "avx512vl")),
    "avx512vnni": ("icelake-server", "+avx2,+fma,+avx,+sse4.2,+ssse3,+f16c,+avx512f,+avx512bw,+avx512vl,+avx512dq,"
                   "+avx512vnni", {"vpdpbusd", "zmm"}, ("avx512f", "avx512bw", "avx512vl", "avx512vnni")),
}


@pytest.mark.parametrize("isa", list(_ISA_TARGETS))
def test_dot_kernels_use_the_targets_integer_instructions(isa, tmp_path):
    """Compiled for each x86 integer-instruction level the kernels know, their code holds its instructions and
    registers: pmaddubsw on ymm (AVX2: a group of 16 outputs as two halves), vpdpbusd on ymm (AVX-VNNI), and on
    zmm (a whole group a register) pmaddubsw (AVX512-BW) or vpdpbusd (AVX512-VNNI). Where this CPU has the
    target's features the kernels also run and give `dot_q8_1`'s bits."""
    name, feats, want, needs = _ISA_TARGETS[isa]
    run = _host_has(*needs)
    f = _asm_flags({"NUMBA_CPU_NAME": name, "NUMBA_CPU_FEATURES": feats, "NUMBA_CACHE_DIR": str(tmp_path)}, run)
    held = {k for k, v in f.items() if v}
    assert want <= held, (isa, held)
    if "+avx512f" not in feats:
        assert "zmm" not in held, (isa, held)                         # no 512-bit register without AVX-512


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("n_out", [1, 8, 70])
def test_packed_parts_hold_the_quants_once_and_unpack_to_them(type_name, n_out):
    """A part holds its weights once, packed; its `w` (the reference's layout, made on first use) is the
    `quant.QPart` it was built from, bit for bit (q, d, and m where there are minimums)."""
    qtype = GGMLQuantizationType[type_name]
    w = RNG.normal(0, 0.05, (n_out, 64)).astype(np.float32)
    qp = G.exact_part(gguf_quants.quantize(w, qtype), qtype, w.shape)
    part = G.Q8_1DotPart.of(qp)
    assert "w" not in part.__dict__                     # not made until the reference asks for it
    assert part.nbytes[1] == part.q.nbytes + part.pd.nbytes + (part.pm.nbytes if qp.has_m else 0)
    u = part.w
    assert u.q.dtype == qp.q.dtype and np.array_equal(u.q, qp.q) and np.array_equal(u.d, qp.d)
    assert u.has_m == qp.has_m and u.nib == qp.nib
    if qp.has_m:
        assert np.array_equal(u.m.view(np.uint32), qp.m.view(np.uint32))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_q8_0_embedding_is_read_from_its_packed_part_with_the_f32_tables_values(tiny_gguf, tied):
    """ggml numerics keep no float32 copy of a Q8_0 token embedding: the rows come from the exact head's packed
    part (tied: the head's own), bit for bit the float32 table f32 numerics builds, in any order, repeated, and
    out-of-range ids are refused."""
    path = tiny_gguf(tensor_type="Q8_0", tied=tied)
    emb = load(path, n_threads=1, numerics="ggml").weights
    table = load(path, n_threads=1, numerics="f32").weights.tok_embd
    assert isinstance(emb.tok_embd, G.PackedEmbedding) and emb.tok_embd.shape == table.shape
    if tied:
        assert emb.tok_embd.part is emb.output.parts[0]
    ids = np.concatenate([np.arange(table.shape[0]), [0, 5, 5, table.shape[0] - 1]])[::-1]
    got = emb.tok_embd[ids]
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), table[ids].view(np.uint32))
    with pytest.raises(IndexError):
        emb.tok_embd[[table.shape[0]]]
