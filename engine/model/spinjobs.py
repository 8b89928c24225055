"""The jobs `spin.SpinPool` runs: the exact quantized products of the "ggml" numerics (`gkernels.dot_*`) and the
fused products of the "q" numerics (`qkernels.range_*`), split into output ranges.

A job is written by a `post_*` function (compiled, so that writing ~15 argument words costs one call): the
addresses and shapes of its arrays go to `job`, the output ranges to `cuts`; `run_ggml_piece` / `run_q_piece`
rebuild the arrays from the addresses and run one range. Every array must be C-contiguous and stay alive until the
job is done: the callers (`ggml.GgmlMatmul`, `quant.QuantMatmul`, `gdecode`) hold them across the job.

Each family's piece runner is one C function (`piece_c`) that the pool's loops and the compiled callers call by
address. The first pool of a family on a new machine compiles its kernels into it (~35-65 s here); numba's cache
keeps it for later processes.
"""

from __future__ import annotations

import numpy as np
from numba import carray, cfunc, njit, types

from engine.model import gkernels, qkernels
from engine.model.spin import (JOB_SIZE, MAX_PIECES, SpinPool, _voidptr, address, f32_at, i8_at, i64_at, set_cuts,
                               u16_at, u8_at)

I64 = np.int64

DOT_NIB, DOT_BYTE, DOT_Q8_0 = 1, 2, 3           # ggml: Q4_1 x Q8_1, Q5_1 x Q8_1, Q8_0 x Q8_0
ATTEND = 7                                      # ggml: one query row's attention (`gkernels.attend_heads`), by heads
ATTEND_TOKENS = 8                               # ggml: the attention of a step's tokens (`gdecode`), by tokens

# words of a token's row of `gdecode.decode_layer`'s `seqs` table (here: the ATTEND_TOKENS pieces read it): its
# sequence's K / V cells (address of layer 0, bytes per layer, cells), float32 shadow (kt and vf addresses of layer 0,
# their bytes per layer, cells), the shadow's valid counts, cells before the token, and 1 when its chunk is that one
# token (ggml_vec_dot_f16's order) or 0 (tinyBLAS's)
S_K, S_V, S_KV_STRIDE, S_CAP, S_KT, S_VF, S_KT_STRIDE, S_VF_STRIDE, S_SH_CAP, S_VALID, S_N_OLD, S_ONE = range(12)
N_SEQ = 12
RANGE_NIB, RANGE_BYTE, RANGE_HALF = 4, 5, 6     # q: nibble, byte and 16-bit weights


# job words of a block-quantized product (both families, `_put_blocks`): 0 kind, 1-4 quants (address, then the
# three dimensions of its array: q [nb, bs, n_out]; ggml's packed q [G, nb, bytes per group block]), 5 d, 6-7 m
# (address, leading dimension), 8-10 activations (address, M, n_in), 11-12 per-block activation values (address,
# blocks), 13 has_m (q) or the second per-block array's address (ggml: sx), 14 output, 15 n_out; the pieces are
# ranges of the outputs
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
    job[15] = y.shape[1]
    return set_cuts(cuts, y.shape[1], align, n_pieces)


@njit(cache=True, nogil=True)
def post_dot(job, cuts, kind, qw, dw, mw, qx, dx, sx, y, n_pieces, align):
    """A ggml dot job (kind DOT_*): qw [G, nb, blk], dw/mw [G, nb, GROUP] in the packed layout (`ggml.pack_blocks`),
    qx [M, n_in] int8, dx/sx [M, nb], y [M, n_out]. Returns the number of pieces (ranges of outputs, `align` a
    multiple of GROUP)."""
    job[13] = address(sx)
    return _put_blocks(job, cuts, kind, qw, dw, mw, qx, dx, y, n_pieces, align)


@njit(cache=True, nogil=True)
def post_attend(job, cuts, q16, kt, vf, out, n_old, n_gqa, scale, one, n_pieces):
    """An ATTEND job: query row 0 of q16 [1, n_head, hd] against cells 0..n_old of kt [n_head_kv, hd, cap] and
    vf [n_head_kv, cap, hd] (`gkernels.attend_heads`, in ggml_vec_dot_f16's order when `one`, else tinyBLAS's),
    out [1, n_head, hd]; the pieces are ranges of heads."""
    job[0] = ATTEND
    job[1] = address(q16)
    job[2] = q16.shape[1]
    job[3] = q16.shape[2]
    job[4] = address(kt)
    job[5] = kt.shape[0]
    job[6] = kt.shape[2]
    job[7] = address(vf)
    job[8] = vf.shape[1]
    job[9] = address(out)
    job[10] = n_old
    job[11] = n_gqa
    job[12] = I64(np.float32(scale).view(np.int32))
    job[13] = 1 if one else 0
    return set_cuts(cuts, q16.shape[1], 1, n_pieces)


