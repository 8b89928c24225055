"""The "q" numerics mode: weights kept in their GGUF quant blocks, products by compiled kernels (`qkernels`).

Every Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K matrix is decoded at load into its integer
quants and per-block scale d and offset m (W = d * q + m per block of 32 inputs -- a K-quant super-block's
sub-blocks, Q6_K's of 16 --, exactly the values `gguf.quants.dequantize` gives) and repacked, without
rounding anything, into the kernels' transposed block layout (`QPart`); F16 / BF16 matrices keep their 16-bit
values (`HalfPart`); the float32 copy is never made. Other types (F32, Q2_K, Q3_K) stay float32 `Linear`s,
multiplied by BLAS.

Products with 1..`NIB_ROWS_MAX` (4-bit) / `BYTE_ROWS_MAX` (8-bit) rows run the fused dequantize-and-dot kernels on numba's threads (exactly
`n_threads` of them); more rows (prefill) dequantize a tile of outputs to float32 and hand it to BLAS on the
engine's own threads, which measured faster there (crossover: docs/engine.md). Activations stay float32: the
arithmetic is that of f32 mode up to float32 summation order (and the attention scale folded in the block
scales instead of the weights), so this mode agrees with f32 mode, not bit for bit with llama.cpp.

numba is imported on first use; when it cannot be imported the mode resolves to "f32" with one warning
(`available`).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.model.matmul import Matmul
from engine.model.types import Linear

T = GGMLQuantizationType
# rows up to which the fused kernels beat dequantize-a-tile + BLAS (measured, docs/engine.md): the nibble
# kernel does 8 multiply-adds per byte loaded and stays ahead to 16 rows; the byte kernel (Q8_0: SmolLM2's
# 49152-row head) only to 4
NIB_ROWS_MAX = 16
BYTE_ROWS_MAX = 4
HALF_ROWS_MAX = 16             # F16 / BF16 fused kernel: ahead of tile + BLAS to ~24 rows (measured, docs/engine.md)
# the output range of one BLAS tile (prefill): [n_in, _TILE_COLS] float32 stays in L2 (576 x 256 x 4 = 590 KB)
_TILE_COLS = 256
_CHUNKS_PER_THREAD = 1         # output ranges per numba thread in the fused kernels
# Who runs the fused kernels' output ranges: False = the engine's own threads (`Matmul._run`: the caller
# drains the queue, so a worker without a core costs nothing), True = numba's threading layer (prange;
# ~3 us a launch instead of ~55 us, but a static split that waits for a descheduled thread: on this shared
# 2-core machine, under load 3.5-5.5, 2-thread decode measured 3x slower than f32 mode that way)
USE_NUMBA_THREADS = False
USE_SPIN_POOL = True            # split fused products on `spin.SpinPool`'s polling workers (docs/engine.md, "Threads")
_SPIN_PIECES_PER_THREAD = 2
_SPLIT_MIN_MACS = 1 << 18      # smaller fused products run on the caller alone
NIB_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
BYTE_TYPES = frozenset({T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K})
K_TYPES = frozenset({T.Q4_K, T.Q5_K, T.Q6_K})  # 256-weight super-blocks, decoded to 32- (Q6_K: 16-) weight blocks
QUANT_TYPES = NIB_TYPES | BYTE_TYPES

_kernels: Any = None
_kernels_error: str | None = None
_launch_lock = threading.Lock()     # numba's workqueue threading layer must not be entered by two threads
_tls = threading.local()


def kernels() -> Any:
    """The compiled kernels module (imported once), or None if numba cannot load (see `unavailable_reason`)."""
    global _kernels, _kernels_error
    if _kernels is None and _kernels_error is None:
        try:
            from engine.model import qkernels
            _kernels = qkernels
        except Exception as e:                           # ImportError, or numba/llvmlite failing to initialise
            _kernels_error = f"{type(e).__name__}: {e}"
    return _kernels


def available() -> bool:
    return kernels() is not None


_warned = False


def warn_unavailable() -> None:
    """One warning per process that "q" fell back to "f32"."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"numerics 'q' needs numba, which cannot be loaded ({_kernels_error}); using 'f32'",
                      RuntimeWarning, stacklevel=3)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def _no_m(d: np.ndarray) -> np.ndarray:
    """m of a type without offset: none ([ne1, 0]; the kernels read no m when not has_m)."""
    return np.empty((d.shape[0], 0), np.float32)


