"""The "f32" numerics' kernels: float32 numpy/BLAS arithmetic (RoPE tables, rms_norm, SwiGLU, softmax attention).

Weights are dequantized to float32 once at load and the attention scale 1/sqrt(head_dim) is folded into
the Q rows (`numerics.F32Numerics`), so attention takes pre-scaled queries. `Rope` is also the base of
ggml numerics' `GgmlRope` (same tables and pairing, ggml's angles and rotation arithmetic).
"""

from __future__ import annotations

import numpy as np

from engine.model.kv import KVStore
from engine.model.matmul import Matmul
from engine.model.types import HParams

_ATTN_SCORE_BUDGET = 1 << 22      # max floats of one attention score block: bounds memory on long chunks
_ATTN_QUERY_BLOCK = 128           # query rows per block: later blocks skip keys past their last query
_ROPE_TABLE_MIN = 4096
_DECODE_SPLIT_MIN = 8             # batched decode attention is split over the threads from this many sequences on


class Rope:
    """Rotary embedding with precomputed cos/sin tables (GGML rope modes NORM and NEOX).

    Pair i of a head (i < n_rot/2) is rotated by angle p * freq_scale * base^(-2i/n_rot) [/ freq_factor_i];
    NORM pairs dims (2i, 2i+1), NEOX pairs (i, i + n_rot/2); dims >= n_rot pass through.
    """

    def __init__(self, hp: HParams, freq_factors: np.ndarray | None = None):
        self.n_rot, self.mode = hp.n_rot, hp.rope_type
        # NORM pairs (2i, 2i+1) rotate as complex64 numbers (`rotate`); subclasses with their own arithmetic
        # (ggml mode) keep the real-valued `apply`
        self.complex_pairs = self.mode == "norm" and type(self).apply is Rope.apply
        half = hp.n_rot // 2
        inv_freq = hp.rope_freq_base ** (-np.arange(half, dtype=np.float64) * 2.0 / hp.n_rot)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.astype(np.float64)
        self.inv_freq = inv_freq * hp.rope_freq_scale                # [n_rot/2] radians per position
        self._cos = np.empty((0, half), np.float32)
        self._sin = np.empty((0, half), np.float32)
        self._grow(max(hp.n_ctx_train, _ROPE_TABLE_MIN))

    def _grow(self, n_pos: int) -> None:
        angles = np.outer(np.arange(n_pos, dtype=np.float64), self.inv_freq)   # [n_pos, n_rot/2]
        self._cos = np.cos(angles).astype(np.float32)
        self._sin = np.sin(angles).astype(np.float32)

    def cos_sin(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin of each position's angles: ([T, n_rot/2], [T, n_rot/2]) float32."""
        top = int(pos.max()) + 1 if pos.size else 0
        if top > self._cos.shape[0]:
            self._grow(max(top, 2 * self._cos.shape[0]))
        return self._cos[pos], self._sin[pos]

    def pairs(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Views of the two members of each rotated pair of x [..., head_dim]: NORM (2i, 2i+1), NEOX
        (i, i + n_rot/2); each [..., n_rot/2]."""
        if self.mode == "norm":
            return x[..., 0:self.n_rot:2], x[..., 1:self.n_rot:2]
        half = self.n_rot // 2
        return x[..., :half], x[..., half:self.n_rot]

    def rotation(self, pos: np.ndarray) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """The rotation of tokens at `pos` [T] for `rotate` on [T, n_heads, head_dim]: NORM pairs are adjacent
        floats, so a complex64 [T, 1, n_rot/2] (one in-place complex product per call instead of eight
        element-wise operations); otherwise (cos, sin) [T, 1, n_rot/2] each."""
        cos, sin = self.cos_sin(pos)
        cos, sin = cos[:, None, :], sin[:, None, :]
        if not self.complex_pairs:
            return cos, sin
        rot = np.empty(cos.shape, np.complex64)
        rot.real, rot.imag = cos, sin
        return rot

    def rotate(self, x: np.ndarray, rot: np.ndarray | tuple[np.ndarray, np.ndarray]) -> None:
        """Rotate x [T, n_heads, head_dim] (last axis contiguous) in place by `rotation(pos)`."""
        if isinstance(rot, tuple):
            self.apply(x, *rot)
            return
        xc = x[..., :self.n_rot].view(np.complex64)                  # [T, n_heads, n_rot/2]: x0 + i*x1
        xc *= rot                                                    # (x0 cos - x1 sin) + i (x0 sin + x1 cos)

    def apply(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
        """Rotate x [..., head_dim] in place; cos/sin broadcast against x[..., :n_rot/2]."""
        x0, x1 = self.pairs(x)
        r0 = x0 * cos - x1 * sin
        r1 = x0 * sin + x1 * cos
        x0[...] = r0
        x1[...] = r1

    def shift_cos_sin(self, delta: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [n_rot/2] float32 of the angles of a position delta."""
        angles = delta * self.inv_freq                               # [n_rot/2]
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def rerotate(self, k: np.ndarray, delta: int) -> None:
        """Keys rotated at p become keys rotated at p + delta: one extra rotation by delta, in place. `k` [...,
        head_dim] holds float32 or float16 cells; float16 ones are rotated in float32 and rounded back, as
        llama.cpp ropes an F16 K (`llama_kv_cache::build_rope_shift`, src/llama-kv-cache.cpp). A 4-d `k` (the KV
        store's [n_layer, n_head_kv, n, head_dim]) goes one layer at a time: the rotation is elementwise, so
        the result is the same as in one go, and the temporaries (float32 copies, ggml's float64 fma) are one
        layer's, not every layer's (24 MB of memory new to the step at 1024 cells of SmolLM2; docs/engine.md,
        "Context shift")."""
        cos, sin = self.shift_cos_sin(delta)
        for part in (k if k.ndim == 4 else (k,)):
            self.rotate_cells(part, cos, sin)

    def rotate_cells(self, k: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
        """`apply` to float32 or float16 cells `k` [..., head_dim] in place, all at once (float16 ones through a
        float32 copy, rounded back)."""
        if k.dtype == np.float32:
            self.apply(k, cos, sin)
            return
        k32 = k.astype(np.float32)
        self.apply(k32, cos, sin)
        k[...] = k32


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x [T, D] / sqrt(mean(x^2) + eps) * w [D]."""
    r = np.einsum("td,td->t", x, x)                                 # [T] sum of squares
    r /= np.float32(x.shape[1])                                     # in place on [T]: ~30% faster than
    r += np.float32(eps)                                            # temporaries (measured, 16 x 576)
    np.sqrt(r, out=r)
    np.reciprocal(r, out=r)
    out = x * r[:, None]                                            # [T, D]
    out *= w
    return out


def silu_mul(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = silu(g) * u = g / (1 + e^-g) * u, element-wise (out may not alias g or u)."""
    np.negative(g, out=out)
    np.exp(out, out=out)
    out += 1.0
    np.divide(g, out, out=out)
    out *= u
    return out


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_old: int, mm: Matmul | None = None) -> np.ndarray:
    """Causal attention of one chunk's queries against its sequence's cells.

    q [m, n_head, head_dim] (pre-scaled), k/v [n_head_kv, >= n_old + m, head_dim] the sequence's cells as
    stored (float16 cells are converted to float32 first), with the chunk's cells at n_old .. n_old+m-1 (all
    earlier cells have smaller positions, so they are all visible).
    Query blocks of a long chunk run on `mm`'s threads. Returns [m, n_head * head_dim].
    """
    m, n_head, head_dim = q.shape
    if k.dtype != np.float32:
        k, v = k[:, :n_old + m].astype(np.float32), v[:, :n_old + m].astype(np.float32)
    n_head_kv = k.shape[0]
    n_gqa = n_head // n_head_kv                          # query head h reads kv head h // n_gqa
    qg = q.reshape(m, n_head_kv, n_gqa, head_dim).transpose(1, 2, 0, 3)   # [n_head_kv, n_gqa, m, head_dim]
    if m == 1:
        s = qg.reshape(n_head_kv, n_gqa, head_dim) @ k[:, :n_old + 1].transpose(0, 2, 1)  # [n_head_kv, n_gqa, L]
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        o = s @ v[:, :n_old + 1]                                          # [n_head_kv, n_gqa, head_dim]
        return o.reshape(1, n_head * head_dim)
    out = np.empty((n_head_kv, n_gqa, m, head_dim), np.float32)          # [n_head_kv, n_gqa, m, head_dim]
    block = max(1, min(m, _ATTN_QUERY_BLOCK, _ATTN_SCORE_BUDGET // (n_head * (n_old + m))))
    causal = np.triu(np.full((m, m), -np.inf, np.float32), k=1)         # [m, m] key j > query i masked

    def query_block(a: int) -> None:
        b = min(m, a + block)
        n_keys = n_old + b
        qb = qg[:, :, a:b].reshape(n_head_kv, n_gqa * (b - a), head_dim)  # [n_head_kv, n_gqa*(b-a), head_dim]
        s = qb @ k[:, :n_keys].transpose(0, 2, 1)                        # [n_head_kv, n_gqa*(b-a), n_keys]
        s4 = s.reshape(n_head_kv, n_gqa, b - a, n_keys)                  # [n_head_kv, n_gqa, b-a, n_keys]
        s4[..., n_old:] += causal[a:b, :b]
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        out[:, :, a:b] = (s @ v[:, :n_keys]).reshape(n_head_kv, n_gqa, b - a, head_dim)

    starts = list(range(0, m, block))
    if mm is None or len(starts) == 1:
        for a in starts:
            query_block(a)
    else:
        mm.parallel([lambda a=a: query_block(a) for a in reversed(starts)])   # costliest (most keys) first
    return out.transpose(2, 0, 1, 3).reshape(m, n_head * head_dim)      # [m, n_head * head_dim]


class DecodeBatch:
    """Attention of S one-token chunks of pooled sequences in a few batched matmuls per layer.

    The sequences' cells live in `kv.pool_k[layer]` [n_seq, n_head_kv, cap, head_dim]; the batch reads the
    range of sequences lo..hi-1 that covers them (a view when they are contiguous) up to the longest one's
    cells, and masks each sequence's unused cells. Equivalent to `attend` per chunk with m == 1.
    """

    def __init__(self, seq_ids: list[int], rows: list[int], n_olds: list[int], n_head: int, n_head_kv: int):
        self.seq = np.asarray(seq_ids, np.intp)                 # [S] sequence ids
        self.rows = np.asarray(rows, np.intp)                   # [S] token rows in the batch
        self.n_old = np.asarray(n_olds, np.intp)                # [S] cells before this token = its cell index
        self.lo, hi = int(self.seq.min()), int(self.seq.max()) + 1
        self.n_range = hi - self.lo
        self.sel = self.seq - self.lo                           # [S] index into the range
        self.dense = self.n_range == len(seq_ids) and bool(np.all(self.sel == np.arange(len(seq_ids))))
        self.n_keys = int(self.n_old.max()) + 1
        self.n_head, self.n_head_kv = n_head, n_head_kv
        r0 = int(self.rows[0])                                  # rows r0..r0+S-1 (a decode-only batch): slices
        self.take = (slice(r0, r0 + len(rows)) if np.array_equal(self.rows, np.arange(r0, r0 + len(rows)))
                     else self.rows)
        visible = np.zeros(self.n_range, np.intp)              # [R] cells visible to each sequence of the range
        visible[self.sel] = self.n_old + 1
        visible[visible == 0] = 1                               # range members not in the batch: any finite row
        mask = np.where(np.arange(self.n_keys)[None, :] < visible[:, None], np.float32(0), np.float32(-np.inf))
        self.mask = mask[:, None, None, :]                      # [R, 1, 1, n_keys] float32

    def write(self, kv: KVStore, il: int, k: np.ndarray, v: np.ndarray) -> None:
        """The S tokens' K/V rows of the batch (k, v [T, n_head_kv, head_dim]) into their cells of layer il."""
        kv.pool_k[il][self.seq, :, self.n_old] = k[self.take]    # [S, n_head_kv, head_dim]
        kv.pool_v[il][self.seq, :, self.n_old] = v[self.take]

    def attend(self, kv: KVStore, il: int, q: np.ndarray, attn: np.ndarray, mm: Matmul) -> None:
        """The S tokens' attention output rows into attn [T, n_head * head_dim] (their cells written); the
        range is split over mm's threads."""
        pk, pv = kv.pool_k[il], kv.pool_v[il]                    # [n_seq, n_head_kv, cap, head_dim]
        n_s, n_head_kv, n_range = len(self.rows), self.n_head_kv, self.n_range
        n_gqa = self.n_head // n_head_kv
        head_dim = q.shape[-1]
        qs = q[self.take].reshape(n_s, n_head_kv, n_gqa, head_dim)   # [S, n_head_kv, n_gqa, head_dim]
        if not self.dense:
            qr = np.zeros((n_range, n_head_kv, n_gqa, head_dim), np.float32)
            qr[self.sel] = qs
            qs = qr                                              # [R, n_head_kv, n_gqa, head_dim]
        o = np.empty((n_range, n_head_kv, n_gqa, head_dim), np.float32)   # [R, n_head_kv, n_gqa, head_dim]

        def part(a: int, b: int) -> None:
            kr = pk[self.lo + a:self.lo + b, :, :self.n_keys]    # [b-a, n_head_kv, n_keys, head_dim] (a view)
            vr = pv[self.lo + a:self.lo + b, :, :self.n_keys]
            if kr.dtype != np.float32:
                kr, vr = kr.astype(np.float32), vr.astype(np.float32)
            sc = qs[a:b] @ kr.transpose(0, 1, 3, 2)               # [b-a, n_head_kv, n_gqa, n_keys]
            sc += self.mask[a:b]
            sc -= sc.max(axis=-1, keepdims=True)
            np.exp(sc, out=sc)
            ob = np.matmul(sc, vr, out=o[a:b])                    # unnormalized: divide the head_dim-wide
            ob /= sc.sum(axis=-1, keepdims=True)                  # outputs, not the n_keys-wide scores

        if mm.n_threads > 1 and n_range >= _DECODE_SPLIT_MIN:
            mm.split(part, n_range)
        else:
            part(0, n_range)
        attn[self.take] = (o if self.dense else o[self.sel]).reshape(n_s, self.n_head * head_dim)
