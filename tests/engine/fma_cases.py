"""float32 fma cases and their exact results, for the tests of `ggml._fma` and `gkernels._fma`.

`fma_exact(a, b, c)` is fmaf with rational arithmetic (`fractions.Fraction`): the exact a*b + c rounded once to
float32 (nearest, ties to even, overflow to inf, IEEE signs of zero). `double_rounded` is the float64 sum
rounded again to float32, which differs from it only near float32 midpoints; `fma_inputs` builds operands
that land there (and other hard cases) so that the two can be told apart.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

F32 = np.float32
_MAX = Fraction(float(np.finfo(F32).max))
_OVERFLOW = Fraction(2) ** 128 - Fraction(2) ** 103     # midpoint of FLT_MAX and 2^128: from here on, inf


def round_to_f32(x: Fraction, negative_zero: bool = False) -> np.float32:
    """The float32 nearest to the rational x (ties to even; |x| >= the overflow midpoint gives inf). A zero
    x gives -0.0 if `negative_zero`, else +0.0; an x that rounds to zero keeps its sign."""
    if x == 0:
        return F32(-0.0) if negative_zero else F32(0.0)
    if abs(x) >= _OVERFLOW:
        return F32(math.copysign(math.inf, x))
    g = F32(float(x))                                        # within one float32 step of the answer
    if not np.isfinite(g):
        g = F32(math.copysign(float(_MAX), x))
    best = None
    for cand in (np.nextafter(g, F32(-np.inf)), g, np.nextafter(g, F32(np.inf))):
        if not np.isfinite(cand):
            continue
        dist = abs(Fraction(float(cand)) - x)
        odd = int(np.abs(cand).view(np.uint32)) & 1
        key = (dist, odd)
        if best is None or key < best[0]:
            best = (key, cand)
    r = best[1]
    return F32(math.copysign(0.0, x)) if r == 0 else F32(r)


def fma_exact(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """fmaf(a, b, c) for finite float32 operands by exact rational arithmetic."""
    prod = Fraction(float(a)) * Fraction(float(b))
    x = prod + Fraction(float(c))
    if x == 0:                                               # exact zero: -0 only for (-0) + (-0)
        prod_negative = (math.copysign(1.0, float(a)) * math.copysign(1.0, float(b))) < 0
        neg = prod == 0 and prod_negative and float(c) == 0 and math.copysign(1.0, float(c)) < 0
        return round_to_f32(x, negative_zero=neg)
    return round_to_f32(x)


def double_rounded(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32(float64(a) * float64(b) + float64(c)): the exact product, the sum rounded to float64, then to
    float32 (two roundings)."""
    return (np.multiply(a, b, dtype=np.float64) + c.astype(np.float64)).astype(F32)


def _pow2(e: np.ndarray) -> np.ndarray:
    return np.ldexp(np.float64(1.0), e)


def near_midpoint_inputs(rng: np.random.Generator, n: int, subnormal: bool = False) -> tuple[np.ndarray, ...]:
    """(a, b, c) with a*b + c off a float32 midpoint next to c by less than half a float64 ulp, so that the
    float64 sum lands on the midpoint itself: s is half of c's float32 step and a*b = +-s(1 - k^2 2^-46) =
    +-s (1 + k 2^-23)(1 - k 2^-23) with c's last bit odd (the sum is just short of the midpoint, whose even
    neighbour is the far one), or +-s(1 + 2^-30) = +-s 6605 * 162565 / 2^30 and +-s(1 + 2^-32) =
    +-s 641 * 6700417 / 2^32 with c's last bit even (just past it, the even neighbour being c); all factors
    below 2^24, so a and b are float32. `subnormal`: c a large float32 subnormal."""
    kind = rng.integers(0, 3, n)
    if subnormal:
        mant = rng.integers(1 << 20, 1 << 23, n)
        e_s = np.full(n, -150)                                    # half of 2^-149
    else:
        e_c = rng.integers(-100, 100, n)
        mant = ((e_c + 127) << 23) | rng.integers(0, 1 << 23, n)
        e_s = e_c - 24
    mant = (mant & ~1) | (kind == 0)
    c = np.asarray(mant, np.uint32).view(F32) * rng.choice(np.array([1, -1], F32), n)
    k = rng.integers(1, 200, n).astype(np.float64)
    fa = np.where(kind == 0, 1 + k * 2.0 ** -23, np.where(kind == 1, 6605 / 8192, 641 / 1024))
    fb = np.where(kind == 0, 1 - k * 2.0 ** -23, np.where(kind == 1, 162565 / 2 ** 17, 6700417 / 2 ** 22))
    ea = e_s // 2
    a = (fa * _pow2(ea)).astype(F32)
    b = (fb * _pow2(e_s - ea) * rng.choice([1.0, -1.0], n)).astype(F32)
    return a, b, c


def fma_inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Operands for the fma tests: near-midpoint cases (normal and subnormal results), exact midpoints (one
    rounding of an exactly representable tie), random operands over a wide exponent range (products far
    larger or far smaller than c), signed zeros, subnormal operands and results, overflow to inf."""
    parts = [near_midpoint_inputs(rng, 3000), near_midpoint_inputs(rng, 1000, subnormal=True)]
    n = 2000                                                      # exact ties: c + s with a = 1, b = s
    e_c = rng.integers(-120, 120, n)
    c = (((e_c + 127) << 23) | rng.integers(0, 1 << 23, n)).astype(np.uint32).view(F32)
    parts.append((np.ones(n, F32), _pow2(e_c - 24).astype(F32) * rng.choice(np.array([1, -1], F32), n), c))
    n = 6000                                                      # random, wide exponents
    r = [(rng.normal(size=n) * _pow2(rng.integers(lo, hi, n))).astype(F32)
         for lo, hi in ((-70, 70), (-70, 70), (-140, 127))]
    parts.append(tuple(r))
    n = 3000                                                      # products of similar size to c: cancellation
    a = rng.normal(size=n).astype(F32)
    b = rng.normal(size=n).astype(F32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.normal(0, 1e-6, n))).astype(F32)
    parts.append((a, b, c))
    z = np.array([0.0, -0.0], F32)                                # signed zeros: every combination
    za, zb, zc = (g.ravel() for g in np.meshgrid(np.array([0.0, -0.0, 1.0, -1.0], F32), z, z, indexing="ij"))
    parts.append((za, zb, zc))
    tiny = np.array([1e-45, -1e-45, 1e-40, 2 ** -126, -2 ** -126], F32)   # subnormal operands / results
    parts.append((tiny, np.array([0.5, 0.5, 3.0, 0.5, 0.75], F32), np.array([1e-45, 0.0, -1e-40, 1e-45, 0.0], F32)))
    big = np.array([3e38, 2e38, -3e38, 1.8e19], F32)              # overflow, and just not
    parts.append((big, np.array([2.0, 1.0, 2.0, 1.8e19], F32), np.array([0.0, 2e38, -1e38, 3.0e38], F32)))
    return tuple(np.concatenate([p[i] for p in parts]).astype(F32) for i in range(3))
