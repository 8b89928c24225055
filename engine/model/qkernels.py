"""numba kernels of the "q" numerics: y = x @ W.T on weights kept quantized (`engine.model.quant`).

Weights are repacked at load, bit for bit, into a layout the compiled loops stream contiguously along the
outputs ("transposed blocks", like `Linear.t` but quantized): for every block b of `bs` inputs and element j
of the block, the quants of all outputs are contiguous.

- nibble kernels (4-bit types: Q4_0, Q4_1, Q4_K): `q [nb, 16, n_out] uint8`, low nibble = element j of the
  32-block, high nibble = element j + 16 (GGUF's own pairing for Q4_0/Q4_1; Q4_K's nibbles are re-paired at
  load); W[o, 32b + j] = d[b, o] * q + m[b, o].
- byte kernels (Q8_0, Q5_0, Q5_1, Q5_K with bs = 32; Q6_K with bs = 16, its scales' granularity):
  `q [nb, bs, n_out] int8`; W[o, bs*b + j] = d[b, o] * q + m[b, o] (d * q alone when not has_m).
- 16-bit kernels (F16, BF16): `w [n_in, n_out] uint16` bit patterns, W[o, i] = float32(w[i, o]) * s[o].

d and m are float32 (Q4_0 / Q5_0 keep their offset in m = -8d / -16d: exact in float32; a K-quant
sub-block's d = d·sc and m = -dmin·mn are exact products of an fp16 and a 6- or 8-bit integer). The products are
float32 with float32 accumulation: x is not re-quantized (measured: the 8-bit activation path is slower here,
see docs/engine.md). Loops are written for LLVM's loop vectorizer: integer operations cast back to int32 at
every step (numba widens them to int64 otherwise, and the int64 -> float conversions do not vectorize), and
innermost loops over slices of runtime length (a loop of constant length 16 is unrolled before
vectorization and then not vectorized, the arrays may alias).

`decode_*` functions: 1..DECODE rows, `parallel=True` (numba threads, `numba.set_num_threads` set by the
caller), output range split in `n_chunks`. `dequant_*`: one output range to a float32 tile [n_in, w] for BLAS
(prefill); `nogil`, run on the engine's own threads.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

I32 = np.int32
F32 = np.float32


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _nib_block_rows(q, b, x, m0, g, t, o0, o1):
    """t[r, :w] = sum_j lo_j * x[m0 + r, 32b + j] + hi_j * x[m0 + r, 32b + 16 + j] for r < g (g in 1..4)."""
    h = q.shape[1]
    w = o1 - o0
    qb = q[b]
    if g == 4:
        t0 = t[0, :w]
        t1 = t[1, :w]
        t2 = t[2, :w]
        t3 = t[3, :w]
        for j in range(h):
            a0 = x[m0, 32 * b + j]
            c0 = x[m0, 32 * b + 16 + j]
            a1 = x[m0 + 1, 32 * b + j]
            c1 = x[m0 + 1, 32 * b + 16 + j]
            a2 = x[m0 + 2, 32 * b + j]
            c2 = x[m0 + 2, 32 * b + 16 + j]
            a3 = x[m0 + 3, 32 * b + j]
            c3 = x[m0 + 3, 32 * b + 16 + j]
            qj = qb[j, o0:o1]
            for o in range(w):
                v = I32(qj[o])
                lo = F32(I32(v & I32(15)))
                hi = F32(I32(v >> I32(4)))
                t0[o] += lo * a0 + hi * c0
                t1[o] += lo * a1 + hi * c1
                t2[o] += lo * a2 + hi * c2
                t3[o] += lo * a3 + hi * c3
    else:
        for r in range(g):
            tr = t[r, :w]
            for j in range(h):
                a0 = x[m0 + r, 32 * b + j]
                c0 = x[m0 + r, 32 * b + 16 + j]
                qj = qb[j, o0:o1]
                for o in range(w):
                    v = I32(qj[o])
                    tr[o] += F32(I32(v & I32(15))) * a0 + F32(I32(v >> I32(4))) * c0


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _byte_block_rows(q, b, x, m0, g, t, o0, o1):
    """t[r, :w] = sum_j q_j * x[m0 + r, bs*b + j] for r < g (g in 1..4)."""
    bs = q.shape[1]
    w = o1 - o0
    qb = q[b]
    if g == 4:
        t0 = t[0, :w]
        t1 = t[1, :w]
        t2 = t[2, :w]
        t3 = t[3, :w]
        for j in range(bs):
            a0 = x[m0, bs * b + j]
            a1 = x[m0 + 1, bs * b + j]
            a2 = x[m0 + 2, bs * b + j]
            a3 = x[m0 + 3, bs * b + j]
            qj = qb[j, o0:o1]
            for o in range(w):
                v = F32(I32(qj[o]))
                t0[o] += v * a0
                t1[o] += v * a1
                t2[o] += v * a2
                t3[o] += v * a3
    else:
        for r in range(g):
            tr = t[r, :w]
            for j in range(bs):
                a0 = x[m0 + r, bs * b + j]
                qj = qb[j, o0:o1]
                for o in range(w):
                    tr[o] += F32(I32(qj[o])) * a0


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _finish_block(d, m, xs, b, m0, g, t, y, o0, o1, has_m):
    """y[m0 + r, o0:o1] += d[b] * t[r] (+ m[b] * xs[m0 + r, b]; m is [0, n_out], not read, when not has_m)."""
    w = o1 - o0
    db = d[b, o0:o1]
    for r in range(g):
        yr = y[m0 + r, o0:o1]
        tr = t[r, :w]
        if has_m:
            mb = m[b, o0:o1]
            s = xs[m0 + r, b]
            for o in range(w):
                yr[o] += db[o] * tr[o] + mb[o] * s
        else:
            for o in range(w):
                yr[o] += db[o] * tr[o]


# _range_nib and _range_byte differ only in the block kernel they call. They stay two functions on purpose:
# numba compiles each with its kernel inlined, while passing the kernel as an argument would make it a
# first-class function call per block (measurably slower in the inner loop).
@njit(cache=True, fastmath=True, nogil=True)
def _range_nib(q, d, m, x, xs, y, o0, o1, t):
    nb = q.shape[0]
    rows = x.shape[0]
    m0 = 0
    while m0 < rows:
        g = min(4, rows - m0)
        for r in range(g):
            y[m0 + r, o0:o1] = 0
        for b in range(nb):
            t[:g] = 0
            _nib_block_rows(q, b, x, m0, g, t, o0, o1)
            _finish_block(d, m, xs, b, m0, g, t, y, o0, o1, True)
        m0 += g


@njit(cache=True, fastmath=True, nogil=True)
def _range_byte(q, d, m, x, xs, y, o0, o1, t, has_m):
    nb = q.shape[0]
    rows = x.shape[0]
    m0 = 0
    while m0 < rows:
        g = min(4, rows - m0)
        for r in range(g):
            y[m0 + r, o0:o1] = 0
        for b in range(nb):
            t[:g] = 0
            _byte_block_rows(q, b, x, m0, g, t, o0, o1)
            _finish_block(d, m, xs, b, m0, g, t, y, o0, o1, has_m)
        m0 += g


@njit(cache=True, fastmath=True, parallel=True)
def decode_nib(q, d, m, x, xs, y, n_chunks):
    """y [M, n_out] = x [M, n_in] @ W.T for nibble weights; xs [M, nb] = block sums of x."""
    n_out = q.shape[2]
    step = ((n_out + n_chunks - 1) // n_chunks + 15) // 16 * 16
    for c in prange(n_chunks):
        o0 = min(n_out, c * step)
        o1 = min(n_out, o0 + step)
        if o1 > o0:
            t = np.empty((4, o1 - o0), np.float32)
            _range_nib(q, d, m, x, xs, y, o0, o1, t)


@njit(cache=True, fastmath=True, parallel=True)
def decode_byte(q, d, m, x, xs, y, n_chunks, has_m):
    """y [M, n_out] = x [M, n_in] @ W.T for byte weights; xs [M, nb] = block sums of x (used when has_m)."""
    n_out = q.shape[2]
    step = ((n_out + n_chunks - 1) // n_chunks + 15) // 16 * 16
    for c in prange(n_chunks):
        o0 = min(n_out, c * step)
        o1 = min(n_out, o0 + step)
        if o1 > o0:
            t = np.empty((4, o1 - o0), np.float32)
            _range_byte(q, d, m, x, xs, y, o0, o1, t, has_m)


@njit(cache=True, fastmath=True, nogil=True)
def dequant_nib(q, d, m, o0, o1, out):
    """out [n_in, o1 - o0] = W[o0:o1].T for nibble weights (a float32 tile for BLAS)."""
    nb, h, _ = q.shape
    w = o1 - o0
    for b in range(nb):
        db = d[b, o0:o1]
        mb = m[b, o0:o1]
        for j in range(h):
            qj = q[b, j, o0:o1]
            lo = out[32 * b + j, :w]
            hi = out[32 * b + 16 + j, :w]
            for o in range(w):
                v = I32(qj[o])
                lo[o] = F32(I32(v & I32(15))) * db[o] + mb[o]
                hi[o] = F32(I32(v >> I32(4))) * db[o] + mb[o]


@njit(cache=True, fastmath=True, nogil=True)
def dequant_byte(q, d, m, o0, o1, out, has_m):
    """out [n_in, o1 - o0] = W[o0:o1].T for byte weights (d q, exact, when not has_m)."""
    nb, bs, _ = q.shape
    w = o1 - o0
    for b in range(nb):
        db = d[b, o0:o1]
        for j in range(bs):
            qj = q[b, j, o0:o1]
            row = out[bs * b + j, :w]
            if has_m:
                mb = m[b, o0:o1]
                for o in range(w):
                    row[o] = F32(I32(qj[o])) * db[o] + mb[o]
            else:
                for o in range(w):
                    row[o] = F32(I32(qj[o])) * db[o]


@njit(cache=True, fastmath=True, nogil=True)
def embed_rows(q, d, m, kind_nib, has_m, ids, out):
    """out [T, n_in] = W[ids] (embedding lookup of quantized rows; few rows, strided reads are fine)."""
    nb, h, _ = q.shape
    bs = 32 if kind_nib else h
    for t in range(ids.shape[0]):
        o = ids[t]
        for b in range(nb):
            db = d[b, o]
            mb = m[b, o] if has_m else F32(-0.0)
            for j in range(h):
                v = I32(q[b, j, o])
                if kind_nib:
                    out[t, 32 * b + j] = F32(I32(v & I32(15))) * db + mb
                    out[t, 32 * b + 16 + j] = F32(I32(v >> I32(4))) * db + mb
                else:
                    out[t, bs * b + j] = F32(v) * db + mb


@njit(cache=True, fastmath=True, nogil=True)
def range_nib(q, d, m, x, xs, y, o0, o1):
    """`decode_nib` over the outputs [o0, o1) only, on the calling thread (no numba threads; GIL released)."""
    t = np.empty((4, o1 - o0), np.float32)
    _range_nib(q, d, m, x, xs, y, o0, o1, t)


@njit(cache=True, fastmath=True, nogil=True)
def range_byte(q, d, m, x, xs, y, o0, o1, has_m):
    """`decode_byte` over the outputs [o0, o1) only, on the calling thread."""
    t = np.empty((4, o1 - o0), np.float32)
    _range_byte(q, d, m, x, xs, y, o0, o1, t, has_m)


# --- 16-bit float weights (F16, BF16) kept as they are: w [n_in, n_out] uint16 (transposed, like `Linear.t`) ---
def _target_has_f16c() -> bool:
    """Whether the CPU numba compiles for has F16C (`vcvtph2ps`): NUMBA_CPU_NAME / NUMBA_CPU_FEATURES as numba
    reads them, else the host's. Unknown -> False (the portable conversion)."""
    try:
        from numba.core.registry import cpu_target
        features = cpu_target.target_context.codegen()._get_host_cpu_features()
        return "+f16c" in features.split(",")
    except Exception:
        return False