def decode_blocks(data: np.ndarray, qtype: GGMLQuantizationType,
                  shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """A tensor's raw GGUF blocks [ne1, row bytes] -> (q [ne1, ne0] integer quants (uint8 for 4-bit types,
    int8 otherwise), d [ne1, ne0 / bs], m [ne1, ne0 / bs] float32 ([ne1, 0] when not has_m), has_m) with
    W = d * q + m (or d * q) per block of bs = `block_size(qtype)` inputs (32; Q6_K 16)."""
    if qtype in K_TYPES:
        return _decode_k(data, qtype, shape)
    ne1, ne0 = shape
    block, size = GGML_QUANT_SIZES[qtype]
    nb = ne0 // block
    blk = np.asarray(data, dtype=np.uint8).reshape(ne1, nb, size)
    d = _f16(blk[..., 0:2])
    if qtype == T.Q8_0:
        return np.ascontiguousarray(blk[..., 2:].view(np.int8)).reshape(ne1, ne0), d, _no_m(d), False
    if qtype in (T.Q4_0, T.Q4_1):
        qs = blk[..., 2:] if qtype == T.Q4_0 else blk[..., 4:]                    # [ne1, nb, 16]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)                           # elements j, j + 16
        m = -8.0 * d if qtype == T.Q4_0 else _f16(blk[..., 2:4])
        return q.reshape(ne1, ne0), d, m.astype(np.float32), True
    if qtype in (T.Q5_0, T.Q5_1):
        off = 2 if qtype == T.Q5_0 else 4
        qh = blk[..., off:off + 4].copy().view("<u4")[..., 0]                    # [ne1, nb]
        qs = blk[..., off + 4:]                                                   # [ne1, nb, 16]
        bits = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1              # [ne1, nb, 32]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int16) | (bits.astype(np.int16) << 4)
        if qtype == T.Q5_0:
            return (q - 16).astype(np.int8).reshape(ne1, ne0), d, _no_m(d), False
        return q.astype(np.int8).reshape(ne1, ne0), d, _f16(blk[..., 2:4]), True
    raise ValueError(f"{qtype.name} has no quant kernel")


def block_size(qtype: GGMLQuantizationType) -> int:
    """Inputs per (d, m) pair once decoded: 32, or 16 for Q6_K (its int8 scales are per 16 weights)."""
    return 16 if qtype == T.Q6_K else 32


def _scale_min_k4(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> the 8 sub-blocks' 6-bit scales and mins [..., 8] (uint8), as
    llama.cpp's get_scale_min_k4 (ggml-quants.c): sub-block j < 4 in the low 6 bits of bytes j (scale) and
    j + 4 (min); j >= 4 in the nibbles of byte j + 4 (low: scale, high: min) with bits 4-5 from the top two
    bits of bytes j - 4 (scale) and j (min)."""
    lo, mid, top = sc[..., 0:4], sc[..., 4:8], sc[..., 8:12]
    scale = np.concatenate([lo & 63, (top & 15) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (top >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scale, mins


def _decode_k(data: np.ndarray, qtype: GGMLQuantizationType,
              shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """K-quant super-blocks (256 weights) -> `decode_blocks`' form, per 32-weight sub-block (Q6_K: 16).

    Q4_K / Q5_K (dequantize_row_q4_K / _q5_K): W = (d sc) q - (dmin mn) with d, dmin fp16, sc, mn 6-bit, q
    4-bit (Q5_K: + 16 x a bit of qh): block d = d sc, m = -(dmin mn), both exact in float32 (11 + 6 bits), and
    d q exact too (<= 22 bits), so d q + m rounds once, like the reference's d q - dmin mn. Each 64 weights
    are 32 bytes of qs: low nibbles the first 32, high nibbles the next; Q5_K's 5th bit of sub-block s is bit
    s of qh[l]. Q6_K (dequantize_row_q6_K): W = (d sc) q with sc int8 per 16 weights and q = 4 bits of ql
    | 2 bits of qh << 4, minus 32; d sc (<= 18 significant bits) times q (<= 5) is exact, so m = 0."""
    ne1, ne0 = shape
    size = GGML_QUANT_SIZES[qtype][1]
    ns = ne0 // 256
    blk = np.asarray(data, dtype=np.uint8).reshape(ne1, ns, size)
    if qtype == T.Q6_K:
        ql = blk[..., 0:128].reshape(ne1, ns, 2, 64)
        qh = blk[..., 128:192].reshape(ne1, ns, 2, 1, 32)
        sc = blk[..., 192:208].view(np.int8).astype(np.float32)                  # [ne1, ns, 16]
        d = _f16(blk[..., 208:210])                                              # [ne1, ns]
        low = np.concatenate([ql & 15, ql >> 4], axis=-1)                        # [ne1, ns, 2, 128]
        high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3             # [ne1, ns, 2, 4, 32]
        q = (low | (high.reshape(ne1, ns, 2, 128) << 4)).astype(np.int8) - np.int8(32)
        ds = (d[..., None] * sc).reshape(ne1, ns * 16)
        return q.reshape(ne1, ne0), ds, _no_m(ds), False
    d = _f16(blk[..., 0:2])
    dmin = _f16(blk[..., 2:4])
    scale, mins = _scale_min_k4(blk[..., 4:16])
    ds = (d[..., None] * scale.astype(np.float32)).reshape(ne1, ns * 8)
    ms = -(dmin[..., None] * mins.astype(np.float32)).reshape(ne1, ns * 8)
    off = 16 if qtype == T.Q4_K else 48
    qs = blk[..., off:off + 128].reshape(ne1, ns, 4, 1, 32)
    q = (qs >> np.array([0, 4], np.uint8)[:, None]) & 15                          # [ne1, ns, 4, 2, 32]
    if qtype == T.Q4_K:
        return np.ascontiguousarray(q).reshape(ne1, ne0), ds, ms, True
    qh = blk[..., 16:48].reshape(ne1, ns, 1, 32)
    hi = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1                        # [ne1, ns, 8, 32]
    q = q.reshape(ne1, ns, 8, 32) | (hi << 4)
    return q.astype(np.int8).reshape(ne1, ne0), ds, ms, True


@dataclass(frozen=True, slots=True)
class QPart:
    """Output columns kept quantized, in the kernels' layout (see `qkernels`): W[o, bs b + j] = d[b, o] * q + m[b, o].

    nib: q [nb, 16, n_out] uint8 (low nibble element j, high nibble element j + 16; bs = 32); byte:
    q [nb, bs, n_out] int8 (bs = 32, or 16 for Q6_K)."""

    nib: bool
    q: np.ndarray
    d: np.ndarray            # [nb, n_out] float32
    m: np.ndarray            # [nb, n_out] float32; [0, n_out] when not has_m
    has_m: bool

    @classmethod
    def from_quants(cls, q: np.ndarray, d: np.ndarray, m: np.ndarray, has_m: bool, nib: bool) -> QPart:
        """From `decode_blocks` output (q [n_out, n_in], d/m [n_out, nb]; bs = n_in / nb, 32 when nib)."""
        n_out, n_in = q.shape
        nb = d.shape[1]
        bs = n_in // nb
        if nib and bs != 32:
            raise ValueError("nibble parts have blocks of 32")
        qb = q.reshape(n_out, nb, bs)
        if nib:
            packed = (qb[..., :16] | (qb[..., 16:] << 4)).astype(np.uint8)          # [n_out, nb, 16]
        else:
            packed = qb.astype(np.int8)
        return cls(nib=nib, q=np.ascontiguousarray(packed.transpose(1, 2, 0)),
                   d=np.ascontiguousarray(d.T, dtype=np.float32), m=np.ascontiguousarray(m.T, dtype=np.float32),
                   has_m=has_m)

    @classmethod
    def from_tensor(cls, data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QPart:
        q, d, m, has_m = decode_blocks(data, qtype, shape)
        return cls.from_quants(q, d, m, has_m, qtype in NIB_TYPES)

    @property
    def block(self) -> int:
        """Inputs per (d, m) pair."""
        return 32 if self.nib else self.q.shape[1]

    @property
    def n_in(self) -> int:
        return self.q.shape[0] * self.block

    @property
    def n_out(self) -> int:
        return self.q.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes a product reads (m only when it is used)."""
        return self.q.nbytes + self.d.nbytes + (self.m.nbytes if self.has_m else 0)

    @property
    def resident_bytes(self) -> int:
        """Bytes held (a fused part may hold m it does not use: the -0.0 of its pieces without m)."""
        return self.q.nbytes + self.d.nbytes + self.m.nbytes

    def scaled(self, s: np.float32) -> QPart:
        """W * s (d and m times s: exact when s is a power of two, as 1/sqrt(head_dim) = 1/8 for SmolLM2)."""
        return replace(self, d=self.d * s, m=self.m * s)

    def dense(self) -> np.ndarray:
        """W [n_out, n_in] float32 (tests, references)."""
        out = np.empty((self.n_in, self.n_out), np.float32)
        k = kernels()
        if k is not None:
            if self.nib:
                k.dequant_nib(self.q, self.d, self.m, 0, self.n_out, out)
            else:
                k.dequant_byte(self.q, self.d, self.m, 0, self.n_out, out, self.has_m)
            return out.T
        nb = self.q.shape[0]
        q = (np.concatenate([self.q & 15, self.q >> 4], axis=1) if self.nib else self.q).astype(np.float32)
        w = q * self.d[:, None, :] + (self.m[:, None, :] if self.has_m else np.float32(-0.0))
        return w.reshape(nb * self.block, -1).T


HALF_TYPES = frozenset({T.F16, T.BF16})


@dataclass(frozen=True, slots=True)
class HalfPart:
    """Output columns of F16 / BF16 weights kept as they are: w [n_in, n_out] uint16 bit patterns (transposed,
    like `Linear.t`), W[o, i] = float32(w[i, o]) * s[o] (s: a factor per output, 1 but for the Q rows)."""

    w: np.ndarray            # [n_in, n_out] uint16
    s: np.ndarray            # [n_out] float32
    bf: bool                 # bfloat16 (else IEEE fp16)

    @classmethod
    def from_tensor(cls, data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> HalfPart:
        ne1, ne0 = shape
        bits = np.asarray(data).view(np.uint16).reshape(ne1, ne0)
        return cls(w=np.ascontiguousarray(bits.T), s=np.ones(ne1, np.float32), bf=qtype == T.BF16)

    @property
    def n_in(self) -> int:
        return self.w.shape[0]

    @property
    def n_out(self) -> int:
        return self.w.shape[1]

    @property
    def nbytes(self) -> int:
        return self.w.nbytes + self.s.nbytes

    @property
    def resident_bytes(self) -> int:
        return self.nbytes

    def scaled(self, s: np.float32) -> HalfPart:
        """W * s: each weight's fl(w s) in the tiles, as f32 mode's scaled rows; the fused kernel scales the
        sums instead (exact when s is a power of two)."""
        return replace(self, s=self.s * s)

    def dense(self) -> np.ndarray:
        """W [n_out, n_in] float32 (tests, references)."""
        out = np.empty((self.n_in, self.n_out), np.float32)
        kernels().dequant_half(self.w, self.s, 0, self.n_out, out, self.bf)
        return out.T


def concat_parts(parts: list[QPart | HalfPart]) -> QPart | HalfPart:
    """Parts of the same kind (nib or byte, block size; F16 or BF16) fused along the outputs."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], HalfPart):
        return HalfPart(w=np.concatenate([p.w for p in parts], axis=1), s=np.concatenate([p.s for p in parts]),
                        bf=parts[0].bf)
    has_m = any(p.has_m for p in parts)
    # a piece without m joining pieces with one gets m = -0.0: d q + (-0.0) is d q bit for bit (x + -0 = x)
    ms = [p.m if p.has_m or not has_m else np.full_like(p.d, -0.0) for p in parts]
    return QPart(nib=parts[0].nib, q=np.concatenate([p.q for p in parts], axis=2),
                 d=np.concatenate([p.d for p in parts], axis=1), m=np.concatenate(ms, axis=1), has_m=has_m)


@dataclass(frozen=True, slots=True)
class QuantLinear:
    """A weight for "q" numerics: parts along the outputs, each a `QPart`, a `HalfPart` or a float32 `Linear`."""

    parts: tuple[QPart | HalfPart | Linear, ...]
    n_in: int
    n_out: int

    @property
    def stream_bytes(self) -> int:
        return sum(p.stream_bytes if isinstance(p, Linear) else p.nbytes for p in self.parts)

    @property
    def resident_bytes(self) -> int:
        return sum(p.resident_bytes for p in self.parts)

    @property
    def weight(self) -> np.ndarray:
        """W [n_out, n_in] float32, dequantized (tests, references; not used to compute)."""
        return np.concatenate([p.weight if isinstance(p, Linear) else p.dense() for p in self.parts])


def quant_linear(pieces: list[tuple[np.ndarray | None, GGMLQuantizationType, Any]]) -> QuantLinear:
    """Fuse (w float32 or None, type, QPart or None) pieces along the outputs; consecutive pieces of one kind
    share a part."""
    groups: list[tuple[str, list]] = []
    for w, _, extra in pieces:
        kind = ((extra.nib, extra.block) if isinstance(extra, QPart) else ("half", extra.bf)
                if isinstance(extra, HalfPart) else "f32")
        item = w if kind == "f32" else extra
        if groups and groups[-1][0] == kind:
            groups[-1][1].append(item)
        else:
            groups.append((kind, [item]))
    parts: list[QPart | HalfPart | Linear] = []
    for kind, items in groups:
        if kind == "f32":
            parts.append(Linear.from_weight(np.concatenate(items) if len(items) > 1 else items[0]))
        else:
            parts.append(concat_parts(items))
    n_in = parts[0].n_in
    if any(p.n_in != n_in for p in parts):
        raise ValueError("fused pieces have different input sizes")
    return QuantLinear(parts=tuple(parts), n_in=n_in, n_out=sum(p.n_out for p in parts))


class QuantEmbedding:
    """The token embedding kept quantized: `emb[ids]` dequantizes those rows (float32 [len(ids), n_embd])."""

    def __init__(self, part: QPart | HalfPart):
        self.part = part
        self.shape = (part.n_out, part.n_in)
        self.dtype = np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        return self.part.resident_bytes

    def __getitem__(self, ids: Any) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        out = np.empty((ids.shape[0], self.part.n_in), np.float32)
        p = self.part
        if isinstance(p, HalfPart):
            kernels().embed_half(p.w, p.s, ids, out, p.bf)
        else:
            kernels().embed_rows(p.q, p.d, p.m, p.nib, p.has_m, ids, out)
        return out


def _set_numba_threads(n: int) -> None:
    """numba.set_num_threads(n) for the calling thread (thread-local in numba), once per thread and value."""
    if getattr(_tls, "n", None) != n:
        import numba
        numba.set_num_threads(n)
        _tls.n = n


def numba_threads_limit() -> int:
    import numba
    return int(numba.config.NUMBA_NUM_THREADS)


class QuantMatmul(Matmul):
    """`Matmul` over `QuantLinear`s: fused kernels on numba's threads for few rows (`NIB_ROWS_MAX`, `BYTE_ROWS_MAX`), tiles
    dequantized to float32 + BLAS on the engine's threads for more (float32 `Linear` parts: `Matmul`)."""

    def __init__(self, n_threads: int = 1):
        super().__init__(n_threads)
        self.numba_threads = max(1, min(self.n_threads, numba_threads_limit()))
        # split fused products go to polling workers (`spin.SpinPool`, as in ggml mode); tiles + BLAS keep the
        # queue threads
        self._spin = None
        if self.n_threads > 1 and USE_SPIN_POOL and not USE_NUMBA_THREADS:
            from engine.model import spinjobs
            self._spin = spinjobs.pool(self.n_threads - 1, "q")

    def _spin_run(self, post: Any) -> bool:
        """`SpinPool.try_run` of the job `post` writes; False without a pool."""
        return self._spin is not None and self._spin.try_run(post, self.n_threads * _SPIN_PIECES_PER_THREAD)

    def close(self) -> None:
        super().close()
        if self._spin is not None:
            self._spin.close()
            self._spin = None

    def __call__(self, lin: Any, x: np.ndarray) -> np.ndarray:
        if not isinstance(lin, QuantLinear):
            return Matmul.__call__(self, lin, x)
        x = np.ascontiguousarray(x, dtype=np.float32)
        if len(lin.parts) == 1:
            return self._part(lin.parts[0], x)
        return np.concatenate([self._part(p, x) for p in lin.parts], axis=1)

    def _part(self, p: QPart | HalfPart | Linear, x: np.ndarray) -> np.ndarray:
        if isinstance(p, Linear):
            return Matmul.__call__(self, p, x)
        k = kernels()
        m = x.shape[0]
        y = np.empty((m, p.n_out), np.float32)
        if isinstance(p, HalfPart):
            if m <= HALF_ROWS_MAX:
                split = self._pool is not None and m * p.n_in * p.n_out >= _SPLIT_MIN_MACS
                if split:
                    from engine.model import spinjobs as sj
                    if self._spin_run(lambda job, cuts, n: sj.post_half(job, cuts, p.w, p.s, x, y, p.bf, n, 16)):
                        return y
                self._run(lambda a, b: k.range_half(p.w, p.s, x, y, a, b, p.bf), p.n_out, 16, split)
                return y
            return self._tiles(lambda c0, c1, t: k.dequant_half(p.w, p.s, c0, c1, t, p.bf), p, x, y)
        if m <= (NIB_ROWS_MAX if p.nib else BYTE_ROWS_MAX):
            xs = x.reshape(m, -1, p.block).sum(axis=2) if p.has_m else x[:, :1]     # [M, nb] block sums
            if USE_NUMBA_THREADS:
                n_chunks = self.numba_threads * _CHUNKS_PER_THREAD
                with _launch_lock:
                    _set_numba_threads(self.numba_threads)
                    if p.nib:
                        k.decode_nib(p.q, p.d, p.m, x, xs, y, n_chunks)
                    else:
                        k.decode_byte(p.q, p.d, p.m, x, xs, y, n_chunks, p.has_m)
                return y
            split = self._pool is not None and m * p.n_in * p.n_out >= _SPLIT_MIN_MACS
            if split:
                from engine.model import spinjobs as sj
                xs_c = np.ascontiguousarray(xs)
                kind = sj.RANGE_NIB if p.nib else sj.RANGE_BYTE
                if self._spin_run(lambda job, cuts, n: sj.post_range(job, cuts, kind, p.q, p.d, p.m, x, xs_c, y,
                                                                     p.has_m, n, 16)):
                    return y
            if p.nib:
                self._run(lambda a, b: k.range_nib(p.q, p.d, p.m, x, xs, y, a, b), p.n_out, 16, split)
            else:
                self._run(lambda a, b: k.range_byte(p.q, p.d, p.m, x, xs, y, a, b, p.has_m), p.n_out, 16, split)
            return y
        if p.nib:
            return self._tiles(lambda c0, c1, t: k.dequant_nib(p.q, p.d, p.m, c0, c1, t), p, x, y)
        return self._tiles(lambda c0, c1, t: k.dequant_byte(p.q, p.d, p.m, c0, c1, t, p.has_m), p, x, y)

    def _tiles(self, deq: Any, p: QPart | HalfPart, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """y = x @ W.T by float32 tiles of `_TILE_COLS` outputs (`deq(c0, c1, tile)` fills W[c0:c1].T) and BLAS,
        output ranges over the engine's threads."""
        def cols(a: int, b: int) -> None:
            tile = np.empty((p.n_in, _TILE_COLS), np.float32)
            for c0 in range(a, b, _TILE_COLS):
                c1 = min(b, c0 + _TILE_COLS)
                t = tile[:, :c1 - c0]
                deq(c0, c1, t)
                np.matmul(x, t, out=y[:, c0:c1])
        self._run(cols, p.n_out, _TILE_COLS, self._pool is not None)
        return y
