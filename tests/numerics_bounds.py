"""Error bounds that follow from float32 arithmetic, not from one machine's BLAS kernel.

A float32 result computed by the engine is compared with a float64 reference, and the allowed difference is
computed from the operands: whatever order OpenBLAS (or numpy, or a numba kernel) sums in, whatever vector
width or thread split, the result stays inside the bound. A test that compares two float32 paths (batched
vs alone, chunked vs whole, 1 vs 2 threads) holds each path to the bound around the same float64 reference;
where two paths are the same arithmetic on the same bits, the test asserts equality instead.

The facts used (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., ch. 2-3):

- u = 2^-24 (float32 unit roundoff); one correctly rounded operation gives op(a, b)(1 + d), |d| <= u.
- gamma_k = k u / (1 - k u). A dot product of length n, products and sums in ANY order (pairwise, blocked,
  split over threads and added, with or without FMA, or accumulated in higher precision), differs from the
  exact one by at most gamma_n * sum_i |a_i b_i| (Higham 3.1, 3.5). A sum of n non-negative terms has
  relative error at most gamma_{n-1}.
- numpy's float32 `exp` is held to 3 ULP by numpy's own accuracy tests on every SIMD target
  (numpy/_core/tests/data/umath-validation-set-exp.csv); we allow 4 ULP, a relative error <= 8u (one ULP
  of x is at most 2u|x|).
- float16 storage (the KV cache) rounds with u16 = 2^-11 relative, 2^-25 absolute in the subnormal range.

The float64 reference carries its own rounding (u64 = 2^-53); every bound below is a sum of terms each
growing with u, so computing it with u = u32 + u64 covers the distance engine -> exact -> reference.

Each function takes its operands as `Ball`s (a float64 value and a radius around it that the engine's float32
value is known to lie in; radius 0 for an operand read from the engine itself) and returns the op's exact
value with the radius the float32 op can reach. Bounds are applied one op at a time, on the engine's own
operands (`tests/engine/forward_check.py` does that for a whole forward pass): propagated through a whole
transformer, worst-case bounds grow by |W| ~ sqrt(n) per product and are useless after one layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

U32 = 2.0 ** -24
U64 = 2.0 ** -53
U = U32 + U64                   # float32 rounding, plus the float64 reference's own
U16 = 2.0 ** -11
F16_TINY = 2.0 ** -25           # float16 absolute rounding below the normal range
EXP_REL = 8 * U32 + U64         # numpy float32 exp: 4 ULP
SILU_LIPSCHITZ = 1.1            # max |d/dz z sigmoid(z)| = 1.0998...


def gamma(k: int | float, u: float = U) -> float:
    """gamma_k = k u / (1 - k u)."""
    assert k * u < 0.5, k
    return k * u / (1 - k * u)


def dot_bound(abs_a: np.ndarray, abs_b: np.ndarray, n: int | None = None) -> np.ndarray:
    """gamma_n * |a| @ |b|: how far a float32 product a @ b (any summation order) is from the exact one;
    n defaults to the inner dimension."""
    n = abs_a.shape[-1] if n is None else n
    return gamma(n) * (1 + gamma(n, U64)) * (abs_a @ abs_b)


def check_within(got: np.ndarray, want: np.ndarray, radius: np.ndarray, what: str = "") -> float:
    """Assert |got - want| <= radius element-wise; return the largest |got - want| / radius (<= 1)."""
    err = np.abs(np.asarray(got, np.float64) - want)
    assert err.shape == np.shape(radius), (err.shape, np.shape(radius))
    bad = err > radius
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {err.size} values outside the float32 bound, worst "
                           f"|diff| {err.max():.3g} with bound {radius.flat[np.argmax(err - radius)]:.3g}")
    return float((err / np.maximum(radius, 1e-300)).max())


@dataclass
class Ball:
    """A float64 value v and a radius r (same shape) with |engine's float32 value - exact value| <= r."""

    v: np.ndarray
    r: np.ndarray

    @property
    def mag(self) -> np.ndarray:
        """An upper bound of |engine's value|."""
        return np.abs(self.v) + self.r

    def __getitem__(self, i) -> Ball:
        return Ball(self.v[i], self.r[i])


def exact(v: np.ndarray) -> Ball:
    return Ball(np.asarray(v, np.float64), np.zeros(np.shape(v)))


def add(a: Ball, b: Ball) -> Ball:
    """a + b in float32 (the residual adds): one rounding."""
    v = a.v + b.v
    return Ball(v, a.r + b.r + U * (np.abs(v) + a.r + b.r))


