"""numba kernels of the "ggml" numerics: the same arithmetic as the numpy code of `engine.model.ggml`, bit for bit.

Every kernel replays, operation by operation, what the numpy reference in `ggml.py` computes (itself a replay of
ggml's x86 CPU kernels); the tests (`tests/engine/test_ggml_kernels.py`) hold them to np.array_equal against it.
Rules that keep the bits:

- no `fastmath`: LLVM must not contract a * b + c into an fma, reassociate a sum or assume away inf / NaN
  (the one exception: `contract` in the attention's scores and V.p, whose products are exact, see there);
- `error_model="numpy"` everywhere: a float division by zero gives IEEE's inf / NaN, as in the numpy reference,
  instead of a ZeroDivisionError check, which kept the loops holding a division from vectorizing (SwiGLU's 5x
  slower);
- float32 values stay float32 (numba types float32 op float32 as float32; constants are typed `F32(...)`);
- an fma of float32 operands is `llvm.fma.f32` (`_fma`, one rounding: vfmadd on CPUs with FMA, the C library's
  fmaf elsewhere), the correctly rounded result the numpy code's exact emulation gives (`ggml._fma`);
- sums whose order matters are written in ggml's order (16-lane reductions as `_mm512_reduce_add_ps`, double
  sums sequential); sums of exact integers or of exact f16 x f16 products may be written in any order the
  vectorizer likes only where every partial sum is exact (integer dot products below 2^24).

Quantized weights come in the dot kernels' packed layout (`ggml.pack_blocks`: groups of 16 outputs, each group's
blocks contiguous, a lane's bytes of the 16 outputs side by side), which their vector code (LLVM IR of ggml's x86
integer instructions, `_group_dot_of`) reads 64 bytes (AVX-512) or 32 bytes (AVX2) at a time. All kernels are `nogil`: the engine's own
threads (`Matmul._run`) and the polling workers call them on disjoint output ranges or query blocks.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from engine.model.types import PACK_GROUP as GROUP   # outputs a group of the packed layout

I16 = np.int16
I32 = np.int32
I64 = np.int64
F32 = np.float32
F64 = np.float64

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


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _fma(a, b, c):
    """ggml._fma: fmaf(a, b, c) on float32 operands, one rounding."""
    return _llvm_fma(a, b, c)


@njit(cache=True, nogil=True, error_model="numpy")
def fma_array(a, b, c, out):
    """`_fma` element-wise (tests)."""
    for i in range(out.size):
        out[i] = _fma(a[i], b[i], c[i])


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
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


def _target_features(context) -> set[str]:
    """The features numba gives LLVM's target machine for the code being compiled ("+avx2", ...): the host's, or
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES. numba keys its cache by them, so code compiled for one set is not loaded
    on a CPU of another."""
    cg = context.codegen()
    feats = getattr(cg, "_tm_features", None)
    if feats is None:
        feats = cg._get_host_cpu_features()
    return set(str(feats).split(","))


@intrinsic
def _has_f16c(typingctx):
    """Whether the compile target has F16C (a constant of the compiled code: the branch not taken is removed)."""
    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(1), int("+f16c" in _target_features(context)))
    return types.boolean(), codegen


@intrinsic
def _f16c_bits(typingctx, x):
    """The fp16 bits of float32 x by the CPU's conversion (`fptrunc` to half: F16C's vcvtps2ph, IEEE round to
    nearest even, overflow to inf, fp16 subnormals exact) where the target has F16C; 0 elsewhere, where LLVM would
    call a runtime helper the JIT does not link (callers test `_has_f16c()` first)."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, signature, args):
        if "+f16c" not in _target_features(context):
            return ir.Constant(ir.IntType(16), 0)
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def _f16c_round(typingctx, x):
    """float32 x rounded to fp16 and back by the CPU's conversions (`fptrunc` / `fpext` half: F16C's vcvtps2ph /
    vcvtph2ps) where the target has F16C, x itself if it is a NaN; x elsewhere (callers test `_has_f16c()`)."""
    if not (isinstance(x, types.Float) and x.bitwidth == 32):
        return None

    def codegen(context, builder, signature, args):
        if "+f16c" not in _target_features(context):
            return args[0]
        r = builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
        return builder.select(builder.fcmp_unordered("uno", args[0], args[0]), args[0], r)
    return types.float32(types.float32), codegen


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def f16_round(x):
    """float32 -> nearest fp16 (round half to even; overflow to inf) -> float32, as x.astype(float16).astype(
    float32) does for every non-NaN x (a NaN is returned as it is). With F16C, the CPU's conversion (the same
    rounding, branch-free: loops over it vectorize); else bit operations."""
    if _has_f16c():
        return _f16c_round(F32(x))
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


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def f16_bits(x):
    """The fp16 bits (uint16) of float32 x rounded to nearest, half to even (`f16_round`), as x.astype(float16)
    gives them for every non-NaN x. A NaN keeps its sign and the top 10 bits of its mantissa (at least 1), as
    numpy's software conversion does (a hardware conversion would also set the quiet bit): the KV cells of a
    model that produced a NaN are lost anyway."""
    u = I64(F32(x).view(np.uint32))
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if _has_f16c():                                      # the CPU's conversion; a NaN as numpy's software one
        nan = sign | 0x7C00 | max((a & 0x7FFFFF) >> 13, I64(1))
        return np.uint16(nan) if a > 0x7F800000 else _f16c_bits(F32(x))
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


