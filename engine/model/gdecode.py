"""One compiled call per layer for the steps of numerics "ggml": decode steps and prompt chunks alike.

Why: a step runs ~25 small operations per layer, and more per sequence (norms, activation quantizers, four exact
products, RoPE, each sequence's fp16 KV write, shadow update and attention, residual adds). Through
`llama.forward_batch` each is a Python call into numpy or a numba kernel, ~5 ms of a ~27 ms single-sequence SmolLM2
step on one thread, all of it serial while the products are split over the threads. `decode_layer` runs a whole
layer in one nopython call: the same kernels (`gkernels`) in the same order on the same values, so every bit of the
KV cells and logits is the layer loop's (`tests/engine/test_gdecode.py` compares them with `np.array_equal`). The
products still go to the model's polling workers (`spin.SpinPool`): the compiled caller publishes each job itself
(`spin.publish_quiet`, then its part and the join, `spin.run_compiled`).

The products and the per-row operations take all T tokens of the step at once; attention goes token by token, in
order: a chunk's token i writes its K / V cell and then attends the cells before it and its own, which is the row
i of its chunk's causal attention. A one-token chunk is attended in ggml_vec_dot_f16's order, the tokens of longer
chunks in tinyBLAS's, as the layer loop's `attend_block` does for a block of 1 or of 2+ rows (`gkernels`:
`attend_heads` gives row i the same values whether its block holds it alone or with later rows, up to the sign of
an all-zero output, which the output projection's quantizer erases).

`ggml.compiled_layers` decides when it applies (else the layer loop runs): the matmul is the compiled `GgmlMatmul`
with 1 thread or its polling workers; every layer matrix is one exact part (Q4_1 / Q5_1 x Q8_1, Q8_0 x Q8_0); the KV
store is fp16; head_dim is a multiple of 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from engine.model import gkernels as gk
from engine.model import spin, spinjobs
from engine.model.spin import ERROR
# the words of a token's row of `seqs` (`spinjobs` defines them: its ATTEND_TOKENS pieces read the table)
from engine.model.spinjobs import N_SEQ, S_CAP, S_K, S_KV_STRIDE, S_N_OLD, S_ONE, S_V

F32 = np.float32
_NIB, _BYTE, _Q8_0 = spinjobs.DOT_NIB, spinjobs.DOT_BYTE, spinjobs.DOT_Q8_0

# int64 words of `decode_layer`'s `ints`
N_HEAD, N_HEAD_KV, HEAD_DIM, N_ROT, NEOX, N_WORKERS, N_PIECES, SPLIT_MIN, HAS_BIAS, ATTEND_MIN = range(10)
N_INTS = 10
# a step's attention goes to the workers from this many cells x n_head x head_dim on (summed over its tokens: split
# by tokens; one token: by heads; below, the hand-off costs more than it saves)
ATTEND_SPLIT_MIN = 1 << 16



@njit(cache=True, nogil=True)
def _keep(a, b, c):
    """Nothing; a call that keeps its arguments alive up to here (see `_product`)."""
    return a.size + b.size + c.size


@njit(cache=True, nogil=True)
def _product(kind, q, d, m, x, y, ctl, job, cuts, ints, piece):
    """y [M, n_out] = x [M, n_in] @ W.T as `GgmlMatmul._dot_compiled` computes it: x quantized to Q8_1 / Q8_0
    (`quantize_q8`), then the exact kernel of `kind` over the outputs, split on the pool's workers when there are
    workers and the product is at least SPLIT_MIN multiply-adds. q, d, m: the part in the packed layout
    (`ggml.pack_blocks`; m: d again for Q8_0). The kernel runs as a job piece through `piece` (`spinjobs.piece_c`,
    a C function called by address), with or without workers: this function's code then holds none of the kernels
    (compiled with them inlined, it took 60-120 s on a fresh cache)."""
    rows, n_in = x.shape
    n_out = y.shape[1]
    qx = np.empty((rows, n_in), np.int8)
    dx = np.empty((rows, n_in // 32), F32)
    sx = np.empty((rows, n_in // 32), F32)
    gk.quantize_q8(x, qx, dx, sx)
    if ints[N_WORKERS] > 0 and rows * n_in * n_out >= ints[SPLIT_MIN]:
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
                 bias, cos, sin, seqs, il, ints, ctl, job, cuts, piece):
    """Layer il of `llama.forward_batch` for T tokens (chunks of distinct sequences, each chunk's tokens in order),
    x [T, D] updated in place (the residual stream).

    kinds [4]: the product kinds of qkv, o, gate_up, down. cos / sin [T, n_rot/2]: each token's rotation.
    seqs [T, N_SEQ]: where each token's sequence keeps its cells (`_seq_table`): its fp16 K / V cells of layer il
    (uint16 [n_head_kv, cap, head_dim]; the token's K and V are written at cell S_N_OLD), their float32 shadow
    (kt [n_head_kv, head_dim, cap'], vf [n_head_kv, cap', head_dim]) and the shadow's valid counts (int64 [n_layer]):
    cells from min(valid[il], S_N_OLD) on are brought up to date, valid[il] set past the token's; S_ONE picks the
    attention's order."""
    n_head, n_head_kv, hd = ints[N_HEAD], ints[N_HEAD_KV], ints[HEAD_DIM]
    n_tok, dim = x.shape
    n_q = n_head * hd
    n_kv = n_head_kv * hd
    xn = np.empty((n_tok, dim), F32)
    gk.rms_norm(x, attn_norm, eps, xn)                                   # attention norm
    qkv = np.empty((n_tok, n_q + 2 * n_kv), F32)
    _product(kinds[0], q_qkv, d_qkv, m_qkv, xn, qkv, ctl, job, cuts, ints, piece)
    if ints[HAS_BIAS]:
        for t in range(n_tok):
            for i in range(qkv.shape[1]):
                qkv[t, i] = qkv[t, i] + bias[i]
    half = ints[N_ROT] // 2                                              # RoPE of Q and K (GgmlRope.apply)
    for t in range(n_tok):
        for h in range(n_head + n_head_kv):
            base = h * hd
            for i in range(half):
                i0 = base + i if ints[NEOX] else base + 2 * i
                i1 = i0 + half if ints[NEOX] else i0 + 1
                x0 = qkv[t, i0]
                x1 = qkv[t, i1]
                c = cos[t, i]
                s = sin[t, i]
                qkv[t, i0] = gk._fma(x0, c, -(x1 * s))
                qkv[t, i1] = gk._fma(x0, s, x1 * c)
    att = np.empty((n_tok, n_head, hd), F32)
    q16 = np.empty((n_tok, n_head, hd), F32)
    cost = 0
    for t in range(n_tok):
        cost += seqs[t, S_N_OLD] + 1
    # every token's attention, once every cell is written (a token reads only the cells up to its own), split over
    # the workers by tokens when there are several, else by heads (one token with many cells); split by tokens, a
    # one-token chunk's shadow update goes with its attention (`spinjobs.attend_tokens`), on the worker that
    # attends it, instead of here in the serial part (its capacity-strided K writes: ~5% of a 16-sequence step)
    split = ints[N_WORKERS] > 0 and cost * n_q >= ints[ATTEND_MIN]
    by_tokens = split and n_tok > 1
    for t in range(n_tok):                                               # each token's cells, its Q in fp16
        sq = seqs[t]
        cap, n_old = sq[S_CAP], sq[S_N_OLD]
        k16 = spin.u16_at(sq[S_K] + il * sq[S_KV_STRIDE], (n_head_kv, cap, hd))
        v16 = spin.u16_at(sq[S_V] + il * sq[S_KV_STRIDE], (n_head_kv, cap, hd))
        for h in range(n_head_kv):                                       # KV write: fp16 cells at n_old
            for j in range(hd):
                k16[h, n_old, j] = gk.f16_bits(qkv[t, n_q + h * hd + j])
                v16[h, n_old, j] = gk.f16_bits(qkv[t, n_q + n_kv + h * hd + j])
        if not spinjobs.shadow_with_attention(sq, by_tokens):
            spinjobs.update_shadow(sq, il, n_head_kv, hd)
        for h in range(n_head):                                          # Q to fp16 (K's vec_dot_type)
            for j in range(hd):
                q16[t, h, j] = gk.f16_round(qkv[t, h * hd + j])
    n_gqa = n_head // n_head_kv
    if split:
        if by_tokens:
            n = spinjobs.post_attend_tokens(job, cuts, q16, seqs, il, att, n_head_kv, n_gqa, scale, ints[N_PIECES],
                                            True)
        else:                                                            # one token: its heads split
            sq = seqs[0]
            kt, vf = spinjobs.shadow_at(sq, il, n_head_kv, hd)
            n = spinjobs.post_attend(job, cuts, q16, kt, vf, att, sq[S_N_OLD], n_gqa, scale, sq[S_ONE] != 0,
                                     ints[N_PIECES])
        spin.publish_quiet(ctl, n)
        spin.run_compiled(ctl, job, cuts, n, piece)
        _keep(q16, att, seqs)
    else:
        spinjobs.attend_tokens(q16, seqs, 0, n_tok, il, n_head_kv, n_gqa, scale, att, False)
    y = np.empty((n_tok, dim), F32)
    _product(kinds[1], q_o, d_o, m_o, att.reshape(n_tok, n_q), y, ctl, job, cuts, ints, piece)
    for t in range(n_tok):                                               # output projection, residual
        for i in range(dim):
            x[t, i] = x[t, i] + y[t, i]
    gk.rms_norm(x, ffn_norm, eps, xn)                                    # FFN norm
    n_ff = q_dn.shape[1] * 32                                            # down's inputs: nb blocks of 32
    gu = np.empty((n_tok, 2 * n_ff), F32)
    _product(kinds[2], q_gu, d_gu, m_gu, xn, gu, ctl, job, cuts, ints, piece)
    hid = np.empty((n_tok, n_ff), F32)
    gk.silu_mul_gu(gu, n_ff, hid)                                        # SwiGLU
    _product(kinds[3], q_dn, d_dn, m_dn, hid, y, ctl, job, cuts, ints, piece)
    for t in range(n_tok):                                               # down projection, residual
        for i in range(dim):
            x[t, i] = x[t, i] + y[t, i]


@dataclass
class Layer:
    """`decode_layer`'s arguments of one layer: attn_norm, ffn_norm, kinds [4], the four products' packed (q, d,
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


def _seq_table(kv, seqs, sizes) -> np.ndarray:
    """`decode_layer`'s seqs table of the chunks of `seqs` (`SeqKV`s after `KVStore.prepare_append`) of `sizes`
    tokens, a row per token (token i of a chunk at cell s.n + i): shadows grown to hold the chunks. The arrays stay
    alive with the sequences meanwhile."""
    tab = np.zeros((sum(sizes), N_SEQ), np.int64)
    t = 0
    for s, size in zip(seqs, sizes):
        if size == 0:
            continue
        n_old = int(s.n)
        sh = kv.shadow(s, n_old + size)
        k, v = s.k.view(np.uint16), s.v.view(np.uint16)
        if k.strides != v.strides or k.strides[1:] != (k.shape[2] * k.shape[3] * 2, k.shape[3] * 2, 2):
            raise ValueError("KV cells of a layer are not contiguous")
        tab[t:t + size] = (k.ctypes.data, v.ctypes.data, k.strides[0], k.shape[2], sh.kt.ctypes.data,
                           sh.v.ctypes.data, sh.kt.strides[0], sh.v.strides[0], sh.v.shape[2], sh.valid.ctypes.data,
                           0, int(size == 1))
        tab[t:t + size, S_N_OLD] = np.arange(n_old, n_old + size)
        t += size
    return tab


def decode_layers(layers: list[Layer], hp, rope, kv, seqs, sizes, x: np.ndarray, pos: np.ndarray,
                  pool: spin.SpinPool | None, n_pieces: int, split_min: int, scale: np.float32) -> None:
    """Run every layer of the chunks of distinct sequences `seqs` (`SeqKV`s after `KVStore.prepare_append`) of
    `sizes` tokens, at positions pos [T] on x [T, D] in place, by `decode_layer`; products of at least `split_min`
    multiply-adds in `n_pieces` pieces on `pool`'s workers when the pool is free (else unsplit)."""
    tab = _seq_table(kv, seqs, sizes)
    cos, sin = rope.cos_sin(np.asarray(pos, dtype=np.int64))
    cos, sin = np.ascontiguousarray(cos, dtype=F32), np.ascontiguousarray(sin, dtype=F32)
    ints = np.zeros(N_INTS, np.int64)
    ints[N_HEAD], ints[N_HEAD_KV], ints[HEAD_DIM] = hp.n_head, hp.n_head_kv, hp.head_dim
    ints[N_ROT], ints[NEOX] = hp.n_rot, int(rope.mode != "norm")
    ints[N_PIECES], ints[SPLIT_MIN], ints[ATTEND_MIN] = n_pieces, split_min, ATTEND_SPLIT_MIN
    eps = F32(hp.f_norm_rms_eps)
    piece = spinjobs.piece_c("ggml")
    held = pool is not None and pool.lock.acquire(blocking=False)
    try:
        if held:
            pool.ctl[ERROR] = 0
            pool.ctl[spin.HOLD] = 1                          # no worker falls asleep during the step
            pool.wake()
            ints[N_WORKERS] = pool.n_workers
            ctl, job, cuts = pool.ctl, pool.job, pool.cuts
        else:                               # one thread, or another caller holds the pool: unsplit products
            ctl = np.zeros(spin.CTL_SIZE, np.int64)         # this call's own job words
            job = np.zeros(spin.JOB_SIZE, np.int64)
            cuts = np.zeros(2 * spin.MAX_PIECES, np.int64)
        for il, lay in enumerate(layers):
            ints[HAS_BIAS] = int(lay.has_bias)
            an, fn, kinds, *prods, bias = lay.args
            decode_layer(x, an, fn, eps, scale, kinds, *prods, bias, cos, sin, tab, il, ints, ctl, job, cuts, piece)
        if ctl[ERROR]:
            raise RuntimeError("a compiled kernel raised in a SpinPool worker or in the caller")
    finally:
        if held:
            pool.ctl[spin.HOLD] = 0
            pool.lock.release()

