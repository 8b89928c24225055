"""The physical latency model: one term per way the numpy engine spends time in a `backend.execute()` call.

`ParametricLatency` (sim/latency.py, "simple") prices aggregate token and attention counts. This model prices
the work as the engine lays it out (engine/model/llama.py, matmul.py, f32.py), which it reads from the
step's `StepCost.calls` (each `llama_decode` call's chunks as `(seq, pos0, n_tokens)`):

- every forward call streams every weight matrix once (one row or 2..64 rows: memory-bound); a call of a
  single token takes the one-row gemv layout, which costs more than the column-blocked layout of 2..64 rows,
  and a call of more than 64 tokens the plain sgemm layout, whose packing of every weight matrix costs a
  fixed amount more (engine/model/types.py `SMALL_M_MAX`);
- each token adds its rows of the dense products (QKV, O, SwiGLU FFN), norms and RoPE;
- each chunk adds its per-layer attention dispatch, its logits row and its sampling;
- one-token chunks (decodes) of two or more sequences are attended together over the range of their
  sequence ids up to the longest context (`f32.DecodeBatch`): the batch reads rows × keys KV cells, so a
  short decode next to a long one reads as much as the long one; from 8 rows on that work is split over the
  threads. A single one-token chunk reads its own c+1 cells;
- a prompt chunk's queries are blocked by 128 (fewer when the keys are many): each block computes its
  query-key pairs and reads its keys once; a chunk of more than one block runs its blocks on the threads;
- host prompt-cache copies: `cache_save` (building a bytes blob) costs several times more per byte than
  `cache_load` (a copy into the KV pool);
- a K re-rotation per shifted cell; a fixed cost per execute();
- a long sequence's cells cost more each: Σ over one-token chunks of (n_past + 1)² (`kv_read_sq_s_per_cell2`).
  Measured on the ggml kernels (AMD EPYC, 2 threads): a decode's marginal cost per cell rises from ~2 µs below
  1k cells to ~3 µs at 1.5–2k (the query heads that share a KV head re-read it, from cache while it fits).

The ggml numerics' compiled kernels (`EngineLayout.attend_by_token`, `gdecode.decode_layer`) lay attention out
otherwise: every token attends its own cells (no query blocks, no decode batch), and the call's attention goes to
the threads as one job: a call of one token by ranges of query heads (SmolLM2's 9 heads in 4 ranges of 2, 2, 2
and 3 on 2 threads: the busiest does 5/9), a call of several by ranges of tokens (a 16-cell decode next to a
2048-cell one leaves the long one to one thread). The `*_split` terms count the busiest thread's cells and pairs;
a prompt chunk reads its keys once (later tokens find them in cache) and computes its pairs.

The **table** variant (`fit_table`, model name "table") replaces the four per-call matmul terms (weights
streamed, the one-token and the sgemm layouts, the per-token rows) by a cost per forward call that depends on
the call's token count m alone, interpolated linearly between knots (every m of 1..16 the grid measured,
then coarser up to 2048). The engine's products are not linear in m: BLAS packs each weight block for 2..64
rows, and its kernels favour some row counts (measured on OpenBLAS, f32 numerics: 1 row 36 ms, 2 rows 80, 3
rows 81, 4 rows 59 for the 30 layers' products on one thread), which no linear term can follow. The other
terms (attention, copies, shifts, per chunk, per step) stay as above.

The engine constants the layout needs (threads, the decode-batch and split thresholds, the query block, the
weight bytes of one call) are an `EngineLayout`, recorded by `slotlab calibrate` in the calibration file.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sim.latency import (
    CALIBRATION_KIND,
    FitResult,
    MeasuredOn,
    ParametricLatency,
    StepCost,
    _check_non_negative,
    _require_numbers,
    check_decode_only_args,
    fit_nonnegative,
    fit_stats,
    held_out_folds,
    load_calibration,
)

PHYSICAL_TERMS = (
    "step_s",                    # per execute() call
    "weights_s_per_byte",        # x weight_bytes per forward call: every call streams every weight matrix
    "one_token_call_s",          # per forward call of a single token (the one-row gemv layout)
    "gemm_call_s",               # per forward call of more than small_m_max tokens (the plain sgemm layout)
    "token_s",                   # per token: its rows of the dense products, norms, RoPE
    "seq_s",                     # per chunk: attention dispatch over the layers, logits row, sampling
    "kv_read_s_per_cell",        # KV cells attention reads on one thread
    "kv_read_split_s_per_cell",  # KV cells read by work split over the threads
    "attn_pair_s",               # query-key pairs of prompt chunks of one query block (one thread)
    "attn_pair_split_s",         # query-key pairs of prompt chunks whose blocks run on the threads
    "save_s_per_byte",           # bytes copied to the host-RAM prompt cache (cache_save)
    "load_s_per_byte",           # bytes restored from it (cache_load)
    "shift_s_per_cell",          # cached cells whose K is re-rotated (context shift, cache reuse)
    "kv_read_sq_s_per_cell2",    # Σ over one-token chunks of (n_past + 1)²: a long sequence's cells cost more each
)
# terms a calibration file may lack (written before they existed): they load as 0, which prices steps as before
OPTIONAL_TERMS = ("kv_read_sq_s_per_cell2",)
MODEL_CHOICES = ("simple", "physical", "table")
# the terms the table model's per-call cost replaces (its fit leaves them at 0)
TABLE_REPLACES = ("weights_s_per_byte", "one_token_call_s", "gemm_call_s", "token_s")
_REPLACED = tuple(PHYSICAL_TERMS.index(name) for name in TABLE_REPLACES)
_KEPT = tuple(i for i in range(len(PHYSICAL_TERMS)) if i not in _REPLACED)
# candidate knots of the per-call table (call token counts); a fit keeps those its rows support
CALL_KNOTS = (*range(1, 17), 24, 32, 48, 64, 65, 128, 256, 512, 768, 1024, 2048)
LAYOUT_FIELDS = ("weight_bytes", "n_threads", "small_m_max", "decode_batch_min", "decode_split_min",
                 "attn_query_block", "attn_score_budget", "n_head", "attend_by_token", "attend_split_cells",
                 "attend_pieces")


@dataclass(frozen=True, slots=True)
class EngineLayout:
    """The engine constants that decide how a forward call's work is laid out.

    weight_bytes: bytes one forward call streams (every layer matrix, norms and the output head);
    n_threads: compute threads (1: nothing is split); small_m_max: calls of 2..small_m_max tokens use the
    column-blocked matmul layout, longer ones the plain one (sgemm); decode_batch_min: one-token chunks are attended
    together from this many on (0: never, e.g. ggml numerics); decode_split_min: that batch is split over the
    threads from this many sequence rows on; attn_query_block and attn_score_budget: a prompt chunk of m
    tokens over n keys is cut into query blocks of min(m, attn_query_block, attn_score_budget // (n_head·n));
    n_head: query heads.
    attend_by_token (0 or 1): attention as the compiled kernels lay it out (ggml numerics, `gdecode.decode_layer`):
    every token attends its own cells (a decode its n_past + 1, prompt token i of a chunk pos0 + i + 1), the
    call's attention together; from `attend_split_cells` cells (summed over the call's tokens) on, with more than
    one thread, it goes to the threads in `attend_pieces` pieces: a call of one token by ranges of query heads,
    of several by ranges of tokens of near-equal cells (a token is never cut). The `*_split` terms then count the
    busiest thread's part (`physical_features`). 0: the f32 layout above (query blocks, decode batches), and
    attend_split_cells / attend_pieces unused.
    """

    weight_bytes: int
    n_threads: int = 1
    small_m_max: int = 64
    decode_batch_min: int = 2
    decode_split_min: int = 8
    attn_query_block: int = 128
    attn_score_budget: int = 1 << 22
    n_head: int = 1
    attend_by_token: int = 0
    attend_split_cells: int = 0
    attend_pieces: int = 1

    def __post_init__(self) -> None:
        for name in LAYOUT_FIELDS:
            value = getattr(self, name)
            low = 0 if name in ("weight_bytes", "decode_batch_min", "attend_by_token", "attend_split_cells") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"EngineLayout: {name} must be an integer >= {low}, got {value!r}")
        if self.attend_by_token not in (0, 1):
            raise ValueError(f"EngineLayout: attend_by_token must be 0 or 1, got {self.attend_by_token!r}")

    @property
    def head_share(self) -> float:
        """The busiest thread's share of a one-token call's split attention (`attend_by_token`): the query heads
        cut into `attend_pieces` near-equal ranges (`spin.set_cuts`), each range taken in order by the thread
        that is free first. SmolLM2 (9 heads, 4 pieces, 2 threads): ranges 2, 2, 2, 3 heads, the busiest thread
        5 of 9."""
        return _head_share(self.n_head, self.attend_pieces, self.n_threads)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object, where: str) -> EngineLayout:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: field 'physical.layout' must be a JSON object")
        unknown = sorted(set(data) - set(LAYOUT_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field 'physical.layout.{unknown[0]}' (expected {LAYOUT_FIELDS})")
        if "weight_bytes" not in data:
            raise ValueError(f"{where}: missing field 'physical.layout.weight_bytes'")
        try:
            return cls(**data)
        except ValueError as exc:
            raise ValueError(f"{where}: field 'physical.layout': {exc}") from exc


@functools.lru_cache(maxsize=64)
def _head_share(n_head: int, n_pieces: int, n_threads: int) -> float:
    bounds = [0]
    for i in range(1, n_pieces + 1):                    # spin.set_cuts with align 1
        b = n_head if i == n_pieces else min(n_head, n_head * i // n_pieces)
        if b > bounds[-1]:
            bounds.append(b)
    busy = [0] * max(1, n_threads)
    for a, b in zip(bounds, bounds[1:]):
        busy[busy.index(min(busy))] += b - a
    return max(busy) / n_head


# --- the step's layout ------------------------------------------------------------------------------


def chunk_blocks(pos0: int, n_tokens: int, layout: EngineLayout) -> tuple[int, int, int]:
    """(query blocks, query-key pairs, KV cells read) of a prompt chunk of n_tokens >= 2 at pos0, as
    `f32.attend` computes it: blocks of B queries, block b attending the pos0 + (its last query + 1) keys."""
    n_keys = pos0 + n_tokens
    block = max(1, min(n_tokens, layout.attn_query_block, layout.attn_score_budget // (layout.n_head * n_keys)))
    n_full, rest = divmod(n_tokens, block)
    pairs = block * pos0 * n_full + block * block * n_full * (n_full + 1) // 2
    reads = pos0 * n_full + block * n_full * (n_full + 1) // 2
    if rest:
        pairs += rest * n_keys
        reads += n_keys
    return n_full + (1 if rest else 0), pairs, reads


def estimate_calls(cost: StepCost) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """A layout for a StepCost that carries none: one call; decode tokens on sequences 0..n_decode-1 at
    equal contexts, the prompt tokens in equal chunks after them. Exact for a decode-only step of equal
    contexts (rounded to the nearest whole context) and for a single prompt chunk."""
    n_dec, n_pre = cost.n_decode_tokens, cost.n_prefill_tokens
    n_prompt = max(cost.n_seqs - n_dec, 1 if n_pre else 0)
    if n_pre == 0:
        if n_dec == 0:
            return ()
        past = (2 * cost.attn_ctx_tokens + n_dec) // (2 * n_dec) - 1     # nearest whole cells, minus itself
        return (tuple((s, max(past, 0), 1) for s in range(n_dec)),)
    length = max(1, round(n_pre / n_prompt))
    tri = length * (length + 1) // 2
    # the decodes attend what the chunks do not: with kv_read counted, solve both; else chunks at pos0 0
    pos0 = 0
    if cost.kv_read_tokens is not None and length > 1:
        # attn = D + n_prompt·(L·p + tri), kv_read = D + n_prompt·(p + L)  =>  p from their difference
        p = ((cost.attn_ctx_tokens - cost.kv_read_tokens) / n_prompt - tri + length) / (length - 1)
        pos0 = max(0, round(p))
    dec_attn = cost.attn_ctx_tokens - n_prompt * (length * pos0 + tri)
    past = max((2 * dec_attn + n_dec) // (2 * n_dec) - 1, 0) if n_dec else 0
    chunks = [(s, past, 1) for s in range(n_dec)] + [(n_dec + i, pos0, length) for i in range(n_prompt)]
    return (tuple(chunks),)


def step_calls(cost: StepCost) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """The step's forward calls as (seq, pos0, n_tokens) chunks: its layout, else `estimate_calls`."""
    return cost.calls if cost.calls is not None else estimate_calls(cost)