@njit(cache=True, nogil=True, error_model="numpy")
def f16_bits_array(x, out):
    """`f16_bits` element-wise (tests)."""
    for i in range(x.size):
        out[i] = f16_bits(x[i])


@njit(cache=True, nogil=True, error_model="numpy")
def rerotate_f16(k16, cos, sin, n_rot, neox):
    """A context shift's K re-rotation in place: fp16 cells (uint16 bits [n_layer, n_head_kv, n, hd], any strides)
    rotated by one angle set (cos, sin [n_rot/2]) as `GgmlRope.apply` rotates their float32 values, each result
    rounded back to fp16 (`f16_bits`): what the numpy path's astype(float32), apply, astype(float16) gives."""
    half = n_rot // 2
    x = np.empty(n_rot, F32)                      # one cell's rotated dims as float32
    for layer in range(k16.shape[0]):
        for h in range(k16.shape[1]):
            for j in range(k16.shape[2]):
                row = k16[layer, h, j]
                for d in range(n_rot):
                    x[d] = f16_value(row[d])
                for i in range(half):
                    i0 = i if neox else 2 * i
                    i1 = i0 + half if neox else i0 + 1
                    x0 = x[i0]
                    x1 = x[i1]
                    c = cos[i]
                    s = sin[i]
                    x[i0] = _fma(x0, c, -(x1 * s))
                    x[i1] = _fma(x0, s, x1 * c)
                for d in range(n_rot):
                    row[d] = f16_bits(x[d])


@njit(cache=True, nogil=True, error_model="numpy")
def kv_values(c16, n, out):
    """out [n_head_kv, n, hd] = the float32 values of the fp16 cells c16[:, :n] (uint16 bits [n_head_kv, cap, hd])."""
    for h in range(c16.shape[0]):
        for j in range(n):
            src = c16[h, j]
            dst = out[h, j]
            for d in range(c16.shape[2]):
                dst[d] = f16_value(src[d])


@njit(cache=True, nogil=True, error_model="numpy")
def kv_values_t(c16, n, out):
    """out [n_head_kv, hd, n] = `kv_values` transposed (keys contiguous, for the score kernels)."""
    for h in range(c16.shape[0]):
        for d in range(c16.shape[2]):
            dst = out[h, d]
            for j in range(n):
                dst[j] = f16_value(c16[h, j, d])


@njit(cache=True, nogil=True, error_model="numpy")
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


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
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
    e = I32(n) if ok else I32(0)
    e1 = e >> 1                                          # 2^e = 2^e1 2^e2, |e1|, |e2| <= 96: normal float32s
    e2 = e - e1
    s1 = I32((e1 + 127) << 23).view(np.float32)
    s2 = I32((e2 + 127) << 23).view(np.float32)
    res = (j * s1) * s2                                  # = ldexpf(j, n): j s1 exact (normal), one rounding
    sat = F32(0.0) if n <= F32(0.0) else _INF            # |n| > 192: 0 or inf
    keep = ok | (n != n)                                 # NaN in (j is NaN), NaN out; no `or`: no branch
    return res if keep else sat


# --- activation quantization --------------------------------------------------------------------------------

