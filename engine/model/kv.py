"""Per-sequence KV storage with llama.cpp position semantics.

Mirrors `llama_kv_cache` (`seq_rm`, `seq_add`, `seq_cp`, `clear`, `seq_pos_min/max`) and
`llama_state_seq_get_data` / `llama_state_seq_set_data` for one sequence.

Storage: each sequence has arrays `k`, `v` of shape [n_layer, n_head_kv, capacity, head_dim] holding its
cells compacted in position order (cell i has position `pos[i]`, sorted non-decreasing). Head-major layout
so that attention reads `k[l, :, :n]` as n_head_kv contiguous [n, head_dim] matrices for BLAS. Non-unified:
each sequence may hold `n_ctx_seq` cells. Unified: all sequences share one pool of `n_ctx = n_seq * n_ctx_seq`
cells (only the accounting differs; `seq_cp` copies count as new cells, where llama.cpp shares them).

Pool: the sequences' arrays are views `pool_k[:, seq]` of one array `pool_k` [n_layer, n_seq, n_head_kv, cap,
head_dim] (same for V) with one capacity for all. The forward pass then attends the
one-token chunks of many sequences with a few batched matmuls over `pool_k[layer, lo:hi]` instead of a loop
of small calls per sequence. The pool is allocated once, at its full capacity, when a sequence first needs
cells (as llama.cpp allocates its KV cache when the context is created): growing it by doubling copied every
pooled sequence's cells inside the step that crossed a power of two (a 19 ms decode step took 118 ms at cell
512). Its pages come from an anonymous mapping (`lazy_zeros`: zero pages supplied on first touch, transparent
huge pages refused). A `resident` store (the engine's, `Model.new_kv`; not unified) allocates the pool at its full
capacity when it is created and writes every page then, as llama.cpp clears its KV buffers when it creates the
context, so that no step pays for the first touch of its cells (`KVStore._make_resident`); a store made without
it, or a unified one (whose pool is n_seq times larger than the cells in use can be), keeps only the cells
written resident. A sequence longer than the pool's capacity
(n_ctx_seq; in unified mode at most 2 * n_ctx_seq) or than `pool_max_bytes` (virtual) allows gets arrays of
its own instead ("private", grown by doubling); the forward pass attends it alone. Where the system refuses
the pool's whole virtual size at once (ENOMEM), it grows by doubling instead.

K is stored after RoPE, so `seq_add` re-rotates the shifted cells' K by the position delta.

Float32 shadow (`KVStore.shadow`, asked for by ggml mode's compiled attention): the float32 values of an fp16
sequence's cells, K transposed ([n_layer, n_head_kv, head_dim, capacity], keys contiguous) and V as stored,
so that each step converts only the cells written since (fp16 -> float32 is exact: the values are the same).
`valid[layer]` counts the leading cells whose shadow is current; every operation that changes cells below it
(`seq_rm`, `seq_add`, `seq_cp`, `state_load`, re-sorting) lowers it (moving cells to larger arrays does not
change them), and cells at n and beyond (the batch being written, not yet committed) are always re-converted
by the reader. Allocated (`lazy_zeros`) on first use, per sequence, at the capacity of the sequence's arrays
(a pooled sequence: the pool's; a private one: its own, regrown with it), so a running sequence never copies
its shadow to grow it: 2 x n_layer x n_head_kv x head_dim x 4 bytes a cell, resident only where written (a
resident store with `shadows` allocates and writes every pooled sequence's shadow when it is created).
"""

from __future__ import annotations

import mmap
import struct
import warnings
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# State blob (all little-endian):
#   header  "<4sIIIIII": magic b"SLKV", version, n_tokens, n_layer, n_head_kv, head_dim, dtype (0 f32, 1 f16)
#   pos     int32 [n_tokens]
#   k       dtype [n_layer, n_head_kv, n_tokens, head_dim]
#   v       dtype [n_layer, n_head_kv, n_tokens, head_dim]
KV_STATE_MAGIC = b"SLKV"
KV_STATE_VERSION = 1
_HEADER = struct.Struct("<4sIIIIII")
_DTYPE_CODE = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}
_CODE_DTYPE = {code: dt.newbyteorder("<") for dt, code in _DTYPE_CODE.items()}
_MIN_CAPACITY = 64
POOL_MAX_BYTES = 4 << 30     # virtual size of the shared pool; its pages are resident only once written


