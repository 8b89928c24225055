"""Llama / Qwen2 forward pass over a batch of chunks from several sequences (mirrors `llm_build_llama` /
`llm_build_qwen2` of llama.cpp, driven like one `llama_decode` call).

Dense ops (embeddings, norms, QKV/O, SwiGLU FFN, output head) run once on all tokens of the batch
concatenated, so each weight matrix is streamed once per step; attention runs per chunk against that
sequence's KV cells. Everything is float32.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from engine.model import gguf_loader
from engine.model.gguf_loader import HParams, Linear, Weights
from engine.model.kv import KVStore

_ATTN_SCORE_BUDGET = 1 << 22      # max floats of one attention score block: bounds memory on long chunks
_ATTN_QUERY_BLOCK = 128           # query rows per block: later blocks skip keys past their last query
_ROPE_TABLE_MIN = 4096
_SPLIT_MIN_MACS = 1 << 19         # smaller products are not worth a thread hand-off (~20 µs)
_SPLIT_ALIGN = 16                 # column split points on 64-byte boundaries
_ELEMENTWISE_ROWS = 64            # rows per task when element-wise work is split over threads
_DECODE_BATCH_MIN = 2             # one-token chunks attended together (_DecodeBatch) from this many on
_DECODE_SPLIT_MIN = 8             # ... and split over the threads from this many sequences on
_FUSED_FFN = True                 # FFN of 1..SMALL_M_MAX tokens as one piece per thread (_ffn_split)
_GEMV_PIECES_PER_THREAD = 2       # one-row products: pieces per thread (late workers leave fewer to wait for)


class BatchChunk(NamedTuple):
    """Tokens of one sequence at positions pos0 .. pos0+len-1 (a slot's part of a `llama_batch`).

    want_logits: True = the last token's row, False = none, or a sequence of row indices in the chunk.
    """

    seq_id: int
    token_ids: Sequence[int]
    pos0: int
    want_logits: bool | Sequence[int] = True


class Matmul:
    """y = x @ W.T for a `Linear`: picks the layout by row count and splits the product over `n_threads`
    threads (the caller plus n_threads - 1 workers; numpy releases the GIL inside BLAS).

    Meant to run with BLAS itself single-threaded: on a machine whose 2 cores are shared, OpenBLAS's own
    threads spin-wait and a step can take 10x longer when another process holds a core. Here the pieces of a
    split go to a shared queue that the caller drains too (`_Workers`): a worker that does not get a core in
    time simply takes no piece, and the step runs at one-thread speed instead of waiting for it.
    """

    def __init__(self, n_threads: int = 1):
        self.n_threads = max(1, int(n_threads))
        self._pool = _Workers(self.n_threads - 1) if self.n_threads > 1 else None

    def __call__(self, lin: Linear, x: np.ndarray) -> np.ndarray:
        """x [M, n_in] -> [M, n_out] float32."""
        m = x.shape[0]
        n_in, n_out = lin.t.shape
        split = self._pool is not None and m * n_in * n_out >= _SPLIT_MIN_MACS
        n_blk = lin.blocks.shape[0]
        if 1 < m <= gguf_loader.SMALL_M_MAX and n_blk > 1:
            out = np.empty((n_blk, m, lin.blocks.shape[2]), np.float32)       # [n_blk, M, n_cols]
            self._run(lambda a, b: np.matmul(x, lin.blocks[a:b], out=out[a:b]), n_blk, 1, split)
            return out.transpose(1, 0, 2).reshape(m, n_out)                    # [M, n_out]
        if not split:
            return x @ lin.t                                                   # [M, n_out]
        if m == 1:
            # one row (gemv) is bandwidth-bound: split the input dimension, so that each piece streams a
            # contiguous band of t's rows, and add the partial results (a split by columns reads strided row
            # pieces and measured slower than no split at all)
            cuts = self._cuts(n_in, _SPLIT_ALIGN, self.n_threads * _GEMV_PIECES_PER_THREAD)
            n_pieces = len(cuts) - 1
            parts = np.empty((n_pieces, 1, n_out), np.float32)                # [pieces, 1, n_out]
            self._pool.run([lambda i=i: np.matmul(x[:, cuts[i]:cuts[i + 1]], lin.t[cuts[i]:cuts[i + 1]],
                                                  out=parts[i]) for i in range(n_pieces)])
            return parts.sum(axis=0)                                           # [1, n_out]
        out = np.empty((m, n_out), np.float32)                                 # [M, n_out]
        self._run(lambda a, b: np.matmul(x, lin.t[:, a:b], out=out[:, a:b]), n_out, _SPLIT_ALIGN, split)
        return out

    def split(self, part: Callable[[int, int], object], n: int, align: int = 1) -> None:
        """part(a, b) over [0, n) cut into n_threads near-equal ranges (bounds multiples of `align`), in
        parallel."""
        self._run(part, n, align, self._pool is not None)

    def _run(self, part: Callable[[int, int], object], n: int, align: int, split: bool) -> None:
        """part(a, b) over [0, n) cut into n_threads aligned ranges, run on the threads."""
        if not split:
            part(0, n)
            return
        cuts = self._cuts(n, align, self.n_threads)
        self._pool.run([lambda i=i: part(cuts[i], cuts[i + 1]) for i in range(len(cuts) - 1)])

    @staticmethod
    @functools.lru_cache(maxsize=1024)              # a model has a handful of shapes; 100+ calls per step
    def _cuts(n: int, align: int, n_pieces: int) -> tuple[int, ...]:
        """Boundaries splitting [0, n) into up to n_pieces near-equal non-empty ranges aligned to `align`."""
        inner = [min(n, round(n * i / n_pieces / align) * align) for i in range(1, n_pieces)]
        return tuple(sorted({0, n, *inner}))

    def parallel(self, tasks: list[Callable[[], object]]) -> None:
        """Run independent tasks on the threads, each thread taking the next task left (give them
        largest first for balance)."""
        if self._pool is None or len(tasks) == 1:
            for task in tasks:
                task()
            return
        self._pool.run(tasks)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


class _Run:
    """One `_Workers.run`: the pieces not taken yet, and one message per piece a worker finished."""

    __slots__ = ("todo", "done")

    def __init__(self, tasks: list[Callable[[], object]]):
        self.todo = deque(tasks)
        self.done: queue.SimpleQueue = queue.SimpleQueue()


class _Workers:
    """n persistent daemon threads that share the pieces of a run with the calling thread.

    `run(tasks)` puts the tasks in a queue, wakes up to n workers, and the caller takes tasks from the same
    queue until it is empty (deque.popleft is atomic); then it waits only for the tasks workers actually
    took. A worker that wakes late finds nothing left, so a busy second core costs the wake-up message, not
    a wait: the run degrades to one-thread speed. Exceptions of any task are re-raised in the caller.

    Written instead of using `concurrent.futures.ThreadPoolExecutor` for latency and for that degradation: a
    split matmul is a hand-off and a join, 150+ per decode step, an executor round trip measured ~100 µs here
    against ~55 µs, and a future handed to a thread that does not get a core makes the caller wait for it.
    """

    def __init__(self, n: int):
        self._inboxes = [queue.SimpleQueue() for _ in range(n)]
        for i, inbox in enumerate(self._inboxes):
            threading.Thread(target=self._serve, args=(inbox,), name=f"slotlab-matmul-{i}", daemon=True).start()
        # the threads hold only their inbox: when this object is collected, they are told to exit
        self._finalizer = weakref.finalize(self, _Workers._stop, self._inboxes)

    @staticmethod
    def _stop(inboxes: list[queue.SimpleQueue]) -> None:
        for inbox in inboxes:
            inbox.put(None)

    @staticmethod
    def _serve(inbox: queue.SimpleQueue) -> None:
        while True:
            run = inbox.get()
            if run is None:
                return
            while True:
                try:
                    task = run.todo.popleft()
                except IndexError:
                    break
                try:
                    task()
                except BaseException as e:             # handed to the caller, re-raised there
                    run.done.put(e)
                else:
                    run.done.put(None)

    def run(self, tasks: list[Callable[[], object]]) -> None:
        run = _Run(tasks)
        for inbox in self._inboxes[:len(tasks) - 1]:
            inbox.put(run)
        n_own = 0
        error: BaseException | None = None
        while True:
            try:
                task = run.todo.popleft()
            except IndexError:
                break
            n_own += 1
            try:
                task()
            except BaseException as e:
                error = error or e
        for _ in range(len(tasks) - n_own):            # the tasks the workers took
            result = run.done.get()
            error = error or result
        if error is not None:
            raise error

    def close(self) -> None:
        self._finalizer()                              # runs _stop once


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

    def rerotate(self, k: np.ndarray, delta: int) -> None:
        """Keys rotated at p become keys rotated at p + delta: one extra rotation by delta (float32)."""
        angles = delta * self.inv_freq                               # [n_rot/2]
        self.apply(k, np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))


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


def _silu_mul(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = silu(g) * u = g / (1 + e^-g) * u, element-wise (out may not alias g or u)."""
    np.negative(g, out=out)
    np.exp(out, out=out)
    out += 1.0
    np.divide(g, out, out=out)
    out *= u
    return out


def _swiglu(gu: np.ndarray, n_ff: int, mm: Matmul) -> np.ndarray:
    """silu(gate) * up for gu [T, 2 * n_ff] -> [T, n_ff]; long batches split by rows over mm's threads."""
    n_tokens = gu.shape[0]
    h = np.empty((n_tokens, n_ff), np.float32)                                       # [T, n_ff]

    def rows(a: int, b: int) -> None:
        _silu_mul(gu[a:b, :n_ff], gu[a:b, n_ff:], h[a:b])                            # [b-a, n_ff] each

    step = _ELEMENTWISE_ROWS
    if n_tokens <= step or mm.n_threads == 1:
        rows(0, n_tokens)
    else:
        mm.parallel([lambda a=a: rows(a, min(n_tokens, a + step)) for a in range(0, n_tokens, step)])
    return h


def _logit_rows(want: bool | Sequence[int], n: int) -> list[int]:
    if want is True:
        return [n - 1]
    if want is False or want is None:
        return []
    rows = [int(i) + n if int(i) < 0 else int(i) for i in want]
    if any(not 0 <= i < n for i in rows):
        raise ValueError(f"logit rows {list(want)} out of range for a chunk of {n} tokens")
    return rows


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_old: int, mm: Matmul | None = None) -> np.ndarray:
    """Causal attention of one chunk's queries against its sequence's cells.

    q [m, n_head, head_dim] (pre-scaled), k/v [n_head_kv, >= n_old + m, head_dim] with the chunk's cells at
    n_old .. n_old+m-1 (all earlier cells have smaller positions, so they are all visible).
    Query blocks of a long chunk run on `mm`'s threads. Returns [m, n_head * head_dim].
    """
    m, n_head, head_dim = q.shape
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