def matmul(x: Ball, w: np.ndarray, abs_w: np.ndarray | None = None, bias: np.ndarray | None = None,
           extra_ops: int = 0) -> Ball:
    """x [.., n_in] @ w.T [n_in, n_out] (+ bias) in float32, any summation order.

    |fl(x^ W^T) - x W^T| <= |x^ - x| |W|^T + gamma_n |x^| |W|^T. `abs_w` replaces |W| where a kernel's terms
    are larger than |w_ij x_j| (the "q" kernels: (|d q| + |m|) |x|), `extra_ops` adds operations per chain."""
    abs_w = np.abs(w) if abs_w is None else abs_w
    n = w.shape[1] + extra_ops + (bias is not None)
    v = x.v @ w.T
    mag = x.mag @ abs_w.T
    if bias is not None:
        v = v + bias
        mag = mag + np.abs(bias)
    r = gamma(n) * (1 + gamma(n, U64)) * mag
    if x.r.any():
        r += x.r @ abs_w.T
    return Ball(v, r)


def rms_norm(x: Ball, w: np.ndarray, eps: float) -> Ball:
    """x / sqrt(mean(x^2) + eps) * w per row of x [T, D], in float32.

    Rounding: the sum of squares (D positive terms) gamma_D, / D, + eps, sqrt, reciprocal, * x, * w one
    rounding each: relative <= gamma_{D+8} of |x^ w| / rho^. Input error: rho (the RMS with eps) is
    1/sqrt(D)-Lipschitz in the 2-norm, so |rho^ - rho| <= e_rho = ||r||_2 / sqrt(D), and
    |x^_i / rho^ - x_i / rho| <= r_i / (rho - e_rho) + |x_i| e_rho / (rho (rho - e_rho))."""
    d = x.v.shape[-1]
    rho = np.sqrt(np.mean(x.v * x.v, axis=-1, keepdims=True) + eps)
    e_rho = np.sqrt(np.sum(x.r * x.r, axis=-1, keepdims=True) / d) * (1 + 4 * U64)
    assert np.all(e_rho < 0.5 * rho), "input error too large for the norm's bound"
    lo = rho - e_rho
    aw = np.abs(w)
    v = x.v / rho * w
    r = aw * (x.r / lo + np.abs(x.v) * e_rho / (rho * lo)) + gamma(d + 8) * aw * x.mag / lo
    return Ball(v, r)


