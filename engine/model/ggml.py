"""The "ggml" numerics mode: the forward pass with llama.cpp's CPU arithmetic instead of plain float32.

`engine.model.load(path, numerics="ggml")` builds the weights and ops of this module. The default mode ("f32")
dequantizes every weight once and computes in float32: closer to the exact model, but not what llama.cpp
computes on a quantized file. Matching llama.cpp on a quantized model needs more than the same formulas:
activations are re-quantized to 8 bits before every matmul, so a last-bit difference anywhere (a different
summation order, a different expf) flips a rounding now and then, the flipped value moves the next layer's
inputs by a whole quantization step, and the difference spreads. Measured: with the right formulas but BLAS
summation order, the logits differ from llama.cpp's as much as plain float32 does. So this mode reproduces,
operation by operation, the arithmetic of ggml's x86 CPU kernels (AVX2/AVX-512 build, no flash attention,
F16 KV cache) down to the summation order:

- mul_mat(W, x): x is quantized per row to W's `vec_dot_type` (Q8_1 for Q4_1/Q5_1: blocks of 32, d = amax/127
  stored fp16, q = round-half-even(x * 127/amax), s = fp16(d * sum q)). Q4_1/Q5_1 x Q8_1 is computed as
  ggml_vec_dot_q4_1_q8_1 does: per block 8 lanes of exact 4-element integer dot products, each lane
  accumulated over the blocks with fma(d_w*d_x, lane, acc) in float32, the lanes summed as hsum_float_8,
  plus the float32 fma chain of m_w * s_x (`Q8_1DotPart`). Q8_0 x Q8_0 (layers, and a Q8_0 output head) as
  ggml_vec_dot_q8_0_q8_0 / tinyBLAS_Q0_AVX: the same lanes and fmas without the minimums (`Q8_0DotPart`).
- RoPE: theta = p * theta_scale^i by repeated float32 multiplication, cos/sin from the C library's float
  functions (glibc sinf/cosf, as ggml calls them), rotation with fma (x0*cos - x1*sin -> fma(x0, cos, -x1*sin)).
- rms_norm: sum of float32 squares in double, scale = 1/sqrtf(mean + eps), y = x * scale * w.
- Attention (non-flash graph): K, V cached as f16; Q -> f16; KQ and KQV as f16 x f16 dot products with
  float32 accumulation in ggml's lane order (llamafile tinyBLAS, 16 lanes, for a chunk of 2+ tokens;
  ggml_vec_dot_f16, 4 x 16 lanes, for one token); softmax of KQ*scale + mask with ggml's vectorized expf
  (ggml_v_expf, AVX-512), per-16 sums in double, times float(1/sum); probabilities -> f16.
- SwiGLU: ggml_v_silu (same expf, 1 + e, division) times up.

Not emulated exactly (close, but a different summation order): matmuls whose weights are not Q4_1/Q5_1/Q8_0
(F32/F16/BF16/Q4_0/Q5_0/K-quants: activations are quantized the ggml way, the products are summed by BLAS),
output heads of those types (nothing is quantized after them, so only the logits move, by ~1e-5), an f32 KV store,
rows whose length is not a multiple of 16 (ggml's scalar tails), and the flash-attention path. The kernels'
order is that of this machine's build (x86 with AVX-512/AVX2; ARM or other builds sum differently).
Every fma (a*b + c with one rounding, as _mm256_fmadd_ps) is computed exactly (`_fma`). This numpy code is
the reference; `numerics="ggml"` runs the numba kernels of `gkernels`, which give its results bit for bit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from engine.model.f32 import Rope
from engine.model.kv import KVStore, SeqKV, Shadow
from engine.model.matmul import _SPLIT_MIN_MACS, Matmul
from engine.model.quant import QPart, concat_parts
from engine.model.types import PACK_GROUP, HParams, Linear

QK8 = 32          # block of Q8_0 / Q8_1 (and of Q4_0 .. Q8_0 weights)
QK_K = 256        # super-block of Q8_K (and of the K-quants)
_ROWS = 16        # activation rows per piece of work (exact matmul chunks, thread tasks)
_QUERY_BLOCK = 8  # query rows per attention block (bounds the [heads, rows, keys, 16] temporaries)
# split exact products run on polling workers (`spin.SpinPool`) rather than `Matmul`'s queue threads; pieces per
# thread: output ranges a worker or the caller claims one at a time
USE_SPIN_POOL = True
_SPIN_PIECES_PER_THREAD = 2
_TILE_ELEMENTS = 1 << 16   # lanes x rows x outputs per tile of the exact Q8_1 matmul (cache-sized temporaries)

T = GGMLQuantizationType
# ggml-cpu type_traits_cpu[type].vec_dot_type: the format activations are converted to for mul_mat
VEC_DOT_TYPE: dict[GGMLQuantizationType, str] = {
    T.F32: "f32", T.F16: "f16", T.BF16: "bf16",
    T.Q4_0: "q8_0", T.Q5_0: "q8_0", T.Q8_0: "q8_0",
    T.Q4_1: "q8_1", T.Q5_1: "q8_1",
    T.Q2_K: "q8_K", T.Q3_K: "q8_K", T.Q4_K: "q8_K", T.Q5_K: "q8_K", T.Q6_K: "q8_K",
}
# weights whose x86 dot product with Q8_1 is replayed exactly (d*q + m blocks of 32)
EXACT_DOT_TYPES = frozenset({T.Q4_1, T.Q5_1})
# weights whose x86 dot product with Q8_0 is replayed exactly (ggml_vec_dot_q8_0_q8_0: d*q blocks of 32; layers and
# heads, e.g. SmolLM2's tied Q8_0 head)
EXACT_Q8_0_TYPES = frozenset({T.Q8_0})

# --- the compiled kernels (numba, `gkernels`), loaded on first use ----------------------------------------------

_kernels: Any = None
_kernels_error: str | None = None
_kernels_lock = threading.Lock()
_warned = False


def kernels() -> Any:
    """The compiled kernels module (imported once), or None if numba cannot load (`compiled_unavailable_reason`)."""
    global _kernels, _kernels_error
    with _kernels_lock:
        if _kernels is None and _kernels_error is None:
            try:
                from engine.model import gkernels
                _kernels = gkernels
            except Exception as e:                       # ImportError, or numba/llvmlite failing to initialise
                _kernels_error = f"{type(e).__name__}: {e}"
    return _kernels


def compiled_available() -> bool:
    return kernels() is not None


def warn_unavailable() -> None:
    """One warning per process that "ggml" falls back to "f32" (numba cannot load)."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"numerics 'ggml' falls back to 'f32' (float32 arithmetic, not llama.cpp's): numba cannot be "
                      f"loaded ({_kernels_error}); its numpy reference (numerics.GGML_REFERENCE, 6-50x slower) gives "
                      f"ggml's results without numba", RuntimeWarning, stacklevel=3)