@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _q8_block_scalar(x, qx, d16, s, r, b):
    """Block b of row r of `quantize_q8`, one element at a time: the blocks holding an inf or NaN."""
    o = 32 * b
    amax = F32(0.0)
    for j in range(32):
        v = abs(x[r, o + j])
        if v > amax or v != v:                           # max with NaN propagating, as np.max
            amax = v
    d = amax / F32(127.0)
    inv = F32(127.0) / amax if amax != F32(0.0) else F32(0.0)
    tot = F32(0.0)
    for j in range(32):
        q = np.rint(x[r, o + j] * inv)
        qx[r, o + j] = q
        tot += q
    d16[r, b] = f16_round(d)
    s[r, b] = f16_round(d * tot)


@njit(cache=True, nogil=True, error_model="numpy")
def quantize_q8(x, qx, d16, s):
    """ggml._q8_blocks / quantize_q8_1 for x [M, n] (n a multiple of 32): qx [M, n] the integer quants (int8,
    or float32 holding them), d16 [M, n/32] the scales d = amax/127 rounded to fp16, s [M, n/32] = fp16(d * sum q).
    Written to vectorize: amax as the largest |x| bit pattern (the float order of finite non-negative floats), the
    sum of the quants in int32 (exact, |sum| <= 32 x 127: the float sum's value); a block with an inf or NaN, or
    so small that 127 / amax overflows (its quants inf or NaN), takes the element-wise loop (`_q8_block_scalar`),
    whose NaN propagation is np.max's."""
    m, n = x.shape
    for r in range(m):
        xr = x[r]
        qr = qx[r]
        for b in range(n // 32):
            o = 32 * b
            top = I32(0)
            for j in range(o, o + 32):
                top = max(top, I32(F32(xr[j]).view(np.int32) & I32(0x7FFFFFFF)))
            amax = I32(top).view(np.float32)
            inv = F32(127.0) / amax if amax != F32(0.0) else F32(0.0)
            if top >= I32(0x7F800000) or inv == _INF:    # an inf or NaN, or 127 / amax overflows (amax < 2^-121)
                _q8_block_scalar(x, qx, d16, s, r, b)
                continue
            d = amax / F32(127.0)
            tot = I32(0)
            for j in range(o, o + 32):
                q = np.rint(xr[j] * inv)
                qr[j] = q
                tot += I32(q)
            d16[r, b] = f16_round(d)
            s[r, b] = f16_round(d * F32(tot))


@njit(cache=True, nogil=True, error_model="numpy")
def q8_values(qx, d16, out):
    """out [M, n] = qx * d16 per block of 32: the Q8_0 / Q8_1 values (ggml.quantize_q8_0)."""
    m, n = qx.shape
    for r in range(m):
        for b in range(n // 32):
            d = d16[r, b]
            for j in range(32 * b, 32 * b + 32):
                out[r, j] = F32(qx[r, j]) * d


# --- Q4_1 / Q5_1 x Q8_1 and Q8_0 x Q8_0 (ggml.dot_q8_1) -----------------------------------------------------------
#
# Per row r, output o and block b: lane l (elements 4l..4l+3 of the block) has the exact integer dot
# xy = sum q_w * q_x (|xy| < 2^16, exact in float32 whatever the order), then acc_l = fma(d_x * d_w, xy, acc_l)
# with one rounding (d_x * d_w is exact in float32), summs = fma(s_x, m_w, summs) likewise, and at the end
# y = ((acc4 + acc0) + (acc6 + acc2)) + ((acc5 + acc1) + (acc7 + acc3)) + summs: ggml.dot_q8_1's operations.
#
# The weights are in the packed layout (`ggml.pack_blocks`): groups of GROUP = 16 outputs, each group's blocks
# contiguous, and in a block the 4 bytes of lane l of the 16 outputs side by side (64 bytes). One 64-byte load then
# holds lane l of the group (a 32-byte load, of half of it), and the lane sums are the integer instructions ggml's
# own kernel uses: `pmaddubsw` of the unsigned weight bytes with the signed activation bytes (4 bytes of the lane
# broadcast to all outputs) gives the pair sums, `pmaddwd` with ones the lane sums, as int32
# (`mul_sum_us8_pairs_float` in ggml-cpu's quants.c); with VNNI one `vpdpbusd` gives the lane sums directly, as
# that function does on AVX512-VNNI / AVX-VNNI. Q8_0 weights are signed: ggml's sign trick, |w| x (x * sign(w))
# (`mul_sum_i8_pairs_float`); with VNNI instead (w + 128) x (unsigned) . x - 128 sum(x), the 4-quant sums of the
# activations precomputed per call (`_dot_packed`'s cx) and the vpdpbusd's starting value: two instructions a lane
# (xor, vpdpbusd) where the sign trick takes four on 512-bit registers (AVX-512 has no vpsignb). The lane
# accumulators are 8 vector registers over a group's blocks, each holding lane l of the group's outputs: one
# 512-bit register (AVX-512), or two passes over the blocks with 256-bit registers, 8 outputs each (AVX2). Every
# output's operations are the same in each: the width changes only how many outputs a register carries.
# Exactness: a pair sum is at most 2 x 31 x 127 = 7874 (Q4_1: 15, Q5_1: 31) or 2 x 128 x 127 (Q8_0) in magnitude,
# so pmaddubsw's int16 saturation never applies (vpdpbusd sums in int32, |sum| < 2^17), and the lane sums are the
# exact integers of the reference.
#
# The vector code is LLVM IR written by `_group_dot_of` (numba's `intrinsic`): LLVM does not form pmaddubsw from
# plain multiplies when it can bound the values (it proves the nibbles small and emits 16-bit multiplies, half the
# speed), so the instructions are asked for by name as the compile target has them (`_target_isa`, from numba's
# target features: the host's, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES), and written as plain widening multiplies
# and pair adds -- the same integers -- for CPUs without AVX2. numba's cache keys compiled code by the target's
# features.
#
# Measured on one thread, SmolLM2-shaped matrices, against the kernels these replaced: see docs/engine.md,
# "ggml's integer instructions" (AVX2: groups of 8) and "Groups of 16, VNNI" (AVX-512 VNNI).

_ROWS_PER_PASS = 32     # rows per pass over a range of groups (their activations stay in L2; a group's weights
                        # in L1 while the rows pass)
_NIB, _U8, _S8 = 1, 2, 3  # weight bytes: two unsigned nibbles (Q4_1), one unsigned quant (Q5_1), one signed (Q8_0)

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)


_ISA_512 = ("vnni512", "avx512")
_ISA_VNNI = ("vnni512", "vnni")


def _target_isa(context) -> str:
    """The integer instructions the code being compiled may use, from the features numba gives LLVM's target
    machine (the host's, or NUMBA_CPU_FEATURES): on 512-bit registers (a whole group of 16 outputs a register),
    "vnni512" (vpdpbusd: AVX512-VNNI) or "avx512" (vpmaddubsw + vpmaddwd: AVX512-BW); on 256-bit ones (half a
    group), "vnni" (vpdpbusd: AVX-VNNI, or AVX512-VNNI with AVX512-VL) or "avx2" (vpmaddubsw + vpmaddwd); or ""
    (plain widening multiplies, SSE2). An empty feature list (NUMBA_CPU_FEATURES= with a NUMBA_CPU_NAME, as CI's
    AVX2 pass sets it) asks for none: correct on any x86-64, slower. All give the same integers."""
    f = _target_features(context)
    if "+avx2" not in f:
        return ""
    if {"+avx512f", "+avx512bw"} <= f:
        return "vnni512" if "+avx512vnni" in f else "avx512"
    if {"+avx512vnni", "+avx512vl"} <= f or "+avxvnni" in f:
        return "vnni"
    return "avx2"


@intrinsic
def _vnni_target(typingctx):
    """Whether the compile target's dot kernels use vpdpbusd (`_target_isa`), a constant of the compiled code."""
    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(1), int(_target_isa(context) in _ISA_VNNI))
    return types.boolean(), codegen


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _load(builder, base, off, ty, align):
    """The `ty` at byte offset off (i64) of address base (i64)."""
    ld = builder.load(builder.inttoptr(builder.add(base, off), ty.as_pointer()))
    ld.align = align
    return ld