def lazy_zeros(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A zeroed array on an anonymous memory mapping: the kernel supplies zero pages on first touch, so untouched
    parts stay virtual (as `np.zeros`' calloc does for large sizes), and with transparent huge pages refused
    (MADV_NOHUGEPAGE, where the platform has it): under THP "always", one written cell of a KV row would
    otherwise make a 2 MB page resident. The mapping is released with the array."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if nbytes < mmap.PAGESIZE:
        return np.zeros(shape, dt)
    m = mmap.mmap(-1, nbytes)
    advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:                                # a kernel without THP: nothing to refuse
            pass
    return np.frombuffer(m, dtype=dt).reshape(shape)


RESIDENT_MAX_SHARE = 0.5     # a resident store larger than this share of the available memory stays lazy


def available_memory_bytes() -> int | None:
    """The memory the system can give without swapping (/proc/meminfo's MemAvailable; None where unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def _touch(a: np.ndarray) -> None:
    """Write one element of every memory page of the contiguous array `a` (its zeros stay zeros): the kernel
    supplies each page now instead of on a later first write."""
    flat = a.reshape(-1)
    flat[::max(1, mmap.PAGESIZE // flat.itemsize)] = 0


class KVCacheFull(RuntimeError):
    """No room for the tokens (llama_decode returning 1: "could not find a KV slot")."""


class Rotator(Protocol):
    def rerotate(self, k: np.ndarray, delta: int) -> None:
        """Rotate post-RoPE keys `k` [..., head_dim] (float32 or float16 cells) in place as if their positions
        moved by `delta`."""


@dataclass(slots=True)
class Shadow:
    """Float32 values of one sequence's fp16 cells (see the module docstring)."""
    kt: np.ndarray      # [n_layer, n_head_kv, head_dim, capacity] float32: K transposed
    v: np.ndarray       # [n_layer, n_head_kv, capacity, head_dim] float32
    valid: np.ndarray   # [n_layer] int64: cells 0..valid[l]-1 of layer l are current

    @property
    def nbytes(self) -> int:
        return self.kt.nbytes + self.v.nbytes


@dataclass(slots=True)
class SeqKV:
    k: np.ndarray       # [n_layer, n_head_kv, capacity, head_dim]; a view of the pool when `pooled`
    v: np.ndarray       # [n_layer, n_head_kv, capacity, head_dim]
    pos: np.ndarray     # [capacity] int32; cells 0..n-1 used, positions sorted (non-decreasing)
    n: int = 0
    seq: int = 0        # sequence id (index into the pool's second axis)
    pooled: bool = True
    shadow: Shadow | None = None    # float32 values of fp16 cells (KVStore.shadow), allocated on first use


class KVStore:
    """KV cells of `n_seq` sequences (ids 0..n_seq-1)."""

    def __init__(self, n_seq: int, n_ctx_seq: int, n_layer: int, n_head_kv: int, head_dim: int,
                 rotator: Rotator, unified: bool = False, dtype: np.dtype | type = np.float32,
                 pool_max_bytes: int = POOL_MAX_BYTES, resident: bool = False, shadows: bool = False):
        if n_seq <= 0 or n_ctx_seq <= 0:
            raise ValueError(f"n_seq ({n_seq}) and n_ctx_seq ({n_ctx_seq}) must be positive")
        self.dtype = np.dtype(dtype)
        if self.dtype not in _DTYPE_CODE:
            raise ValueError(f"KV dtype must be float32 or float16, got {self.dtype}")
        self.n_seq, self.n_ctx_seq, self.unified = n_seq, n_ctx_seq, unified
        self.n_ctx = n_seq * n_ctx_seq
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, n_head_kv, head_dim
        self.rotator = rotator
        self._cell_values = 2 * n_layer * n_head_kv * head_dim          # K and V values a cell holds
        cell_bytes = self._cell_values * self.dtype.itemsize
        # Pool capacity per sequence: its own limit, but in unified mode at most 2 * n_ctx_seq (a sequence may
        # use the whole n_ctx, and n_seq * n_ctx cells would be n_seq times what the configuration asks for;
        # with transparent huge pages even lightly used pool rows can become resident). Longer sequences go
        # private. And the pool's virtual size stays within pool_max_bytes.
        seq_max = min(self.n_ctx, 2 * n_ctx_seq) if unified else n_ctx_seq
        self._pool_cap_max = min(seq_max, max(0, int(pool_max_bytes)) // (n_seq * cell_bytes))
        # resident: the pool (and with `shadows`, every sequence's float32 shadow) allocated at its full capacity
        # and every page written now, not on a step's first write (see `_make_resident`). Not in unified mode: its
        # pool holds up to 2 * n_ctx_seq cells a sequence (n_seq * n_ctx_seq = n_ctx each for llama-server's
        # default, 4x the n_ctx cells that can be in use at once), so it stays lazy and only the cells in use are
        # resident, as llama.cpp's n_ctx cells would be
        self.resident = bool(resident) and not unified
        self._resident_shadows = self.resident and bool(shadows)
        self.pool_k: np.ndarray | None = None
        self.clear()

    # --- accounting -----------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """State bytes one cached token costs: its position (int32) plus K and V over all layers."""
        return 4 + self._cell_values * self.dtype.itemsize

    @property
    def n_cells_used(self) -> int:
        return sum(s.n for s in self._seqs)

    def seq_limit(self, seq: int) -> int:
        """Most cells `seq` could hold right now (its own cap; in unified mode what the pool leaves)."""
        s = self._seq(seq)
        if self.unified:
            return self.n_ctx - self.n_cells_used + s.n
        return self.n_ctx_seq

    def n_tokens(self, seq: int) -> int:
        return self._seq(seq).n

    def pos_min(self, seq: int) -> int:
        """`llama_memory_seq_pos_min`: smallest position of `seq`, -1 when empty."""
        s = self._seq(seq)
        return int(s.pos[0]) if s.n else -1

    def pos_max(self, seq: int) -> int:
        """`llama_memory_seq_pos_max`: largest position of `seq`, -1 when empty."""
        s = self._seq(seq)
        return int(s.pos[s.n - 1]) if s.n else -1

    def positions(self, seq: int) -> np.ndarray:
        s = self._seq(seq)
        return s.pos[:s.n].copy()                              # [n] int32

    # --- llama.cpp memory operations ------------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove cells with p0 <= pos < p1 (p0 < 0: from 0; p1 < 0: to the end); seq < 0: every sequence."""
        for s in self._targets(seq):
            lo, hi = self._index_range(s, p0, p1)
            if lo < hi:
                self._delete(s, lo, hi)
        return True

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions in [p0, p1) by `delta` and re-rotate their K; cells moved below 0 are removed."""
        if delta == 0:
            return
        for s in self._targets(seq):
            lo, hi = self._index_range(s, p0, p1)
            if lo >= hi:
                continue
            s.pos[lo:hi] += delta
            self._invalidate(s, lo)
            self.rotator.rerotate(s.k[:, :, lo:hi], delta)    # [n_layer, n_head_kv, hi-lo, head_dim], in place
            n_neg = int(np.count_nonzero(s.pos[lo:hi] < 0))
            if n_neg:                                          # positions are sorted: the negatives lead
                self._delete(s, lo, lo + n_neg)
            self._restore_order(s)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy src's cells in [p0, p1) to dst, replacing dst's cells in that range."""
        if src == dst:
            return
        s, d = self._seq(src), self._seq(dst)
        lo, hi = self._index_range(s, p0, p1)
        n_copy = hi - lo
        dlo, dhi = self._index_range(d, p0, p1)
        n_new = d.n - (dhi - dlo) + n_copy
        limit = self.n_ctx - self.n_cells_used + d.n if self.unified else self.n_ctx_seq
        if n_new > limit:
            raise KVCacheFull(f"seq_cp {src}->{dst}: {n_new} cells do not fit (limit {limit})")
        k = np.concatenate([d.k[:, :, :dlo], s.k[:, :, lo:hi], d.k[:, :, dhi:d.n]], axis=2)
        v = np.concatenate([d.v[:, :, :dlo], s.v[:, :, lo:hi], d.v[:, :, dhi:d.n]], axis=2)
        pos = np.concatenate([d.pos[:dlo], s.pos[lo:hi], d.pos[dhi:d.n]])
        self._replace(dst, k, v, pos)

    def clear(self) -> None:
        """`llama_memory_clear`: every sequence empty (buffers are released; a resident store keeps its pool and
        shadows, as llama.cpp keeps its KV buffers)."""
        if self.resident and self.pool_k is not None:
            for s in self._seqs:
                if s.pooled:
                    s.n = 0
                    self._invalidate(s, 0)
                else:                              # a private sequence rejoins the pool (its arrays released)
                    s.k, s.v = self.pool_k[:, s.seq], self.pool_v[:, s.seq]
                    s.pos, s.n, s.pooled, s.shadow = np.zeros(self.pool_cap, np.int32), 0, True, None
            self._shadows_resident()
            return
        self.pool_k = None                         # [n_layer, n_seq, n_head_kv, pool_cap, head_dim]
        self.pool_v: np.ndarray | None = None
        self.pool_cap = 0
        self._seqs = [self._private(i, 0) for i in range(self.n_seq)]
        for s in self._seqs:
            s.pooled = True                        # capacity 0: joins the pool when it first needs cells
        if self.resident:
            self._make_resident()

    def _make_resident(self) -> None:
        """The pool at its full capacity and every page of it written now, as llama.cpp's KV cache is: its
        constructor (`llama_kv_cache::llama_kv_cache`, src/llama-kv-cache.cpp) allocates the buffers and clears
        them (`ggml_backend_buffer_clear(buf, 0)`), so no decode pays for the first touch of its cells. Left
        lazy, the first write of each page faults inside a step: 0.6-2.1 ns a byte on the virtual machines of
        docs/validation_sim.md §13, 6-18% more time for a prompt written into cells no sequence had used. Where
        the system refuses the whole pool at once, or the cells (and shadows) would take more than
        RESIDENT_MAX_SHARE of the available memory, the store stays lazy (warned)."""
        if self._pool_cap_max <= 0:
            return
        need = (self.n_seq * self._pool_cap_max * self._cell_values
                * (self.dtype.itemsize + (4 if self._resident_shadows else 0)))        # float32 shadows: 4 bytes
        have = available_memory_bytes()
        if have is not None and need > RESIDENT_MAX_SHARE * have:
            # a context far larger than the machine: llama.cpp would fail to allocate it; this store stays lazy
            # (pages supplied as cells are written) so that what fits still runs
            warnings.warn(f"KV cells of {need / 2**20:.0f} MiB exceed {RESIDENT_MAX_SHARE:.0%} of the available "
                          f"memory ({have / 2**20:.0f} MiB): allocated lazily, so a step that first writes a page "
                          "pays for it (a smaller -c keeps them resident)", RuntimeWarning, stacklevel=3)
            return
        try:
            self._grow_pool(self._pool_cap_max)
        except (OSError, MemoryError):
            return
        _touch(self.pool_k)
        _touch(self.pool_v)
        self._shadows_resident()

    def _shadows_resident(self) -> None:
        """With `shadows`: every pooled sequence's shadow allocated at the pool's capacity and written."""
        if not self._resident_shadows or self.pool_k is None:
            return
        for s in self._seqs:
            if s.pooled and (s.shadow is None or s.shadow.v.shape[2] < self.pool_cap):
                try:
                    sh = self._new_shadow(self.pool_cap)
                except (OSError, MemoryError):
                    return
                _touch(sh.kt)
                _touch(sh.v)
                s.shadow = sh

    # --- state (slot save / host-RAM prompt cache) -------------------------------------------------------

    def state_size(self, seq: int) -> int:
        return _HEADER.size + self._seq(seq).n * self.bytes_per_token

    def state_save(self, seq: int) -> memoryview:
        """One sequence's cells as a read-only bytes-like blob (layout at the top of this module).

        The cells are copied once, straight from the KV arrays into the blob's own buffer (`np.empty`: its
        pages are first touched by that copy). Building it from `tobytes()` parts joined into `bytes` copied
        every byte three times into fresh memory: 1.8 ns a byte against 0.2 for SmolLM2's f32 cells (docs/engine.md,
        "Saving a sequence's state")."""
        s = self._seq(seq)
        n = s.n
        size = self.state_size(seq)
        buf = np.empty(size, np.uint8)
        _HEADER.pack_into(buf, 0, KV_STATE_MAGIC, KV_STATE_VERSION, n, self.n_layer, self.n_head_kv,
                          self.head_dim, _DTYPE_CODE[self.dtype])
        off = _HEADER.size
        buf[off:off + 4 * n].view("<i4")[:] = s.pos[:n]
        off += 4 * n
        dt = self.dtype.newbyteorder("<")
        shape = (self.n_layer, self.n_head_kv, n, self.head_dim)
        n_bytes = self.n_layer * self.n_head_kv * n * self.head_dim * dt.itemsize
        for src in (s.k, s.v):
            buf[off:off + n_bytes].view(dt).reshape(shape)[...] = src[:, :, :n]
            off += n_bytes
        return memoryview(buf).toreadonly()

    def state_load(self, seq: int, data: bytes | memoryview) -> None:
        """Replace `seq`'s cells with a `state_save` blob (any bytes-like object; its cells are copied once,
        into the KV arrays); any mismatch raises before anything changes."""
        self._seq(seq)
        if len(data) < _HEADER.size:
            raise ValueError(f"KV state too short: {len(data)} bytes < header {_HEADER.size}")
        magic, version, n, n_layer, n_head_kv, head_dim, code = _HEADER.unpack_from(data, 0)
        if magic != KV_STATE_MAGIC:
            raise ValueError(f"KV state has bad magic {magic!r}, expected {KV_STATE_MAGIC!r}")
        if version != KV_STATE_VERSION:
            raise ValueError(f"KV state version {version} is not supported (expected {KV_STATE_VERSION})")
        if (n_layer, n_head_kv, head_dim) != (self.n_layer, self.n_head_kv, self.head_dim):
            raise ValueError(f"KV state shape (n_layer, n_head_kv, head_dim) = {(n_layer, n_head_kv, head_dim)} "
                             f"does not match this model {(self.n_layer, self.n_head_kv, self.head_dim)}")
        if code not in _CODE_DTYPE:
            raise ValueError(f"KV state has unknown dtype code {code}")
        dt = _CODE_DTYPE[code]
        n_kv = n_layer * n_head_kv * n * head_dim
        expected = _HEADER.size + 4 * n + 2 * n_kv * dt.itemsize
        if len(data) != expected:
            raise ValueError(f"KV state is {len(data)} bytes, header says {expected}")
        off = _HEADER.size
        pos = np.frombuffer(data, dtype="<i4", count=n, offset=off).astype(np.int32)
        if n and (pos[0] < 0 or np.any(np.diff(pos) < 0)):
            raise ValueError("KV state positions are not non-negative and sorted")
        limit = self.n_ctx - self.n_cells_used + self._seqs[seq].n if self.unified else self.n_ctx_seq
        if n > limit:
            raise KVCacheFull(f"KV state of {n} tokens does not fit sequence {seq} (limit {limit})")
        off += 4 * n
        shape = (n_layer, n_head_kv, n, head_dim)
        k = np.frombuffer(data, dtype=dt, count=n_kv, offset=off).reshape(shape)
        v = np.frombuffer(data, dtype=dt, count=n_kv, offset=off + n_kv * dt.itemsize).reshape(shape)
        self._replace(seq, k, v, pos)

    # --- used by the forward pass -----------------------------------------------------------------------

    def prepare_append(self, items: list[tuple[int, int, int]]) -> list[SeqKV]:
        """Check and make room for appending (seq, pos0, n_new) for each item; nothing changes on error.

        llama.cpp requires a sequence's positions to stay consecutive: a non-empty sequence continues at
        pos_max + 1. Returns each item's SeqKV; the caller writes cells n..n+n_new-1 then calls
        `commit_append`.
        """
        seen = set()
        total_new = 0
        for seq, pos0, n_new in items:
            s = self._seq(seq)
            if seq in seen:
                raise ValueError(f"sequence {seq} appears twice in one batch")
            seen.add(seq)
            if n_new <= 0:
                raise ValueError(f"empty chunk for sequence {seq}")
            if pos0 < 0 or (s.n and pos0 != int(s.pos[s.n - 1]) + 1):
                raise ValueError(f"sequence {seq}: chunk starts at position {pos0}, but the KV holds up to "
                                 f"position {self.pos_max(seq)}; positions must stay consecutive")
            if not self.unified and s.n + n_new > self.n_ctx_seq:
                raise KVCacheFull(f"sequence {seq}: {s.n} + {n_new} cells exceed n_ctx_seq {self.n_ctx_seq}")
            total_new += n_new
        if self.unified and self.n_cells_used + total_new > self.n_ctx:
            raise KVCacheFull(f"{self.n_cells_used} + {total_new} cells exceed the unified n_ctx {self.n_ctx}")
        out = []
        for seq, _pos0, n_new in items:
            s = self._seqs[seq]
            self._reserve(s, s.n + n_new)
            out.append(s)
        return out

    @staticmethod
    def commit_append(s: SeqKV, pos0: int, n_new: int) -> None:
        s.pos[s.n:s.n + n_new] = np.arange(pos0, pos0 + n_new, dtype=np.int32)
        s.n += n_new

    def seq_kv(self, seq: int) -> SeqKV:
        """Sequence `seq`'s arrays (read by the forward pass and `Model.shadow_current`)."""
        return self._seq(seq)

    def shadow(self, s: SeqKV, n_cells: int) -> Shadow:
        """`s`'s float32 shadow (module docstring) with room for `n_cells` cells: allocated (nothing current) on
        first use at the capacity of the sequence's arrays (the pool's, for a pooled sequence), grown by doubling
        (the current cells copied) only when they have grown (a private sequence), or when the system refuses
        the arrays' whole capacity at once (then as many cells as needed, doubled). The reader converts layer
        l's cells min(valid[l], s.n) .. n_tot-1 and sets valid[l]."""
        sh = s.shadow
        cap = 0 if sh is None else sh.v.shape[2]
        if n_cells <= cap:
            return sh
        need = max(_MIN_CAPACITY, cap)
        while need < n_cells:
            need *= 2
        try:
            grown = self._new_shadow(max(need, s.pos.shape[0]))        # the capacity of the sequence's arrays
        except (OSError, MemoryError):
            grown = self._new_shadow(need)
        if sh is not None:
            n = int(sh.valid.max())
            grown.kt[..., :n] = sh.kt[..., :n]
            grown.v[:, :, :n] = sh.v[:, :, :n]
            grown.valid[:] = sh.valid
        s.shadow = grown
        return grown

    def _new_shadow(self, cap: int) -> Shadow:
        return Shadow(kt=lazy_zeros((self.n_layer, self.n_head_kv, self.head_dim, cap), np.float32),
                      v=lazy_zeros((self.n_layer, self.n_head_kv, cap, self.head_dim), np.float32),
                      valid=np.zeros(self.n_layer, np.int64))

    @property
    def shadow_bytes(self) -> int:
        """Bytes (virtual) of the float32 shadows allocated so far."""
        return sum(s.shadow.nbytes for s in self._seqs if s.shadow is not None)

    # --- internals ------------------------------------------------------------------------------------

    def _seq(self, seq: int) -> SeqKV:
        if not 0 <= seq < self.n_seq:
            raise ValueError(f"sequence id {seq} out of range [0, {self.n_seq})")
        return self._seqs[seq]

    def _targets(self, seq: int) -> list[SeqKV]:
        return list(self._seqs) if seq < 0 else [self._seq(seq)]

    def _private(self, seq: int, capacity: int) -> SeqKV:
        shape = (self.n_layer, self.n_head_kv, capacity, self.head_dim)
        return SeqKV(k=lazy_zeros(shape, self.dtype), v=lazy_zeros(shape, self.dtype),
                     pos=np.zeros(capacity, np.int32), seq=seq, pooled=False)

    def _grow_pool(self, cap: int) -> None:
        """Reallocate the pool with capacity `cap` and move every pooled sequence's cells into it."""
        shape = (self.n_layer, self.n_seq, self.n_head_kv, cap, self.head_dim)
        pool_k, pool_v = lazy_zeros(shape, self.dtype), lazy_zeros(shape, self.dtype)
        for s in self._seqs:
            if not s.pooled:
                continue
            pool_k[:, s.seq, :, :s.n] = s.k[:, :, :s.n]
            pool_v[:, s.seq, :, :s.n] = s.v[:, :, :s.n]
            pos = np.zeros(cap, np.int32)
            pos[:s.n] = s.pos[:s.n]
            s.k, s.v, s.pos = pool_k[:, s.seq], pool_v[:, s.seq], pos
        self.pool_k, self.pool_v, self.pool_cap = pool_k, pool_v, cap

    def _reserve(self, s: SeqKV, n_cells: int) -> None:
        cap = s.pos.shape[0]
        if n_cells <= cap:
            return
        new_cap = max(_MIN_CAPACITY, cap)
        while new_cap < n_cells:
            new_cap *= 2
        if s.pooled:
            if n_cells <= self._pool_cap_max:
                try:
                    self._grow_pool(self._pool_cap_max)     # once: the pool's full capacity
                except (OSError, MemoryError):
                    # the system refuses that much virtual memory at once (a small machine without overcommit
                    # room): grow by doubling instead, as the pool did before it was allocated whole
                    self._grow_pool(min(new_cap, self._pool_cap_max))
                return
            s.pooled = False                       # too long for the pool: its own arrays from now on
        grown = self._private(s.seq, new_cap)
        grown.k[:, :, :s.n] = s.k[:, :, :s.n]
        grown.v[:, :, :s.n] = s.v[:, :, :s.n]
        grown.pos[:s.n] = s.pos[:s.n]
        s.k, s.v, s.pos = grown.k, grown.v, grown.pos

    @staticmethod
    def _index_range(s: SeqKV, p0: int, p1: int) -> tuple[int, int]:
        """Cell index range [lo, hi) of positions p0 <= pos < p1 (positions are sorted)."""
        pos = s.pos[:s.n]
        lo = 0 if p0 < 0 else int(np.searchsorted(pos, p0, side="left"))
        hi = s.n if p1 < 0 else int(np.searchsorted(pos, p1, side="left"))
        return lo, max(lo, hi)

    @staticmethod
    def _invalidate(s: SeqKV, lo: int) -> None:
        """Cells from lo on changed: their shadow (if any) is no longer current."""
        if s.shadow is not None:
            np.minimum(s.shadow.valid, lo, out=s.shadow.valid)

    @classmethod
    def _delete(cls, s: SeqKV, lo: int, hi: int) -> None:
        cls._invalidate(s, lo)
        n_tail = s.n - hi
        if n_tail:
            # overlapping slice copies are safe in numpy: it copies the source first when the two may overlap,
            # which for these strided views it always presumes; layer by layer that copy is one layer's cells
            for layer in range(s.k.shape[0]):
                s.k[layer, :, lo:lo + n_tail] = s.k[layer, :, hi:s.n]
                s.v[layer, :, lo:lo + n_tail] = s.v[layer, :, hi:s.n]
            s.pos[lo:lo + n_tail] = s.pos[hi:s.n]
        s.n -= hi - lo

    @classmethod
    def _restore_order(cls, s: SeqKV) -> None:
        """Re-sort cells by position after a shift moved a range past its neighbours (rare)."""
        pos = s.pos[:s.n]
        if s.n < 2 or np.all(np.diff(pos) >= 0):
            return
        cls._invalidate(s, 0)
        order = np.argsort(pos, kind="stable")
        s.k[:, :, :s.n] = s.k[:, :, order]
        s.v[:, :, :s.n] = s.v[:, :, order]
        s.pos[:s.n] = pos[order]

    def _replace(self, seq: int, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> None:
        n = pos.shape[0]
        s = self._seqs[seq]
        self._invalidate(s, 0)
        s.n, s.pooled = 0, True                    # rejoin the pool; _reserve moves it out if it is too long
        if self.pool_k is not None:
            s.k, s.v = self.pool_k[:, seq], self.pool_v[:, seq]
            s.pos = np.zeros(self.pool_cap, np.int32)
        else:
            empty = self._private(seq, 0)
            s.k, s.v, s.pos = empty.k, empty.v, empty.pos
        self._reserve(s, n)
        s.k[:, :, :n] = k
        s.v[:, :, :n] = v
        s.pos[:n] = pos
        s.n = n
