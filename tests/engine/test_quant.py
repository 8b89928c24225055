"""numerics "q": weights kept in their quant blocks, numba kernels (engine.model.quant / qkernels).

Tolerances follow from the arithmetic: the blocks decode to exactly what gguf's dequantizer gives (d*q is exact
in float32, one rounding for + m), and a kernel's float32 product differs from the float64 one by at most
gamma_K * sum_i (|d q_i| + |m|) |x_i| (K = the number of float32 operations in a chain, any summation order),
whatever kernel, BLAS or vector width the machine has."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from engine.model import load
from engine.model import quant
from engine.model.numerics import resolve
from tests.engine.forward_check import checked_forward

pytestmark = pytest.mark.skipif(not quant.available(), reason="numba cannot be loaded")

T = GGMLQuantizationType
TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
U = np.finfo(np.float32).eps / 2
# byte offsets of the fp16 super-block scales: d, dmin (Q4_K, Q5_K); d (Q6_K)
K_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _kw(tensor_type: str) -> dict:
    """tiny_gguf arguments: K-quant rows must be multiples of 256 (smaller ones would fall back to F16)."""
    return {"tensor_type": tensor_type} | ({"n_embd": 256, "n_ff": 256} if tensor_type in K_TYPES else {})


def _bound(part: quant.QPart | quant.HalfPart, x: np.ndarray) -> np.ndarray:
    """gamma_K * sum_i (|d q_i| + |m|) |x_i| per output, K = n_in + 8 (float64); 16-bit parts:
    gamma_K * sum_i |w_i| |x_i|, K = n_in + 1 (the sum's roundings and the scale applied to it)."""
    if isinstance(part, quant.HalfPart):
        k = part.n_in + 1
        return k * U / (1 - k * U) * (np.abs(x.astype(np.float64)) @ np.abs(part.dense().astype(np.float64)).T)
    nb, bs = part.q.shape[0], part.block
    q = (np.concatenate([part.q & 15, part.q >> 4], axis=1) if part.nib else part.q).astype(np.float64)
    dq = np.abs(q * part.d[:, None, :].astype(np.float64)).reshape(nb * bs, -1)     # [n_in, n_out]
    mm = np.repeat(np.abs(part.m.astype(np.float64)) if part.has_m else 0 * part.d, bs, axis=0)
    k = part.n_in + 8
    return k * U / (1 - k * U) * (np.abs(x.astype(np.float64)) @ (dq + mm))


def _k_blocks(qtype: GGMLQuantizationType, ne1: int, ne0: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw K-quant rows [ne1, row bytes]: every byte random, the fp16 scales any finite value (either
    sign, zero, subnormal, up to 65504)."""
    size = GGML_QUANT_SIZES[qtype][1]
    blk = rng.integers(0, 256, (ne1, ne0 // 256, size), dtype=np.uint8)
    for off in K_SCALES[qtype]:
        h = rng.integers(0, 1 << 16, (ne1, ne0 // 256), dtype=np.uint16)
        h = np.where((h & 0x7C00) == 0x7C00, h & 0x83FF, h).astype(np.uint16)      # inf / NaN -> finite
        blk[..., off:off + 2] = h[..., None].view(np.uint8)
    return blk.reshape(ne1, -1)


def _f16(b: np.ndarray, off: int) -> float:
    return float(b[off:off + 2].copy().view(np.float16)[0])


def _scale_min(j: int, sc: np.ndarray) -> tuple[int, int]:
    if j < 4:
        return int(sc[j]) & 63, int(sc[j + 4]) & 63
    return (int(sc[j + 4]) & 15) | ((int(sc[j - 4]) >> 6) << 4), (int(sc[j + 4]) >> 4) | ((int(sc[j]) >> 6) << 4)


def _scalar_row(b: np.ndarray, qtype: GGMLQuantizationType) -> list[float]:
    """One super-block dequantized by a direct transcription of llama.cpp's loops (dequantize_row_q4_K /
    _q5_K / _q6_K, ggml-quants.c), float32 step by step: an oracle independent of gguf-py's numpy code."""
    f = np.float32
    y: list[float] = []
    if qtype == T.Q6_K:
        d = f(_f16(b, 208))
        sc = b[192:208].view(np.int8)
        y = [0.0] * 256
        for n in range(2):
            ql, qh = b[64 * n:64 * n + 64], b[128 + 32 * n:128 + 32 * n + 32]
            for lo in range(32):
                qs = [(ql[lo] & 15) | (((qh[lo] >> 0) & 3) << 4), (ql[lo + 32] & 15) | (((qh[lo] >> 2) & 3) << 4),
                      (ql[lo] >> 4) | (((qh[lo] >> 4) & 3) << 4), (ql[lo + 32] >> 4) | (((qh[lo] >> 6) & 3) << 4)]
                for k in range(4):
                    y[128 * n + 32 * k + lo] = float(d * f(sc[8 * n + lo // 16 + 2 * k]) * f(int(qs[k]) - 32))
        return y
    d, dmin = f(_f16(b, 0)), f(_f16(b, 2))
    qs = b[16:144] if qtype == T.Q4_K else b[48:176]
    qh = b[16:48]
    for c in range(4):
        for half in range(2):
            s, mn = _scale_min(2 * c + half, b[4:16])
            d1, m1 = d * f(s), dmin * f(mn)
            for lo in range(32):
                q = (int(qs[32 * c + lo]) >> (4 * half)) & 15
                if qtype == T.Q5_K and qh[lo] & (1 << (2 * c + half)):
                    q += 16
                y.append(float(d1 * f(q) - m1))
    return y


@pytest.mark.parametrize("tensor_type", K_TYPES)
def test_k_quant_blocks_decode_exactly(tensor_type):
    """Q4_K / Q5_K / Q6_K super-blocks of random bytes decode, through the kernels' layout, to exactly
    gguf.quants.dequantize's values (signs of zeros included), and to a scalar transcription of llama.cpp's
    loops; embedding rows too."""
    qtype = T[tensor_type]
    rng = np.random.default_rng(11)
    data = _k_blocks(qtype, 7, 768, rng)
    ref = gguf_quants.dequantize(data, qtype)
    part = quant.QPart.from_tensor(data, qtype, (7, 768))
    assert (part.nib, part.block, part.n_in, part.n_out) == (qtype == T.Q4_K, 16 if qtype == T.Q6_K else 32, 768, 7)
    got = part.dense()
    np.testing.assert_array_equal(got, ref)
    assert (np.signbit(got) == np.signbit(ref)).all()
    size = GGML_QUANT_SIZES[qtype][1]
    for r, sb in ((0, 0), (3, 2), (6, 1)):
        scalar = np.array(_scalar_row(data[r, sb * size:(sb + 1) * size], qtype), np.float32)
        np.testing.assert_array_equal(got[r, 256 * sb:256 * (sb + 1)], scalar)
    ids = [6, 0, 3, 3]
    np.testing.assert_array_equal(quant.QuantEmbedding(part)[ids], ref[ids])


@pytest.mark.parametrize("tensor_type", ("F16", "BF16"))
def test_half_weights_read_exactly(tensor_type):
    """Every 16-bit pattern (zeros of both signs, subnormals, infinities, NaNs) kept in a F16 / BF16 part reads
    as gguf.quants.dequantize's float32, through the tile dequantizer, the embedding lookup and a fused
    product with one-hot rows; scaled by 1/8 (the Q rows), as fl(w / 8)."""
    qtype = T[tensor_type]
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(256, 256)                    # [ne1, ne0]
    data = bits.view(np.float16) if qtype == T.F16 else bits.view(np.uint8)
    ref = gguf_quants.dequantize(data, qtype).reshape(256, 256)
    part = quant.HalfPart.from_tensor(data, qtype, (256, 256))

    def same(a: np.ndarray, b: np.ndarray) -> None:
        nan = np.isnan(b)
        assert (np.isnan(a) == nan).all()
        np.testing.assert_array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))

    same(part.dense(), ref)
    ids = [0, 255, 128, 124, 7]
    same(quant.QuantEmbedding(part)[ids], ref[ids])
    rows = np.flatnonzero(np.isfinite(ref).all(axis=1))                              # rows with no inf / NaN
    eighth = part.scaled(np.float32(0.125))
    with np.errstate(invalid="ignore"):
        ref8 = ref * np.float32(0.125)
    same(eighth.dense(), ref8)
    mm = quant.QuantMatmul(1)
    cols = [0, 5, 77, 255]
    one_hot = np.eye(256, dtype=np.float32)[cols]                                    # x = e_i: y[o] = W[o, i]
    for p, w in ((part, ref), (eighth, ref8)):
        # a sum starts from +0, so a -0 weight reads back as +0 here: values compared, not bits
        np.testing.assert_array_equal(mm(quant.quant_linear([(None, qtype, p)]), one_hot)[:, rows], w[rows][:, cols].T)


@pytest.mark.parametrize("portable", (True, False))
def test_f16_conversions_exact(portable):
    """Both fp16 -> float32 conversions of the kernels (the portable integer one, and the one used on this
    target: F16C's where numba's target has it) give numpy's cast of every bit pattern, bit for bit (NaNs as
    NaNs)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.shape, np.float32)
    quant.kernels().f16_bits_to_f32(bits, out, portable)
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert (np.isnan(out) == nan).all()
    np.testing.assert_array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))


@pytest.mark.parametrize("tensor_type", TYPES + K_TYPES + ("F16", "BF16"))
def test_blocks_decode_exactly_as_gguf(tiny_model, tiny_gguf, tensor_type):
    """Every matrix kept quantized equals the f32 mode's dequantized one bit for bit (Q rows scaled by 1/8 in
    both: a power of two)."""
    path = tiny_gguf(**_kw(tensor_type))
    f, q = load(path, n_threads=1), load(path, n_threads=1, numerics="q")
    assert q.numerics == "q"
    for lf, lq in zip(f.weights.layers[0].linears, q.weights.layers[0].linears):
        assert all(isinstance(p, (quant.QPart, quant.HalfPart)) for p in lq.parts)
        np.testing.assert_array_equal(lq.weight, lf.weight)
    ids = [3, 7, 200]
    np.testing.assert_array_equal(q.weights.tok_embd[ids], f.weights.tok_embd[ids])


@pytest.mark.parametrize("tensor_type", ("Q4_1", "Q8_0", "Q5_0") + K_TYPES + ("F16", "BF16"))
@pytest.mark.parametrize("n_threads", (1, 2))
def test_product_within_float32_bound(tiny_gguf, tensor_type, n_threads):
    """Fused kernels (1..16 rows, odd counts) and the tile + BLAS path (more rows) against the float64 product."""
    q = load(tiny_gguf(**_kw(tensor_type)), n_threads=n_threads, numerics="q")
    rng = np.random.default_rng(3)
    for lin in q.weights.layers[0].linears + (q.weights.output,):
        [part] = lin.parts
        assert isinstance(part, quant.HalfPart if tensor_type in ("F16", "BF16") else quant.QPart)
        w = part.dense().astype(np.float64)                                         # [n_out, n_in]
        for m in (1, 3, 7, 16, 33):
            x = rng.standard_normal((m, lin.n_in)).astype(np.float32)
            y = q.matmul(lin, x)
            err = np.abs(y - x.astype(np.float64) @ w.T)
            assert (err <= _bound(part, x)).all(), (tensor_type, m, err.max())


@pytest.mark.parametrize("n_threads", (1, 2))
def test_mixed_types_fuse_by_layout(n_threads):
    """A fused matrix of K-quant and other pieces (as in a Q4_K_M file, whose V rows are Q6_K): pieces of one
    layout (nibble / byte, block size) share a part, the others get their own, and the product over all parts
    is the float64 product of the reference weights, within the bound of each part."""
    rng = np.random.default_rng(5)
    n_in = 512
    pieces, refs = [], []
    for name, n_out in (("Q4_K", 40), ("Q4_1", 24), ("Q5_K", 16), ("Q8_0", 8), ("Q6_K", 33), ("Q6_K", 7),
                        ("F16", 9), ("BF16", 5)):
        qtype = T[name]
        if qtype in quant.HALF_TYPES:
            data = gguf_quants.quantize(rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.1, qtype)
            refs.append(gguf_quants.dequantize(data, qtype).reshape(n_out, n_in).astype(np.float64))
            pieces.append((None, qtype, quant.HalfPart.from_tensor(data, qtype, (n_out, n_in))))
            continue
        if qtype in quant.K_TYPES:
            data = _k_blocks(qtype, n_out, n_in, rng)
            # finite but sane scales for a product test: replace the random fp16 ones by magnitudes ~1e-3
            for off in K_SCALES[qtype]:
                data.reshape(n_out, -1, GGML_QUANT_SIZES[qtype][1])[..., off:off + 2] = np.frombuffer(
                    np.float16(1e-3).tobytes(), np.uint8)
        else:
            data = gguf_quants.quantize(rng.standard_normal((n_out, n_in)).astype(np.float32), qtype)
        refs.append(gguf_quants.dequantize(data, qtype).astype(np.float64))
        pieces.append((None, qtype, quant.QPart.from_tensor(data, qtype, (n_out, n_in))))
    lin = quant.quant_linear(pieces)
    assert [(p.nib, p.block, p.n_out) for p in lin.parts[:3]] == [
        (True, 32, 64), (False, 32, 24), (False, 16, 40)]
    assert [(type(p), p.bf, p.n_out) for p in lin.parts[3:]] == [(quant.HalfPart, False, 9), (quant.HalfPart, True, 5)]
    w = np.concatenate(refs)
    np.testing.assert_array_equal(lin.weight, w)
    mm = quant.QuantMatmul(n_threads)
    for m in (1, 3, 7, 16, 33):
        x = rng.standard_normal((m, n_in)).astype(np.float32)
        err = np.abs(mm(lin, x) - x.astype(np.float64) @ w.T)
        bound = np.concatenate([_bound(p, x) for p in lin.parts], axis=1)
        assert (err <= bound).all(), (m, err.max())


def _held(weights) -> int:
    """Bytes of the distinct arrays the weights reference (found by walking them, each array once)."""
    seen: dict[int, int] = {}

    def add(obj) -> None:
        if isinstance(obj, np.ndarray):
            base = obj if obj.base is None else obj.base
            seen[id(base)] = obj.nbytes
        elif isinstance(obj, quant.QPart):
            for a in (obj.q, obj.d, obj.m):
                add(a)
        elif isinstance(obj, quant.HalfPart):
            add(obj.w)
            add(obj.s)
        elif isinstance(obj, quant.QuantLinear):
            for p in obj.parts:
                add(p)
        elif isinstance(obj, quant.QuantEmbedding):
            add(obj.part)
        elif obj is not None:
            add(obj.t)
            add(obj.blocks)

    for lw in weights.layers:
        for a in (lw.attn_norm, lw.ffn_norm, lw.bqkv) + lw.linears:
            add(a)
    for a in (weights.tok_embd, weights.output_norm, weights.output):
        add(a)
    return sum(seen.values())


@pytest.mark.parametrize("tensor_type, bits", [("Q4_K", 6), ("Q5_K", 10), ("Q6_K", 10), ("Q4_1", 6), ("Q8_0", 9),
                                               ("F16", 16), ("BF16", 16)])
def test_memory_held_is_reported(tiny_gguf, tensor_type, bits):
    """n_resident_bytes is the bytes of the distinct arrays held (the tied head shares the embedding's part:
    once), each quantized weight costing its layout's bits (Q4_K: 4-bit q + float32 d, m per 32 = 6 bits;
    Q5_K: int8 q + d, m per 32 = 10; Q6_K: int8 q + d per 16 = 10; Q8_0: int8 q + d per 32 = 9; F16 / BF16:
    16, plus a float32 factor per output); a decode step streams every part's q and d, and m where used."""
    path = tiny_gguf(**_kw(tensor_type))
    q, f = load(path, n_threads=1, numerics="q"), load(path, n_threads=1)
    w = q.weights
    assert w.output.parts[0] is w.tok_embd.part                                     # tied: one table
    assert w.n_resident_bytes == _held(w)
    parts = [p for lw in w.layers for lin in lw.linears for p in lin.parts] + list(w.output.parts)
    n_weights = sum(p.n_in * p.n_out for p in parts)
    per_output = sum(p.s.nbytes for p in parts if isinstance(p, quant.HalfPart))
    assert (sum(p.resident_bytes for p in parts) - per_output) * 8 == n_weights * bits
    norms = w.output_norm.nbytes + sum(lw.attn_norm.nbytes + lw.ffn_norm.nbytes for lw in w.layers)
    read = [p.w.nbytes + p.s.nbytes if isinstance(p, quant.HalfPart) else
            p.q.nbytes + p.d.nbytes + (p.m.nbytes if p.has_m else 0) for p in parts]
    assert w.n_stream_bytes == norms + sum(read)
    assert w.n_resident_bytes < f.weights.n_resident_bytes / (3 if bits == 16 else 4)