def physical_features(cost: StepCost, layout: EngineLayout, calls: Any = None) -> list[float]:
    """The regressors of PhysicalLatency for one step, in PHYSICAL_TERMS order (`calls`: `step_calls(cost)`
    when the caller has it already)."""
    if calls is None:
        calls = step_calls(cost)
    threads = layout.n_threads > 1
    batch_min = layout.decode_batch_min
    n_calls = one_token = gemm = tokens = seqs = 0
    read = read_split = pairs = pairs_split = 0.0
    squares = 0
    for call in calls:
        n_calls += 1
        n_ones = call_tokens = 0
        lo = hi = keys = 0
        ones_alone = 0
        call_pairs = call_keys = call_most = 0
        for seq, pos0, n in call:
            call_tokens += n
            seqs += 1
            if n == 1:
                if n_ones == 0:
                    lo = hi = seq
                    keys = pos0 + 1
                else:
                    lo, hi, keys = min(lo, seq), max(hi, seq), max(keys, pos0 + 1)
                n_ones += 1
                ones_alone += pos0 + 1
                squares += (pos0 + 1) * (pos0 + 1)
            elif layout.attend_by_token:
                call_pairs += n * pos0 + n * (n + 1) // 2
                call_keys += pos0 + n
            else:
                n_blocks, p, r = chunk_blocks(pos0, n, layout)
                if threads and n_blocks > 1:
                    pairs_split += p
                    read_split += r
                else:
                    pairs += p
                    read += r
            call_most = max(call_most, pos0 + n)
        if layout.attend_by_token:
            total = ones_alone + call_pairs
            if not threads or total < layout.attend_split_cells:
                read_split += ones_alone + call_keys           # one thread does it all: the busiest, alone
                pairs_split += call_pairs
            elif call_tokens == 1:
                read_split += ones_alone * layout.head_share
            else:
                share = max(total / layout.n_threads, float(call_most)) / total
                read_split += (ones_alone + call_keys) * share
                pairs_split += call_pairs * share
        elif n_ones:
            if batch_min and n_ones >= batch_min:
                rows = hi - lo + 1
                if threads and rows >= layout.decode_split_min:
                    read_split += rows * keys
                else:
                    read += rows * keys
            else:
                read += ones_alone
        tokens += call_tokens
        one_token += call_tokens == 1
        gemm += call_tokens > layout.small_m_max
    copy = cost.kv_copy_bytes
    save = copy if cost.kv_save_bytes is None else cost.kv_save_bytes   # uncounted: priced as saves
    return [1.0, float(layout.weight_bytes * n_calls), float(one_token), float(gemm), float(tokens), float(seqs),
            float(read), float(read_split), float(pairs), float(pairs_split), float(save), float(copy - save),
            float(cost.kv_shift_tokens), float(squares)]