@njit(cache=True, nogil=True)
def _run_attend(job, cuts, i):
    n_head, hd, n_kv = job[2], job[3], job[5]
    q16 = f32_at(job[1], (1, n_head, hd))
    kt = f32_at(job[4], (n_kv, hd, job[6]))
    vf = f32_at(job[7], (n_kv, job[8], hd))
    out = f32_at(job[9], (1, n_head, hd))
    scale = np.int32(job[12]).view(np.float32)
    gkernels.attend_heads(q16, kt, vf, job[10], 0, 1, job[13] != 0, scale, job[11], out, cuts[2 * i],
                          cuts[2 * i + 1])


_BLOCK_ROWS = 8     # a chunk's consecutive tokens attended together (K / V read once for them), as ggml.attend


@njit(cache=True, nogil=True, inline="always")
def shadow_at(sq, il, n_head_kv, hd):
    """(kt [n_head_kv, hd, cap], vf [n_head_kv, cap, hd]): layer il of the float32 shadow of the sequence whose row
    of the `seqs` table is sq."""
    kt = f32_at(sq[S_KT] + il * sq[S_KT_STRIDE], (n_head_kv, hd, sq[S_SH_CAP]))
    vf = f32_at(sq[S_VF] + il * sq[S_VF_STRIDE], (n_head_kv, sq[S_SH_CAP], hd))
    return kt, vf


@njit(cache=True, nogil=True)
def update_shadow(sq, il, n_head_kv, hd):
    """Bring layer il of the float32 shadow of the sequence whose `seqs` row is sq up to date through its cell
    S_N_OLD (cells from min(valid[il], S_N_OLD) on, from the fp16 cells), and set valid[il] past it."""
    cap, n_old = sq[S_CAP], sq[S_N_OLD]
    k16 = u16_at(sq[S_K] + il * sq[S_KV_STRIDE], (n_head_kv, cap, hd))
    v16 = u16_at(sq[S_V] + il * sq[S_KV_STRIDE], (n_head_kv, cap, hd))
    kt, vf = shadow_at(sq, il, n_head_kv, hd)
    valid = i64_at(sq[S_VALID], (il + 1,))
    gkernels.kv_shadow(k16, v16, min(valid[il], n_old), n_old + 1, kt, vf)
    valid[il] = n_old + 1


@njit(cache=True, nogil=True, inline="always")
def shadow_with_attention(sq, by_tokens):
    """Whether the token of `seqs` row sq has its shadow updated by the thread that attends it (`attend_tokens`)
    rather than before the attention is posted: a one-token chunk, when the step's attention is split by tokens
    (the token is its sequence's only one in the step, so no two threads touch one shadow)."""
    return by_tokens and sq[S_ONE] != 0


@njit(cache=True, nogil=True)
def attend_tokens(q16, seqs, t0, t1, il, n_head_kv, n_gqa, scale, out, update):
    """The attention of tokens t0..t1-1: row t of q16 [T, n_head, hd] (fp16 values) over the cells 0..S_N_OLD of
    its sequence's layer il (row t of `seqs`), into out[t]. Consecutive tokens of one chunk of 2+ tokens go in
    blocks of up to _BLOCK_ROWS rows (`gkernels.attend_block` masks each row's later cells; a row's values do not
    depend on the block it is in, up to the sign of an all-zero output). `update` (the attention is split by
    tokens): the shadows `shadow_with_attention` names are brought up to date here first (`update_shadow`)."""
    hd = q16.shape[2]
    t = t0
    while t < t1:
        sq = seqs[t]
        b = t + 1
        if shadow_with_attention(sq, update):
            update_shadow(sq, il, n_head_kv, hd)
        if sq[S_ONE] == 0:
            while (b < t1 and b - t < _BLOCK_ROWS and seqs[b, S_KT] == sq[S_KT]
                   and seqs[b, S_N_OLD] == sq[S_N_OLD] + (b - t)):
                b += 1
        kt, vf = shadow_at(sq, il, n_head_kv, hd)
        gkernels.attend_block(q16[t:b], kt, vf, sq[S_N_OLD], 0, b - t, sq[S_ONE] != 0, scale, n_gqa, out[t:b])
        t = b


@njit(cache=True, nogil=True)
def post_attend_tokens(job, cuts, q16, seqs, il, out, n_head_kv, n_gqa, scale, n_pieces, update):
    """An ATTEND_TOKENS job: `attend_tokens` of every token (q16, out [T, n_head, hd], seqs [T, N_SEQ]; `update` as
    there); the pieces are ranges of tokens of near-equal cost (a token's cost is its cell count). Returns the
    number of pieces."""
    n_tok = q16.shape[0]
    job[0] = ATTEND_TOKENS
    job[1] = address(q16)
    job[2] = n_tok
    job[3] = q16.shape[1]
    job[4] = q16.shape[2]
    job[5] = address(seqs)
    job[6] = il
    job[7] = address(out)
    job[8] = n_head_kv
    job[9] = n_gqa
    job[10] = I64(np.float32(scale).view(np.int32))
    job[11] = 1 if update else 0
    total = 0
    for t in range(n_tok):
        total += seqs[t, S_N_OLD] + 1
    k = 0
    done = 0
    start = 0
    for t in range(n_tok):
        done += seqs[t, S_N_OLD] + 1
        if t == n_tok - 1 or (done * n_pieces >= total * (k + 1) and k < n_pieces - 1):
            cuts[2 * k] = start
            cuts[2 * k + 1] = t + 1
            k += 1
            start = t + 1
    return k