# --- float32 helpers -------------------------------------------------------------------------------------------

_LOW28 = np.int64((1 << 28) - 1)   # float64 fraction bits below a float32 midpoint's last bit


def _fma64(a: Any, b: Any, c: Any) -> np.ndarray:
    """a*b + c for float32 operands as a float64 array whose rounding to float32 is the correctly rounded
    fmaf(a, b, c) (`_fma`). The product is exact in float64 (24 + 24 <= 53 bits), so only the sum rounds:
    t = RN64(a*b + c). Rounding t again to float32 gives the fma's result except where t is itself a float32
    midpoint while the exact sum is not (a midpoint strictly between the exact sum and t would be a float64
    closer to the sum than t). Such t have their 28 low fraction bits zero (on the normal and the subnormal
    float32 grid alike); for those candidates the TwoSum error e = (a*b + c) - t (exact) decides: t moves one
    float64 ulp toward the exact sum when e != 0. That is round-to-odd where it matters, and float64
    round-to-odd followed by float32 round-to-nearest is the correctly rounded result (53 >= 24 + 2); a
    candidate that is a float32 value keeps its rounding after the move."""
    p = np.multiply(a, b, dtype=np.float64)                              # exact
    t = np.array(np.add(p, c, dtype=np.float64), dtype=np.float64)      # a fresh (writable, maybe 0-d) array
    cand = (t.view(np.int64) & _LOW28) == 0
    if cand.any():
        pc = np.broadcast_to(p, t.shape)[cand]
        cc = np.broadcast_to(np.asarray(c, dtype=np.float64), t.shape)[cand]
        tc = t[cand]
        with np.errstate(invalid="ignore"):                             # inf - inf for infinite operands
            bv = tc - pc                                                 # TwoSum (Knuth): tc + e = pc + cc
            av = tc - bv
            e = (pc - av) + (cc - bv)
            fix = np.isfinite(tc) & (e != 0)
        if fix.any():
            tc[fix] = np.nextafter(tc[fix], np.copysign(np.inf, e[fix]))
            t[cand] = tc
    return t


def _fma(a: Any, b: Any, c: Any) -> np.ndarray:
    """fmaf(a, b, c) on float32 operands with one rounding, as ggml's `_mm256_fmadd_ps` / `_mm512_fmadd_ps` and
    the compilers' contracted a*b + c compute it (`_fma64`, then float32). Scalars give a 0-d array."""
    return _fma64(a, b, c).astype(np.float32)


def _fma_into(a: Any, b: Any, c: np.ndarray) -> None:
    """c = `_fma`(a, b, c) in place (c float32, a*b broadcasting to c's shape)."""
    np.copyto(c, _fma64(a, b, c), casting="same_kind")


def _reduce16(a: np.ndarray) -> np.ndarray:
    """_mm512_reduce_add_ps over the last axis (16): halves added pairwise, 8 -> 4 -> 2 -> 1."""
    a = a[..., 8:] + a[..., :8]
    a = a[..., 4:] + a[..., :4]
    a = a[..., :2] + a[..., 2:]
    return a[..., 0] + a[..., 1]


def round_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 (round half to even, NaN kept quiet) -> float32, as ggml_compute_fp32_to_bf16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16) << 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = np.where(nan, ((u >> 16) | 64) << 16, r).astype(np.uint32)
    return r.view(np.float32).reshape(x.shape)


_F = [np.float32(float.fromhex(h)) for h in (
    "0x1.8p23", "0x1.715476p+0", "0x1.62e4p-1", "0x1.7f7d1cp-20", "0x1.0e4020p-7", "0x1.573e2ep-5",
    "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1")]


def expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (AVX-512 version) elementwise on float32: exp(x) = 2^n * p(b), n = round(x / ln2),
    b = x - n*ln2 in two fma steps, p a degree-5 polynomial by fma; |n| > 192 gives 0 or inf."""
    r, log2e, ln2_hi, ln2_lo, c5, c4, c3, c2, c1 = _F
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        z = _fma(x, log2e, r)
        n = z - r                                                          # float32
        b = _fma(-n, ln2_hi, x)                                            # fnmadd(n, ln2_hi, x)
        b = _fma(-n, ln2_lo, b)
        u = b * b
        j = _fma(_fma(_fma(c5, b, c4), u, _fma(c3, b, c2)), u, _fma(c1, b, np.float32(1.0)))
        big = ~(np.abs(n) <= 192)                                          # _CMP_GT_OQ (NaN: not big)
        big &= ~np.isnan(n)
        e = np.where(big, 0, n).astype(np.int32)
        res = np.ldexp(j, e).astype(np.float32)                            # _mm512_scalef_ps
        return np.where(big, np.where(n <= 0, np.float32(0), np.float32(np.inf)), res).astype(np.float32)


def _sum_sequential(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis in double, element after element as a C loop `sum += (double) a[i]` does
    (ggml's order; numpy's own sum is pairwise, which differs in the last double bits)."""
    return np.cumsum(a, axis=-1, dtype=np.float64)[..., -1]


