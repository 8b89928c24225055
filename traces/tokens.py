"""Deterministic stand-in token ids for traces that carry only lengths or prefix-block hashes.

Every token is a pure function of (seed, stream key, position) through SplitMix64 counters, vectorised in
numpy: equal block hashes give equal token blocks (so prefix sharing survives), a bounded cache of recent
blocks only saves recomputation, and
nothing depends on the order in which prompts are materialised. Each sequence comes as a `list` of int, or
(the `*_array` methods, for the simulator's core) as the same ids in an `array('i')`.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

from engine.core.tokens import token_array
from traces.schema import TraceRequest

MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15           # SplitMix64 increment
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB

# Stream domains: keep token streams of different purposes apart even for equal numbers.
DOMAIN_BLOCK, DOMAIN_UNIQUE, DOMAIN_SYSTEM, DOMAIN_USER, DOMAIN_REPLY = 1, 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class TokenSpace:
    """Token ids to draw from: [0, vocab_size) minus `reserved` (special / EOS ids that a synthetic
    prompt must never contain). Defaults match SmolLM2 (49,152 ids)."""

    vocab_size: int = 49152
    reserved: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"TokenSpace: vocab_size must be >= 1, got {self.vocab_size}")
        if self.n_allowed < 1:
            raise ValueError("TokenSpace: every id is reserved, nothing left to draw from")

    @property
    def n_allowed(self) -> int:
        return self.vocab_size - sum(1 for r in self.reserved if 0 <= r < self.vocab_size)


def _mix64(z: int) -> int:
    """SplitMix64 finaliser on a Python int (64-bit wrap-around)."""
    z = ((z ^ (z >> 30)) * _M1) & MASK64
    z = ((z ^ (z >> 27)) * _M2) & MASK64
    return z ^ (z >> 31)


_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)
_UM1, _UM2, _UGOLDEN = np.uint64(_M1), np.uint64(_M2), np.uint64(_GOLDEN)


def _mix64_np(z: np.ndarray) -> np.ndarray:
    """`_mix64` on a uint64 array (numpy uint64 arithmetic wraps modulo 2**64)."""
    z = (z ^ (z >> _U30)) * _UM1
    z = (z ^ (z >> _U27)) * _UM2
    return z ^ (z >> _U31)


def _mix64_np_inplace(z: np.ndarray) -> np.ndarray:
    """`_mix64_np` overwriting `z` (a fresh uint64 array the caller owns): no temporaries but one."""
    t = z >> _U30
    z ^= t
    z *= _UM1
    np.right_shift(z, _U27, out=t)
    z ^= t
    z *= _UM2
    np.right_shift(z, _U31, out=t)
    z ^= t
    return z


def _remainder_inplace(z: np.ndarray, n: np.uint64) -> None:
    """z %= n on a uint64 array, as z - (z // n) * n: exact for unsigned integers, and numpy divides by a
    scalar with a multiply-and-shift (libdivide), several times faster than its remainder loop."""
    q = z // n
    q *= n
    z -= q


def stream_key(*parts: int) -> int:
    """Fold integers (any sign, taken modulo 2**64) into one 64-bit stream key."""
    return extend_key(0, *parts)


def extend_key(key: int, *parts: int) -> int:
    """Fold more integers into a stream key: `extend_key(stream_key(*a), *b) == stream_key(*a, *b)` (so a
    shared head of the parts is folded once)."""
    k = key
    for p in parts:
        k = _mix64(((k ^ (p & MASK64)) + _GOLDEN) & MASK64)
    return k


def _as_u64(values: tuple[int, ...]) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64).view(np.uint64)
    except OverflowError:
        return np.array([v & MASK64 for v in values], dtype=np.uint64)


class PromptMaterializer:
    """Turns trace requests into token-id lists for one (TokenSpace, seed).

    Its only state is caches (of blocks and of the id table) that never change a result, so one instance
    may be shared freely; `reserved` ids are
    skipped by an order-preserving remap of [0, n_allowed) onto the allowed ids.
    """

    __slots__ = ("space", "seed", "_n_allowed", "_u_allowed", "_gaps", "_pos_mult", "_table", "_table_c", "_blocks",
                 "_block_size", "_blocks_array", "_block_size_array", "_unique_key", "_block_key")

    BLOCK_CACHE_TOKENS = 1 << 24   # ~16M token ids (128 MB of pointers) of recently used prefix blocks
    BLOCK_CACHE_TOKENS_ARRAY = 1 << 25   # the same 128 MB as C ints (array blocks): ~32M token ids

    def __init__(self, space: TokenSpace, seed: int) -> None:
        self.space = space
        self.seed = int(seed)
        self._n_allowed = space.n_allowed
        self._u_allowed = np.uint64(self._n_allowed)
        reserved = sorted(r for r in space.reserved if 0 <= r < space.vocab_size)
        # allowed ids below reserved[j] = reserved[j] - j; searchsorted on it counts the reserved ids to skip
        self._gaps = np.array(reserved, dtype=np.int64) - np.arange(len(reserved), dtype=np.int64)
        # (position + 1) * golden for positions 0.., grown on demand: the per-position half of the counter
        self._pos_mult = np.zeros(0, dtype=np.uint64)
        self._table: np.ndarray | None = None
        self._table_c: np.ndarray | None = None      # the same ids as C ints, for _draw_array
        # (block hash) -> its tokens, for one block size; a pure cache (values are functions of seed, hash)
        self._blocks: dict[int, list[int]] = {}
        self._block_size = 0
        self._blocks_array: dict[int, array] = {}       # the same blocks for prompt_array
        self._block_size_array = 0
        self._unique_key = stream_key(self.seed, DOMAIN_UNIQUE)   # heads of the per-request and block keys
        self._block_key = stream_key(self.seed, DOMAIN_BLOCK)

    def _id_table(self) -> np.ndarray:
        """[n_allowed] object array: draw index -> token id as a shared Python int. Indexing it and calling
        tolist() reuses one int object per id instead of allocating one per token (faster, and millions
        of prompt tokens then cost a pointer each)."""
        if self._table is None:
            idx = np.arange(self._n_allowed, dtype=np.int64)
            if len(self._gaps):
                idx += np.searchsorted(self._gaps, idx, side="right")
            self._table = np.array(idx.tolist(), dtype=object)
        return self._table

    def _pos(self, end: int) -> np.ndarray:
        """(position + 1) * golden for positions 0 .. end-1 (at least)."""
        if len(self._pos_mult) < end:
            size = max(end, 2 * len(self._pos_mult), 4096)
            self._pos_mult = (np.arange(size, dtype=np.uint64) + np.uint64(1)) * _UGOLDEN
        return self._pos_mult

    def _draw(self, z: np.ndarray) -> list[int]:
        """Counters (a fresh uint64 array, overwritten) -> token ids."""
        _mix64_np_inplace(z)
        _remainder_inplace(z, self._u_allowed)
        return self._id_table().take(z.view(np.int64)).tolist()                  # [n] allowed ids

    DRAW_CHUNK = 1 << 15           # counters mixed per numpy pass: 256 KB of uint64, so the ~12 passes stay in cache

    def _draw_array(self, z: np.ndarray) -> array:
        """`_draw` into an array('i'): the ids go from numpy to the array in one copy. Long counter arrays are
        drawn DRAW_CHUNK at a time (each token is a function of its own counter only, so the ids are the same;
        a pass over 2M counters that spill the cache costs ~6x more per token than over 32k)."""
        if self.space.vocab_size > 2 ** 31:
            raise ValueError(f"TokenSpace: vocab_size {self.space.vocab_size} does not fit array('i') token ids")
        n = len(z)
        if n > self.DRAW_CHUNK:
            out = token_array()
            for i in range(0, n, self.DRAW_CHUNK):
                out += self._draw_array(z[i:i + self.DRAW_CHUNK])     # (a view: mixed in place, as z is)
            return out
        _mix64_np_inplace(z)
        _remainder_inplace(z, self._u_allowed)
        idx = z.view(np.int64)
        if len(self._gaps) and self._n_allowed > 1 << 22:    # (a table would be large)
            ids = (idx + np.searchsorted(self._gaps, idx, side="right")).astype(np.intc)
        elif len(self._gaps):                    # draw index -> allowed id through a C-int table (in cache)
            if self._table_c is None:
                t = np.arange(self._n_allowed, dtype=np.int64)
                self._table_c = (t + np.searchsorted(self._gaps, t, side="right")).astype(np.intc)
            ids = self._table_c.take(idx)
        else:
            ids = idx.astype(np.intc)
        out = token_array()
        out.frombytes(memoryview(ids).cast("B"))
        return out

    def tokens(self, key: int, n: int, start: int = 0) -> list[int]:
        """Positions start .. start+n-1 of the token stream `key` (see `stream_key`)."""
        if n <= 0:
            return []
        end = start + n
        return self._draw(self._pos(end)[start:end] + np.uint64(key & MASK64))    # [n] uint64 counters

    def tokens_array(self, key: int, n: int, start: int = 0) -> array:
        """`tokens` as an array('i')."""
        if n <= 0:
            return token_array()
        end = start + n
        return self._draw_array(self._pos(end)[start:end] + np.uint64(key & MASK64))

    def block(self, block_hash: int, block_size: int) -> list[int]:
        """The tokens of one prefix block; a pure function of (seed, block_hash)."""
        return self.tokens(stream_key(self.seed, DOMAIN_BLOCK, block_hash), block_size)

    def prompt(self, req: TraceRequest) -> list[int]:
        """`n_prompt` token ids for a request: its real tokens, else its blocks, else a unique stream.

        Blocks cover the prompt in order and the last is cut at `n_prompt`; if the hashes cover fewer
        than `n_prompt` tokens the rest comes from the request's unique stream (seed, index).
        """
        if req.prompt_tokens is not None:
            return list(req.prompt_tokens)
        return self._prompt(req, False)

    def prompt_array(self, req: TraceRequest) -> array:
        """`prompt` as an array('i') (the same ids)."""
        if req.prompt_tokens is not None:
            try:
                return token_array(req.prompt_tokens)
            except OverflowError:
                raise ValueError(f"request {req.index} (source line {req.source_line}): a prompt token id is "
                                 f"outside the C int range of array('i')") from None
        return self._prompt(req, True)

    def prompt_arrays(self, reqs: list[TraceRequest]) -> list[array]:
        """`[prompt_array(r) for r in reqs]`, the length-only requests drawn together in one numpy pass (numpy's
        per-call overhead, paid once instead of per request, is most of the cost of a short prompt)."""
        out: list = [None] * len(reqs)
        plain = []                                   # (position in out, request) of length-only requests
        blocked: dict[int, list] = {}                # block size -> (position in out, request) of block prompts
        for i, r in enumerate(reqs):
            if r.prompt_tokens is not None:
                out[i] = self.prompt_array(r)
            elif r.block_hashes and r.block_size > 0:
                blocked.setdefault(r.block_size, []).append((i, r))
            elif r.n_prompt > 0:
                plain.append((i, r))
            else:
                out[i] = self.prompt_array(r)
        for group in blocked.values():
            self._block_prompts(group, out)
        if len(plain) == 1:
            i, r = plain[0]
            out[i] = self.prompt_array(r)
        elif plain:
            # groups of at most BATCH_TOKENS tokens (a longer prompt alone), so the position table stays small
            group: list = []
            n_group = 0
            for ir in plain:
                n = ir[1].n_prompt
                if group and n_group + n > self.BATCH_TOKENS:
                    self._draw_plain(group, out)
                    group, n_group = [], 0
                group.append(ir)
                n_group += n
            self._draw_plain(group, out)
        return out

    BATCH_TOKENS = 1 << 21         # prompts drawn in one numpy pass by prompt_arrays (at most, unless one is longer)

    def _draw_plain(self, plain: list, out: list) -> None:
        """Length-only prompts (position in out, request), drawn together into `out`.

        Token j of a prompt starting at offset s of the batch has the counter key + (j + 1) * golden, which is
        (s + j + 1) * golden + (key - s * golden) modulo 2**64: the position table read at the batch offset
        plus one per-prompt constant, so no per-token index arithmetic is needed."""
        ns = np.array([r.n_prompt for _, r in plain], dtype=np.int64)
        # extend_key(unique_key, index) of every request at once (uint64 arithmetic wraps as extend_key masks)
        keys = _mix64_np((np.uint64(self._unique_key) ^ _as_u64(tuple([r.index for _, r in plain]))) + _UGOLDEN)
        ends = np.cumsum(ns)
        total = int(ends[-1])
        starts = (ends - ns).view(np.uint64)
        z = self._pos(total)[:total] + np.repeat(keys - starts * _UGOLDEN, ns)    # [total] uint64 counters
        ids = self._draw_array(z)
        off = 0
        for (i, _), end in zip(plain, ends.tolist()):
            out[i] = ids[off:end]
            off = end

    def _prompt(self, req: TraceRequest, as_array: bool):
        n = req.n_prompt
        if not req.block_hashes or req.block_size <= 0:
            unique_key = extend_key(self._unique_key, req.index)    # = stream_key(seed, DOMAIN_UNIQUE, index)
            return (self.tokens_array if as_array else self.tokens)(unique_key, n)
        if as_array:
            out = [None]
            self._block_prompts([(0, req)], out)
            return out[0]
        bs = req.block_size
        n_blocks = min(len(req.block_hashes), -(-n // bs))
        n_hashed = min(n, n_blocks * bs)
        hashes = req.block_hashes[:n_blocks]
        if bs != self._block_size:
            self._blocks, self._block_size = {}, bs
        cache = self._blocks
        got = {}
        missing = []
        for h in dict.fromkeys(hashes):
            blk = cache.pop(h, None)
            if blk is None:
                missing.append(h)
            else:
                got[h] = cache[h] = blk                                           # re-inserted: most recent
        if missing:
            self._draw_blocks(missing, bs, cache, got, False)
        out = []
        for h in hashes:
            out += got[h]
        del out[n_hashed:]
        if n_hashed < n:
            out += self.tokens(extend_key(self._unique_key, req.index), n - n_hashed, start=n_hashed)
        return out

    def _draw_blocks(self, missing: list[int], bs: int, cache: dict, got: dict, as_array: bool) -> None:
        """Draw the blocks `missing` (distinct hashes) of size bs into `got` and the block cache `cache` (its least
        recent half dropped first when it is over its size)."""
        # equal hashes repeat across requests (prefix sharing): draw each new block once, all in one go
        block_keys = _mix64_np(((np.uint64(self._block_key) ^ _as_u64(tuple(missing))) + _UGOLDEN))
        if len(cache) * bs > (self.BLOCK_CACHE_TOKENS_ARRAY if as_array else self.BLOCK_CACHE_TOKENS):
            for h in list(cache)[: len(cache) // 2]:                              # drop the least recent half
                del cache[h]
        pos = self._pos(bs)[None, :bs]
        draw = self._draw_array if as_array else self._draw
        # groups of blocks of about DRAW_CHUNK tokens (the counters of a group stay in cache)
        g = max(1, self.DRAW_CHUNK // bs) if as_array else len(missing)
        for g0 in range(0, len(missing), g):
            # counter of (block, position) = block key + (position + 1) * golden, as a [n_blocks, bs] grid
            flat = draw((block_keys[g0:g0 + g, None] + pos).ravel())            # [n_blocks * bs]
            for i, h in enumerate(missing[g0:g0 + g]):
                got[h] = cache[h] = flat[i * bs:(i + 1) * bs]

    def _block_prompts(self, group: list, out: list) -> None:
        """Block-hash prompts (position in out, request; one block size) as arrays, into `out`. The blocks that
        none of them finds in the block cache are drawn together (numpy's per-call overhead, ~30 calls for a
        prompt's new blocks, is then paid once per group); the blocks cover each prompt in order, the last one
        cut at `n_prompt`, and the rest comes from the request's unique stream (seed, index)."""
        bs = group[0][1].block_size
        if bs != self._block_size_array:
            self._blocks_array, self._block_size_array = {}, bs
        cache = self._blocks_array
        got: dict = {}                   # hash -> its block, for every block of the group
        missing = []
        todo = []
        for i, r in group:
            n = r.n_prompt
            n_blocks = min(len(r.block_hashes), -(-n // bs))
            hashes = r.block_hashes[:n_blocks]
            todo.append((i, r, n, n_blocks, hashes))
            for h in hashes:
                if h in got:
                    continue
                blk = cache.pop(h, None)
                if blk is None:
                    got[h] = None
                    missing.append(h)
                else:
                    got[h] = cache[h] = blk                                       # re-inserted: most recent
        if missing:
            self._draw_blocks(missing, bs, cache, got, True)
        for i, r, n, n_blocks, hashes in todo:
            # the blocks (the last one cut: no tail to delete afterwards) and the unique tail
            parts = [got[h] for h in hashes]
            n_hashed = min(n, n_blocks * bs)
            cut = n_hashed - (n_blocks - 1) * bs
            if parts and cut < bs:
                parts[-1] = parts[-1][:cut]
            if n_hashed < n:
                parts.append(self.tokens_array(extend_key(self._unique_key, r.index), n - n_hashed, start=n_hashed))
            a = token_array()
            for p in parts:
                a += p
            out[i] = a


def materialize_prompt(req: TraceRequest, space: TokenSpace, seed: int) -> list[int]:
    """Token ids for one request; see `PromptMaterializer.prompt` (use that class for many requests)."""
    return PromptMaterializer(space, seed).prompt(req)
