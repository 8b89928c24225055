"""The engine's data types: hyperparameters, weights laid out for the matmuls, a file summary, a batch chunk.

Imports no compute module: `gguf_loader` builds these, the forward pass (`llama`) and the numerics
(`numerics`, `f32`, `ggml`) read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True, slots=True)
class HParams:
    """Model hyperparameters (`llama_hparams` names)."""

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int              # n_embd_head_k == n_embd_head_v
    n_rot: int                 # rotated dims per head (rope.dimension_count), <= head_dim
    rope_type: str             # "norm" (adjacent pairs) | "neox" (halves)
    rope_freq_base: float
    rope_freq_scale: float     # 1 / linear scaling factor
    f_norm_rms_eps: float
    tied_embeddings: bool      # no output.weight: the head reuses token_embd.weight

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_head_kv * self.head_dim


# Matmuls with 2..SMALL_M_MAX rows use the column-blocked layout: OpenBLAS sgemm with few rows spends most
# of its time re-packing a large operand, while a stack of [n_in, ~64] blocks stays cache-sized (~1.5-2x
# faster measured on this machine for 4..16 rows). One row is a gemv on the plain layout; many rows, a gemm.
SMALL_M_MAX = 64
_BLOCK_COLS = 64

# Outputs a group of the ggml numerics' packed block layout (`ggml.pack_blocks`, read by `gkernels`): one 512-bit
# register of float32 (AVX-512), or two 256-bit halves (AVX2).
PACK_GROUP = 16


_SMALL_N_OUT = 1024    # narrower blocks for narrow matrices: more blocks to share between threads


def _block_cols(n_out: int) -> int:
    """The divisor of n_out closest to 64 columns (32 when n_out <= 1024; at least 32), or n_out itself.

    SmolLM2's 576- and 960-wide matrices in 32-column blocks (18 and 30 of them instead of 9 and 15) split
    evenly over 2 threads: 16-sequence decode steps measured ~3% faster, interleaved in one process."""
    target = 32 if n_out <= _SMALL_N_OUT else _BLOCK_COLS
    divisors = [d for d in range(32, min(n_out, 4 * _BLOCK_COLS) + 1) if n_out % d == 0]
    return min(divisors, key=lambda d: abs(d - target)) if divisors else n_out


@dataclass(frozen=True, slots=True)
class Linear:
    """A GGUF weight W [n_out, n_in] used as y = x @ W.T, kept in the two layouts BLAS streams best
    (`engine.model.matmul.Matmul` picks one by row count)."""

    t: np.ndarray          # [n_in, n_out] C-contiguous (W.T): gemv for one row, gemm for many rows
    blocks: np.ndarray     # [n_out / n_cols, n_in, n_cols] C-contiguous column blocks of t: 2..SMALL_M_MAX rows

    @classmethod
    def from_weight(cls, w: np.ndarray) -> Linear:
        t = np.ascontiguousarray(w.T, dtype=np.float32)                       # [n_in, n_out]
        n_in, n_out = t.shape
        n_cols = _block_cols(n_out)
        blocks = np.ascontiguousarray(t.reshape(n_in, n_out // n_cols, n_cols).transpose(1, 0, 2))
        return cls(t=t, blocks=blocks)                                        # blocks: [n_blk, n_in, n_cols]

    @property
    def n_in(self) -> int:
        return self.t.shape[0]

    @property
    def n_out(self) -> int:
        return self.t.shape[1]

    @property
    def weight(self) -> np.ndarray:
        """W in GGUF orientation [n_out, n_in] (a view)."""
        return self.t.T

    @property
    def stream_bytes(self) -> int:
        """Bytes one single-row matmul with this weight reads (`t`)."""
        return self.t.nbytes

    @property
    def resident_bytes(self) -> int:
        """Bytes held in RAM (both layouts)."""
        return self.t.nbytes + self.blocks.nbytes


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One transformer block; Q, K, V and gate/up are fused so each is one matmul over all tokens.

    The matrices are whatever the numerics' `linear` builds (`Linear` in f32 numerics, `ggml.QLinear` in
    ggml numerics); f32 numerics folds the attention scale 1/sqrt(head_dim) into the Q rows and Q bias."""

    attn_norm: np.ndarray      # [n_embd]
    wqkv: Linear               # W [(n_head + 2*n_head_kv) * head_dim, n_embd]
    bqkv: np.ndarray | None    # [(n_head + 2*n_head_kv) * head_dim]; qwen2 only
    wo: Linear                 # W [n_embd, n_head * head_dim]
    ffn_norm: np.ndarray       # [n_embd]
    w_gate_up: Linear          # W [2 * n_ff, n_embd]; outputs 0..n_ff-1 gate, n_ff.. up
    w_down: Linear             # W [n_embd, n_ff]

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.wqkv, self.wo, self.w_gate_up, self.w_down)


@dataclass(frozen=True, slots=True)
class Weights:
    tok_embd: np.ndarray            # [n_vocab, n_embd] (embedding lookup)
    output_norm: np.ndarray         # [n_embd]
    output: Linear                  # W [n_vocab, n_embd]; built from tok_embd when tied
    layers: tuple[LayerWeights, ...]
    rope_freqs: np.ndarray | None   # [n_rot // 2] frequency divisors (rope_freqs.weight), if present

    @property
    def n_stream_bytes(self) -> int:
        """Bytes one decode step reads: every layer matrix and norm, the final norm and the head."""
        n = self.output.stream_bytes + self.output_norm.nbytes
        for lw in self.layers:
            n += lw.attn_norm.nbytes + lw.ffn_norm.nbytes + sum(lin.stream_bytes for lin in lw.linears)
            n += 0 if lw.bqkv is None else lw.bqkv.nbytes
        return n

    @property
    def n_resident_bytes(self) -> int:
        """Bytes held in RAM (both matmul layouts, embeddings, norms). A tied head that reads the embedding's
        own storage (numerics "q": one quantized table for both) is counted once."""
        part = getattr(self.tok_embd, "part", None)
        shared = part is not None and any(p is part for p in getattr(self.output, "parts", ()))
        n = (0 if shared else self.tok_embd.nbytes) + self.output_norm.nbytes + self.output.resident_bytes
        for lw in self.layers:
            n += lw.attn_norm.nbytes + lw.ffn_norm.nbytes + sum(lin.resident_bytes for lin in lw.linears)
            n += 0 if lw.bqkv is None else lw.bqkv.nbytes
        return n


@dataclass(frozen=True, slots=True)
class FileSummary:
    """What the file was: size, llama.cpp ftype, and the GGML type of every tensor (for reporting)."""

    path: str
    file_size_bytes: int
    ftype: int                      # general.file_type (LlamaFileType), -1 when absent
    ftype_name: str                 # e.g. "MOSTLY_Q4_1"
    tensor_types: dict[str, str]    # tensor name -> GGML type name as stored, e.g. "Q4_1"
    type_counts: dict[str, int]     # GGML type name -> number of tensors
    n_params: int
    n_tensor_bytes: int             # bytes of tensor data in the file


class BatchChunk(NamedTuple):
    """Tokens of one sequence at positions pos0 .. pos0+len-1 (a slot's part of a `llama_batch`).

    want_logits: True = the last token's row, False = none, or a sequence of row indices in the chunk.
    """

    seq_id: int
    token_ids: Sequence[int]
    pos0: int
    want_logits: bool | Sequence[int] = True