def softmax_rows(s: np.ndarray) -> np.ndarray:
    """ggml_compute_forward_soft_max_f32 on rows already scaled and masked (last axis, a multiple of 16):
    max, e = ggml_v_expf(s - max) per 16, sum of each 16 (reduce) added in double (in order, as
    ggml_vec_soft_max_f32), times float(1/sum)."""
    n = s.shape[-1]
    mx = s.max(axis=-1, keepdims=True)
    e = expf(s - mx)
    sums = _sum_sequential(_reduce16(e.reshape(*e.shape[:-1], n // 16, 16)))[..., None]
    return e * (1.0 / sums).astype(np.float32)


def silu_mul(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> np.ndarray:
    """ggml_vec_swiglu_f32 element-wise: out = ggml_v_silu(g) * u, ggml_v_silu(g) = g / (1 + expf(0 - g))."""
    den = np.float32(1.0) + expf(np.float32(0.0) - g)
    np.divide(g, den, out=out)
    out *= u
    return out


def swiglu(gu: np.ndarray, n_ff: int) -> np.ndarray:
    """`silu_mul` of gu [T, 2 * n_ff] = (gate, up) -> [T, n_ff]."""
    return silu_mul(gu[:, :n_ff], gu[:, n_ff:], np.empty((gu.shape[0], n_ff), np.float32))


# --- activation quantizers (x [M, n] float32 -> what ggml's dot product sees) ------------------------------------

def _q8_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q8_0/Q8_1 blocks of 32 as ggml-cpu's x86 quantize_row_q8_0/q8_1 compute them: amax = max|x|,
    d = amax/127, id = 127/amax, q = round-half-even(x * id); d is stored as fp16.
    Returns q [M, n/32, 32] (float32 integers), d [M, n/32] float32, d as fp16 -> float32."""
    m, n = x.shape
    if n % QK8:
        raise ValueError(f"row length {n} is not a multiple of {QK8}")
    xb = x.reshape(m, n // QK8, QK8)                                     # [M, nb, 32]
    amax = np.abs(xb).max(axis=-1)                                       # [M, nb]
    d = amax / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = xb * inv[..., None]
    np.rint(q, out=q)                                                    # _MM_ROUND_NEAREST: half to even
    return q, d, d.astype(np.float16).astype(np.float32)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """x [M, n] -> its Q8_0 values d16 * q [M, n] float32."""
    q, _, d16 = _q8_blocks(x)
    q *= d16[..., None]
    return q.reshape(x.shape)


def quantize_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, n] -> (Q8_1 values d16 * q [M, n], s [M, n/32]); s = fp16(d * sum(q)) with the float32 d."""
    q, d, d16 = _q8_blocks(x)
    s = (d * q.sum(axis=-1)).astype(np.float16).astype(np.float32)      # [M, nb]
    q *= d16[..., None]
    return q.reshape(x.shape), s


def quantize_q8_k(x: np.ndarray) -> np.ndarray:
    """x [M, n] -> its Q8_K values [M, n] (quantize_row_q8_K_ref): blocks of 256, `max` = the element of
    largest magnitude (first one, sign kept), iscale = -127/max, q = min(127, nearest_int(iscale * x)),
    d = 1/iscale (float32, negative when max > 0: d*q has x's sign)."""
    m, n = x.shape
    if n % QK_K:
        raise ValueError(f"row length {n} is not a multiple of {QK_K}")
    xb = x.reshape(m, n // QK_K, QK_K)                                   # [M, nb, 256]
    idx = np.abs(xb).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(xb, idx, axis=-1)[..., 0]                    # [M, nb] signed
    nz = mx != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(nz, np.float32(-127.0) / mx, np.float32(0.0)).astype(np.float32)
        d = np.where(nz, np.float32(1.0) / iscale, np.float32(0.0)).astype(np.float32)
    q = xb * iscale[..., None]
    np.rint(q, out=q)
    np.minimum(q, np.float32(127.0), out=q)
    q *= d[..., None]
    return q.reshape(x.shape)


def quantize_activations(act: str, x: np.ndarray) -> np.ndarray:
    """x [M, n] -> the values a `BlasPart` of this activation type multiplies."""
    if act == "f32":
        return x
    if act == "q8_1":
        return quantize_q8_1(x)[0]
    if act == "q8_0":
        return quantize_q8_0(x)
    if act == "q8_K":
        return quantize_q8_k(x)
    if act == "f16":
        return round_f16(x)
    if act == "bf16":
        return round_bf16(x)
    raise ValueError(f"unknown activation type {act!r}")


# --- weights --------------------------------------------------------------------------------------------------

def block_params(data: np.ndarray, qtype: GGMLQuantizationType,
                 shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1/Q5_1 tensor's raw blocks -> (q [ne1, ne0] float32 integer quants, d [ne1, ne0/32], m [ne1, ne0/32])
    with W = d*q + m per block. Both layouts start with fp16 d, fp16 m: dequantizing with d = 1, m = 0 gives q."""
    if qtype not in EXACT_DOT_TYPES:
        raise ValueError(f"{qtype.name} is not a d*q + m type")
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = np.array(data, dtype=np.uint8, copy=True).reshape(-1, size)          # [n_blocks, size]
    dm = blocks[:, 0:4].copy().view(np.float16).astype(np.float32)                # [n_blocks, 2]
    blocks[:, 0:4] = np.array([1.0, 0.0], dtype="<f2").view(np.uint8)
    q = np.asarray(gguf_quants.dequantize(blocks, qtype), dtype=np.float32)
    ne1, ne0 = shape
    return (np.ascontiguousarray(q.reshape(ne1, ne0)), np.ascontiguousarray(dm[:, 0].reshape(ne1, ne0 // block)),
            np.ascontiguousarray(dm[:, 1].reshape(ne1, ne0 // block)))


@dataclass(frozen=True, slots=True)
class BlasPart:
    """Output columns computed approximately: activations quantized to `act`, products summed by BLAS."""

    act: str
    lin: Linear
    n_out: int

    @property
    def nbytes(self) -> tuple[int, int]:
        return self.lin.stream_bytes, self.lin.resident_bytes


def pack_blocks(q: np.ndarray, d: np.ndarray, m: np.ndarray | None,
                group: int = PACK_GROUP) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The packed layout of the dot kernels from `quant.QPart`'s transposed one: q [nb, bs, n_out] (bs 16: two
    nibbles a byte; 32: a byte each), d, m [nb, n_out] -> (qp uint8 [G, nb, P bs], dp, mp float32 [G, nb, P]),
    P = group (the kernels read PACK_GROUP; another width serves benchmarks of older kernels), G = ceil(n_out / P)
    groups of P outputs, the last one padded with zeros; qp[g, b, 4 P l + 4 o + e] is byte 4 l + e of output
    P g + o's block b (lane l). m None (Q8_0): mp is dp."""
    P = group
    nb, bs, n_out = q.shape
    g = -(-n_out // P)
    pad = g * P - n_out
    qz = np.pad(q.view(np.uint8), ((0, 0), (0, 0), (0, pad)))
    qp = np.ascontiguousarray(qz.reshape(nb, bs // 4, 4, g, P).transpose(3, 0, 1, 4, 2)).reshape(g, nb, P * bs)

    def scales(s):
        return np.ascontiguousarray(np.pad(s, ((0, 0), (0, pad))).reshape(nb, g, P).transpose(1, 0, 2))
    dp = scales(d.astype(np.float32, copy=False))
    return qp, dp, (dp if m is None else scales(m.astype(np.float32, copy=False)))


def unpack_blocks(qp: np.ndarray, dp: np.ndarray, mp: np.ndarray | None, n_out: int, nib: bool,
                  has_m: bool) -> QPart:
    """`pack_blocks` undone: the `quant.QPart` (transposed layout; Q5_1 / Q8_0 quants int8) of packed arrays.
    mp None or has_m False: m is [0, n_out] (no minimums)."""
    P = PACK_GROUP
    g, nb, blk = qp.shape
    bs = blk // P
    q = qp.reshape(g, nb, bs // 4, P, 4).transpose(1, 2, 4, 0, 3).reshape(nb, bs, P * g)[:, :, :n_out]
    q = np.ascontiguousarray(q if nib else q.view(np.int8))

    def scales(s):
        return np.ascontiguousarray(s.transpose(1, 0, 2).reshape(nb, P * g)[:, :n_out])
    m = scales(mp) if has_m else np.zeros((0, n_out), np.float32)
    return QPart(nib=nib, q=q, d=scales(dp), m=m, has_m=has_m)


@dataclass(frozen=True)
class Q8_1DotPart:
    """Output columns of Q4_1/Q5_1 weights, computed as ggml_vec_dot_q4_1_q8_1 (x86) does.

    The weights are held once, in the compiled kernels' packed layout (`pack_blocks`: GGUF's integer quants,
    4-bit ones two per byte, and float32 d, m per block of 32, W = d*q + m exactly, in groups of PACK_GROUP outputs).
    The numpy reference (`dot_q8_1`) reads `w` (`quant.QPart`'s transposed layout) and `qw` (the quants as
    float32 grouped by lane), both made from the packed arrays on first use. Build with `of`."""

    q: np.ndarray      # [G, nb, PACK_GROUP bs] uint8 (packed)
    pd: np.ndarray     # [G, nb, PACK_GROUP] float32
    pm: np.ndarray     # [G, nb, PACK_GROUP] float32 (pd again without minimums)
    n_out: int
    nib: bool
    has_m: bool
    act: str = "q8_1"

    @classmethod
    def of(cls, w: QPart) -> Q8_1DotPart:
        """The part of `w`'s columns (Q8_0DotPart when w has no minimums)."""
        kind = cls if w.has_m else Q8_0DotPart
        q, d, m = pack_blocks(w.q, w.d, w.m if w.has_m else None)
        return kind(q=q, pd=d, pm=m, n_out=w.n_out, nib=w.nib, has_m=w.has_m)

    @property
    def packed(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q, d, m or d) in the packed layout, as the compiled kernels take them."""
        return self.q, self.pd, self.pm

    @functools.cached_property
    def w(self) -> QPart:
        """The weights in `quant.QPart`'s transposed layout (the numpy reference's), made on first use."""
        return unpack_blocks(self.q, self.pd, self.pm, self.n_out, self.nib, self.has_m)

    @property
    def d(self) -> np.ndarray:
        """[n_in/32, n_out] float32 block scales."""
        return self.w.d

    @property
    def m(self) -> np.ndarray:
        """[n_in/32, n_out] float32 block minimums."""
        return self.w.m

    @functools.cached_property
    def qw(self) -> np.ndarray:
        """[n_in/4, 4, n_out] float32 integer quants grouped by 4-element lane (the numpy reference's layout)."""
        q = self.w.q
        if self.nib:
            q = np.concatenate([q & 15, q >> 4], axis=1)                       # [nb, 32, n_out]: elements j, j + 16
        return np.ascontiguousarray(q.astype(np.float32).reshape(-1, 4, self.n_out))

    @property
    def nbytes(self) -> tuple[int, int]:
        """(bytes a product streams, bytes held)."""
        held = self.q.nbytes + self.pd.nbytes + (self.pm.nbytes if self.has_m else 0)
        return held, held


@dataclass(frozen=True)
class Q8_0DotPart(Q8_1DotPart):
    """Output columns of Q8_0 weights (the output head), computed as ggml_vec_dot_q8_0_q8_0 (x86) does: the
    activations quantized to Q8_0, per block 8 lanes of exact 4-element integer dot products, each lane
    accumulated over the blocks with fma(d_w*d_x, lane, acc) in float32, hsum_float_8; no minimums term
    (`has_m` False). llama.cpp's CPU backend sends this product to llamafile's tinyBLAS_Q0_AVX when the
    activations are contiguous (`ggml_compute_forward_mul_mat` -> `llamafile_sgemm`), whose per-output
    operations are the same: `madd(set1(unhalf(A.d) * unhalf(B.d)), updot(...), Cv)` and `hsum`; Q8_0 is not
    repacked on x86 (`ggml_repack_get_optimal_repack_type` repacks Q8_0 for ARM only)."""

    act: str = "q8_0"


class PackedEmbedding:
    """A Q8_0 token embedding read from its exact head's packed part (the output head itself when tied) instead of
    a float32 table (113 MB for SmolLM2): `emb[ids]` is d * q of those rows, one float32 product per weight, as
    ggml_get_rows dequantizes a Q8_0 row (`dequantize_row_q8_0`) and as the loader's float32 values are: the same
    bits."""

    def __init__(self, part: Q8_0DotPart, n_embd: int):
        if part.has_m or part.q.shape[2] != PACK_GROUP * 32 or part.q.shape[1] * 32 != n_embd:
            raise ValueError("a packed embedding reads a Q8_0 part of n_embd inputs")
        self.part = part
        self.shape = (part.n_out, n_embd)
        self.dtype = np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.part.nbytes[1]

    def __getitem__(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[0]):
            raise IndexError(f"token id out of range [0, {self.shape[0]})")
        p = self.part
        g, nb, _ = p.q.shape
        grp, col = ids // PACK_GROUP, ids % PACK_GROUP
        q = p.q.reshape(g, nb, 8, PACK_GROUP, 4)[grp, :, :, col, :]              # [T, nb, lane, 4]: element 4 lane + e
        d = p.pd[grp, :, col]                                           # [T, nb]
        x = q.view(np.int8).astype(np.float32).reshape(ids.size, nb, 32) * d[:, :, None]
        return x.reshape(ids.size, nb * 32)


@dataclass(frozen=True, slots=True)
class QLinear:
    """A weight for ggml numerics: parts concatenated along the outputs (fused matrices whose pieces need
    different activation formats or kernels keep one part each)."""

    parts: tuple[BlasPart | Q8_1DotPart, ...]
    n_in: int
    n_out: int

    @property
    def stream_bytes(self) -> int:
        return sum(p.nbytes[0] for p in self.parts)

    @property
    def resident_bytes(self) -> int:
        return sum(p.nbytes[1] for p in self.parts)


def exact_part(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QPart:
    """A Q4_1/Q5_1/Q8_0 tensor's raw blocks (shape (ne1, ne0)) -> the `QPart` its exact product reads (bit for
    bit the integer quants, d and m of `block_params`; Q8_0: quants and d, no m)."""
    if qtype not in EXACT_DOT_TYPES | EXACT_Q8_0_TYPES:
        raise ValueError(f"{qtype.name} has no exact dot product here")
    return QPart.from_tensor(data, qtype, shape)


def exact_head(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QLinear:
    """A Q8_0 output head's raw blocks (shape (n_vocab, n_embd)) -> its exact `Q8_0DotPart` as a `QLinear`."""
    if qtype not in EXACT_Q8_0_TYPES:
        raise ValueError(f"{qtype.name} has no exact head kernel")
    return qlinear([(None, qtype, exact_part(data, qtype, shape))])


def qlinear(pieces: list[tuple[np.ndarray | None, GGMLQuantizationType, Any]]) -> QLinear:
    """Fuse (w [n_out_i, n_in] dequantized -- None for exact pieces --, ggml type, `exact_part` or None) along
    the outputs; consecutive pieces of the same kind share a part. Pieces with an `exact_part` get the exact
    kernel (Q4_1/Q5_1: `Q8_1DotPart`, Q8_0: `Q8_0DotPart`)."""
    groups: list[tuple[str, list]] = []
    n_in = None
    for w, qtype, part in pieces:
        n = part.n_in if isinstance(part, QPart) else w.shape[1]
        if n_in is not None and n != n_in:
            raise ValueError(f"fused pieces have different input sizes ({n} != {n_in})")
        n_in = n
        kind = f"exact-{qtype.name}" if isinstance(part, QPart) else VEC_DOT_TYPE[qtype]
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(part if isinstance(part, QPart) else w)
        else:
            groups.append((kind, [part if isinstance(part, QPart) else w]))
    parts: list[BlasPart | Q8_1DotPart] = []
    for kind, items in groups:
        if kind.startswith("exact"):
            qp = concat_parts(items)
            parts.append(Q8_1DotPart.of(qp))
        else:
            w = np.concatenate(items) if len(items) > 1 else items[0]
            parts.append(BlasPart(act=kind, lin=Linear.from_weight(w), n_out=w.shape[0]))
    return QLinear(parts=tuple(parts), n_in=n_in, n_out=sum(p.n_out for p in parts))


def dot_q8_1(part: Q8_1DotPart, x: np.ndarray) -> np.ndarray:
    """x [M, n_in] @ W.T for a Q4_1/Q5_1 part, as ggml quantizes x to Q8_1 and runs ggml_vec_dot_q4_1_q8_1
    (x86): per block b and lane l (4 elements) the exact integer dot xy; acc_l = fma(d_w*d_x, xy, acc_l) over
    the blocks; summs = fma(m_w, s_x, summs); y = hsum_float_8(acc) + summs. Returns [M, n_out] float32.
    For a `Q8_0DotPart` (no minimums) it is ggml_vec_dot_q8_0_q8_0: y = hsum_float_8(acc), x quantized to Q8_0
    (the same quants and d as Q8_1).

    The fmas are correctly rounded (`_fma_into`), over output tiles small
    enough for the temporaries to stay in cache."""
    q, d, d16 = _q8_blocks(x)                                            # q [M, nb, 32]
    s = (d * q.sum(axis=-1)).astype(np.float16).astype(np.float32)      # [M, nb]
    rows, nb = d.shape
    n_out = part.n_out
    has_m = part.has_m
    qg = np.ascontiguousarray(q.reshape(rows, nb * 8, 4).transpose(1, 0, 2))   # [nb*8, M, 4]
    summs = np.zeros((rows, n_out), np.float32)                          # m_w * s_x chain, all outputs
    for b in range(nb if has_m else 0):
        _fma_into(s[:, b, None], part.m[b][None, :], summs)
    out = np.empty((rows, n_out), np.float32)
    width = max(64, min(n_out, (_TILE_ELEMENTS // (8 * rows)) // 64 * 64))
    for o0 in range(0, n_out, width):
        o1 = min(n_out, o0 + width)
        w = o1 - o0
        xy = np.matmul(qg, part.qw[..., o0:o1]).reshape(nb, 8, rows, w)  # exact integers (|xy| < 2^16)
        acc = np.zeros((8, rows, w), np.float32)
        d0d1 = d16.T[:, :, None] * part.d[:, None, o0:o1]                # [nb, M, w] float32 (exact: fp16 x fp16)
        for b in range(nb):
            _fma_into(xy[b], d0d1[b], acc)                               # acc = fma(d0d1, xy, acc)
        h = acc[4:] + acc[:4]
        h = h[:2] + h[2:]
        out[:, o0:o1] = (h[0] + h[1]) + summs[:, o0:o1] if has_m else h[0] + h[1]
    return out


class GgmlMatmul(Matmul):
    """`Matmul` for `QLinear`s: exact Q8_1 dot products or activation quantization + BLAS (plain `Linear`s pass
    through). `compiled`: the numba kernels (`gkernels`: same bits, output ranges split over the threads);
    otherwise the numpy reference (`dot_q8_1`, row blocks split over the threads)."""

    def __init__(self, n_threads: int = 1, compiled: bool = False):
        super().__init__(n_threads)
        self.compiled = compiled
        # the exact dot products' output ranges go to workers that poll (`spin.SpinPool`): a split product costs
        # no thread wake-up; other work (attention blocks, BLAS parts) keeps `Matmul`'s queue threads
        self._spin = None
        self._fused: tuple[Any, Any] | None = None     # (weights, their `gdecode.Layer`s): `compiled_layers`
        if compiled and self.n_threads > 1 and USE_SPIN_POOL:
            from engine.model import spinjobs
            self._spin = spinjobs.pool(self.n_threads - 1)

    def __call__(self, lin: Linear | QLinear, x: np.ndarray) -> np.ndarray:
        if not isinstance(lin, QLinear):
            return Matmul.__call__(self, lin, x)
        outs = [self._part(p, x) for p in lin.parts]
        return outs[0] if len(outs) == 1 else np.concatenate(outs, axis=1)

    def _part(self, p: BlasPart | Q8_1DotPart, x: np.ndarray) -> np.ndarray:
        if isinstance(p, BlasPart):
            if self.compiled and p.act in ("q8_0", "q8_1"):
                qx, d16, _ = quantize_q8_compiled(x)
                xq = np.empty(qx.shape, np.float32)
                kernels().q8_values(qx, d16, xq)
                return Matmul.__call__(self, p.lin, xq)
            return Matmul.__call__(self, p.lin, quantize_activations(p.act, x))
        if self.compiled:
            return self._dot_compiled(p, x)
        m = x.shape[0]
        if m <= _ROWS:
            return dot_q8_1(p, x)
        out = np.empty((m, p.n_out), np.float32)

        def rows(a: int) -> None:
            out[a:a + _ROWS] = dot_q8_1(p, x[a:a + _ROWS])
        self.parallel([lambda a=a: rows(a) for a in range(0, m, _ROWS)])
        return out

    def _dot_compiled(self, p: Q8_1DotPart, x: np.ndarray) -> np.ndarray:
        """`dot_q8_1` by `gkernels.dot_nib` / `dot_byte`, the output range split over the threads."""
        k = kernels()
        qx, d16, s = quantize_q8_compiled(x)
        m, n_in = qx.shape
        y = np.empty((m, p.n_out), np.float32)
        q, d, mw = p.packed
        split = self._pool is not None and m * n_in * p.n_out >= _SPLIT_MIN_MACS
        if split and self._spin is not None:
            from engine.model import spinjobs as sj
            kind = _dot_kind(p)
            if self._spin.try_run(lambda job, cuts, n: sj.post_dot(job, cuts, kind, q, d, mw, qx, d16, s, y,
                                                                   n, 64), self.n_threads * _SPIN_PIECES_PER_THREAD):
                return y
        if not p.has_m:
            self._run(lambda a, b: k.dot_q8_0(q, d, qx, d16, y, a, b), p.n_out, 64, split)
            return y
        fn = k.dot_nib if p.nib else k.dot_byte
        self._run(lambda a, b: fn(q, d, mw, qx, d16, s, y, a, b), p.n_out, 64, split)
        return y

    def close(self) -> None:
        super().close()
        if self._spin is not None:
            self._spin.close()
            self._spin = None


def compiled_layers(w: Any, hp: HParams, rope: Rope, mm: Matmul, kv: KVStore, seqs: list[SeqKV], sizes: list[int],
                    x: np.ndarray, pos: np.ndarray) -> bool:
    """`Numerics.compiled_layers` of the compiled kernels: every layer of a step (chunks of sequences `seqs`, of
    `sizes` tokens, on x [T, D]) in one compiled call each (`gdecode.decode_layers`, the layer loop's bits). False,
    nothing done, unless the matmul is the compiled one with 1 thread or polling workers, the KV store fp16,
    head_dim a multiple of 16, and every layer matrix one exact part."""
    if not runs_compiled_layers(mm, w, hp, kv.dtype) or x.shape[0] != sum(sizes):
        return False
    layers = _fused_layers(mm, w)
    from engine.model import gdecode
    gdecode.decode_layers(layers, hp, rope, kv, seqs, sizes, x, pos, mm._spin,
                          mm.n_threads * _SPIN_PIECES_PER_THREAD, _SPLIT_MIN_MACS, attention_scale(hp.head_dim))
    return True


def runs_compiled_layers(mm: Matmul, w: Any, hp: HParams, kv_dtype: Any) -> bool:
    """Whether `compiled_layers` runs a step's layers (and so lays its attention out per token, `gdecode`): the
    matmul is the compiled one with 1 thread or polling workers, the KV store fp16, head_dim a multiple of 16,
    and every layer matrix one exact part."""
    return (isinstance(mm, GgmlMatmul) and mm.compiled and not (mm.n_threads > 1 and mm._spin is None)
            and np.dtype(kv_dtype) == np.float16 and hp.head_dim % 16 == 0 and _fused_layers(mm, w) is not None)


def attend_layout(n_threads: int, hp: HParams) -> dict[str, int]:
    """The layout constants of the compiled attention (`sim.latency_physical.EngineLayout.attend_*`): it goes to
    the threads from `gdecode.ATTEND_SPLIT_MIN` cells x n_head x head_dim on, in n_threads x
    _SPIN_PIECES_PER_THREAD pieces (`compiled_layers`)."""
    from engine.model import gdecode
    n_q = hp.n_head * hp.head_dim
    return {"attend_by_token": 1, "attend_split_cells": -(-gdecode.ATTEND_SPLIT_MIN // n_q),
            "attend_pieces": n_threads * _SPIN_PIECES_PER_THREAD}


def _dot_kind(p: Q8_1DotPart) -> int:
    """The spin job kind (`spinjobs.DOT_*`) of an exact part's kernel."""
    from engine.model import spinjobs as sj
    return sj.DOT_Q8_0 if not p.has_m else sj.DOT_NIB if p.nib else sj.DOT_BYTE


def _exact_part(lin: Any) -> tuple[int, np.ndarray, np.ndarray, np.ndarray] | None:
    """(kind, q, d, m or d again) of a `QLinear` that is one exact part, in the packed layout, else None."""
    if not isinstance(lin, QLinear) or len(lin.parts) != 1 or isinstance(lin.parts[0], BlasPart):
        return None
    p = lin.parts[0]
    return (_dot_kind(p), *p.packed)


def _fused_layers(mm: GgmlMatmul, w: Any) -> list | None:
    """`gdecode.Layer`s of weights `w`, or None when a layer matrix is not one exact part; kept by the model's
    matmul (`Weights` cannot hold it: frozen, slots)."""
    if mm._fused is not None and mm._fused[0] is w:
        return mm._fused[1]
    from engine.model import gdecode
    layers: list | None = []
    for lw in w.layers:
        prods = [_exact_part(lin) for lin in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
        if any(p is None for p in prods):
            layers = None
            break
        layers.append(gdecode.layer(lw.attn_norm, lw.ffn_norm, prods, lw.bqkv))
    mm._fused = (w, layers)
    return layers


# --- RoPE, norm -------------------------------------------------------------------------------------------------

def _libm_float_fn(name: str) -> Callable[[np.ndarray], np.ndarray] | None:
    """The C library's float function `name` (sinf, cosf) applied elementwise, or None without a libm."""
    path = ctypes.util.find_library("m")
    if path is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    ufunc = np.frompyfunc(fn, 1, 1)
    return lambda a: ufunc(a).astype(np.float32)


class GgmlRope(Rope):
    """`Rope` with ggml's angles (theta starts at float32 p and is multiplied by theta_scale = powf(base,
    -2/n_rot) in float32 once per pair, divided by the freq factor, times freq_scale), cos/sin from the C
    library's cosf/sinf (float64 rounded when there is no libm), and ggml's fma rotation."""

    def __init__(self, hp: HParams, freq_factors: np.ndarray | None = None, compiled: bool = False):
        half = hp.n_rot // 2
        self.compiled = compiled                 # `rerotate` of fp16 cells by the numba kernel
        self.theta_scale = np.float32(np.float64(hp.rope_freq_base)
                                      ** np.float64(np.float32(-2.0) / np.float32(hp.n_rot)))
        self.freq_scale = np.float32(hp.rope_freq_scale)
        self.freq_factors = (None if freq_factors is None
                             else np.asarray(freq_factors, dtype=np.float32).reshape(half))
        self._cosf, self._sinf = _libm_float_fn("cosf"), _libm_float_fn("sinf")
        self._shift: tuple[int, np.ndarray, np.ndarray] | None = None     # rerotate's last delta, its cos, sin
        super().__init__(hp, freq_factors)

    def angles(self, pos: np.ndarray) -> np.ndarray:
        """[len(pos), n_rot/2] float32 angles, as ggml_rope_cache_init computes them."""
        theta = np.asarray(pos).astype(np.float32).reshape(-1)
        out = np.empty((theta.shape[0], self.n_rot // 2), np.float32)
        for i in range(self.n_rot // 2):
            t = theta if self.freq_factors is None else theta / self.freq_factors[i]
            out[:, i] = self.freq_scale * t
            theta = theta * self.theta_scale
        return out

    def _cos_sin_of(self, angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self._cosf is None or self._sinf is None:
            a = angles.astype(np.float64)
            return np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)
        return self._cosf(angles), self._sinf(angles)

    def _grow(self, n_pos: int) -> None:
        self._cos, self._sin = self._cos_sin_of(self.angles(np.arange(n_pos)))

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
        """rotate_pairs as compiled: x0' = fma(x0, cos, -(x1*sin)), x1' = fma(x0, sin, x1*cos)."""
        x0, x1 = self.pairs(x)
        r0 = _fma(x0, cos, -(x1 * sin))
        r1 = _fma(x0, sin, x1 * cos)
        x0[...] = r0
        x1[...] = r1

    def shift_cos_sin(self, delta: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._shift                                  # one read and one write of the tuple: thread-safe
        if got is None or got[0] != delta:
            cos, sin = self._cos_sin_of(self.angles(np.array([delta])))
            got = self._shift = (delta, cos[0], sin[0])
        return got[1], got[2]

    def rerotate(self, k: np.ndarray, delta: int) -> None:
        """`Rope.rerotate`; fp16 cells by the compiled kernel (`gkernels.rerotate_f16`: the same bits, no
        temporaries: a shift of 1024 cells of SmolLM2 in 6 ms, against 23-25 for the numpy path over the whole range at
        once; benchmarks/bench_context_shift.py) when `compiled`."""
        gk = kernels() if self.compiled else None
        if gk is None or k.dtype != np.float16:
            super().rerotate(k, delta)
            return
        cos, sin = self.shift_cos_sin(delta)
        k16 = k.view(np.uint16)
        gk.rerotate_f16(k16 if k16.ndim == 4 else k16[None], cos, sin, self.n_rot, self.mode != "norm")


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """ggml_rms_norm + mul: sum of float32 squares in double (in order, as ggml_compute_forward_rms_norm_f32),
    scale = 1/sqrtf(float(mean) + eps), x*scale*w."""
    ss = _sum_sequential(np.square(x))                                    # [T]
    mean = (ss / x.shape[1]).astype(np.float32)
    scale = np.float32(1.0) / np.sqrt(mean + np.float32(eps))            # [T] float32
    return x * scale[:, None] * w                                         # [T, D]


# --- attention --------------------------------------------------------------------------------------------------

def attention_scale(head_dim: int) -> np.float32:
    """kq_scale = 1.0f/sqrtf(float(n_embd_head))."""
    return np.float32(1.0) / np.sqrt(np.float32(head_dim))


def dot_f16_tiny(p: np.ndarray) -> np.ndarray:
    """Sum over the last axis (a multiple of 16) of exact f16 x f16 products as llamafile's tinyBLAS
    (AVX-512) does: 16 lanes, lane l accumulates elements l, l+16, ... in order (fma), then reduce."""
    acc = p[..., 0:16].copy()
    for i in range(16, p.shape[-1], 16):
        acc += p[..., i:i + 16]
    return _reduce16(acc)


def dot_f16_vec(p: np.ndarray) -> np.ndarray:
    """Sum over the last axis of exact f16 x f16 products as ggml_vec_dot_f16 (AVX-512) does: 4 accumulators
    of 16 lanes over steps of 64 (fma), reduced (0+2, 1+3, then the two) and _mm512_reduce_add_ps to double,
    the n % 64 tail added in double; the result is rounded to float32."""
    n = p.shape[-1]
    n64 = n - n % 64
    if n64:
        acc = p[..., 0:64].copy()
        for i in range(64, n64, 64):
            acc += p[..., i:i + 64]
        acc = acc.reshape(*acc.shape[:-1], 4, 16)
        x = (acc[..., 0, :] + acc[..., 2, :]) + (acc[..., 1, :] + acc[..., 3, :])
        sumf = _reduce16(x).astype(np.float64)
    else:
        sumf = np.zeros(p.shape[:-1], np.float64)
    for i in range(n64, n):
        sumf += p[..., i]
    return sumf.astype(np.float32)


def _pad(a: np.ndarray, axis: int, multiple: int, value: float) -> np.ndarray:
    n = a.shape[axis]
    extra = -n % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return np.pad(a, widths, constant_values=value)


def _run_blocks(mm: Matmul | None, tasks: list[Callable[[], None]]) -> None:
    """The query blocks of one attention call: on the matmul's threads (`Matmul.parallel` runs a single task
    inline), or in this thread when there is no matmul."""
    if mm is None:
        for t in tasks:
            t()
    else:
        mm.parallel(tasks)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_old: int, mm: Matmul | None = None) -> np.ndarray:
    """`f32.attend` with ggml's non-flash-attention arithmetic: q [m, n_head, head_dim] (not scaled), k/v
    [n_head_kv, >= n_old + m, head_dim] the sequence's cells as stored. Returns [m, n_head * head_dim].
    With an f32 KV store (not llama.cpp's default) the exact kernels do not apply: float32 BLAS products."""
    m, n_head, head_dim = q.shape
    scale = attention_scale(head_dim)
    kv_f16 = k.dtype != np.float32
    if kv_f16:
        k, v = k[:, :n_old + m].astype(np.float32), v[:, :n_old + m].astype(np.float32)
    n_head_kv = k.shape[0]
    n_gqa = n_head // n_head_kv
    kv_of = np.arange(n_head) // n_gqa                               # KV head of each query head
    q = round_f16(q) if kv_f16 else q                               # Q to K's vec_dot_type (f16)
    out = np.empty((m, n_head, head_dim), np.float32)

    def scores(qb: np.ndarray, n_keys: int, one: bool) -> np.ndarray:
        """[n_head, rows, n_keys] = K . Q for query rows qb [rows, n_head, head_dim]."""
        kk = k[kv_of, :n_keys]                                       # [n_head, n_keys, head_dim]
        if not kv_f16:
            return np.matmul(qb.transpose(1, 0, 2), kk.transpose(0, 2, 1))
        prod = qb.transpose(1, 0, 2)[:, :, None, :] * kk[:, None, :, :]   # [n_head, rows, n_keys, hd]
        return dot_f16_vec(prod) if one else dot_f16_tiny(prod)

    def weighted(p: np.ndarray, n_keys: int, one: bool) -> np.ndarray:
        """[rows, n_head, head_dim] = V . P for probabilities p [n_head, rows, n_keys_padded]."""
        vv = v[kv_of, :n_keys]                                       # [n_head, n_keys, head_dim]
        if not kv_f16:
            return np.matmul(p[..., :n_keys], vv).transpose(1, 0, 2)
        vt = _pad(vv.transpose(0, 2, 1), 2, 64 if one else 16, 0.0)  # [n_head, head_dim, n_pad]
        prod = p[:, :, None, :] * vt[:, None, :, :]                 # [n_head, rows, head_dim, n_pad]
        o = dot_f16_vec(prod) if one else dot_f16_tiny(prod)
        return o.transpose(1, 0, 2)

    def block(a: int, b: int) -> None:
        n_keys = n_old + b
        one = m == 1                                                 # ggml_vec_dot_f16 vs tinyBLAS
        s = scores(q[a:b], n_keys, one) * scale                      # [n_head, rows, n_keys]
        if b - a > 1:                                                # key j > query position: -inf
            causal = np.arange(n_keys)[None, :] > (n_old + np.arange(a, b))[:, None]
            s = np.where(causal[None], np.float32(-np.inf), s)
        s = _pad(s, 2, 64 if one else 16, -np.inf)
        p = softmax_rows(s)
        if kv_f16:
            p = round_f16(p)                                         # probabilities to V's vec_dot_type
        out[a:b] = weighted(p, n_keys, one)

    starts = list(range(0, m, _QUERY_BLOCK))
    tasks = [lambda a=a: block(a, min(m, a + _QUERY_BLOCK)) for a in reversed(starts)]
    _run_blocks(mm, tasks)
    return out.reshape(m, n_head * head_dim)


# --- the compiled path: the same operations by `gkernels`, bit for bit -----------------------------------------------

def quantize_q8_compiled(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`_q8_blocks` + the Q8_1 sums by `gkernels.quantize_q8`: (q [M, n] int8, d16 [M, n/32], s [M, n/32])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    m, n = x.shape
    if n % QK8:
        raise ValueError(f"row length {n} is not a multiple of {QK8}")
    qx = np.empty(x.shape, np.int8)
    d16 = np.empty((m, n // QK8), np.float32)
    s = np.empty((m, n // QK8), np.float32)
    kernels().quantize_q8(x, qx, d16, s)
    return qx, d16, s


def rms_norm_compiled(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """`rms_norm` by `gkernels.rms_norm`."""
    out = np.empty(x.shape, np.float32)
    kernels().rms_norm(np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(w, dtype=np.float32),
                       np.float32(eps), out)
    return out


def silu_mul_compiled(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> np.ndarray:
    """`silu_mul` by `gkernels.silu_mul`. g and u are usually column halves of one [T, 2 n_ff] product: numba
    cannot vectorize over a view whose inner stride it does not know, so they are copied contiguous first
    (measured on 512 x 1536: 7.2 ms on the views, less than half with the copies)."""
    if out.flags.c_contiguous:
        kernels().silu_mul(np.ascontiguousarray(g), np.ascontiguousarray(u), out)
    else:
        res = np.empty(out.shape, np.float32)
        kernels().silu_mul(np.ascontiguousarray(g), np.ascontiguousarray(u), res)
        out[...] = res
    return out


def attend_compiled(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_old: int, mm: Matmul | None = None) -> np.ndarray:
    """`attend` with each query block (the same blocks) by `gkernels.attend_block`; the cells' fp16 values are
    read by `gkernels.kv_values` (numpy's float16 cast measured ~2 ns an element here). An f32 KV store, or a
    head_dim that is not a multiple of 16 (where `attend` has no exact kernel), goes to `attend`."""
    m, n_head, head_dim = q.shape
    if k.dtype != np.float16 or v.dtype != np.float16 or head_dim % 16:
        return attend(q, k, v, n_old, mm)
    kern = kernels()
    n_tot = n_old + m
    n_head_kv = k.shape[0]
    n_gqa = n_head // n_head_kv
    kt = np.empty((n_head_kv, head_dim, n_tot), np.float32)                       # K's values, keys contiguous
    kern.kv_values_t(k.view(np.uint16), n_tot, kt)
    vf = np.empty((n_head_kv, n_tot, head_dim), np.float32)
    kern.kv_values(v.view(np.uint16), n_tot, vf)
    return _attend_values(q, kt, vf, n_old, n_gqa, mm)


def _attend_values(q: np.ndarray, kt: np.ndarray, vf: np.ndarray, n_old: int, n_gqa: int,
                   mm: Matmul | None) -> np.ndarray:
    """The query blocks of `attend_compiled` by `gkernels.attend_block` over the cells' float32 values kt
    [n_head_kv, head_dim, >= n_tot] (K transposed) and vf [n_head_kv, >= n_tot, head_dim]."""
    kern = kernels()
    m, n_head, head_dim = q.shape
    q16 = np.empty(q.shape, np.float32)                                            # Q to f16 (K's vec_dot_type)
    kern.f16_round_array(np.ascontiguousarray(q, dtype=np.float32).reshape(-1), q16.reshape(-1))
    out = np.empty((m, n_head, head_dim), np.float32)
    scale = attention_scale(head_dim)
    one = m == 1

    def block(a: int) -> None:
        kern.attend_block(q16, kt, vf, n_old, a, min(m, a + _QUERY_BLOCK), one, scale, n_gqa, out)

    tasks = [lambda a=a: block(a) for a in reversed(range(0, m, _QUERY_BLOCK))]
    _run_blocks(mm, tasks)
    return out.reshape(m, n_head * head_dim)


def shadow_current(kv: KVStore, s: SeqKV) -> None:
    """Bring every layer of sequence `s`'s float32 shadow (`KVStore.shadow`) current through its last cell, as
    the attention of a running sequence keeps it: a sequence that has been decoding converts only its new cell
    each step. `slotlab calibrate` calls it (untimed) on the sequences it loads, so that a decode shape times a
    running slot's step, not the one-off conversion of a freshly loaded context (which a real server pays in the
    step after a prompt-cache load or a context shift, and which those shapes time)."""
    if s.k.dtype != np.float16 or s.v.dtype != np.float16 or s.n == 0:
        return
    n = int(s.n)
    sh = kv.shadow(s, n)
    for il in range(s.k.shape[0]):
        _shadow_through(s, sh, il, n, n)


def _shadow_through(s: SeqKV, sh: Shadow, il: int, n_old: int, n_tot: int) -> None:
    """Layer il of `s`'s shadow `sh` made current through cell n_tot - 1: cells from min(valid, n_old) on are
    converted (cells at n_old and beyond are always re-converted: they may have just been written)."""
    lo = min(int(sh.valid[il]), n_old)
    if lo < n_tot:
        kernels().kv_shadow(s.k[il].view(np.uint16), s.v[il].view(np.uint16), lo, n_tot, sh.kt[il], sh.v[il])
    sh.valid[il] = n_tot


def attend_cells(q: np.ndarray, kv: KVStore, s: SeqKV, il: int, n_old: int, mm: Matmul | None = None) -> np.ndarray:
    """`attend_compiled` of sequence `s`'s cells of layer il, reading their float32 values from the store's
    shadow (`KVStore.shadow`): only the cells not yet current there (this chunk's, normally) are converted,
    by `gkernels.kv_shadow`, instead of every cell each step. The same values, so the same bits."""
    k, v = s.k[il], s.v[il]
    m, n_head, head_dim = q.shape
    if k.dtype != np.float16 or v.dtype != np.float16 or head_dim % 16:
        return attend(q, k, v, n_old, mm)
    n_tot = n_old + m
    sh = kv.shadow(s, n_tot)
    _shadow_through(s, sh, il, n_old, n_tot)               # cells from n_old on: this chunk's, just written
    return _attend_values(q, sh.kt[il], sh.v[il], n_old, n_head // k.shape[0], mm)