def _ffn_splittable(gate_up: Linear, down: Linear, n_ff: int) -> bool:
    """The column blocks of gate/up hold whole gate and whole up blocks, and down has column blocks."""
    return (gate_up.blocks.shape[0] > 1 and n_ff % gate_up.blocks.shape[2] == 0
            and n_ff // gate_up.blocks.shape[2] >= 2 and down.blocks.shape[0] > 1)


def _ffn_split_row(gate_up: Linear, down: Linear, xn: np.ndarray, n_ff: int, mm: Matmul) -> np.ndarray:
    """The FFN of one row (decode of a single sequence), one piece per thread.

    Each piece takes a range of the n_ff hidden units: its gate and its up columns of `gate_up.t` (two
    strided views, ~3 KB contiguous per row for SmolLM2 on 2 threads), their SwiGLU, and the matching rows
    (an input band) of `down.t`; the caller adds the partial outputs. One hand-off instead of three (gate/up,
    down, each split over input bands), and no serial SwiGLU between them: the FFN alone ~13% faster on 2
    threads, a decode step ~2% (interleaved A/B). More, narrower pieces measured slower (strided reads), so
    there is one piece per thread."""
    t, td = gate_up.t, down.t                                 # [n_in, 2 * n_ff], [n_ff, n_embd]
    partial: dict[int, np.ndarray] = {}                       # first hidden unit -> [1, n_embd]

    def piece(a: int, b: int) -> None:
        g = xn @ t[:, a:b]                                    # [1, b-a]
        u = xn @ t[:, n_ff + a:n_ff + b]                      # [1, b-a]
        partial[a] = _silu_mul(g, u, np.empty_like(g)) @ td[a:b]   # [1, n_embd]
    mm.split(piece, n_ff, _SPLIT_ALIGN)
    parts = [partial[a] for a in sorted(partial)]             # a fixed summation order
    y = parts[0]
    for p in parts[1:]:
        y += p
    return y


def _ffn_split(gate_up: Linear, down: Linear, xn: np.ndarray, n_ff: int, mm: Matmul) -> np.ndarray:
    """silu(xn @ Wgate.T) * (xn @ Wup.T) @ Wdown.T for 1..SMALL_M_MAX rows, one piece per thread.

    Each piece takes a range of the n_ff hidden units: its gate and up column blocks, their SwiGLU, and the
    product with the matching rows (input band) of every Wdown column block; the caller adds the pieces'
    partial outputs. One hand-off per FFN instead of two, and each piece's hidden units stay in its cache.
    Equal to the unfused path up to float32 summation order."""
    if xn.shape[0] == 1:
        return _ffn_split_row(gate_up, down, xn, n_ff, mm)
    gb, db = gate_up.blocks, down.blocks                      # [nb, n_in, cols], [nb_d, n_ff, cols_d]
    cols = gb.shape[2]
    n_half = n_ff // cols                                     # gate blocks 0..n_half-1, up blocks n_half..
    m = xn.shape[0]
    partial: dict[int, np.ndarray] = {}                       # first gate block -> [nb_d, M, cols_d]

    def piece(a: int, b: int) -> None:
        g = np.matmul(xn, gb[a:b])                            # [b-a, M, cols]
        u = np.matmul(xn, gb[n_half + a:n_half + b])          # [b-a, M, cols]
        h = _silu_mul(g, u, np.empty_like(g))
        hm = h.transpose(1, 0, 2).reshape(m, (b - a) * cols)  # [M, (b-a)*cols]: hidden units a*cols..b*cols
        partial[a] = np.matmul(hm, db[:, a * cols:b * cols])
    mm.split(piece, n_half)
    parts = [partial[a] for a in sorted(partial)]             # a fixed summation order
    y = parts[0]
    for p in parts[1:]:
        y += p
    return y.transpose(1, 0, 2).reshape(m, db.shape[0] * db.shape[2])   # [M, n_embd]


class _DecodeBatch:
    """Attention of S one-token chunks of pooled sequences in a few batched matmuls per layer.

    The sequences' cells live in `kv.pool_k[layer]` [n_seq, n_head_kv, cap, head_dim]; the batch reads the
    range of sequences lo..hi-1 that covers them (a view when they are contiguous) up to the longest one's
    cells, and masks each sequence's unused cells. Equivalent to `_attend` per chunk with m == 1.
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

    def attend(self, kv: KVStore, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, attn: np.ndarray,
               mm: Matmul) -> None:
        """Write the S tokens' K/V into their cells and their attention output rows into attn; the range
        is split over mm's threads."""
        pk, pv = kv.pool_k[il], kv.pool_v[il]                    # [n_seq, n_head_kv, cap, head_dim]
        pk[self.seq, :, self.n_old] = k[self.take]               # [S, n_head_kv, head_dim]
        pv[self.seq, :, self.n_old] = v[self.take]
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


def forward_batch(w: Weights, hp: HParams, rope: Rope, kv: KVStore, chunks: Sequence[BatchChunk | tuple],
                  matmul: Matmul | None = None, numerics: str = "f32") -> list[np.ndarray]:
    """One decode step: append every chunk's tokens to its sequence's KV and return, per chunk, the logits
    rows it asked for as a float32 array [n_rows, n_vocab] (n_rows may be 0).

    numerics="ggml": llama.cpp's CPU arithmetic (engine.model.ggml); `w`, `rope` and `matmul` must be the
    ggml ones (`engine.model.load(..., numerics="ggml")` builds them).

    Raises ValueError (bad ids, positions, duplicate sequence) or KVCacheFull before any KV cell changes.
    """
    chunks = [BatchChunk(*c) for c in chunks]
    mm = matmul or Matmul(1)
    if not chunks:
        return []
    ids = [np.asarray(c.token_ids, dtype=np.int64).reshape(-1) for c in chunks]
    for c, t in zip(chunks, ids):
        if t.size and (t.min() < 0 or t.max() >= hp.n_vocab):
            raise ValueError(f"sequence {c.seq_id}: token id out of range [0, {hp.n_vocab})")
    sizes = [int(t.size) for t in ids]
    rows = [_logit_rows(c.want_logits, n) for c, n in zip(chunks, sizes)]
    seqs = kv.prepare_append([(int(c.seq_id), int(c.pos0), n) for c, n in zip(chunks, sizes)])
    offsets = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    n_olds = [s.n for s in seqs]

    tokens = np.concatenate(ids)                                                     # [T]
    pos = np.concatenate([np.arange(c.pos0, c.pos0 + n) for c, n in zip(chunks, sizes)])  # [T]
    n_tokens = tokens.shape[0]
    n_head, n_head_kv, head_dim = hp.n_head, hp.n_head_kv, hp.head_dim
    n_qk = (n_head + n_head_kv) * head_dim
    rot = rope.rotation(pos)                                                         # [T, 1, n_rot/2]
    kv_f16 = kv.dtype != np.float32
    # one-token chunks of pooled sequences are attended together (_DecodeBatch); the rest one by one
    # (ggml mode keeps per-chunk attention: its kernels' summation order is per sequence)
    batched = [ic for ic, s in enumerate(seqs) if sizes[ic] == 1 and s.pooled] if numerics == "f32" else []
    dec = None
    if len(batched) >= _DECODE_BATCH_MIN:
        dec = _DecodeBatch([seqs[ic].seq for ic in batched], [offsets[ic] for ic in batched],
                           [n_olds[ic] for ic in batched], n_head, n_head_kv)
        taken = set(batched)
        loop = [ic for ic in range(len(chunks)) if ic not in taken]
    else:
        loop = list(range(len(chunks)))
    norm, attend, swiglu = rms_norm, _attend, _swiglu
    if numerics == "ggml":                                                           # llama.cpp's CPU arithmetic
        from engine.model import ggml
        norm, swiglu = ggml.rms_norm, ggml.swiglu
        attend = ggml.make_attend(ggml.attention_scale(head_dim), kv_f16)

    lw0 = w.layers[0] if w.layers else None
    fused_ffn = (_FUSED_FFN and numerics == "f32" and mm.n_threads > 1 and lw0 is not None
                 and 1 <= n_tokens <= gguf_loader.SMALL_M_MAX and _ffn_splittable(lw0.w_gate_up, lw0.w_down, hp.n_ff))
    x = w.tok_embd[tokens]                                                           # [T, D]
    with np.errstate(over="ignore"):                                                 # exp(-g) -> inf is fine in SiLU
        for il, lw in enumerate(w.layers):
            xn = norm(x, lw.attn_norm, hp.f_norm_rms_eps)                            # [T, D]
            qkv = mm(lw.wqkv, xn)                                                    # [T, (n_head + 2*n_head_kv) * head_dim]
            if lw.bqkv is not None:
                qkv += lw.bqkv
            qk = qkv[:, :n_qk].reshape(n_tokens, n_head + n_head_kv, head_dim)       # [T, n_head + n_head_kv, head_dim]
            rope.rotate(qk, rot)
            q = qk[:, :n_head]                                                       # [T, n_head, head_dim]
            k = qk[:, n_head:]                                                       # [T, n_head_kv, head_dim]
            v = qkv[:, n_qk:].reshape(n_tokens, n_head_kv, head_dim)                 # [T, n_head_kv, head_dim]
            attn = np.empty((n_tokens, n_head * head_dim), np.float32)               # [T, n_head * head_dim]
            if dec is not None:
                dec.attend(kv, il, q, k, v, attn, mm)
            for ic in loop:
                s = seqs[ic]
                a, b, n_old = offsets[ic], offsets[ic + 1], n_olds[ic]
                kl, vl = s.k[il], s.v[il]                                            # [n_head_kv, capacity, head_dim]
                if b - a == 1:
                    kl[:, n_old] = k[a]
                    vl[:, n_old] = v[a]
                else:
                    kl[:, n_old:n_old + b - a] = k[a:b].transpose(1, 0, 2)
                    vl[:, n_old:n_old + b - a] = v[a:b].transpose(1, 0, 2)
                if kv_f16:
                    kl = kl[:, :n_old + b - a].astype(np.float32)
                    vl = vl[:, :n_old + b - a].astype(np.float32)
                attn[a:b] = attend(q[a:b], kl, vl, n_old, mm)
            x += mm(lw.wo, attn)                                                     # [T, D]
            xn = norm(x, lw.ffn_norm, hp.f_norm_rms_eps)                             # [T, D]
            if fused_ffn:
                x += _ffn_split(lw.w_gate_up, lw.w_down, xn, hp.n_ff, mm)            # [T, D]
            else:
                gu = mm(lw.w_gate_up, xn)                                            # [T, 2 * n_ff]
                h = swiglu(gu, hp.n_ff, mm)                                          # [T, n_ff]
                x += mm(lw.w_down, h)                                                # [T, D]

    for ic, s in enumerate(seqs):
        kv.commit_append(s, int(chunks[ic].pos0), sizes[ic])

    sel = [offsets[ic] + r for ic, rr in enumerate(rows) for r in rr]
    if not sel:
        return [np.empty((0, hp.n_vocab), np.float32) for _ in chunks]
    xs = norm(x[sel], w.output_norm, hp.f_norm_rms_eps)                             # [R, D]
    logits = mm(w.output, xs)                                                        # [R, n_vocab]
    bounds = np.cumsum([0] + [len(rr) for rr in rows]).tolist()
    return [logits[bounds[i]:bounds[i + 1]] for i in range(len(chunks))]
