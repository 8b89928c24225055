"""The arithmetic of the forward pass, chosen once at load: a `Numerics` object per mode.

A numerics supplies everything in which the modes differ, so that neither the loader nor the forward pass
tests a mode name: how weights are prepared at load (what else to read of a tensor, how matrices are laid
out, whether the attention scale is folded into Q), the matmul and RoPE classes, the norm, the SwiGLU, the
per-chunk attention, whether one-token chunks are attended together, and the KV store's dtype.

`NUMERICS` maps the names users give (`engine.model.load(path, numerics=...)`) to the objects; `resolve` is
the one place that reads a name (and where, when numba cannot load, "q" and "ggml" fall back to "f32" with one
warning; ggml's numpy reference `GGML_REFERENCE` gives its results without numba, many times slower).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from engine.model import f32, ggml, quant
from engine.model.matmul import Matmul, SiluMul
from engine.model.types import HParams, Linear

# (weight [n_out_i, n_in] float32 -- None when `keeps_quantized` -- its GGML type, what `tensor_extra` read of
# it or None): parts of one matrix
Piece = tuple[np.ndarray, GGMLQuantizationType, Any]
# (q [m, n_head, head_dim], k, v [n_head_kv, >= n_old + m, head_dim] as stored, n_old, matmul) -> [m, n_head * head_dim]
Attend = Callable[..., np.ndarray]


class Numerics(ABC):
    """One numerics mode. A model builds its `matmul`, `rope` and KV store (`kv_dtype`) from it once; the
    forward pass calls `rms_norm`, `attend` and `decode_batch`, and hands `silu_mul` to `Matmul.ffn`; the
    loader prepares the weights with `tensor_extra`, `q_scale`, `linear` and `output`."""

    name: str
    kv_dtype: np.dtype                               # the KV store's default dtype
    rms_norm: Callable[[np.ndarray, np.ndarray, float], np.ndarray]   # (x [T, D], w [D], eps) -> [T, D]
    silu_mul: SiluMul                                # out = silu(g) * u element-wise
    attend: Attend                                   # one chunk's causal attention, see `f32.attend`
    # or, when set, (q, kv, seq's SeqKV, layer, n_old, matmul) -> the same, given the store (`ggml.attend_cells`)
    attend_cells: Callable[..., np.ndarray] | None = None
    # when set, (kv, a sequence's SeqKV) -> None: its float32 shadow made current (`ggml.shadow_current`)
    shadow_current: Callable[..., None] | None = None
    decode_batch: type[f32.DecodeBatch] | None       # attends one-token chunks of pooled sequences together
    # when set, (weights, hparams, rope, matmul, kv, the chunks' SeqKVs, their sizes, x [T, D], pos [T]) -> bool:
    # every layer of the step run on x in place, the same bits as the layer loop (False: not applicable)
    compiled_layers: Callable[..., bool] | None = None

    # --- load ---------------------------------------------------------------------------------------------
    def tensor_extra(self, t: Any) -> Any:
        """What to read of GGUF tensor `t` besides its float32 values (in the loader's parallel pass), or None."""
        return None

    def keeps_quantized(self, extra: Any) -> bool:
        """True when the tensor whose `tensor_extra` is `extra` needs no float32 copy (the loader skips it)."""
        return False

    def dequantized_warning(self, path: str, dequantized: Mapping[str, tuple[GGMLQuantizationType, int]]) -> str | None:
        """What the loader warns about when quantized layer matrices of the file got a float32 copy (name -> (type,
        bytes of the copy)); None when this mode means to (f32 mode dequantizes every matrix: it is the reference).
        The output head is not counted: a mode may dequantize it by design (ggml: any head but Q8_0)."""
        return None

    def q_scale(self, hp: HParams) -> np.float32 | None:
        """A factor folded into the Q rows (and Q bias) of every layer at load, or None."""
        return None

    def scale_piece(self, piece: Piece, scale: np.float32) -> Piece:
        """The piece times `scale` (the Q rows times `q_scale`)."""
        w, qtype, extra = piece
        return w * scale, qtype, extra

    def embedding(self, w: np.ndarray | None, extra: Any) -> Any:
        """The token embedding's lookup table: `emb[ids]` -> float32 rows."""
        return w

    @abstractmethod
    def linear(self, pieces: list[Piece]) -> Any:
        """A matrix for `matmul`: the pieces fused along the outputs."""

    @abstractmethod
    def output(self, w: np.ndarray, qtype: GGMLQuantizationType, extra: Any = None) -> Any:
        """The output head's matrix (W [n_vocab, n_embd] float32, stored as `qtype`; `tensor_extra` of it)."""

    # --- compute ------------------------------------------------------------------------------------------
    @abstractmethod
    def matmul(self, n_threads: int) -> Matmul:
        """The matmul object of a model: products of this mode's matrices, split over `n_threads` threads."""

    @abstractmethod
    def rope(self, hp: HParams, freq_factors: np.ndarray | None) -> f32.Rope:
        """The RoPE of a model (also the KV store's re-rotation)."""

    def __repr__(self) -> str:
        return f"<numerics {self.name!r}>"


class F32Numerics(Numerics):
    """Weights dequantized to float32 once, the attention scale folded into Q, float32 compute and KV."""

    name = "f32"
    kv_dtype = np.dtype(np.float32)
    decode_batch = f32.DecodeBatch
    rms_norm = staticmethod(f32.rms_norm)
    silu_mul = staticmethod(f32.silu_mul)
    attend = staticmethod(f32.attend)

    def q_scale(self, hp: HParams) -> np.float32:
        return np.float32(1.0 / np.sqrt(hp.head_dim))

    def linear(self, pieces: list[Piece]) -> Linear:
        return Linear.from_weight(np.concatenate([w for w, _, _ in pieces]) if len(pieces) > 1 else pieces[0][0])

    def output(self, w: np.ndarray, qtype: GGMLQuantizationType, extra: Any = None) -> Linear:
        return Linear.from_weight(w)

    def matmul(self, n_threads: int) -> Matmul:
        return Matmul(n_threads)

    def rope(self, hp: HParams, freq_factors: np.ndarray | None) -> f32.Rope:
        return f32.Rope(hp, freq_factors)


class GgmlNumerics(Numerics):
    """llama.cpp's CPU arithmetic (`engine.model.ggml`): Q4_1/Q5_1/Q8_0 matrices (and a Q8_0 head) kept as integer
    quants + block scales (+ minimums), activations quantized to each matrix's vec_dot_type, f16 KV, ggml's RoPE, rms_norm,
    softmax and SwiGLU; the attention scale is applied to the scores, as ggml does, not folded into Q.

    `compiled` (the "ggml" of `NUMERICS`): matmuls, quantizers, norm, SwiGLU and attention by the numba kernels
    of `engine.model.gkernels`, bit for bit the numpy code's results (tests), and every layer of a step runs in one
    compiled call (`compiled_layers`, `engine.model.gdecode`: the same bits);
    `GGML_REFERENCE` is the numpy code itself (selectable by that object); when numba cannot load, `resolve`
    turns "ggml" into "f32" with one warning."""

    name = "ggml"
    kv_dtype = np.dtype(np.float16)
    decode_batch = None            # one-token chunks attended one by one: the kernels' order is per sequence
    rms_norm = staticmethod(ggml.rms_norm)
    silu_mul = staticmethod(ggml.silu_mul)
    attend = staticmethod(ggml.attend)

    def __init__(self, compiled: bool = True):
        self.compiled = compiled
        if compiled:
            self.rms_norm = ggml.rms_norm_compiled
            self.silu_mul = ggml.silu_mul_compiled
            self.attend = ggml.attend_compiled
            self.attend_cells = ggml.attend_cells         # the same, reading the store's float32 shadow
            self.shadow_current = ggml.shadow_current
            self.compiled_layers = ggml.compiled_layers   # one compiled call per layer (`engine.model.gdecode`)

    def tensor_extra(self, t: Any) -> Any:
        """Q4_1/Q5_1/Q8_0 matrices of the layers: their integer quants and block scales (`ggml.exact_part`); a
        Q8_0 head (`output.weight`, or the token embedding a tied head reuses): its exact head (`ggml.exact_head`);
        a tied one is also the embedding's lookup table (`embedding`)."""
        exact = ggml.EXACT_DOT_TYPES | ggml.EXACT_Q8_0_TYPES
        if t.tensor_type in exact and len(t.shape) == 2 and t.name.startswith("blk."):
            return ggml.exact_part(t.data, t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
        if (t.tensor_type in ggml.EXACT_Q8_0_TYPES and len(t.shape) == 2 and int(t.shape[0]) % 32 == 0
                and t.name in ("output.weight", "token_embd.weight")):
            return ggml.exact_head(t.data, t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
        return None

    def keeps_quantized(self, extra: Any) -> bool:
        return isinstance(extra, quant.QPart)

    def dequantized_warning(self, path: str, dequantized: Mapping[str, tuple[GGMLQuantizationType, int]]) -> str | None:
        """A file with quantized matrices this mode has no exact kernel for (a Q4_K_M file's Q4_K / Q6_K, say):
        they were dequantized to float32 and go through BLAS, which costs memory and speed and is not llama.cpp's
        arithmetic; "q" keeps every one of those types in its blocks."""
        if not dequantized:
            return None
        types = ", ".join(sorted({t.name for t, _ in dequantized.values()}))
        mb = sum(n for _, n in dequantized.values()) / 1e6
        return (f"{path}: numerics 'ggml' keeps only Q4_1, Q5_1 and Q8_0 layer matrices in their quant blocks "
                f"(llama.cpp's kernels replayed); {len(dequantized)} quantized layer matrices of this file "
                f"({types}) were dequantized to float32 ({mb:.1f} MB) and are multiplied by BLAS: not llama.cpp's "
                "arithmetic, and slower and larger than their blocks. --numerics q keeps them in their quant blocks")

    def embedding(self, w: np.ndarray | None, extra: Any) -> Any:
        """A Q8_0 token embedding (its exact head, tied or not): rows read from the head's packed part
        (`ggml.PackedEmbedding`, the same values as the float32 table, which is dropped); else the table."""
        if isinstance(extra, ggml.QLinear) and len(extra.parts) == 1 and isinstance(extra.parts[0], ggml.Q8_0DotPart):
            return ggml.PackedEmbedding(extra.parts[0], w.shape[1])
        return w

    def linear(self, pieces: list[Piece]) -> ggml.QLinear:
        return ggml.qlinear(pieces)

    def output(self, w: np.ndarray, qtype: GGMLQuantizationType, extra: Any = None) -> ggml.QLinear:
        """A Q8_0 head is replayed exactly (`ggml.Q8_0DotPart`); other types: activations quantized the ggml
        way, products by BLAS (nothing downstream is re-quantized, so only the logits move, by ~1e-5)."""
        if isinstance(extra, ggml.QLinear):
            return extra
        return ggml.qlinear([(w, qtype, None)])

    def matmul(self, n_threads: int) -> Matmul:
        return ggml.GgmlMatmul(n_threads, compiled=self.compiled)

    def rope(self, hp: HParams, freq_factors: np.ndarray | None) -> f32.Rope:
        return ggml.GgmlRope(hp, freq_factors, compiled=self.compiled)

    def __repr__(self) -> str:
        return f"<numerics {self.name!r} ({'numba kernels' if self.compiled else 'numpy reference'})>"


class QuantNumerics(F32Numerics):
    """f32 mode's arithmetic with the matrices kept in their quant blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/
    Q5_K/Q6_K; F16/BF16 as 16-bit floats; the token embedding included) and multiplied by compiled kernels
    (`engine.model.quant`); the attention scale is folded into the Q rows' block scales (16-bit parts: a
    factor per output). Needs numba: without it `resolve` gives f32 mode (one warning)."""

    name = "q"

    def tensor_extra(self, t: Any) -> Any:
        if (t.tensor_type in quant.QUANT_TYPES and len(t.shape) == 2
                and int(t.shape[0]) % (256 if t.tensor_type in quant.K_TYPES else 32) == 0):
            return quant.QPart.from_tensor(t.data, t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
        if t.tensor_type in quant.HALF_TYPES and len(t.shape) == 2:
            return quant.HalfPart.from_tensor(t.data, t.tensor_type, (int(t.shape[1]), int(t.shape[0])))
        return None

    def keeps_quantized(self, extra: Any) -> bool:
        return isinstance(extra, (quant.QPart, quant.HalfPart))

    def scale_piece(self, piece: Piece, scale: np.float32) -> Piece:
        w, qtype, extra = piece
        if self.keeps_quantized(extra):
            return None, qtype, extra.scaled(scale)
        return w * scale, qtype, extra

    def embedding(self, w: np.ndarray | None, extra: Any) -> Any:
        return quant.QuantEmbedding(extra) if self.keeps_quantized(extra) else w

    def linear(self, pieces: list[Piece]) -> quant.QuantLinear:
        return quant.quant_linear(pieces)

    def output(self, w: np.ndarray | None, qtype: GGMLQuantizationType, extra: Any = None) -> quant.QuantLinear:
        return quant.quant_linear([(w, qtype, extra)])

    def matmul(self, n_threads: int) -> Matmul:
        return quant.QuantMatmul(n_threads)


NUMERICS: dict[str, Numerics] = {"f32": F32Numerics(), "ggml": GgmlNumerics(), "q": QuantNumerics()}
NUMERICS_MODES = tuple(NUMERICS)
GGML_REFERENCE = GgmlNumerics(compiled=False)     # "ggml" on its numpy code (tests, benchmarks, no numba)


def resolve(numerics: str | Numerics) -> Numerics:
    """The numerics object of a mode name (a `Numerics` passes through); ValueError for an unknown name."""
    if not isinstance(numerics, Numerics):
        try:
            numerics = NUMERICS[numerics]
        except (KeyError, TypeError):
            raise ValueError(f"numerics must be one of {NUMERICS_MODES}, got {numerics!r}") from None
    if isinstance(numerics, QuantNumerics) and not quant.available():
        quant.warn_unavailable()
        return NUMERICS["f32"]
    if isinstance(numerics, GgmlNumerics) and numerics.compiled and not ggml.compiled_available():
        ggml.warn_unavailable()
        return NUMERICS["f32"]          # the speed users expect of a default; the numpy reference stays selectable
    return numerics