F16C = _target_has_f16c()


@intrinsic
def _f16_bits_fpext(typingctx, v):
    """An fp16 bit pattern (uint16) -> float32 by LLVM's `fpext half` (F16C's vcvtph2ps; exact). Only where
    the target has F16C: elsewhere LLVM calls a runtime helper that the JIT does not link (a crash)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return sig, codegen


@intrinsic
def _f16_bits_portable(typingctx, v):
    """An fp16 bit pattern (uint16) -> float32, exactly, in integer operations and one multiply (any CPU). The
    magnitude bits shifted into float32 position (em << 13) read as a float32 that is the value times 2^-112,
    normal or subnormal alike; times 2^112 it is exact. Exponent 31 (inf, NaN) sets float32's exponent to 255
    instead, keeping the payload; the sign bit is or-ed in last (signed zeros exact)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        i32, f32 = ir.IntType(32), ir.FloatType()
        h = builder.zext(args[0], i32)
        sign = builder.shl(builder.and_(h, ir.Constant(i32, 0x8000)), ir.Constant(i32, 16))
        em = builder.and_(h, ir.Constant(i32, 0x7FFF))
        shifted = builder.shl(em, ir.Constant(i32, 13))
        finite = builder.bitcast(builder.fmul(builder.bitcast(shifted, f32), ir.Constant(f32, 2.0 ** 112)), i32)
        special = builder.or_(shifted, ir.Constant(i32, 0x7F800000))
        is_special = builder.icmp_unsigned(">=", em, ir.Constant(i32, 0x7C00))
        bits = builder.or_(builder.select(is_special, special, finite), sign)
        return builder.bitcast(bits, f32)
    return sig, codegen