@pytest.mark.parametrize("tensor_type, extra", [(t, {}) for t in ("Q4_1",) + K_TYPES + ("F16", "BF16")] + [
    ("Q6_K", {"arch": "qwen2", "tied": False}), ("BF16", {"arch": "qwen2", "tied": False})])
def test_q_mode_forward_invariants(tiny_model, tiny_gguf, tensor_type, extra):
    """The q forward (one chunk; a prefill then cached one-token steps: the fused kernels) and the f32
    forward of the same file are each the model, every op within its float32 bound (`forward_check`); also
    a qwen2 model (Q/K/V biases) with its own output matrix."""
    path = tiny_gguf(**_kw(tensor_type), **extra)
    f, q = load(path, n_threads=1), load(path, n_threads=2, numerics="q")
    ids = list(range(3, 30))
    for model in (q, f):
        checked_forward(model, model.new_kv(1, 64), [(0, ids, 0, range(len(ids)))])
    kv = q.new_kv(1, 64)
    checked_forward(q, kv, [(0, ids[:20], 0, range(20))])
    for i, t in enumerate(ids[20:]):
        checked_forward(q, kv, [(0, [t], 20 + i, True)])


def test_falls_back_to_f32_with_one_warning(monkeypatch):
    monkeypatch.setattr(quant, "_kernels", None)
    monkeypatch.setattr(quant, "_kernels_error", "ImportError: no numba")
    monkeypatch.setattr(quant, "_warned", False)
    with pytest.warns(RuntimeWarning, match="numba"):
        assert resolve("q").name == "f32"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("q").name == "f32"                                            # once per process