def rope_tables(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """cos, sin of float64 angles and the error of the engine's float32 tables of them: rounding to float32
    (u32 |c|), the engine computing the angle in another float64 order (a few u64 |angle|), float64 cos."""
    c, s = np.cos(angles), np.sin(angles)
    slack = U64 * (8 * np.abs(angles) + 2)
    return c, s, U32 * np.abs(c) + slack, U32 * np.abs(s) + slack


def rotate_pairs(x0: Ball, x1: Ball, c, s, ec, es) -> tuple[Ball, Ball]:
    """(x0 c - x1 s, x0 s + x1 c) in float32 with tables c^, s^ (|c^ - c| <= ec): two products and a sum,
    gamma_2, plus the input errors through |c|, |s| <= 1 and the table errors."""
    ac, as_ = np.abs(c) + ec, np.abs(s) + es
    g = gamma(2)
    y0 = Ball(x0.v * c - x1.v * s,
              np.abs(c) * x0.r + np.abs(s) * x1.r + ec * x0.mag + es * x1.mag + g * (x0.mag * ac + x1.mag * as_))
    y1 = Ball(x0.v * s + x1.v * c,
              np.abs(s) * x0.r + np.abs(c) * x1.r + es * x0.mag + ec * x1.mag + g * (x0.mag * as_ + x1.mag * ac))
    return y0, y1


def rope(x: Ball, pos: np.ndarray, hp) -> Ball:
    """RoPE of x [T, heads, head_dim] by angle pos_t * theta_i (theta_i = freq_scale * base^(-2i/n_rot)), NORM
    pairs (2i, 2i+1) or NEOX pairs (i, i + n_rot/2) as hp.rope_type says, as the engine's float32 tables and
    rotation compute it; dims >= n_rot pass through. pos [T] may be negative (a re-rotation by a delta)."""
    half = hp.n_rot // 2
    inv = hp.rope_freq_base ** (-np.arange(half, dtype=np.float64) * 2.0 / hp.n_rot) * hp.rope_freq_scale
    ang = np.asarray(pos, np.float64).reshape(-1, 1) * inv[None, :]                 # [T, half]
    c, s, ec, es = (a.reshape(ang.shape[0], *([1] * (x.v.ndim - 2)), half) for a in rope_tables(ang))
    if hp.rope_type == "norm":
        i0, i1 = np.arange(0, hp.n_rot, 2), np.arange(1, hp.n_rot, 2)
    else:
        i0, i1 = np.arange(half), np.arange(half, hp.n_rot)
    y0, y1 = rotate_pairs(x[..., i0], x[..., i1], c, s, ec, es)
    v, r = x.v.copy(), x.r.copy()
    v[..., i0], v[..., i1], r[..., i0], r[..., i1] = y0.v, y1.v, y0.r, y1.r
    return Ball(v, r)


def softmax_attend(q: Ball, k: Ball, v: Ball) -> Ball:
    """softmax(q k^T) v for one query head: q [hd] (pre-scaled), k, v [L, hd]; in float32, any summation
    order, the weights normalized before (numerics f32 `attend`) or after (`DecodeBatch`) the weighted sum.

    The computed exponentials are, up to a factor common to all j, exp(s_j + eta_j) with
    |eta_j| <= delta_j + u |s^_j - max s^| + 8u/(1 - 8u): the score error delta_j = |k_j| r_q + r_kj |q^| +
    gamma_hd |q^| |k^_j|, the rounding of the shift by the max, exp's 4 ULP. They normalize to p~_j with
    p~_j / p_j within exp(+-(|eta_j| + max|eta|)) =: 1 +- E_j, and since sum p~ = sum p = 1,
    |sum (p~_j - p_j) v_j| = |sum (p~_j - p_j)(v_j - o)| <= sum p_j E_j |v_j - o| (o the exact output).
    The sum of the exponentials, the division and the weighted sum add at most gamma_{3L} relative per term."""
    hd = q.v.shape[-1]
    L = k.v.shape[0]
    s = k.v @ q.v
    p = np.exp(s - s.max())
    p /= p.sum()
    o = p @ v.v
    delta = (np.abs(k.v) + k.r) @ q.r + k.r @ np.abs(q.v) + gamma(hd) * (k.mag @ q.mag)
    eta = delta + U * (s.max() - s + delta + delta.max()) + EXP_REL / (1 - EXP_REL)
    e = np.expm1(eta + eta.max())
    pv = p[:, None]
    r = ((pv * e[:, None]) * np.abs(v.v - o)).sum(0)
    r += ((pv * (1 + e[:, None])) * (gamma(3 * L) * v.mag + v.r)).sum(0)
    r += 2.0 ** -125 * v.mag.sum(0)                # exponentials below float32's normal range (absolute)
    return Ball(o, r)


def softmax_rel(logits, roundings: int = 1, renormalized: bool = False) -> float:
    """Relative error bound of every probability of a float32 softmax (the sampler's) of `logits` (float64,
    the exact values) whose float32 inputs went through `roundings` roundings each (u |l| apiece: the
    float32 logit, a temperature division): scores perturbed by at most d = roundings u max|l| + u spread
    (the shift by the max) move p_j by a factor within exp(+-2 d); exp 4 ULP (twice: in p_j and in the sum),
    the sum gamma_n, the division u; `renormalized`: the kept probabilities summed and divided once more."""
    ll = np.asarray(logits, np.float64)
    n = ll.size
    d = roundings * U * np.abs(ll).max() + U * (ll.max() - ll.min())
    rel = np.expm1(2 * d + 2 * EXP_REL / (1 - EXP_REL)) + gamma(n + 1)
    return float(rel + (gamma(n + 1) if renormalized else 0.0))


def silu_mul(g: Ball, up: Ball) -> Ball:
    """silu(g) * up = g / (1 + exp(-g)) * up in float32: exp (8u), + 1 (its error relative to 1 + e^-g is at
    most exp's), /, * : relative eta = 8u + 4u of |silu(g^) up^|; input errors through silu's Lipschitz
    constant 1.1; an exp that overflows (g < -88) gives 0 where silu(g) < 1e-36."""
    sg = g.v / (1 + np.exp(-g.v))
    sg_mag = np.abs(sg) + SILU_LIPSCHITZ * g.r
    eta = EXP_REL + 4 * U
    r = SILU_LIPSCHITZ * g.r * up.mag + np.abs(sg) * up.r + eta * sg_mag * up.mag + 1e-30
    return Ball(sg * up.v, r)


def to_f16(x: Ball) -> Ball:
    """A float32 value stored as float16 (KV cells)."""
    return Ball(x.v, x.r + U16 * x.mag + F16_TINY)


def gguf_tensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float64, [rows, cols] as the engine holds it (dequantized)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    out = {}
    for t in GGUFReader(path).tensors:
        out[t.name] = np.asarray(dequantize(t.data, t.tensor_type), np.float64)
    return out
