"""Llama / Qwen2 forward pass over a batch of chunks from several sequences (mirrors `llm_build_llama` /
`llm_build_qwen2` of llama.cpp, driven like one `llama_decode` call).

Dense ops (embeddings, norms, QKV/O, SwiGLU FFN, output head) run once on all tokens of the batch
concatenated, so each weight matrix is streamed once per step; attention runs per chunk against that
sequence's KV cells (one-token chunks of pooled sequences together, when the numerics allows). The
arithmetic is the model's `Numerics` (`engine.model.numerics`); threads only inside its `Matmul`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.model.f32 import Rope
from engine.model.kv import KVStore, SeqKV
from engine.model.matmul import Matmul
from engine.model.numerics import Numerics
from engine.model.types import BatchChunk, HParams, Weights

_DECODE_BATCH_MIN = 2             # one-token chunks attended together (Numerics.decode_batch) from this many on


def forward_batch(w: Weights, hp: HParams, num: Numerics, rope: Rope, mm: Matmul, kv: KVStore,
                  chunks: Sequence[BatchChunk | tuple]) -> list[np.ndarray]:
    """One decode step: append every chunk's tokens to its sequence's KV and return, per chunk, the logits
    rows it asked for as a float32 array [n_rows, n_vocab] (n_rows may be 0).

    `w`, `rope` and `mm` must be built by the same numerics `num` (`engine.model.load` builds them).
    Raises ValueError (bad ids, positions, duplicate sequence) or KVCacheFull before any KV cell changes.
    """
    chunks = [BatchChunk(*c) for c in chunks]
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
    cells = _Cells(num, hp, kv, seqs, offsets)

    tokens = np.concatenate(ids)                                             # [T]
    pos = np.concatenate([np.arange(c.pos0, c.pos0 + n) for c, n in zip(chunks, sizes)])  # [T]
    n_tokens = tokens.shape[0]
    n_head, n_head_kv, head_dim = hp.n_head, hp.n_head_kv, hp.head_dim
    n_qk = (n_head + n_head_kv) * head_dim
    eps = hp.f_norm_rms_eps
    rot = rope.rotation(pos)                                                 # [T, 1, n_rot/2]

    x = w.tok_embd[tokens]                                                   # embed: [T, D]
    with np.errstate(over="ignore"):                                         # exp(-g) -> inf is fine in SiLU
        fused = (num.compiled_layers is not None                                # the layers in compiled calls
                 and num.compiled_layers(w, hp, rope, mm, kv, seqs, sizes, x, pos))
        for il, lw in enumerate(w.layers if not fused else ()):
            xn = num.rms_norm(x, lw.attn_norm, eps)                          # attention norm: [T, D]
            qkv = mm(lw.wqkv, xn)                                            # Q, K, V in one product
            if lw.bqkv is not None:
                qkv += lw.bqkv
            qk = qkv[:, :n_qk].reshape(n_tokens, n_head + n_head_kv, head_dim)   # [T, n_head + n_head_kv, head_dim]
            rope.rotate(qk, rot)                                             # RoPE of Q and K in one call
            q, k = qk[:, :n_head], qk[:, n_head:]                            # [T, n_head | n_head_kv, head_dim]
            v = qkv[:, n_qk:].reshape(n_tokens, n_head_kv, head_dim)         # [T, n_head_kv, head_dim]
            cells.write(il, k, v)                                            # KV write
            attn = cells.attend(il, q, mm)                                   # attention: [T, n_head * head_dim]
            x += mm(lw.wo, attn)                                             # output projection, residual
            xn = num.rms_norm(x, lw.ffn_norm, eps)                           # FFN norm: [T, D]
            x += mm.ffn(lw.w_gate_up, lw.w_down, xn, num.silu_mul)           # SwiGLU FFN, residual

    for ic, s in enumerate(seqs):
        kv.commit_append(s, int(chunks[ic].pos0), sizes[ic])

    sel = [offsets[ic] + r for ic, rr in enumerate(rows) for r in rr]
    if not sel:
        return [np.empty((0, hp.n_vocab), np.float32) for _ in chunks]
    xs = num.rms_norm(x[sel], w.output_norm, eps)                            # final norm: [R, D]
    logits = mm(w.output, xs)                                                # head: [R, n_vocab]
    bounds = np.cumsum([0] + [len(rr) for rr in rows]).tolist()
    return [logits[bounds[i]:bounds[i + 1]] for i in range(len(chunks))]


class _Cells:
    """The batch's chunks in the KV store: where each chunk's K/V rows go and what it attends to.

    One-token chunks of pooled sequences are written and attended together (`num.decode_batch`, from
    _DECODE_BATCH_MIN of them on), the other chunks one by one with `num.attend`. Chunks belong to distinct
    sequences, so writing every chunk's cells before attending changes nothing."""

    def __init__(self, num: Numerics, hp: HParams, kv: KVStore, seqs: list[SeqKV], offsets: list[int]):
        self.kv, self.attend_one, self.attend_cells = kv, num.attend, num.attend_cells
        self.n_attn = hp.n_head * hp.head_dim
        sizes = [b - a for a, b in zip(offsets, offsets[1:])]
        batched = ([ic for ic, s in enumerate(seqs) if sizes[ic] == 1 and s.pooled]
                   if num.decode_batch is not None else [])
        self.dec = None
        if len(batched) >= _DECODE_BATCH_MIN:
            self.dec = num.decode_batch([seqs[ic].seq for ic in batched], [offsets[ic] for ic in batched],
                                        [seqs[ic].n for ic in batched], hp.n_head, hp.n_head_kv)
        taken = set(batched) if self.dec is not None else set()
        # (sequence, first row, end row, cells before the chunk) of the chunks attended one by one
        self.alone = [(seqs[ic], offsets[ic], offsets[ic + 1], seqs[ic].n)
                      for ic in range(len(seqs)) if ic not in taken]
        self.n_tokens = offsets[-1]

    def write(self, il: int, k: np.ndarray, v: np.ndarray) -> None:
        """Layer il's K/V rows of the batch (k, v [T, n_head_kv, head_dim]) into their sequences' cells."""
        if self.dec is not None:
            self.dec.write(self.kv, il, k, v)
        for s, a, b, n_old in self.alone:
            kl, vl = s.k[il], s.v[il]                                        # [n_head_kv, capacity, head_dim]
            if b - a == 1:
                kl[:, n_old] = k[a]
                vl[:, n_old] = v[a]
            else:
                kl[:, n_old:n_old + b - a] = k[a:b].transpose(1, 0, 2)
                vl[:, n_old:n_old + b - a] = v[a:b].transpose(1, 0, 2)

    def attend(self, il: int, q: np.ndarray, mm: Matmul) -> np.ndarray:
        """Every chunk's causal attention over its sequence's cells of layer il: [T, n_head * head_dim]."""
        attn = np.empty((self.n_tokens, self.n_attn), np.float32)            # [T, n_head * head_dim]
        if self.dec is not None:
            self.dec.attend(self.kv, il, q, attn, mm)
        for s, a, b, n_old in self.alone:
            if self.attend_cells is not None:
                attn[a:b] = self.attend_cells(q[a:b], self.kv, s, il, n_old, mm)
            else:
                attn[a:b] = self.attend_one(q[a:b], s.k[il], s.v[il], n_old, mm)
        return attn


def _logit_rows(want: bool | Sequence[int], n: int) -> list[int]:
    if want is True:
        return [n - 1]
    if want is False or want is None:
        return []
    rows = [int(i) + n if int(i) < 0 else int(i) for i in want]
    if any(not 0 <= i < n for i in rows):
        raise ValueError(f"logit rows {list(want)} out of range for a chunk of {n} tokens")
    return rows
