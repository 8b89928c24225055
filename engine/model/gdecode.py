"""One compiled call per layer for the single-sequence, one-token decode step of numerics "ggml".

Why: a decode step of one sequence runs ~25 small operations per layer (norms, activation quantizers, four exact
products, RoPE, the KV write, the shadow update, attention, residual adds). Through `llama.forward_batch` each is
a Python call into numpy or a numba kernel, ~5 ms of a ~27 ms SmolLM2 step on one thread, all of it serial while
the products are split over the threads. `decode_layer` runs a whole layer in one nopython call: the same kernels
(`gkernels`) in the same order on the same values, so every bit of the KV cells and logits is the general path's
(`tests/engine/test_gdecode.py` compares them with `np.array_equal`). The products still go to the model's
polling workers (`spin.SpinPool`): the compiled caller publishes each job itself (`spin.publish_quiet`, then its
part and the join, `spin.run_compiled`).

`ggml.decode_one` decides when it applies (else the layer loop runs): the chunk is one token of one sequence; the
matmul is the compiled `GgmlMatmul` with 1 thread or its polling workers; every layer matrix is one exact part
(Q4_1 / Q5_1 x Q8_1, Q8_0 x Q8_0); the KV store is fp16; head_dim is a multiple of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from engine.model import gkernels as gk
from engine.model import spin, spinjobs
from engine.model.spin import ERROR

F32 = np.float32
_NIB, _BYTE, _Q8_0 = spinjobs.DOT_NIB, spinjobs.DOT_BYTE, spinjobs.DOT_Q8_0

# int64 words of `decode_layer`'s `ints`
N_HEAD, N_HEAD_KV, HEAD_DIM, N_ROT, NEOX, N_OLD, LO, N_WORKERS, N_PIECES, SPLIT_MIN, HAS_BIAS = range(11)
N_INTS = 11


@njit(cache=True, nogil=True)
def _keep(a, b, c):
    """Nothing; a call that keeps its arguments alive up to here (see `_product`)."""
    return a.size + b.size + c.size


@njit(cache=True, nogil=True)
def _product(kind, q, d, m, x, y, ctl, job, cuts, ints, piece):
    """y [1, n_out] = x [1, n_in] @ W.T as `GgmlMatmul._dot_compiled` computes it: x quantized to Q8_1 / Q8_0
    (`quantize_q8`), then the exact kernel of `kind` over the outputs, split on the pool's workers when there are
    workers and the product is at least SPLIT_MIN multiply-adds. q: the part's quants as uint8, d / m [nb, n_out]
    (m: d again for Q8_0). The kernel runs as a job piece through `piece` (`spinjobs.piece_c`, a C function called
    by address), with or without workers: this function's code then holds none of the kernels (compiled with them
    inlined, it took 60-120 s on a fresh cache)."""
    n_in = x.shape[1]
    n_out = y.shape[1]
    qx = np.empty((1, n_in), F32)
    dx = np.empty((1, n_in // 32), F32)
    sx = np.empty((1, n_in // 32), F32)
    gk.quantize_q8(x, qx, dx, sx)
    if ints[N_WORKERS] > 0 and n_in * n_out >= ints[SPLIT_MIN]:
        n = spinjobs.post_dot(job, cuts, kind, q, d, m, qx, dx, sx, y, ints[N_PIECES], 64)
        spin.publish_quiet(ctl, n)
        spin.run_compiled(ctl, job, cuts, n, piece)
    else:
        n = spinjobs.post_dot(job, cuts, kind, q, d, m, qx, dx, sx, y, 1, 64)
        if piece(spin.address(job), spin.address(cuts), 0) != 0:
            ctl[ERROR] = 1
    # numba frees an array after its last use in the function's code: the kernel reads qx, dx and sx by address, so
    # they must be used after it ran (else the allocator could reuse their memory meanwhile)
    _keep(qx, dx, sx)


@njit(cache=True, nogil=True)
def decode_layer(x, attn_norm, ffn_norm, eps, scale, kinds,
                 q_qkv, d_qkv, m_qkv, q_o, d_o, m_o, q_gu, d_gu, m_gu, q_dn, d_dn, m_dn,
                 bias, cos, sin, k16, v16, kt, vf, ints, ctl, job, cuts, piece):
    """One layer of `llama.forward_batch` for one token, x [1, D] updated in place (the residual stream).

    kinds [4]: the product kinds of qkv, o, gate_up, down. cos / sin [n_rot/2]: the token's rotation. k16 / v16
    [n_head_kv, cap, head_dim] uint16: the sequence's fp16 cells of this layer (the token's K and V are written at
    N_OLD); kt [n_head_kv, head_dim, >cap'] / vf [n_head_kv, cap', head_dim]: their float32 shadow, cells
    LO..N_OLD brought up to date (`KVStore.shadow`)."""
    n_head, n_head_kv, hd = ints[N_HEAD], ints[N_HEAD_KV], ints[HEAD_DIM]
    n_old = ints[N_OLD]
    dim = x.shape[1]
    n_q = n_head * hd
    n_kv = n_head_kv * hd
    xn = np.empty((1, dim), F32)
    gk.rms_norm(x, attn_norm, eps, xn)                                   # attention norm
    qkv = np.empty((1, n_q + 2 * n_kv), F32)
    _product(kinds[0], q_qkv, d_qkv, m_qkv, xn, qkv, ctl, job, cuts, ints, piece)
    if ints[HAS_BIAS]:
        for i in range(qkv.shape[1]):
            qkv[0, i] = qkv[0, i] + bias[i]
    half = ints[N_ROT] // 2                                              # RoPE of Q and K (GgmlRope.apply)
    for h in range(n_head + n_head_kv):
        base = h * hd
        for i in range(half):
            i0 = base + i if ints[NEOX] else base + 2 * i
            i1 = i0 + half if ints[NEOX] else i0 + 1
            x0 = qkv[0, i0]
            x1 = qkv[0, i1]
            c = cos[i]
            s = sin[i]
            qkv[0, i0] = gk._fma(x0, c, -(x1 * s))
            qkv[0, i1] = gk._fma(x0, s, x1 * c)
    for h in range(n_head_kv):                                           # KV write: fp16 cells at n_old
        for j in range(hd):
            k16[h, n_old, j] = gk.f16_bits(qkv[0, n_q + h * hd + j])
            v16[h, n_old, j] = gk.f16_bits(qkv[0, n_q + n_kv + h * hd + j])
    gk.kv_shadow(k16, v16, ints[LO], n_old + 1, kt, vf)
    q16 = np.empty((1, n_head, hd), F32)                                 # Q to fp16 (K's vec_dot_type)
    for h in range(n_head):
        for j in range(hd):
            q16[0, h, j] = gk.f16_round(qkv[0, h * hd + j])
    att = np.empty((1, n_head, hd), F32)
    gk.attend_block(q16, kt, vf, n_old, 0, 1, True, scale, n_head // n_head_kv, att)
    y = np.empty((1, dim), F32)
    _product(kinds[1], q_o, d_o, m_o, att.reshape(1, n_q), y, ctl, job, cuts, ints, piece)
    for i in range(dim):                                                 # output projection, residual
        x[0, i] = x[0, i] + y[0, i]
    gk.rms_norm(x, ffn_norm, eps, xn)                                    # FFN norm
    n_ff = q_gu.shape[2] // 2
    gu = np.empty((1, 2 * n_ff), F32)
    _product(kinds[2], q_gu, d_gu, m_gu, xn, gu, ctl, job, cuts, ints, piece)
    g = np.ascontiguousarray(gu[:, :n_ff])
    u = np.ascontiguousarray(gu[:, n_ff:])
    hid = np.empty((1, n_ff), F32)
    gk.silu_mul(g, u, hid)                                               # SwiGLU
    _product(kinds[3], q_dn, d_dn, m_dn, hid, y, ctl, job, cuts, ints, piece)
    for i in range(dim):                                                 # down projection, residual
        x[0, i] = x[0, i] + y[0, i]


@dataclass
class Layer:
    """`decode_layer`'s arguments of one layer: attn_norm, ffn_norm, kinds [4], the four products' (q as uint8, d,
    m or d), the QKV bias (empty when none)."""
    args: tuple
    has_bias: bool


def layer(attn_norm: np.ndarray, ffn_norm: np.ndarray, products: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]],
          bias: np.ndarray | None) -> Layer:
    """A `Layer` from the norms, the (kind, q, d, m) of qkv, o, gate_up and down, and the QKV bias or None."""
    kinds = np.array([p[0] for p in products], np.int64)
    flat = tuple(a for p in products for a in p[1:])
    b = np.zeros(0, F32) if bias is None else np.ascontiguousarray(bias, dtype=F32).reshape(-1)
    return Layer(args=(np.ascontiguousarray(attn_norm, dtype=F32), np.ascontiguousarray(ffn_norm, dtype=F32),
                       kinds, *flat, b), has_bias=bias is not None)


def decode_layers(layers: list[Layer], hp, rope, kv, s, x: np.ndarray, pos: int, pool: spin.SpinPool | None,
                  n_pieces: int, split_min: int, scale: np.float32) -> None:
    """Run every layer of a one-token chunk of sequence `s` (a `SeqKV` after `KVStore.prepare_append`, its token
    at cell s.n) on x [1, D] in place, by `decode_layer`; products of at least `split_min` multiply-adds in
    `n_pieces` pieces on `pool`'s workers when the pool is free (else unsplit)."""
    n_old = int(s.n)
    sh = kv.shadow(s, n_old + 1)
    cos, sin = rope.cos_sin(np.array([pos]))
    cos, sin = np.ascontiguousarray(cos[0]), np.ascontiguousarray(sin[0])
    ints = np.zeros(N_INTS, np.int64)
    ints[N_HEAD], ints[N_HEAD_KV], ints[HEAD_DIM] = hp.n_head, hp.n_head_kv, hp.head_dim
    ints[N_ROT], ints[NEOX], ints[N_OLD] = hp.n_rot, int(rope.mode != "norm"), n_old
    ints[N_PIECES], ints[SPLIT_MIN] = n_pieces, split_min
    eps = F32(hp.f_norm_rms_eps)
    piece = spinjobs.piece_c("ggml")
    held = pool is not None and pool.lock.acquire(blocking=False)
    try:
        if held:
            pool.ctl[ERROR] = 0
            pool.wake()
            ints[N_WORKERS] = pool.n_workers
            ctl, job, cuts = pool.ctl, pool.job, pool.cuts
        else:                               # one thread, or another caller holds the pool: unsplit products
            ctl = np.zeros(spin.CTL_SIZE, np.int64)         # this call's own job words
            job = np.zeros(spin.JOB_SIZE, np.int64)
            cuts = np.zeros(2 * spin.MAX_PIECES, np.int64)
        k16, v16 = s.k.view(np.uint16), s.v.view(np.uint16)
        for il, lay in enumerate(layers):
            ints[LO] = min(int(sh.valid[il]), n_old)
            ints[HAS_BIAS] = int(lay.has_bias)
            an, fn, kinds, *prods, bias = lay.args
            decode_layer(x, an, fn, eps, scale, kinds, *prods, bias, cos, sin, k16[il], v16[il],
                         sh.kt[il], sh.v[il], ints, ctl, job, cuts, piece)
            sh.valid[il] = n_old + 1
        if ctl[ERROR]:
            raise RuntimeError("a compiled kernel raised in a SpinPool worker or in the caller")
    finally:
        if held:
            pool.lock.release()