@njit(cache=True, nogil=True)
def _run_attend_tokens(job, cuts, i):
    n_tok, n_head, hd = job[2], job[3], job[4]
    q16 = f32_at(job[1], (n_tok, n_head, hd))
    seqs = i64_at(job[5], (n_tok, N_SEQ))
    out = f32_at(job[7], (n_tok, n_head, hd))
    scale = np.int32(job[10]).view(np.float32)
    attend_tokens(q16, seqs, cuts[2 * i], cuts[2 * i + 1], job[6], job[8], job[9], scale, out, job[11] != 0)


@njit(cache=True, nogil=True)
def run_ggml_piece(job, cuts, i):
    if job[0] == ATTEND:
        _run_attend(job, cuts, i)
        return
    if job[0] == ATTEND_TOKENS:
        _run_attend_tokens(job, cuts, i)
        return
    o0, o1 = cuts[2 * i], cuts[2 * i + 1]
    g, nb, blk, n_out, m, n_in, nbx = job[2], job[3], job[4], job[15], job[9], job[10], job[12]
    qw = u8_at(job[1], (g, nb, blk))
    dw = f32_at(job[5], (g, nb, gkernels.GROUP))
    mw = f32_at(job[6], (g, nb, gkernels.GROUP))
    qx = i8_at(job[8], (m, n_in))
    dx = f32_at(job[11], (m, nbx))
    sx = f32_at(job[13], (m, nbx))
    y = f32_at(job[14], (m, n_out))
    kind = job[0]
    if kind == DOT_NIB:
        gkernels.dot_nib(qw, dw, mw, qx, dx, sx, y, o0, o1)
    elif kind == DOT_BYTE:
        gkernels.dot_byte(qw, dw, mw, qx, dx, sx, y, o0, o1)
    else:
        gkernels.dot_q8_0(qw, dw, qx, dx, y, o0, o1)


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


def _ggml_piece(job_addr, cuts_addr, i):
    """`run_ggml_piece` of the job at job_addr (JOB_SIZE words) and cuts_addr (2 MAX_PIECES words): 0, or 1 if it
    raised."""
    try:
        run_ggml_piece(carray(_voidptr(job_addr), (JOB_SIZE,), np.int64),
                       carray(_voidptr(cuts_addr), (2 * MAX_PIECES,), np.int64), i)
    except Exception:                                   # noqa: BLE001 - reported to the caller (spin.ERROR)
        return 1
    return 0


def _q_piece(job_addr, cuts_addr, i):
    """`_ggml_piece` for the jobs of the q numerics (`run_q_piece`). (Two module-level functions, not one made by a
    factory: numba caches a cfunc only for a function defined at module level, not for a closure.)"""
    try:
        run_q_piece(carray(_voidptr(job_addr), (JOB_SIZE,), np.int64),
                    carray(_voidptr(cuts_addr), (2 * MAX_PIECES,), np.int64), i)
    except Exception:                                   # noqa: BLE001
        return 1
    return 0


_PIECES = {"ggml": _ggml_piece, "q": _q_piece}
_piece_c: dict[str, object] = {}


def piece_c(family: str = "ggml"):
    """The piece runner of a job family ("ggml": the DOT_* jobs, "q": the RANGE_* jobs) as a C function (numba
    `cfunc`, compiled on first use and cached): what `spin.serve`, `spin.work_join` and the compiled callers
    (`gdecode`) call by address, so that a family's kernels are compiled once, into this function alone (compiled
    into each loop that runs pieces instead, a pool's first start took ~65 s here per loop)."""
    if family not in _piece_c:
        _piece_c[family] = cfunc(types.int64(types.int64, types.int64, types.int64), cache=True,
                                 nopython=True)(_PIECES[family])
    return _piece_c[family]


def pool(n_workers: int, family: str = "ggml") -> SpinPool:
    """A `SpinPool` running the jobs of one family of this module ("ggml" dot or "q" range products)."""
    return SpinPool(n_workers, piece_c(family))


__all__ = ["ATTEND", "ATTEND_TOKENS", "DOT_BYTE", "DOT_NIB", "DOT_Q8_0", "N_SEQ", "RANGE_BYTE", "RANGE_HALF",
           "RANGE_NIB", "attend_tokens", "piece_c", "pool", "post_attend", "post_attend_tokens", "post_dot",
           "post_half", "post_range", "run_ggml_piece", "run_q_piece", "shadow_at"]
