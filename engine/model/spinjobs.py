"""The jobs `spin.SpinPool` runs: the exact quantized products of the "ggml" numerics (`gkernels.dot_*`) and the
fused products of the "q" numerics (`qkernels.range_*`), split into output ranges.

A job is written by a `post_*` function (compiled, so that writing ~15 argument words costs one call): the
addresses and shapes of its arrays go to `job`, the output ranges to `cuts`; `run_piece` rebuilds the arrays from
the addresses and runs one range. Every array must be C-contiguous and stay alive until the job is done: the
callers (`ggml.GgmlMatmul`, `quant.QuantMatmul`) hold them across `SpinPool.run`.

The first pool of a process on a new machine compiles the dot kernels for these array views (~25 s here); numba's
cache keeps them for later processes.
"""

from __future__ import annotations

from numba import njit

from engine.model import gkernels, qkernels
from engine.model.spin import SpinPool, address, f32_at, i8_at, serve_loop, set_cuts, u16_at, u8_at, work_join_loop

DOT_NIB, DOT_BYTE, DOT_Q8_0 = 1, 2, 3           # ggml: Q4_1 x Q8_1, Q5_1 x Q8_1, Q8_0 x Q8_0
RANGE_NIB, RANGE_BYTE, RANGE_HALF = 4, 5, 6     # q: nibble, byte and 16-bit weights


# job words of a block-quantized product (both families): 0 kind, 1-4 quants (address, nb, bs, n_out), 5 d, 6-7 m
# (address, rows), 8-10 activations (address, M, n_in), 11-12 per-block activation values (address, blocks),
# 13 has_m (q) or the second per-block array's address (ggml: sx), 14 output
@njit(cache=True, nogil=True, inline="always")
def _put_blocks(job, cuts, kind, q, d, m, x, xb, y, n_pieces, align):
    job[0] = kind
    job[1] = address(q)
    job[2] = q.shape[0]
    job[3] = q.shape[1]
    job[4] = q.shape[2]
    job[5] = address(d)
    job[6] = address(m)
    job[7] = m.shape[0]
    job[8] = address(x)
    job[9] = x.shape[0]
    job[10] = x.shape[1]
    job[11] = address(xb)
    job[12] = xb.shape[1]
    job[14] = address(y)
    return set_cuts(cuts, q.shape[2], align, n_pieces)


@njit(cache=True, nogil=True)
def post_dot(job, cuts, kind, qw, dw, mw, qx, dx, sx, y, n_pieces, align):
    """A ggml dot job (kind DOT_*): qw [nb, bs, n_out], dw/mw [nb or 0, n_out], qx [M, n_in], dx/sx [M, nb],
    y [M, n_out]. Returns the number of pieces."""
    job[13] = address(sx)
    return _put_blocks(job, cuts, kind, qw, dw, mw, qx, dx, y, n_pieces, align)


@njit(cache=True, nogil=True)
def run_ggml_piece(job, cuts, i):
    o0, o1 = cuts[2 * i], cuts[2 * i + 1]
    nb, bs, n_out, m, n_in, nbx = job[2], job[3], job[4], job[9], job[10], job[12]
    dw = f32_at(job[5], (nb, n_out))
    mw = f32_at(job[6], (job[7], n_out))
    qx = f32_at(job[8], (m, n_in))
    dx = f32_at(job[11], (m, nbx))
    sx = f32_at(job[13], (m, nbx))
    y = f32_at(job[14], (m, n_out))
    kind = job[0]
    if kind == DOT_NIB:
        gkernels.dot_nib(u8_at(job[1], (nb, bs, n_out)), dw, mw, qx, dx, sx, y, o0, o1)
    elif kind == DOT_BYTE:
        gkernels.dot_byte(i8_at(job[1], (nb, bs, n_out)), dw, mw, qx, dx, sx, y, o0, o1)
    else:
        gkernels.dot_q8_0(i8_at(job[1], (nb, bs, n_out)), dw, qx, dx, y, o0, o1)


@njit(cache=True, nogil=True)
def post_range(job, cuts, kind, q, d, m, x, xs, y, has_m, n_pieces, align):
    """A q job (kind RANGE_NIB / RANGE_BYTE): q [nb, bs, n_out], d/m [nb or 0, n_out], x [M, n_in],
    xs [M, nbx], y [M, n_out]."""
    job[13] = has_m
    return _put_blocks(job, cuts, kind, q, d, m, x, xs, y, n_pieces, align)


@njit(cache=True, nogil=True)
def post_half(job, cuts, w, s, x, y, bf, n_pieces, align):
    """A q job of 16-bit weights (RANGE_HALF): w [n_in, n_out] uint16, s [n_out], x [M, n_in], y [M, n_out]."""
    job[0] = RANGE_HALF
    job[1] = address(w)
    job[2] = w.shape[0]
    job[4] = w.shape[1]
    job[5] = address(s)
    job[8] = address(x)
    job[9] = x.shape[0]
    job[13] = bf
    job[14] = address(y)
    return set_cuts(cuts, w.shape[1], align, n_pieces)


@njit(cache=True, nogil=True)
def run_q_piece(job, cuts, i):
    o0, o1 = cuts[2 * i], cuts[2 * i + 1]
    n_out, m = job[4], job[9]
    y = f32_at(job[14], (m, n_out))
    kind = job[0]
    if kind == RANGE_HALF:
        n_in = job[2]
        qkernels.range_half(u16_at(job[1], (n_in, n_out)), f32_at(job[5], (n_out,)), f32_at(job[8], (m, n_in)),
                            y, o0, o1, job[13] != 0)
        return
    nb, bs, n_in = job[2], job[3], job[10]
    d = f32_at(job[5], (nb, n_out))
    mm = f32_at(job[6], (job[7], n_out))
    x = f32_at(job[8], (m, n_in))
    xs = f32_at(job[11], (m, job[12]))
    if kind == RANGE_NIB:
        qkernels.range_nib(u8_at(job[1], (nb, bs, n_out)), d, mm, x, xs, y, o0, o1)
    else:
        qkernels.range_byte(i8_at(job[1], (nb, bs, n_out)), d, mm, x, xs, y, o0, o1, job[13] != 0)


@njit(cache=True, nogil=True)
def run_piece(job, cuts, i):
    if job[0] <= DOT_Q8_0:
        run_ggml_piece(job, cuts, i)
    else:
        run_q_piece(job, cuts, i)


@njit(cache=True, nogil=True)
def serve(ctl, job, cuts, me, spin_cycles):
    serve_loop(ctl, job, cuts, me, spin_cycles, run_piece)


@njit(cache=True, nogil=True)
def work_join(ctl, job, cuts, n):
    return work_join_loop(ctl, job, cuts, n, run_piece)


def pool(n_workers: int) -> SpinPool:
    """A `SpinPool` running the jobs of this module (ggml dot and q range products)."""
    return SpinPool(n_workers, serve, work_join)


__all__ = ["DOT_BYTE", "DOT_NIB", "DOT_Q8_0", "RANGE_BYTE", "RANGE_HALF", "RANGE_NIB", "pool", "post_dot",
           "post_half", "post_range", "run_piece", "serve", "work_join"]