def call_tokens(cost: StepCost, calls: Any = None) -> list[int]:
    """Tokens of each forward call of a step (`calls`: `step_calls(cost)` when the caller has it already)."""
    return [sum(n for _, _, n in call) for call in (step_calls(cost) if calls is None else calls)]


def hat_weights(m: float, knots: Sequence[int]) -> list[tuple[int, float]]:
    """(knot index, weight) pairs of linear interpolation at m over increasing `knots`: the two knots around
    m (weights summing to 1), the first knot's value below it, and the last segment's line beyond the last
    knot (one knot: a constant)."""
    if len(knots) == 1 or m <= knots[0]:
        return [(0, 1.0)]
    n = len(knots)
    if m >= knots[-1]:
        lo = n - 2
    else:
        lo = bisect.bisect_right(knots, m) - 1
    a, b = knots[lo], knots[lo + 1]
    w = (m - a) / (b - a)
    return [(lo, 1.0 - w), (lo + 1, w)]


def interp_call(table: Sequence[tuple[int, float]], m: int) -> float:
    """The table's cost of one forward call of m tokens (`hat_weights` over its knots)."""
    knots = [k for k, _ in table]
    return sum(w * table[i][1] for i, w in hat_weights(m, knots))


def _check_table(table: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    out = []
    prev = 0
    for item in table:
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise ValueError(f"PhysicalLatency: call_table entries must be (tokens, seconds) pairs, got {item!r}")
        m, sec = item
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m <= prev:
            raise ValueError(f"PhysicalLatency: call_table tokens must be increasing integers >= 1, got {m!r} "
                             f"after {prev}")
        _check_non_negative("PhysicalLatency", f"call_table[{m}]", sec)
        out.append((int(m), float(sec)))
        prev = int(m)
    return tuple(out)


# --- the model ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PhysicalLatency:
    """t = Σ coefficient · term over PHYSICAL_TERMS (seconds per unit, all >= 0), terms counted from the
    step's layout by `physical_features`. `measured_on`, `source` and `load_moved` document the calibration
    and do not take part in equality."""

    coefficients: tuple[float, ...]
    layout: EngineLayout
    call_table: tuple[tuple[int, float], ...] = ()     # (call tokens, seconds) knots; empty: no table
    measured_on: MeasuredOn | None = field(default=None, compare=False)
    source: str | None = field(default=None, compare=False)
    load_moved: bool | None = field(default=None, compare=False)
    # the table's knots and seconds apart, made once (step_time_s prices every simulated step)
    _knots: tuple[int, ...] = field(default=(), init=False, repr=False, compare=False)
    _seconds: tuple[float, ...] = field(default=(), init=False, repr=False, compare=False)

    wants_layout = True          # the simulated backend fills StepCost.calls / kv_save_bytes for this model

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(PHYSICAL_TERMS):
            raise ValueError(f"PhysicalLatency: {len(PHYSICAL_TERMS)} coefficients expected "
                             f"({', '.join(PHYSICAL_TERMS)}), got {len(self.coefficients)}")
        for name, value in zip(PHYSICAL_TERMS, self.coefficients):
            _check_non_negative("PhysicalLatency", name, value)
        object.__setattr__(self, "call_table", _check_table(self.call_table))
        object.__setattr__(self, "_knots", tuple(k for k, _ in self.call_table))
        object.__setattr__(self, "_seconds", tuple(v for _, v in self.call_table))

    @classmethod
    def from_terms(cls, terms: Mapping[str, float], layout: EngineLayout, **kw: Any) -> PhysicalLatency:
        unknown = sorted(set(terms) - set(PHYSICAL_TERMS))
        if unknown:
            raise ValueError(f"PhysicalLatency: unknown term {unknown[0]!r} (expected {PHYSICAL_TERMS})")
        return cls(tuple(float(terms.get(name, 0.0)) for name in PHYSICAL_TERMS), layout, **kw)

    def terms(self) -> dict[str, float]:
        return dict(zip(PHYSICAL_TERMS, self.coefficients))

    def _call_s(self, m: int) -> float:
        """The table's seconds for one forward call of m tokens (`interp_call` over the cached knots)."""
        return sum(w * self._seconds[i] for i, w in hat_weights(m, self._knots))

    def step_time_s(self, cost: StepCost) -> float:
        calls = step_calls(cost)
        t = 0.0
        for c, x in zip(self.coefficients, physical_features(cost, self.layout, calls)):
            t += c * x                      # left to right, as decode_only_times_s adds its arrays
        if self._knots:
            for m in call_tokens(cost, calls):
                t += self._call_s(m)
        return t

    def breakdown(self, cost: StepCost) -> dict[str, float]:
        """Seconds per term of one step (and `call_table_s`, the table's per-call costs, when it has one)."""
        calls = step_calls(cost)
        out = {name: c * x for name, c, x in
               zip(PHYSICAL_TERMS, self.coefficients, physical_features(cost, self.layout, calls))}
        if self._knots:
            out["call_table_s"] = sum(self._call_s(m) for m in call_tokens(cost, calls))
        return out

    def decode_only_times_s(self, n_seqs: int, attn_ctx0: int, k: int,
                            decode: Sequence[tuple[int, int]] | None = None) -> list[float]:
        """Times of k decode-only steps; `decode` = (seq, n_past) of each decoding sequence at the first step
        (each n_past grows by one per step). Without it: sequences 0..n-1 at equal contexts, as
        `estimate_calls` lays out `decode_only_cost(n, attn_ctx0 + i·n)`."""
        check_decode_only_args(n_seqs, attn_ctx0, k)
        if decode is None:
            past = max((2 * attn_ctx0 + n_seqs) // (2 * n_seqs) - 1, 0)
            decode = [(s, past) for s in range(n_seqs)]
        elif len(decode) != n_seqs:
            raise ValueError(f"decode_only_times_s: {len(decode)} (seq, n_past) pairs for n_seqs {n_seqs}")
        lay = self.layout
        i = np.arange(k, dtype=np.int64)                                     # [k]
        zero = np.zeros(k)
        read, read_split = zero, zero
        cells = (sum(p + 1 for _, p in decode) + n_seqs * i).astype(np.float64)   # [k] each token's own cells
        if lay.attend_by_token:
            split = (cells >= lay.attend_split_cells) if lay.n_threads > 1 else np.zeros(k, bool)
            if n_seqs == 1:
                busiest = cells * lay.head_share
            else:
                most = (max(p for _, p in decode) + 1 + i).astype(np.float64)
                busiest = cells * (np.maximum(cells / lay.n_threads, most) / cells)
            read_split = np.where(split, busiest, cells)
        elif lay.decode_batch_min and n_seqs >= lay.decode_batch_min:
            seqs = [s for s, _ in decode]
            rows = max(seqs) - min(seqs) + 1
            cells = (rows * (max(p for _, p in decode) + 1 + i)).astype(np.float64)   # [k]
            if lay.n_threads > 1 and rows >= lay.decode_split_min:
                read_split = cells
            else:
                read = cells
        else:
            read = cells
        squares = sum((np.int64(p) + 1 + i) ** 2 for _, p in decode).astype(np.float64)     # [k]
        x = [1.0, float(lay.weight_bytes), float(n_seqs == 1), float(n_seqs > lay.small_m_max), float(n_seqs),
             float(n_seqs), read, read_split, 0.0, 0.0, 0.0, 0.0, 0.0, squares]
        t = np.zeros(k)
        for c, xi in zip(self.coefficients, x):
            t += c * xi
        if self._knots:
            t += self._call_s(n_seqs)                           # one call of n_seqs one-token chunks
        return t.tolist()

    def describe(self) -> dict:
        return {
            "kind": "physical",
            "terms": self.terms(),
            **({"call_table": [list(kv) for kv in self.call_table]} if self.call_table else {}),
            "layout": self.layout.to_dict(),
            "measured_on": None if self.measured_on is None else asdict(self.measured_on),
            "source": self.source,
            "load_moved": self.load_moved,
        }


# --- fitting --------------------------------------------------------------------------------------


def physical_design(costs: Iterable[StepCost], layout: EngineLayout) -> np.ndarray:
    """[n_rows, len(PHYSICAL_TERMS)] regressors of the costs."""
    rows = [physical_features(c, layout) for c in costs]
    return np.array(rows, dtype=np.float64).reshape(len(rows), len(PHYSICAL_TERMS))


def fit_physical(rows: Iterable[tuple[StepCost, float]], layout: EngineLayout, *,
                 weighting: str = "relative") -> FitResult:
    """Fit non-negative PhysicalLatency coefficients to measured `(StepCost, elapsed_s)` rows (same
    weighting and solver as `fit_parametric`)."""
    rows = list(rows)
    x = physical_design([c for c, _ in rows], layout)
    t = np.array([elapsed for _, elapsed in rows], dtype=np.float64)
    coef, method = fit_nonnegative(x, t, weighting=weighting, where="fit_physical")
    model = PhysicalLatency(tuple(coef.tolist()), layout)
    return FitResult(model=model, **fit_stats(x @ coef, t), n_rows=len(t), method=method, weighting=weighting)


def table_design(costs: Sequence[StepCost], layout: EngineLayout,
                 knots: Sequence[int]) -> np.ndarray:
    """[n_rows, kept terms + knots] regressors of the table model: the physical terms it keeps, then per knot
    the sum over the step's calls of its interpolation weight."""
    kept = physical_design(costs, layout)[:, list(_KEPT)]
    hats = np.zeros((len(costs), len(knots)))
    for r, cost in enumerate(costs):
        for m in call_tokens(cost):
            for i, w in hat_weights(m, knots):
                hats[r, i] += w
    return np.hstack([kept, hats])


def table_knots(costs: Sequence[StepCost], candidates: Sequence[int] = CALL_KNOTS) -> tuple[int, ...]:
    """The knots of `candidates` the costs' calls support. From the smallest call's size up to the first
    candidate at or above the largest call; a knot stays while some call lies strictly between its
    neighbours (the first knot's span reaches down to 0, the last one's up without bound); dropping one
    widens its neighbours' spans, so this repeats until none drops. Calls beyond the last knot are priced on
    the last segment's line."""
    sizes = np.array(sorted({m for c in costs for m in call_tokens(c)}), dtype=np.int64)
    if not len(sizes):
        raise ValueError("table model: no forward calls to fit a per-call table on")
    knots: list[int] = []
    for k in sorted(candidates):
        if k >= sizes.min():
            knots.append(int(k))
            if k >= sizes.max():
                break
    knots = knots or [int(sizes.max())]
    while True:
        keep = []
        for i, k in enumerate(knots):
            lo = knots[i - 1] if i else -np.inf
            hi = knots[i + 1] if i + 1 < len(knots) else np.inf
            if ((sizes > lo) & (sizes < hi)).any():
                keep.append(k)
        if len(keep) == len(knots) or not keep:
            return tuple(keep or knots[:1])
        knots = keep


def fit_table(rows: Iterable[tuple[StepCost, float]], layout: EngineLayout, *, weighting: str = "relative",
              candidates: Sequence[int] = CALL_KNOTS) -> FitResult:
    """Fit the table model (module docs) to measured `(StepCost, elapsed_s)` rows: non-negative coefficients of
    the kept physical terms and one cost per supported knot (`table_knots`), same weighting and solver as
    `fit_parametric`."""
    rows = list(rows)
    costs = [c for c, _ in rows]
    knots = table_knots(costs, candidates)
    x = table_design(costs, layout, knots)
    t = np.array([elapsed for _, elapsed in rows], dtype=np.float64)
    coef, method = fit_nonnegative(x, t, weighting=weighting, where="fit_table")
    terms = [0.0] * len(PHYSICAL_TERMS)
    for j, i in enumerate(_KEPT):
        terms[i] = float(coef[j])
    table = tuple(zip(knots, (float(v) for v in coef[len(_KEPT):])))
    model = PhysicalLatency(tuple(terms), layout, call_table=table)
    return FitResult(model=model, **fit_stats(x @ coef, t), n_rows=len(t), method=method, weighting=weighting)


def held_out_table(costs: Sequence[StepCost], t: np.ndarray, groups: Sequence[object], layout: EngineLayout, *,
                   weighting: str = "relative") -> np.ndarray:
    """`held_out_predictions` for the table model: each group predicted by a `fit_table` of the other groups
    (whose knots are the ones those groups support, so a held-out call size is interpolated)."""
    pred = np.empty(len(t))
    for held in held_out_folds(groups, "held_out_table"):
        fit = fit_table([(c, float(v)) for c, v, h in zip(costs, t, held) if not h], layout, weighting=weighting)
        pred[held] = [fit.model.step_time_s(c) for c, h in zip(costs, held) if h]
    return pred


# --- calibration files with both models ----------------------------------------------------------------


def save_calibration_file(path: str | Path, simple: FitResult, measured_on: MeasuredOn | Mapping[str, object], *,
                          physical: FitResult | None = None, model: str = "physical",
                          extra: Mapping[str, object] | None = None, table: FitResult | None = None) -> None:
    """Write a calibration file holding the simple model (the `coefficients` every reader knows) and, when
    given, the physical one (`physical`) and the table one (`table`, with its `call_table`); `model` names the
    one `parametric:FILE` loads. `extra` adds top-level fields (cross-validation, load figures)."""
    if model not in MODEL_CHOICES:
        raise ValueError(f"save_calibration_file: model must be one of {MODEL_CHOICES}, got {model!r}")
    if model == "physical" and physical is None:
        raise ValueError("save_calibration_file: model 'physical' needs a physical fit")
    if model == "table" and table is None:
        raise ValueError("save_calibration_file: model 'table' needs a table fit")
    if not isinstance(measured_on, MeasuredOn):
        measured_on = MeasuredOn.from_dict(dict(measured_on), "save_calibration_file")
    data: dict[str, object] = {"kind": CALIBRATION_KIND, "model": model,
                               "coefficients": simple.model.coefficients()}
    if physical is not None:
        data["physical"] = {"terms": physical.model.terms(), "layout": physical.model.layout.to_dict()}
    if table is not None:
        data["table"] = {"terms": table.model.terms(), "layout": table.model.layout.to_dict(),
                         "call_table": [list(kv) for kv in table.model.call_table]}
    data["measured_on"] = asdict(measured_on)
    data["fit"] = simple.stats()
    if physical is not None:
        data["fit_physical"] = physical.stats()
    if table is not None:
        data["fit_table"] = table.stats()
    data.update(extra or {})
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def read_calibration_json(path: str | Path) -> dict:
    where = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"{where}: cannot read calibration file: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{where}: top level must be a JSON object, got {type(data).__name__}")
    return data


def load_physical(path: str | Path, block: str = "physical") -> PhysicalLatency:
    """The physical model (`block` "physical") or the table model ("table") of a calibration file;
    ValueError naming file and field when it has none or it is malformed."""
    where = str(path)
    simple = load_calibration(path)                   # validates the common part (kind, measured_on)
    data = read_calibration_json(path)
    part = data.get(block)
    if part is None:
        raise ValueError(f"{where}: no field '{block}' (a calibration without the {block} model: "
                         f"recalibrate with `slotlab calibrate`, or use simple:{where})")
    if not isinstance(part, dict):
        raise ValueError(f"{where}: field '{block}' must be a JSON object")
    for name in ("terms", "layout", *(("call_table",) if block == "table" else ())):
        if name not in part:
            raise ValueError(f"{where}: missing field '{block}.{name}'")
    terms = part["terms"]
    if isinstance(terms, dict):                       # a file written before a term existed: that term is 0
        terms = {**{name: 0.0 for name in OPTIONAL_TERMS}, **terms}
    values = tuple(_require_numbers(where, f"{block}.terms", terms, PHYSICAL_TERMS).values())
    layout = EngineLayout.from_dict(part["layout"], where)
    table: tuple[tuple[int, float], ...] = ()
    if block == "table":
        raw = part["call_table"]
        if not isinstance(raw, list) or not raw:
            raise ValueError(f"{where}: field 'table.call_table' must be a non-empty list of [tokens, seconds]")
        for i, item in enumerate(raw):
            if (not isinstance(item, list) or len(item) != 2 or isinstance(item[0], bool)
                    or not isinstance(item[0], int) or isinstance(item[1], bool)
                    or not isinstance(item[1], (int, float))):
                raise ValueError(f"{where}: field 'table.call_table[{i}]' must be [tokens (integer), seconds "
                                 f"(number)], got {item!r}")
        try:
            table = _check_table([(int(m), float(v)) for m, v in raw])
        except ValueError as exc:
            raise ValueError(f"{where}: field 'table.call_table': {exc}") from exc
    moved = data.get("load_moved")
    return PhysicalLatency(values, layout, call_table=table, measured_on=simple.measured_on, source=where,
                           load_moved=moved if isinstance(moved, bool) else None)


def load_latency_file(path: str | Path, model: str | None = None) -> ParametricLatency | PhysicalLatency:
    """The model of a calibration file: `model` ("simple", "physical" or "table"), else the file's `model`
    field (files without one hold only the simple model)."""
    where = str(path)
    if model is None:
        chosen = read_calibration_json(path).get("model", "simple")
        if chosen not in MODEL_CHOICES:
            raise ValueError(f"{where}: field 'model' must be one of {MODEL_CHOICES}, got {chosen!r}")
    else:
        chosen = model
        if chosen not in MODEL_CHOICES:
            raise ValueError(f"latency model {model!r}: expected one of {MODEL_CHOICES}")
    return load_calibration(path) if chosen == "simple" else load_physical(path, chosen)
