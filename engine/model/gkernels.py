"""numba kernels of the "ggml" numerics: the same arithmetic as the numpy code of `engine.model.ggml`, bit for bit.

Every kernel replays, operation by operation, what the numpy reference in `ggml.py` computes (itself a replay of
ggml's x86 CPU kernels); the tests (`tests/engine/test_ggml_kernels.py`) hold them to np.array_equal against it.
Rules that keep the bits:

- no `fastmath`: LLVM must not contract a * b + c into an fma, reassociate a sum or assume away inf / NaN;
- float32 values stay float32 (numba types float32 op float32 as float32; constants are typed `F32(...)`);
- an fma of float32 operands is `llvm.fma.f32` (`_fma`, one rounding: vfmadd on CPUs with FMA, the C library's
  fmaf elsewhere), the correctly rounded result the numpy code's exact emulation gives (`ggml._fma`);
- sums whose order matters are written in ggml's order (16-lane reductions as `_mm512_reduce_add_ps`, double
  sums sequential); sums of exact integers or of exact f16 x f16 products may be written in any order the
  vectorizer likes only where every partial sum is exact (integer dot products below 2^24).

Quantized weights come in `quant.QPart`'s transposed block layout (`qkernels` docstring): the quants of all
outputs contiguous per (block, element), so the loops over outputs are innermost and vectorize. All kernels
are `nogil`: the engine's own threads (`Matmul._run`) call them on disjoint output ranges or query blocks.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

I16 = np.int16
I32 = np.int32
I64 = np.int64
F32 = np.float32
F64 = np.float64

_TILE = 1024        # outputs per tile of the dot kernels for 2+ rows (the tile's weights and accumulators stay in L2)
_KEYS = 256         # keys per block of the score kernels (lane scratch [16 or 64, _KEYS])

# ggml_v_expf constants (ggml.expf)
_R = F32(float.fromhex("0x1.8p23"))
_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_LN2_HI = F32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))
_C5 = F32(float.fromhex("0x1.0e4020p-7"))
_C4 = F32(float.fromhex("0x1.573e2ep-5"))
_C3 = F32(float.fromhex("0x1.555e66p-3"))
_C2 = F32(float.fromhex("0x1.fffdb6p-2"))
_C1 = F32(float.fromhex("0x1.ffffecp-1"))
_INF = F32(np.inf)


# --- scalar helpers ------------------------------------------------------------------------------------------

@intrinsic
def _llvm_fma(typingctx, a, b, c):
    """llvm.fma.f32(a, b, c): a*b + c rounded once (IEEE fusedMultiplyAdd); the loop vectorizer keeps it an fma."""
    if not all(isinstance(t, types.Float) and t.bitwidth == 32 for t in (a, b, c)):
        return None                                      # float32 operands only: no silent casts
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)
    return sig, codegen


@intrinsic
def _prefetch(typingctx, arr, off):
    """llvm.prefetch(read, locality 3, data) of the byte at offset `off` of arr's buffer (C-contiguous arr): a hint
    that never faults, so an offset past the end is harmless."""
    if not isinstance(arr, types.Array) or not isinstance(off, types.Integer):
        return None
    sig = types.void(arr, off)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        i64 = ir.IntType(64)
        i32 = ir.IntType(32)
        o = args[1] if args[1].type.width == 64 else builder.sext(args[1], i64)
        p = builder.inttoptr(builder.add(builder.ptrtoint(ary.data, i64), o), ir.IntType(8).as_pointer())
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [p.type, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _wide_vectors(typingctx):
    """Marks the function being compiled "prefer-vector-width"="512": on AVX-512 CPUs LLVM then vectorizes its
    loops with 16 float32 lanes (zmm) instead of the 8 its tuning prefers for many Intel models (this machine's
    host CPU reads as "rocketlake"); elsewhere the hint is ignored. The width changes no result: every output
    lane computes the same operations (no reassociation), only more of them per instruction. (llvmlite's
    FunctionAttributes accepts only enum attributes, so the string attribute is added to its set directly.)"""
    sig = types.void()

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _mad16(typingctx, a, b, c):
    """a * b + c in 16-bit integers (wrapping; the callers' values never wrap). numba types int16 arithmetic as
    int64, which the vectorizer then runs 4 lanes to a 256-bit vector; in i16 it runs 16."""
    if not all(isinstance(t, types.Integer) and t.bitwidth == 16 and t.signed for t in (a, b, c)):
        return None
    sig = types.int16(types.int16, types.int16, types.int16)

    def codegen(context, builder, signature, args):
        return builder.add(builder.mul(args[0], args[1]), args[2])
    return sig, codegen


def _nibble16(high):
    @intrinsic
    def nibble(typingctx, q):
        if not (isinstance(q, types.Integer) and q.bitwidth == 8 and not q.signed):
            return None
        sig = types.int16(types.uint8)

        def codegen(context, builder, signature, args):
            v = builder.zext(args[0], ir.IntType(16))
            four = ir.Constant(ir.IntType(16), 4)
            return builder.lshr(v, four) if high else builder.and_(v, ir.Constant(ir.IntType(16), 15))
        return sig, codegen
    return nibble


_lo16 = _nibble16(False)
_lo16.__doc__ = "The low nibble of a uint8 as int16."
_hi16 = _nibble16(True)
_hi16.__doc__ = "The high nibble of a uint8 as int16."


@njit(cache=True, nogil=True, inline="always")
def _prefetch_block(qw, dw, mw, has_m, b, o0, o1):
    """Prefetch block b's weights over outputs o0..o1-1: the quant rows (qw [nb, E, n_out], one byte each), d and
    (has_m) m (float32 [nb, n_out]). The one-row kernels stream each block's rows once, and the hardware
    prefetcher does not run far enough ahead on these short rows (measured: half the bandwidth without it)."""
    if b < qw.shape[0]:
        n_out = qw.shape[2]
        base = b * qw.shape[1] * n_out
        for e in range(qw.shape[1]):
            row = base + e * n_out
            for o in range(o0, o1, 64):
                _prefetch(qw, row + o)
        for o in range(4 * (b * n_out + o0), 4 * (b * n_out + o1), 64):
            _prefetch(dw, o)
            if has_m:
                _prefetch(mw, o)


@njit(cache=True, nogil=True, inline="always")
def _fma(a, b, c):
    """ggml._fma: fmaf(a, b, c) on float32 operands, one rounding."""
    return _llvm_fma(a, b, c)


@njit(cache=True, nogil=True)
def fma_array(a, b, c, out):
    """`_fma` element-wise (tests)."""
    for i in range(out.size):
        out[i] = _fma(a[i], b[i], c[i])


@njit(cache=True, nogil=True, inline="always")
def f16_round(x):
    """float32 -> nearest fp16 (round half to even; overflow to inf) -> float32, as x.astype(float16).astype(
    float32) does for every non-NaN x (a NaN is returned as it is)."""
    u = I64(F32(x).view(np.uint32))
    s = u & 0x80000000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:                                   # NaN
        return F32(x)
    if a >= 0x477FF000:                                  # |x| >= 65520 rounds to inf
        r = s | 0x7F800000
    elif a >= 0x38800000:                                # fp16 normal range: keep 10 mantissa bits
        r = s | ((a + 0xFFF + ((a >> 13) & 1)) & 0xFFFFE000)
    else:                                                # fp16 subnormal or zero: k * 2^-24, k = RNE(|x| 2^24)
        e = a >> 23
        if e < 102:                                      # |x| < 2^-25: rounds to 0 (2^-25 itself: tie to 0)
            r = s
        else:
            mant = (a & 0x7FFFFF) | 0x800000
            sh = 126 - e                                 # 14..24
            k = (mant + (I64(1) << (sh - 1)) - 1 + ((mant >> sh) & 1)) >> sh
            sub = F32(F32(k) * F32(5.9604644775390625e-08))    # exact: k < 2^11
            r = s | I64(sub.view(np.uint32))
    return np.uint32(r).view(np.float32)


@njit(cache=True, nogil=True)
def f16_bits(x):
    """The fp16 bits (uint16) of float32 x rounded to nearest, half to even (`f16_round`), as x.astype(float16)
    gives them for every non-NaN x. A NaN keeps its sign and the top 10 bits of its mantissa (at least 1), as
    numpy's software conversion does (a hardware conversion would also set the quiet bit): the KV cells of a
    model that produced a NaN are lost anyway."""
    u = I64(F32(x).view(np.uint32))
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    fr = F32(f16_round(x))                               # an fp16 value held in float32
    r = I64(F32(fr).view(np.uint32)) & 0x7FFFFFFF
    if a > 0x7F800000:                                   # NaN
        top = (a & 0x7FFFFF) >> 13
        h = 0x7C00 | max(top, I64(1))
    elif r == 0x7F800000:
        h = I64(0x7C00)
    elif r >= 0x38800000:                                # normal: rebias the exponent, keep 10 mantissa bits
        h = (((r >> 23) - 112) << 10) | ((r >> 13) & 0x3FF)
    else:                                                # subnormal or zero: k * 2^-24, k < 1024
        h = I64(abs(fr) * F32(16777216.0))
    return np.uint16(sign | h)


@njit(cache=True, nogil=True)
def f16_bits_array(x, out):
    """`f16_bits` element-wise (tests)."""
    for i in range(x.size):
        out[i] = f16_bits(x[i])


@njit(cache=True, nogil=True, inline="always")
def f16_value(h):
    """The float32 value of fp16 bits h (uint16), exactly: the exponent and mantissa bits moved to float32's
    place read a float32 2^-112 times the value (subnormal halves become float32 subnormals), times 2^112;
    exponent 31 (inf, NaN) is set to float32's 255; the sign is put back."""
    u = I32(h)
    body = I32(I32(u & I32(0x7FFF)) << I32(13))
    scaled = F32(body.view(np.float32) * F32(5.192296858534828e+33))   # 2^112
    special = I32(body | I32(0x7F800000))
    mag = special if I32(u & I32(0x7C00)) == I32(0x7C00) else scaled.view(np.int32)
    return I32(mag | I32(I32(u & I32(0x8000)) << I32(16))).view(np.float32)


@njit(cache=True, nogil=True)
def kv_values(c16, n, out):
    """out [n_head_kv, n, hd] = the float32 values of the fp16 cells c16[:, :n] (uint16 bits [n_head_kv, cap, hd])."""
    for h in range(c16.shape[0]):
        for j in range(n):
            src = c16[h, j]
            dst = out[h, j]
            for d in range(c16.shape[2]):
                dst[d] = f16_value(src[d])


@njit(cache=True, nogil=True)
def kv_values_t(c16, n, out):
    """out [n_head_kv, hd, n] = `kv_values` transposed (keys contiguous, for the score kernels)."""
    for h in range(c16.shape[0]):
        for d in range(c16.shape[2]):
            dst = out[h, d]
            for j in range(n):
                dst[j] = f16_value(c16[h, j, d])


@njit(cache=True, nogil=True)
def kv_shadow(k16, v16, lo, hi, kt, vf):
    """Cells lo..hi-1 of the fp16 K and V cells (uint16 bits [n_head_kv, cap, hd]) into their float32 shadow:
    kt [n_head_kv, hd, cap] (K transposed, as `kv_values_t`) and vf [n_head_kv, cap, hd] (as `kv_values`)."""
    for h in range(k16.shape[0]):
        for j in range(lo, hi):
            src = v16[h, j]
            dst = vf[h, j]
            for d in range(v16.shape[2]):
                dst[d] = f16_value(src[d])
        for d in range(k16.shape[2]):
            dst = kt[h, d]
            for j in range(lo, hi):
                dst[j] = f16_value(k16[h, j, d])


@njit(cache=True, nogil=True, inline="always")
def expf(x):
    """ggml.expf (ggml_v_expf, AVX-512) for one float32 x."""
    z = _fma(x, _LOG2E, _R)
    n = z - _R
    b = _fma(-n, _LN2_HI, x)
    b = _fma(-n, _LN2_LO, b)
    u = b * b
    j = _fma(_fma(_fma(_C5, b, _C4), u, _fma(_C3, b, _C2)), u, _fma(_C1, b, F32(1.0)))
    # written with selects, no early return, so that loops over it vectorize
    ok = abs(n) <= F32(192.0)                            # False for NaN
    e = I64(n) if ok else I64(0)
    p2 = I64((e + 1023) << 52)                           # 2^e as float64 bits (|e| <= 192: normal)
    res = F32(F64(j) * p2.view(np.float64))              # = ldexpf(j, n): exact scaling, one rounding
    sat = F32(0.0) if n <= F32(0.0) else _INF            # |n| > 192: 0 or inf
    return res if (ok or n != n) else sat                # NaN in (j is NaN), NaN out


# --- activation quantization --------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def quantize_q8(x, qx, d16, s):
    """ggml._q8_blocks / quantize_q8_1 for x [M, n] (n a multiple of 32): qx [M, n] the integer quants (as
    float32), d16 [M, n/32] the scales d = amax/127 rounded to fp16, s [M, n/32] = fp16(d * sum q)."""
    m, n = x.shape
    for r in range(m):
        for b in range(n // 32):
            o = 32 * b
            amax = F32(0.0)
            for j in range(32):
                v = abs(x[r, o + j])
                if v > amax or v != v:                   # max with NaN propagating, as np.max
                    amax = v
            d = amax / F32(127.0)
            inv = F32(127.0) / amax if amax != F32(0.0) else F32(0.0)
            tot = F32(0.0)
            for j in range(32):
                q = np.rint(x[r, o + j] * inv)
                qx[r, o + j] = q
                tot += q                                 # exact: |sum| <= 32 * 127
            d16[r, b] = f16_round(d)
            s[r, b] = f16_round(d * tot)


@njit(cache=True, nogil=True)
def q8_values(qx, d16, out):
    """out [M, n] = qx * d16 per block of 32: the Q8_0 / Q8_1 values (ggml.quantize_q8_0)."""
    m, n = qx.shape
    for r in range(m):
        for b in range(n // 32):
            d = d16[r, b]
            for j in range(32 * b, 32 * b + 32):
                out[r, j] = qx[r, j] * d


# --- Q4_1 / Q5_1 x Q8_1 (ggml.dot_q8_1) ---------------------------------------------------------------------
#
# Per row r, output o and block b: lane l (elements 4l..4l+3 of the block) has the exact integer dot
# xy = sum q_w * q_x (|xy| < 2^14, exact in float32 whatever the order), then acc_l = fma(d_x * d_w, xy, acc_l)
# with one rounding (`_fma`; d_x * d_w is exact in float32), summs = fma(s_x, m_w, summs) likewise, and at the end
# y = ((acc4 + acc0) + (acc6 + acc2)) + ((acc5 + acc1) + (acc7 + acc3)) + summs: ggml.dot_q8_1's operations.
#
# These kernels alone are compiled with fastmath={"contract"}: LLVM may then fuse a multiply and an add into an
# fma. Every such pair here has an exact product (small integers in float32), and
# fma(a, b, c) = round(a*b + c) = round(round(a*b) + c) when a*b is exact: the bits cannot change. No other
# fast-math flag (no reassociation) is given, and the other kernels get none (there a fused product would
# round differently).
#
# One row (decode): every (block, element) row of the weights is streamed over the whole output range, with the
# 8 lane accumulators of all outputs in a scratch [8, w] (as `qkernels`; tiles of a few outputs read short
# pieces at a stride of n_out bytes, which measured 2x slower from DRAM). Two rows and more (prefill): tiles of
# _TILE outputs whose weights stay in cache while every row passes; two rows share each weight's decoding, the
# lane sums go to a scratch and a second loop applies the fma steps.

_CONTRACT = {"contract"}
_AHEAD = 2          # blocks of weights prefetched ahead by the one-row kernels
_ROW_TILE = 1024    # outputs per pass of the one-row kernels (their 8 x _ROW_TILE accumulators stay in L1)


@njit(cache=True, nogil=True, inline="always")
def _finish(acc, summ, has_m, y, r, t0, w):
    """y[r, t0:t0+w] = hsum_float_8(acc) + summs (has_m; else hsum_float_8(acc) alone), in ggml.dot_q8_1's /
    ggml.dot_q8_0's order; acc [8, >= w], summ [>= w]."""
    for o in range(w):
        h0 = acc[4, o] + acc[0, o]
        h1 = acc[5, o] + acc[1, o]
        h2 = acc[6, o] + acc[2, o]
        h3 = acc[7, o] + acc[3, o]
        v = (h0 + h2) + (h1 + h3)
        y[r, t0 + o] = v + summ[o] if has_m else v


@njit(cache=True, nogil=True, inline="always", fastmath=_CONTRACT)
def _block_scales(sx, dx, mw, dw, has_m, summ, dd, r, b, t0, w):
    """summs = fma(s_x, m_w, summs) (has_m) over the outputs t0..t0+w-1 of block b, and dd = d_x * d_w for them
    (float32, exact: fp16 x fp16)."""
    dxv = dx[r, b]
    db = dw[b, t0:t0 + w]
    if has_m:
        sv = sx[r, b]
        mb = mw[b, t0:t0 + w]
        for o in range(w):
            summ[o] = _fma(sv, mb[o], summ[o])
    for o in range(w):
        dd[o] = dxv * db[o]


@njit(cache=True, nogil=True, inline="always", fastmath=_CONTRACT)
def _fma_lanes(xy, dd, acc, w):
    """acc[l, o] = fma(dd[o], xy[l, o], acc[l, o]) for the 8 lanes."""
    for lane in range(8):
        al = acc[lane]
        xl = xy[lane]
        for o in range(w):
            al[o] = _fma(xl[o], dd[o], al[o])


@njit(cache=True, nogil=True, fastmath=_CONTRACT)
def _nib_row(qw, dw, mw, q16, dx, sx, y, r, o0, o1):
    """One row of `dot_nib` over the outputs o0..o1-1, each weight row streamed once; q16 [M, n_in] the row's
    quants as int16. The lane sums are computed in 16-bit integers, 16 outputs per 256-bit vector (float32: 8):
    a lane sum is 4 products of a nibble (0..15) and a quant (-127..127), |sum| <= 7620, exact in int16 and in
    float32 alike, so the bits are those of the float32 sums. Measured on one thread, SmolLM2's 120 layer
    matrices in a row (80 MB, AMD EPYC AVX2): 23.0-24.9 ms float32 -> 19.8-22.1 ms."""
    _wide_vectors()
    nb = qw.shape[0]
    w = o1 - o0
    acc = np.zeros((8, w), F32)
    summ = np.zeros(w, F32)
    dd = np.empty(w, F32)
    zero = I16(0)
    for b in range(nb):
        _prefetch_block(qw, dw, mw, True, b + _AHEAD, o0, o1)
        _block_scales(sx, dx, mw, dw, True, summ, dd, r, b, o0, w)
        qb = qw[b]
        for lane in range(4):
            j = 32 * b + 4 * lane
            x0, x1, x2, x3 = _four(q16[r], j)
            c0, c1, c2, c3 = _four(q16[r], j + 16)
            q0 = qb[4 * lane, o0:o1]
            q1 = qb[4 * lane + 1, o0:o1]
            q2 = qb[4 * lane + 2, o0:o1]
            q3 = qb[4 * lane + 3, o0:o1]
            al = acc[lane]
            ah = acc[lane + 4]
            for o in range(w):
                v0 = q0[o]
                v1 = q1[o]
                v2 = q2[o]
                v3 = q3[o]
                lo = _mad16(_lo16(v3), x3, _mad16(_lo16(v2), x2, _mad16(_lo16(v1), x1, _mad16(_lo16(v0), x0, zero))))
                hi = _mad16(_hi16(v3), c3, _mad16(_hi16(v2), c2, _mad16(_hi16(v1), c1, _mad16(_hi16(v0), c0, zero))))
                e = dd[o]
                al[o] = _fma(F32(lo), e, al[o])
                ah[o] = _fma(F32(hi), e, ah[o])
    _finish(acc, summ, True, y, r, o0, w)


@njit(cache=True, nogil=True, inline="always", fastmath=_CONTRACT)
def _nib_lanes(qb, qx, r, g, b, t0, w, xy):
    """xy[i, l, :w] = the lane sums of block b for rows r + i (i < g, g in 1..2), outputs t0..t0+w-1; the two
    rows share each byte's decoding."""
    for lane in range(4):
        j = 32 * b + 4 * lane
        q0 = qb[4 * lane, t0:t0 + w]
        q1 = qb[4 * lane + 1, t0:t0 + w]
        q2 = qb[4 * lane + 2, t0:t0 + w]
        q3 = qb[4 * lane + 3, t0:t0 + w]
        a0, a1, a2, a3 = _four(qx[r], j)
        c0, c1, c2, c3 = _four(qx[r], j + 16)
        xl = xy[0, lane]
        xh = xy[0, lane + 4]
        if g == 2:
            e0 = qx[r + 1, j]
            e1 = qx[r + 1, j + 1]
            e2 = qx[r + 1, j + 2]
            e3 = qx[r + 1, j + 3]
            f0 = qx[r + 1, j + 16]
            f1 = qx[r + 1, j + 17]
            f2 = qx[r + 1, j + 18]
            f3 = qx[r + 1, j + 19]
            yl = xy[1, lane]
            yh = xy[1, lane + 4]
            for o in range(w):
                v0 = I32(q0[o])
                v1 = I32(q1[o])
                v2 = I32(q2[o])
                v3 = I32(q3[o])
                l0 = F32(I32(v0 & I32(15)))
                l1 = F32(I32(v1 & I32(15)))
                l2 = F32(I32(v2 & I32(15)))
                l3 = F32(I32(v3 & I32(15)))
                h0 = F32(I32(v0 >> I32(4)))
                h1 = F32(I32(v1 >> I32(4)))
                h2 = F32(I32(v2 >> I32(4)))
                h3 = F32(I32(v3 >> I32(4)))
                xl[o] = l0 * a0 + l1 * a1 + l2 * a2 + l3 * a3
                xh[o] = h0 * c0 + h1 * c1 + h2 * c2 + h3 * c3
                yl[o] = l0 * e0 + l1 * e1 + l2 * e2 + l3 * e3
                yh[o] = h0 * f0 + h1 * f1 + h2 * f2 + h3 * f3
        else:
            for o in range(w):
                v0 = I32(q0[o])
                v1 = I32(q1[o])
                v2 = I32(q2[o])
                v3 = I32(q3[o])
                xl[o] = (F32(I32(v0 & I32(15))) * a0 + F32(I32(v1 & I32(15))) * a1
                         + F32(I32(v2 & I32(15))) * a2 + F32(I32(v3 & I32(15))) * a3)
                xh[o] = (F32(I32(v0 >> I32(4))) * c0 + F32(I32(v1 >> I32(4))) * c1
                         + F32(I32(v2 >> I32(4))) * c2 + F32(I32(v3 >> I32(4))) * c3)


@njit(cache=True, nogil=True, inline="always", fastmath=_CONTRACT)
def _byte_lanes(qb, qx, r, g, b, t0, w, xy):
    """`_nib_lanes` for one quant per byte: lane l = elements 4l..4l+3, rows 4l..4l+3 of qb."""
    for lane in range(8):
        j = 32 * b + 4 * lane
        q0 = qb[4 * lane, t0:t0 + w]
        q1 = qb[4 * lane + 1, t0:t0 + w]
        q2 = qb[4 * lane + 2, t0:t0 + w]
        q3 = qb[4 * lane + 3, t0:t0 + w]
        a0 = qx[r, j]
        a1 = qx[r, j + 1]
        a2 = qx[r, j + 2]
        a3 = qx[r, j + 3]
        xl = xy[0, lane]
        if g == 2:
            e0 = qx[r + 1, j]
            e1 = qx[r + 1, j + 1]
            e2 = qx[r + 1, j + 2]
            e3 = qx[r + 1, j + 3]
            yl = xy[1, lane]
            for o in range(w):
                u0 = F32(I32(q0[o]))
                u1 = F32(I32(q1[o]))
                u2 = F32(I32(q2[o]))
                u3 = F32(I32(q3[o]))
                xl[o] = u0 * a0 + u1 * a1 + u2 * a2 + u3 * a3
                yl[o] = u0 * e0 + u1 * e1 + u2 * e2 + u3 * e3
        else:
            for o in range(w):
                xl[o] = (F32(I32(q0[o])) * a0 + F32(I32(q1[o])) * a1
                         + F32(I32(q2[o])) * a2 + F32(I32(q3[o])) * a3)


@njit(cache=True, nogil=True, fastmath=_CONTRACT)
def _byte_row(qw, dw, mw, qx, dx, sx, y, r, o0, o1, has_m):
    """One row of `dot_byte` (has_m) or `dot_q8_0` over the outputs o0..o1-1, each weight row streamed once."""
    _wide_vectors()
    nb = qw.shape[0]
    w = o1 - o0
    acc = np.zeros((8, w), F32)
    summ = np.zeros(w, F32)
    dd = np.empty(w, F32)
    for b in range(nb):
        _prefetch_block(qw, dw, mw, has_m, b + _AHEAD, o0, o1)
        _block_scales(sx, dx, mw, dw, has_m, summ, dd, r, b, o0, w)
        qb = qw[b]
        for lane in range(8):
            j = 32 * b + 4 * lane
            x0 = qx[r, j]
            x1 = qx[r, j + 1]
            x2 = qx[r, j + 2]
            x3 = qx[r, j + 3]
            q0 = qb[4 * lane, o0:o1]
            q1 = qb[4 * lane + 1, o0:o1]
            q2 = qb[4 * lane + 2, o0:o1]
            q3 = qb[4 * lane + 3, o0:o1]
            al = acc[lane]
            for o in range(w):
                xy = (F32(I32(q0[o])) * x0 + F32(I32(q1[o])) * x1
                      + F32(I32(q2[o])) * x2 + F32(I32(q3[o])) * x3)
                al[o] = _fma(xy, dd[o], al[o])
    _finish(acc, summ, has_m, y, r, o0, w)


@njit(cache=True, nogil=True, inline="always")
def _four(xr, j):
    """xr[j..j+3] as four scalars."""
    return xr[j], xr[j + 1], xr[j + 2], xr[j + 3]


@njit(cache=True, nogil=True, inline="always", fastmath=_CONTRACT)
def _quad_lane(q0, q1, q2, q3, nib, high, xr0, xr1, xr2, xr3, j, dd, a0, a1, a2, a3, w):
    """One lane of one block for 4 rows at once, its fma step included: the 4 weight rows q0..q3 (outputs
    0..w-1 of the tile) are decoded once (nib: the low or, `high`, the high nibbles) for the 4 rows' lane sums
    with activations xr*[j..j+3], and a_i[o] = fma(xy_i, dd[i, o], a_i[o]) (dd = d_x * d_w of the block, made
    once for its 8 lanes). Four accumulator rows written per loop: the vectorizer's alias checks stay few enough
    for it to vectorize (eight did not)."""
    x00, x01, x02, x03 = _four(xr0, j)                   # scalars before the loop (loop-invariant)
    x10, x11, x12, x13 = _four(xr1, j)
    x20, x21, x22, x23 = _four(xr2, j)
    x30, x31, x32, x33 = _four(xr3, j)
    for o in range(w):
        if nib:
            if high:
                u0 = F32(I32(I32(q0[o]) >> I32(4)))
                u1 = F32(I32(I32(q1[o]) >> I32(4)))
                u2 = F32(I32(I32(q2[o]) >> I32(4)))
                u3 = F32(I32(I32(q3[o]) >> I32(4)))
            else:
                u0 = F32(I32(I32(q0[o]) & I32(15)))
                u1 = F32(I32(I32(q1[o]) & I32(15)))
                u2 = F32(I32(I32(q2[o]) & I32(15)))
                u3 = F32(I32(I32(q3[o]) & I32(15)))
        else:
            u0 = F32(I32(q0[o]))
            u1 = F32(I32(q1[o]))
            u2 = F32(I32(q2[o]))
            u3 = F32(I32(q3[o]))
        a0[o] = _fma(u0 * x00 + u1 * x01 + u2 * x02 + u3 * x03, dd[0, o], a0[o])
        a1[o] = _fma(u0 * x10 + u1 * x11 + u2 * x12 + u3 * x13, dd[1, o], a1[o])
        a2[o] = _fma(u0 * x20 + u1 * x21 + u2 * x22 + u3 * x23, dd[2, o], a2[o])
        a3[o] = _fma(u0 * x30 + u1 * x31 + u2 * x32 + u3 * x33, dd[3, o], a3[o])


@njit(cache=True, nogil=True, inline="always", fastmath=_CONTRACT)
def _quad_block(qb, dw, mw, qx, sx, dx, has_m, nib, r, b, t0, w, acc, summ, dd):
    """Block b of rows r..r+3 over the outputs t0..t0+w-1: summs (has_m) and the 8 lanes' fma steps into
    acc [4, 8, >= w] (`_quad_lane`); dd [4, >= w] scratch."""
    db = dw[b, t0:t0 + w]
    for i in range(4):
        e = dx[r + i, b]
        di = dd[i]
        for o in range(w):
            di[o] = e * db[o]
    if has_m:
        mb = mw[b, t0:t0 + w]
        for i in range(4):
            sv = sx[r + i, b]
            si = summ[i]
            for o in range(w):
                si[o] = _fma(sv, mb[o], si[o])
    xr0 = qx[r]
    xr1 = qx[r + 1]
    xr2 = qx[r + 2]
    xr3 = qx[r + 3]
    for lane in range(4 if nib else 8):
        q0 = qb[4 * lane, t0:t0 + w]
        q1 = qb[4 * lane + 1, t0:t0 + w]
        q2 = qb[4 * lane + 2, t0:t0 + w]
        q3 = qb[4 * lane + 3, t0:t0 + w]
        j = 32 * b + 4 * lane
        _quad_lane(q0, q1, q2, q3, nib, False, xr0, xr1, xr2, xr3, j, dd,
                   acc[0, lane], acc[1, lane], acc[2, lane], acc[3, lane], w)
        if nib:
            _quad_lane(q0, q1, q2, q3, nib, True, xr0, xr1, xr2, xr3, j + 16, dd,
                       acc[0, lane + 4], acc[1, lane + 4], acc[2, lane + 4], acc[3, lane + 4], w)


@njit(cache=True, nogil=True, fastmath=_CONTRACT)
def _rows_tiled(qw, dw, mw, qx, dx, sx, y, o0, o1, nib, has_m, tile):
    """All rows of `dot_nib` / `dot_byte` / `dot_q8_0` over the outputs o0..o1-1: tiles of `tile` outputs (the
    kernels pass _TILE), rows in fours (`_quad_block`: each weight decoded once for 4 rows, the fma steps in the
    same loop), the last 1..3 rows in pairs (lane sums to a scratch, then the fma steps)."""
    _wide_vectors()
    nb = qw.shape[0]
    m = qx.shape[0]
    acc = np.empty((4, 8, tile), F32)
    summ = np.empty((4, tile), F32)
    dd = np.empty(tile, F32)
    dd4 = np.empty((4, tile), F32)
    xy = np.empty((2, 8, tile), F32)
    m4 = m - m % 4
    for t0 in range(o0, o1, tile):
        w = min(o1, t0 + tile) - t0
        for r in range(0, m4, 4):
            acc[:, :, :w] = F32(0.0)
            summ[:, :w] = F32(0.0)
            for b in range(nb):
                _quad_block(qw[b], dw, mw, qx, sx, dx, has_m, nib, r, b, t0, w, acc, summ, dd4)
            for i in range(4):
                _finish(acc[i], summ[i], has_m, y, r + i, t0, w)
        for r in range(m4, m, 2):
            g = min(2, m - r)
            acc[:, :, :w] = F32(0.0)
            summ[:, :w] = F32(0.0)
            for b in range(nb):
                if nib:
                    _nib_lanes(qw[b], qx, r, g, b, t0, w, xy)
                else:
                    _byte_lanes(qw[b], qx, r, g, b, t0, w, xy)
                for i in range(g):
                    _block_scales(sx, dx, mw, dw, has_m, summ[i], dd, r + i, b, t0, w)
                    _fma_lanes(xy[i], dd, acc[i], w)
            for i in range(g):
                _finish(acc[i], summ[i], has_m, y, r + i, t0, w)


@njit(cache=True, nogil=True)
def dot_nib(qw, dw, mw, qx, dx, sx, y, o0, o1):
    """y[:, o0:o1] of ggml.dot_q8_1 for 4-bit weights (Q4_1): qw [nb, 16, n_out] uint8 (low nibble = element j
    of the block, high nibble = element j + 16), dw, mw [nb, n_out] float32; qx [M, n_in], dx, sx [M, nb] from
    `quantize_q8`. Lanes 0..3 of a block are the low nibbles of bytes 4l..4l+3, lanes 4..7 their high nibbles."""
    if qx.shape[0] == 1:
        q16 = np.empty(qx.shape, np.int16)               # integers -127..127 held as float32: exact
        for i in range(qx.shape[1]):
            q16[0, i] = I16(qx[0, i])
        for t0 in range(o0, o1, _ROW_TILE):
            _nib_row(qw, dw, mw, q16, dx, sx, y, 0, t0, min(o1, t0 + _ROW_TILE))
    else:
        _rows_tiled(qw, dw, mw, qx, dx, sx, y, o0, o1, True, True, _TILE)


@njit(cache=True, nogil=True)
def dot_byte(qw, dw, mw, qx, dx, sx, y, o0, o1):
    """`dot_nib` for weights with one quant per byte (Q5_1): qw [nb, 32, n_out] int8, lane l = rows 4l..4l+3."""
    if qx.shape[0] == 1:
        for t0 in range(o0, o1, _ROW_TILE):
            _byte_row(qw, dw, mw, qx, dx, sx, y, 0, t0, min(o1, t0 + _ROW_TILE), True)
    else:
        _rows_tiled(qw, dw, mw, qx, dx, sx, y, o0, o1, False, True, _TILE)


@njit(cache=True, nogil=True)
def dot_q8_0(qw, dw, qx, dx, y, o0, o1):
    """y[:, o0:o1] of ggml.dot_q8_0 (ggml_vec_dot_q8_0_q8_0, and tinyBLAS_Q0_AVX: the same lane operations) for
    Q8_0 weights qw [nb, 32, n_out] int8, dw [nb, n_out] float32, activations from `quantize_q8` (its s unused):
    per block the 8 exact lane sums, acc_l = fma(xy, d_x * d_w, acc_l), y = hsum_float_8(acc); no minimums."""
    if qx.shape[0] == 1:
        for t0 in range(o0, o1, _ROW_TILE):
            _byte_row(qw, dw, dw, qx, dx, dx, y, 0, t0, min(o1, t0 + _ROW_TILE), False)
    else:
        _rows_tiled(qw, dw, dw, qx, dx, dx, y, o0, o1, False, False, _TILE)


# --- norm, SwiGLU --------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def rms_norm(x, w, eps, out):
    """ggml.rms_norm: out [T, D] = x * scale * w, scale = 1/sqrtf(float(sum of float32 squares in double,
    sequential) / D) + eps) (eps float32)."""
    t_rows, dim = x.shape
    for t in range(t_rows):
        ss = 0.0
        for i in range(dim):
            v = x[t, i]
            ss += F64(v * v)
        mean = F32(ss / dim)
        scale = F32(1.0) / np.sqrt(mean + eps)
        for i in range(dim):
            out[t, i] = (x[t, i] * scale) * w[i]


@njit(cache=True, nogil=True)
def silu_mul(g, u, out):
    """ggml.silu_mul: out = (g / (1 + expf(0 - g))) * u element-wise, [T, n] (C-contiguous). expf has a loop
    of its own: fused with the division the loop did not vectorize (measured 2.8x slower)."""
    for t in range(g.shape[0]):
        gr = g[t]
        ur = u[t]
        orow = out[t]
        for i in range(gr.shape[0]):
            orow[i] = expf(F32(0.0) - gr[i])
        for i in range(gr.shape[0]):
            orow[i] = (gr[i] / (F32(1.0) + orow[i])) * ur[i]


@njit(cache=True, nogil=True)
def expf_array(x, out):
    """ggml.expf element-wise (tests)."""
    for i in range(x.size):
        out[i] = expf(x[i])


@njit(cache=True, nogil=True)
def f16_round_array(x, out):
    """`f16_round` element-wise (tests)."""
    for i in range(x.size):
        out[i] = f16_round(x[i])


# --- attention (ggml.attend with an f16 KV store) -------------------------------------------------------------

@njit(cache=True, nogil=True, inline="always")
def _reduce16_col(a, j):
    """ggml._reduce16 of a[0:16, j] (halves added pairwise, 8 -> 4 -> 2 -> 1)."""
    b0 = a[8, j] + a[0, j]
    b1 = a[9, j] + a[1, j]
    b2 = a[10, j] + a[2, j]
    b3 = a[11, j] + a[3, j]
    b4 = a[12, j] + a[4, j]
    b5 = a[13, j] + a[5, j]
    b6 = a[14, j] + a[6, j]
    b7 = a[15, j] + a[7, j]
    c0 = b4 + b0
    c1 = b5 + b1
    c2 = b6 + b2
    c3 = b7 + b3
    return (c0 + c2) + (c1 + c3)


@njit(cache=True, nogil=True, inline="always")
def _fold64_col(a, j, x):
    """x[l, j] = (a[l] + a[32 + l]) + (a[16 + l] + a[48 + l]) at column j: ggml_vec_dot_f16's 4 x 16 lanes."""
    for lane in range(16):
        x[lane, j] = (a[lane, j] + a[32 + lane, j]) + (a[16 + lane, j] + a[48 + lane, j])


@njit(cache=True, nogil=True)
def _scores(qi, kt, n_keys, one, s, lanes, fold):
    """s[:n_keys] = K . qi in ggml.dot_f16_tiny (one False) or ggml.dot_f16_vec (one True) order; kt [hd, n_tot]
    float32 (f16 values), qi [hd]. Vectorized across keys: lanes [16 or 64, _KEYS] hold the lane sums."""
    hd = qi.shape[0]
    if not one:
        for j0 in range(0, n_keys, _KEYS):
            jw = min(_KEYS, n_keys - j0)
            for t in range(hd // 16):
                for lane in range(16):
                    d = 16 * t + lane
                    qq = qi[d]
                    kk = kt[d, j0:j0 + jw]
                    ll = lanes[lane]
                    if t == 0:
                        for j in range(jw):
                            ll[j] = qq * kk[j]
                    else:
                        for j in range(jw):
                            ll[j] += qq * kk[j]
            for j in range(jw):
                s[j0 + j] = _reduce16_col(lanes, j)
        return
    n64 = hd - hd % 64
    for j0 in range(0, n_keys, _KEYS):
        jw = min(_KEYS, n_keys - j0)
        for c in range(n64 // 64):
            for i in range(64):
                d = 64 * c + i
                qq = qi[d]
                kk = kt[d, j0:j0 + jw]
                ll = lanes[i]
                if c == 0:
                    for j in range(jw):
                        ll[j] = qq * kk[j]
                else:
                    for j in range(jw):
                        ll[j] += qq * kk[j]
        sums = fold[0]                                   # float32 scratch row: the 64-lane part, per key
        ll = lanes
        if n64:
            for j in range(jw):                          # written out: the loop over keys vectorizes
                x0 = (ll[0, j] + ll[32, j]) + (ll[16, j] + ll[48, j])
                x1 = (ll[1, j] + ll[33, j]) + (ll[17, j] + ll[49, j])
                x2 = (ll[2, j] + ll[34, j]) + (ll[18, j] + ll[50, j])
                x3 = (ll[3, j] + ll[35, j]) + (ll[19, j] + ll[51, j])
                x4 = (ll[4, j] + ll[36, j]) + (ll[20, j] + ll[52, j])
                x5 = (ll[5, j] + ll[37, j]) + (ll[21, j] + ll[53, j])
                x6 = (ll[6, j] + ll[38, j]) + (ll[22, j] + ll[54, j])
                x7 = (ll[7, j] + ll[39, j]) + (ll[23, j] + ll[55, j])
                x8 = (ll[8, j] + ll[40, j]) + (ll[24, j] + ll[56, j])
                x9 = (ll[9, j] + ll[41, j]) + (ll[25, j] + ll[57, j])
                x10 = (ll[10, j] + ll[42, j]) + (ll[26, j] + ll[58, j])
                x11 = (ll[11, j] + ll[43, j]) + (ll[27, j] + ll[59, j])
                x12 = (ll[12, j] + ll[44, j]) + (ll[28, j] + ll[60, j])
                x13 = (ll[13, j] + ll[45, j]) + (ll[29, j] + ll[61, j])
                x14 = (ll[14, j] + ll[46, j]) + (ll[30, j] + ll[62, j])
                x15 = (ll[15, j] + ll[47, j]) + (ll[31, j] + ll[63, j])
                b0 = x8 + x0
                b1 = x9 + x1
                b2 = x10 + x2
                b3 = x11 + x3
                b4 = x12 + x4
                b5 = x13 + x5
                b6 = x14 + x6
                b7 = x15 + x7
                c0 = b4 + b0
                c1 = b5 + b1
                c2 = b6 + b2
                c3 = b7 + b3
                sums[j] = (c0 + c2) + (c1 + c3)
        if n64 == hd:
            for j in range(jw):
                s[j0 + j] = sums[j]                      # F32(F64(r)) = r: no tail
        else:                                            # the n % 64 tail, added in double
            tail = np.empty(jw, F64)
            for j in range(jw):
                tail[j] = F64(sums[j]) if n64 else 0.0
            for d in range(n64, hd):
                qq = qi[d]
                kk = kt[d, j0:j0 + jw]
                for j in range(jw):
                    tail[j] += F64(qq * kk[j])
            for j in range(jw):
                s[j0 + j] = F32(tail[j])


@njit(cache=True, nogil=True)
def _softmax_f16(s, npad):
    """ggml.softmax_rows of s[:npad] in place, then the probabilities rounded to fp16 (ggml.round_f16)."""
    mx = s[0]
    for j in range(1, npad):
        if s[j] > mx:
            mx = s[j]
    for j in range(npad):
        s[j] = expf(s[j] - mx)
    total = 0.0
    for c in range(npad // 16):
        b = 16 * c
        a0 = s[b + 8] + s[b]
        a1 = s[b + 9] + s[b + 1]
        a2 = s[b + 10] + s[b + 2]
        a3 = s[b + 11] + s[b + 3]
        a4 = s[b + 12] + s[b + 4]
        a5 = s[b + 13] + s[b + 5]
        a6 = s[b + 14] + s[b + 6]
        a7 = s[b + 15] + s[b + 7]
        total += F64(((a4 + a0) + (a6 + a2)) + ((a5 + a1) + (a7 + a3)))
    inv = F32(1.0 / total)
    for j in range(npad):
        s[j] = f16_round(s[j] * inv)


@njit(cache=True, nogil=True)
def _weighted(p, v, n_keys, npad, one, acc, fold, out):
    """out [hd] = V . p over the npad keys (V rows past n_keys are 0) in ggml.dot_f16_tiny / dot_f16_vec order
    along the keys; v [n_tot, hd] float32 (f16 values). Vectorized across head_dim: acc [16 or 64, hd]."""
    hd = v.shape[1]
    width = 64 if one else 16
    for c in range(npad // width):
        for i in range(width):
            j = width * c + i
            pj = p[j]
            al = acc[i]
            if j < n_keys:
                vr = v[j]
                if c == 0:
                    for d in range(hd):
                        al[d] = pj * vr[d]
                else:
                    for d in range(hd):
                        al[d] += pj * vr[d]
            else:
                z = pj * F32(0.0)
                if c == 0:
                    for d in range(hd):
                        al[d] = z
                else:
                    for d in range(hd):
                        al[d] += z
    if one:
        for d in range(hd):
            _fold64_col(acc, d, fold)
            out[d] = _reduce16_col(fold, d)
    else:
        for d in range(hd):
            out[d] = _reduce16_col(acc, d)


@njit(cache=True, nogil=True)
def attend_block(q, kt, v, n_old, a, b, one, scale, n_gqa, out):
    """ggml.attend's `block(a, b)` for an f16 KV store: query rows a..b-1 of q [m, n_head, hd] (fp16 values)
    against keys 0..n_old+b-1; kt [n_head_kv, hd, n_tot], v [n_head_kv, n_tot, hd] float32 (the cells' f16
    values); out [m, n_head, hd]. Scores times `scale`, keys after a row's position masked (blocks of 2+
    rows), padded with -inf to a multiple of 16 (64 when one), softmax, probabilities to fp16, V . p."""
    attend_heads(q, kt, v, n_old, a, b, one, scale, n_gqa, out, 0, q.shape[1])


@njit(cache=True, nogil=True)
def attend_heads(q, kt, v, n_old, a, b, one, scale, n_gqa, out, h0, h1):
    """`attend_block` for the heads h0..h1-1 only (each head's work is independent of the others')."""
    hd = q.shape[2]
    n_keys = n_old + b
    width = 64 if one else 16
    npad = (n_keys + width - 1) // width * width
    s = np.empty(npad, F32)
    lanes = np.empty((width, _KEYS), F32)
    fold = np.empty((16, max(_KEYS, hd)), F32)
    acc = np.empty((width, hd), F32)
    for h in range(h0, h1):
        kh = h // n_gqa
        for i in range(a, b):
            _scores(q[i, h], kt[kh], n_keys, one, s, lanes, fold)
            for j in range(n_keys):
                s[j] = s[j] * scale
            if b - a > 1:
                for j in range(n_old + i + 1, n_keys):
                    s[j] = -_INF
            for j in range(n_keys, npad):
                s[j] = -_INF
            _softmax_f16(s, npad)
            _weighted(s, v[kh], n_keys, npad, one, acc, fold, out[i, h])