def _splat(builder, v, n):
    vt = ir.VectorType(v.type, n)
    x = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(x, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _evens_odds(builder, v):
    n = v.type.count
    und = ir.Constant(v.type, ir.Undefined)
    return [builder.shuffle_vector(v, und, ir.Constant(ir.VectorType(_I32, n // 2), list(range(k, n, 2))))
            for k in (0, 1)]


def _lane_sums(builder, w, a, signed_w, isa, corr=None):
    """<W x i32> sums of 4 consecutive products of weight bytes w and activation bytes a (<4W x i8> each). Signed
    weights (Q8_0) with VNNI need corr, the i32 -128 x (sum of the lane's 4 activation quants)."""
    n = w.type.count
    vb, vw, vd = (ir.VectorType(t, n // k) for t, k in ((_I8, 1), (_I16, 2), (_I32, 4)))
    start = ir.Constant(vd, None)
    if signed_w and isa in _ISA_VNNI:     # (w + 128) . a - 128 sum(a), the correction as vpdpbusd's start: exact
        w = builder.xor(w, ir.Constant(vb, [-128] * n))
        start = _splat(builder, corr, n // 4)
    elif signed_w:                        # |w| x (a * sign(w)): ggml's sign trick; the products are w * a
        a_signed = (_call(builder, "llvm.x86.avx2.psign.b", vb, [a, w]) if isa and n == 32 else
                    builder.select(builder.icmp_signed("<", w, ir.Constant(vb, None)),
                                   builder.sub(ir.Constant(vb, None), a), a))
        w = _call(builder, f"llvm.abs.v{n}i8", vb, [w, ir.Constant(ir.IntType(1), 0)])
        a = a_signed
    if isa in _ISA_VNNI:                  # one vpdpbusd: the same 4-product sums, exact in int32
        return _call(builder, "llvm.x86.avx512.vpdpbusd." + {32: "256", 64: "512"}[n], vd,
                     [start, builder.bitcast(w, vd), builder.bitcast(a, vd)])
    if isa:
        madd = {32: ("llvm.x86.avx2.pmadd.ub.sw", "llvm.x86.avx2.pmadd.wd"),
                64: ("llvm.x86.avx512.pmaddubs.w.512", "llvm.x86.avx512.pmaddw.d.512")}[n]
        p = _call(builder, madd[0], vw, [w, a])
        return _call(builder, madd[1], vd, [p, ir.Constant(vw, [1] * (n // 2))])
    ty16 = ir.VectorType(_I16, n // 2)
    (we, wo), (ae, ao) = _evens_odds(builder, w), _evens_odds(builder, a)
    p = builder.add(builder.mul(builder.zext(we, ty16), builder.sext(ae, ty16)),
                    builder.mul(builder.zext(wo, ty16), builder.sext(ao, ty16)))     # exact: |p| <= 32512
    pe, po = _evens_odds(builder, p)
    return builder.add(builder.sext(pe, vd), builder.sext(po, vd))


def _group_dot_of(kind, has_m):
    """The intrinsic computing the GROUP outputs of one group of one row: see `_group_dot`."""
    n_lane = 4 if kind == _NIB else 8
    row = 4 * GROUP                     # bytes of one lane of a block: 4 per output

    @intrinsic
    def group_dot(typingctx, qw, qoff, dw, mw, doff, qx, xoff, dx, sx, boff, nb, y, yoff):
        """y[yoff:yoff+GROUP] (flat offsets, in elements) = the outputs of the group whose blocks start at qw's
        byte qoff and dw / mw's element doff, with activation quants qx from xoff and block values dx / sx from
        boff, over nb blocks."""
        sig = types.void(qw, qoff, dw, mw, doff, qx, xoff, dx, sx, boff, nb, y, yoff)

        def codegen(context, builder, signature, args):
            isa = _target_isa(context)

            def base(i):
                a = context.make_array(signature.args[i])(context, builder, args[i])
                return builder.ptrtoint(a.data, _I64)

            def word(i):
                v = args[i]
                return v if v.type.width == 64 else builder.sext(v, _I64)

            def k(n):
                return ir.Constant(_I64, n)

            qb, db, mb, xb, dxb, sxb, yb = (base(i) for i in (0, 2, 3, 5, 7, 8, 11))
            qo, do, xo, bo, n, yo = (word(i) for i in (1, 4, 6, 9, 10, 12))
            w_reg = GROUP if isa in _ISA_512 else 8          # outputs a register holds: the group, or half of it
            vb, vf = ir.VectorType(_I8, 4 * w_reg), ir.VectorType(ir.FloatType(), w_reg)
            fma = f"llvm.fma.v{w_reg}f32"
            for h in range(0, GROUP, w_reg):                 # the group's outputs h..h+w_reg, one pass each
                zero = ir.Constant(vf, None)
                acc = [cgutils.alloca_once_value(builder, zero) for _ in range(8)]
                summ = cgutils.alloca_once_value(builder, zero)
                with cgutils.for_range(builder, n) as loop:
                    b = loop.index
                    bx = builder.mul(builder.add(bo, b), k(4))
                    bw = builder.mul(builder.add(do, builder.add(builder.mul(b, k(GROUP)), k(h))), k(4))
                    dd = builder.fmul(_splat(builder, _load(builder, dxb, bx, ir.FloatType(), 4), w_reg),
                                      _load(builder, db, bw, vf, 4))               # d_x * d_w: exact
                    if has_m:
                        sv = _splat(builder, _load(builder, sxb, bx, ir.FloatType(), 4), w_reg)
                        builder.store(_call(builder, fma, vf, [sv, _load(builder, mb, bw, vf, 4),
                                                               builder.load(summ)]), summ)
                    qblk = builder.add(qo, builder.add(builder.mul(b, k(row * n_lane)), k(4 * h)))
                    xblk = builder.add(xo, builder.mul(b, k(32)))
                    for lane in range(n_lane):
                        v = _load(builder, qb, builder.add(qblk, k(row * lane)), vb, 1)

                        def act(e):
                            word4 = _load(builder, xb, builder.add(xblk, k(e)), _I32, 1)
                            return builder.bitcast(_splat(builder, word4, w_reg), vb)
                        if kind == _NIB:
                            steps = [(lane, builder.and_(v, ir.Constant(vb, [15] * 4 * w_reg)), act(4 * lane)),
                                     (lane + 4, builder.lshr(v, ir.Constant(vb, [4] * 4 * w_reg)),
                                      act(16 + 4 * lane))]
                        else:
                            steps = [(lane, v, act(4 * lane))]
                        for i, wv, av in steps:
                            corr = (_load(builder, sxb, builder.add(xblk, k(4 * lane)), _I32, 4)
                                    if kind == _S8 and isa in _ISA_VNNI else None)   # `_dot_packed`'s cx
                            xy = builder.sitofp(_lane_sums(builder, wv, av, kind == _S8, isa, corr), vf)
                            builder.store(_call(builder, fma, vf, [xy, dd, builder.load(acc[i])]), acc[i])
                a = [builder.load(p) for p in acc]
                h0 = builder.fadd(a[4], a[0])
                h1 = builder.fadd(a[5], a[1])
                h2 = builder.fadd(a[6], a[2])
                h3 = builder.fadd(a[7], a[3])
                out = builder.fadd(builder.fadd(h0, h2), builder.fadd(h1, h3))
                if has_m:
                    out = builder.fadd(out, builder.load(summ))
                dst = builder.add(yb, builder.mul(builder.add(yo, k(h)), k(4)))
                st = builder.store(out, builder.inttoptr(dst, vf.as_pointer()))
                st.align = 4
            return context.get_dummy_value()
        return sig, codegen
    return group_dot


_group_nib = _group_dot_of(_NIB, True)
_group_u8 = _group_dot_of(_U8, True)
_group_s8 = _group_dot_of(_S8, False)


@njit(cache=True, nogil=True, error_model="numpy")
def _dot_packed(kind, qw, dw, mw, qx, dx, sx, y, o0, o1):
    """y[:, o0:o1] for packed weights qw [G, nb, GROUP bs] (`ggml.pack_blocks`), dw / mw [G, nb, GROUP]; qx [M, n_in]
    int8, dx / sx [M, nb] (`quantize_q8`); o0 a multiple of GROUP. Rows pass in groups of _ROWS_PER_PASS over each
    group of outputs."""
    nb, blk = qw.shape[1], qw.shape[2]
    m, n_in = qx.shape
    n_out = y.shape[1]
    if o0 % GROUP:
        raise ValueError("output range not on a group")
    tail = np.empty((1, GROUP), F32)
    if kind == _S8 and _vnni_target():   # Q8_0 on VNNI: -128 x each 4 quants' sum, offset as qx's bytes (_lane_sums)
        cx = np.empty((m, n_in // 4), I32)
        for r in range(m):
            for j in range(n_in // 4):
                cx[r, j] = -128 * (I32(qx[r, 4 * j]) + I32(qx[r, 4 * j + 1]) + I32(qx[r, 4 * j + 2]) +
                                   I32(qx[r, 4 * j + 3]))
    else:
        cx = np.empty((0, 0), I32)
    for r0 in range(0, m, _ROWS_PER_PASS):
        for g in range(o0 // GROUP, (o1 + GROUP - 1) // GROUP):
            full = GROUP * g + GROUP <= n_out
            for r in range(r0, min(m, r0 + _ROWS_PER_PASS)):
                yy = y if full else tail
                yo = r * n_out + GROUP * g if full else 0
                qo, do = g * nb * blk, g * nb * GROUP
                if kind == _NIB:
                    _group_nib(qw, qo, dw, mw, do, qx, r * n_in, dx, sx, r * nb, nb, yy, yo)
                elif kind == _U8:
                    _group_u8(qw, qo, dw, mw, do, qx, r * n_in, dx, sx, r * nb, nb, yy, yo)
                else:
                    _group_s8(qw, qo, dw, mw, do, qx, r * n_in, dx, cx, r * nb, nb, yy, yo)
                if not full:
                    for o in range(GROUP * g, min(o1, n_out)):
                        y[r, o] = tail[0, o - GROUP * g]


@njit(cache=True, nogil=True, error_model="numpy")
def dot_nib(qw, dw, mw, qx, dx, sx, y, o0, o1):
    """y[:, o0:o1] of ggml.dot_q8_1 for Q4_1 weights in the packed layout (qw [G, nb, 16 GROUP]: low nibble element j
    of a block, high nibble element j + 16), dw, mw [G, nb, GROUP]; qx [M, n_in] int8, dx, sx [M, nb] from `quantize_q8`.
    Lanes 0..3 of a block are the low nibbles of bytes 4l..4l+3, lanes 4..7 their high nibbles."""
    _dot_packed(_NIB, qw, dw, mw, qx, dx, sx, y, o0, o1)


@njit(cache=True, nogil=True, error_model="numpy")
def dot_byte(qw, dw, mw, qx, dx, sx, y, o0, o1):
    """`dot_nib` for weights with one unsigned quant per byte (Q5_1): qw [G, nb, 32 GROUP], lane l = bytes 4l..4l+3."""
    _dot_packed(_U8, qw, dw, mw, qx, dx, sx, y, o0, o1)


@njit(cache=True, nogil=True, error_model="numpy")
def dot_q8_0(qw, dw, qx, dx, y, o0, o1):
    """y[:, o0:o1] of ggml.dot_q8_0 (ggml_vec_dot_q8_0_q8_0, and tinyBLAS_Q0_AVX: the same lane operations) for
    Q8_0 weights in the packed layout, qw [G, nb, 32 GROUP] (int8 quants as bytes), dw [G, nb, GROUP]; activations from
    `quantize_q8` (its s unused): per block the 8 exact lane sums, acc_l = fma(xy, d_x * d_w, acc_l),
    y = hsum_float_8(acc); no minimums."""
    _dot_packed(_S8, qw, dw, dw, qx, dx, dx, y, o0, o1)

# --- norm, SwiGLU --------------------------------------------------------------------------------------------

@njit(cache=True, nogil=True, error_model="numpy")
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


@njit(cache=True, nogil=True, error_model="numpy")
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


@njit(cache=True, nogil=True, error_model="numpy")
def silu_mul_gu(gu, n_ff, out):
    """`silu_mul` of gu [T, 2 n_ff] = (gate | up) column halves, read in place (no copies of the halves)."""
    for t in range(gu.shape[0]):
        row = gu[t]
        orow = out[t]
        for i in range(n_ff):
            orow[i] = expf(F32(0.0) - row[i])
        for i in range(n_ff):
            orow[i] = (row[i] / (F32(1.0) + orow[i])) * row[n_ff + i]


@njit(cache=True, nogil=True, error_model="numpy")
def expf_array(x, out):
    """ggml.expf element-wise (tests)."""
    for i in range(x.size):
        out[i] = expf(x[i])


@njit(cache=True, nogil=True, error_model="numpy")
def f16_round_array(x, out):
    """`f16_round` element-wise (tests)."""
    for i in range(x.size):
        out[i] = f16_round(x[i])


# --- attention (ggml.attend with an f16 KV store) -------------------------------------------------------------
#
# `_scores` and `_weighted` alone are compiled with fastmath={"contract"}: LLVM may fuse their multiply-adds into
# fmas. Every product there is exact (fp16 values times fp16 values: 22 significant bits, in float32's 24; no
# underflow below 2^-48 nor overflow), and fma(a, b, c) = round(a*b + c) = round(round(a*b) + c) when a*b is
# exact, so the bits cannot change. The softmax (expf's polynomial) gets no such flag.

_CONTRACT = {"contract"}


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
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


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_CONTRACT)
def _scores_hd64(qi, kt, n_keys, one, s, lanes):
    """`_scores` for head_dim 64, each of 16 lanes (one: ggml_vec_dot_f16's 64 lanes folded to 16; else
    tinyBLAS's 16) made in one pass over its 4 rows of K, then the 16-lane reduction; both loops over keys
    vectorize. The same sums as the general loops, which read and write each lane 4 times."""
    for j0 in range(0, n_keys, _KEYS):
        jw = min(_KEYS, n_keys - j0)
        for lane in range(16):
            ll = lanes[lane]
            k0 = kt[lane, j0:j0 + jw]
            k1 = kt[16 + lane, j0:j0 + jw]
            k2 = kt[32 + lane, j0:j0 + jw]
            k3 = kt[48 + lane, j0:j0 + jw]
            q0 = qi[lane]
            q1 = qi[16 + lane]
            q2 = qi[32 + lane]
            q3 = qi[48 + lane]
            if one:                          # (a[l] + a[32 + l]) + (a[16 + l] + a[48 + l]), a[i] = q[i] k[i]
                for j in range(jw):
                    ll[j] = (q0 * k0[j] + q2 * k2[j]) + (q1 * k1[j] + q3 * k3[j])
            else:                            # a[l] + a[16 + l] + a[32 + l] + a[48 + l], in order
                for j in range(jw):
                    ll[j] = ((q0 * k0[j] + q1 * k1[j]) + q2 * k2[j]) + q3 * k3[j]
        for j in range(jw):
            s[j0 + j] = _reduce16_col(lanes, j)


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_CONTRACT)
def _scores(qi, kt, n_keys, one, s, lanes, fold):
    """s[:n_keys] = K . qi in ggml.dot_f16_tiny (one False) or ggml.dot_f16_vec (one True) order; kt [hd, n_tot]
    float32 (f16 values), qi [hd]. Vectorized across keys: lanes [16 or 64, _KEYS] hold the lane sums (keys in
    register-only code instead, all 64 rows of K touched per key vector, ran 1.3-4x slower: K's rows are
    capacity-strided, and strides near a power of two alias in L1)."""
    hd = qi.shape[0]
    if hd == 64:
        _scores_hd64(qi, kt, n_keys, one, s, lanes)
        return
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


@njit(cache=True, nogil=True, error_model="numpy")
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


@njit(cache=True, nogil=True, error_model="numpy", fastmath=_CONTRACT)
def _weighted(p, v, n_keys, npad, one, acc, fold, out):
    """out [hd] = V . p over the npad keys (V rows past n_keys are 0) in ggml.dot_f16_tiny / dot_f16_vec order
    along the keys; v [n_tot, hd] float32 (f16 values). Vectorized across head_dim: acc [16 or 64, hd].

    The padding keys past n_keys (probability 0, V 0) set their lanes to 0 in the first chunk and are skipped
    after it: adding 0 x 0 = +0 changes no lane that is not zero, and an all-zero output differs at most in its
    sign (which the next product's quantizer erases). The final reductions run across head_dim."""
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
            elif c == 0:
                z = pj * F32(0.0)
                for d in range(hd):
                    al[d] = z
    if one:
        x = fold
        for lane in range(16):
            xl = x[lane]
            a0 = acc[lane]
            a1 = acc[32 + lane]
            a2 = acc[16 + lane]
            a3 = acc[48 + lane]
            for d in range(hd):
                xl[d] = (a0[d] + a1[d]) + (a2[d] + a3[d])
    else:
        x = acc
    for d in range(hd):
        out[d] = _reduce16_col(x, d)


@njit(cache=True, nogil=True, error_model="numpy")
def attend_block(q, kt, v, n_old, a, b, one, scale, n_gqa, out):
    """ggml.attend's `block(a, b)` for an f16 KV store: query rows a..b-1 of q [m, n_head, hd] (fp16 values)
    against keys 0..n_old+b-1; kt [n_head_kv, hd, n_tot], v [n_head_kv, n_tot, hd] float32 (the cells' f16
    values); out [m, n_head, hd]. Scores times `scale`, keys after a row's position masked (blocks of 2+
    rows), padded with -inf to a multiple of 16 (64 when one), softmax, probabilities to fp16, V . p."""
    attend_heads(q, kt, v, n_old, a, b, one, scale, n_gqa, out, 0, q.shape[1])


@njit(cache=True, nogil=True, error_model="numpy")
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