@intrinsic
def _bf16_bits_to_f32(typingctx, v):
    """A bf16 bit pattern (uint16) -> float32: the bits shifted to the top half (exact, as gguf's dequantize)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return sig, codegen


_f16_bits_to_f32 = _f16_bits_fpext if F16C else _f16_bits_portable


@njit(cache=True, fastmath=True, nogil=True, inline="always")
def _half(v, bf):
    return _bf16_bits_to_f32(v) if bf else _f16_bits_to_f32(v)


@njit(cache=True, fastmath=True, nogil=True)
def f16_bits_to_f32(bits, out, portable):
    """out[i] = float32 of fp16 bit pattern bits[i] by the portable conversion or (False) the one the kernels
    use on this target (tests: both against numpy's cast)."""
    for i in range(bits.shape[0]):
        out[i] = _f16_bits_portable(bits[i]) if portable else _f16_bits_to_f32(bits[i])


# range_half repeats the 4-row accumulation of _byte_block_rows with its own element decoding, for the reason
# given above _range_nib: a decoder passed as an argument would be a function call per weight.
@njit(cache=True, fastmath=True, nogil=True)
def range_half(w, s, x, y, o0, o1, bf):
    """y[:, o0:o1] = (x @ W[o0:o1].T) * s[o0:o1] for 16-bit weights w [n_in, n_out] (bf: bfloat16, else fp16),
    4 rows of x per pass over the weights; on the calling thread (GIL released)."""
    n_in = w.shape[0]
    wd = o1 - o0
    rows = x.shape[0]
    t = np.empty((4, wd), np.float32)
    sw = s[o0:o1]
    m0 = 0
    while m0 < rows:
        g = min(4, rows - m0)
        t[:g] = 0
        if g == 4:
            t0 = t[0, :wd]
            t1 = t[1, :wd]
            t2 = t[2, :wd]
            t3 = t[3, :wd]
            for j in range(n_in):
                a0 = x[m0, j]
                a1 = x[m0 + 1, j]
                a2 = x[m0 + 2, j]
                a3 = x[m0 + 3, j]
                wj = w[j, o0:o1]
                for o in range(wd):
                    v = _half(wj[o], bf)
                    t0[o] += v * a0
                    t1[o] += v * a1
                    t2[o] += v * a2
                    t3[o] += v * a3
        else:
            for r in range(g):
                tr = t[r, :wd]
                for j in range(n_in):
                    a0 = x[m0 + r, j]
                    wj = w[j, o0:o1]
                    for o in range(wd):
                        tr[o] += _half(wj[o], bf) * a0
        for r in range(g):
            yr = y[m0 + r, o0:o1]
            tr = t[r, :wd]
            for o in range(wd):
                yr[o] = tr[o] * sw[o]
        m0 += g


@njit(cache=True, fastmath=True, nogil=True)
def dequant_half(w, s, o0, o1, out, bf):
    """out [n_in, o1 - o0] = W[o0:o1].T * s (a float32 tile for BLAS; fl(w s), as f32 mode's scaled rows)."""
    n_in = w.shape[0]
    wd = o1 - o0
    sw = s[o0:o1]
    for j in range(n_in):
        wj = w[j, o0:o1]
        row = out[j, :wd]
        for o in range(wd):
            row[o] = _half(wj[o], bf) * sw[o]


@njit(cache=True, fastmath=True, nogil=True)
def embed_half(w, s, ids, out, bf):
    """out [T, n_in] = W[ids] * s[ids] (embedding rows of 16-bit weights; strided reads, few rows)."""
    for t in range(ids.shape[0]):
        o = ids[t]
        for j in range(w.shape[0]):
            out[t, j] = _half(w[j, o], bf) * s[o]
