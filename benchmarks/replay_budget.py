"""What the in-run probe's replays buy, measured on the same real runs: each run's replays of one path (the steps
with prompt tokens, or the decode steps) thinned to those a smaller budget would have made, and the run re-simulated
with them.

    python benchmarks/replay_budget.py RUN_DIR [RUN_DIR ...] [--path prompt|decode] [--budgets 1,0.5,0] [--out OUT]

Each RUN_DIR is a `slotlab validate --speed-correct track-mix` output folder (or a folder of them, e.g. a
`benchmarks/validate_settings.py --out` folder, whose <setting>-<seed>/track-mix runs are taken) whose real run
replayed every one of its steps of that path: for the prompt path (the default) that is the in-run probe's default
prompt budget, 1 (`MIX_BUDGET_PROMPT`); for the decode path, a run made with a decode budget of 1 (`MIX_BUDGET`,
`validate --replay-decode 1`, the default since docs/validation_sim.md §25; runs of before it had 0.15). For each budget B of `--budgets`, the path's replays are
thinned to the ones the probe's own credit rule (`experiments.calibrate.MixCredit`) would have made at B, in the
run's order, the other path's replays left as they are (B = 0: no replay on that path), and the run is
re-simulated with them: `slotlab validate --real-run` with the run's own command line and `--speed-correct
track-mix`, into OUT/<run>/budget-<B> (decode: decode-budget-<B>). The real run is the same for every budget, so the
budgets differ by the replays they keep and by nothing else: no second real run, whose host would have moved,
enters the comparison. (Only a run that replayed every step of the path can be thinned exactly: at a budget below
1 the credit rule picks steps a smaller budget's rule may not.)

Printed: per budget, the aggregates within 3% (P50 and P90 of TTFT, TPOT and E2E: issue 14's targets), the
median |error| of each, the per-request median |error| of TTFT, TPOT and E2E (the median over runs), and the
|TTFT error| of each run's first request; then each run's TTFT P50 / P90 errors per budget. Written: OUT/summary.csv
(one row per run and budget); a rerun with the same --out reuses the re-simulations already there (delete a
budget's folder to redo it). Figures and what they meant for the default: docs/validation_sim.md §24.
"""

from __future__ import annotations

import argparse
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from experiments.calibrate import MixCredit  # noqa: E402
from experiments.results import read_json  # noqa: E402
from experiments.speed_probe import SpeedTrack, TrackPass, read_run_track, write_run_track  # noqa: E402
from experiments.steplog import STEPS_FILE, path_steps, read_steps  # noqa: E402
from experiments.validate import FILES, read_validation  # noqa: E402

AGG = [(m, s) for m in ("ttft", "tpot", "e2e") for s in ("p50", "p90")]
# validate options this script sets itself for each re-simulation (the value-taking ones drop their value too)
OWN_FLAGS = {"--speed-correct": True, "--real-run": True, "--out": True, "--noise-floor": True, "--csv": False,
             "--quiet": False, "--no-plots": False}


PATHS = {"prompt": True, "decode": False}     # --path -> MixSample.prompt of the replays it thins
DEFAULT_BUDGETS = {"prompt": "1,0.5,0", "decode": "1,0.15"}


def thin_track(track: SpeedTrack, budget: float, prompt: bool = True) -> SpeedTrack:
    """The track with the replays of one path (`prompt`: the steps with prompt tokens; False: the decode steps)
    thinned to those the probe's credit rule would have made at `budget`, in the run's order (every pass's replays
    in turn); the other path's replays and the fixed-shape passes unchanged."""
    credit = MixCredit(budget)
    passes = []
    for p in track.passes:
        kept = []
        for m in p.mix:
            if m.prompt != prompt:
                kept.append(m)
            elif credit.offer(m.step_s):
                credit.spend(m.measured_s)
                kept.append(m)
        passes.append(TrackPass(p.clock_s, p.wall_s, dict(p.shapes_s), p.load1, tuple(kept)))
    return SpeedTrack(track.every_s, tuple(passes), track.repeats)


def replayed_track(real: Path, prompt: bool = True) -> SpeedTrack:
    """A real run's speed track, checked to hold a replay of every step of one path (`prompt`: every step with
    prompt tokens; False: every decode step, a step without prompt tokens that ran a forward pass): only such a
    track can be thinned to what a smaller budget would have kept."""
    track = read_run_track(real)
    if track is None:
        raise ValueError(f"{real}: no speed track (speed_track.json): the run was made without the in-run probe")
    steps = read_steps(real)
    if steps is None:
        raise ValueError(f"{real / STEPS_FILE}: no step log there (a real run's directory has one)")
    n_steps = path_steps(steps, prompt)
    n_rep = sum(1 for p in track.passes for m in p.mix if m.prompt == prompt)
    if n_rep < n_steps:
        path, how = (("prompt", "the probe's default prompt budget 1; a run of before it had 0.5") if prompt else
                     ("decode", "validate --replay-decode 1, the default; a run of before it had 0.15"))
        raise ValueError(f"{real}: {n_rep} {path} replays for {n_steps} {path} steps; thinning needs a run that "
                         f"replayed every one ({how})")
    return track


def validate_argv(command: str, where: Path) -> list[str]:
    """The run's `slotlab validate` options (validation.json `command`) without the ones set here."""
    words = shlex.split(command)
    if words[:2] != ["slotlab", "validate"]:
        raise ValueError(f"{where}: field 'command' is not a slotlab validate command line: {command[:80]!r}")
    out, i = [], 2
    while i < len(words):
        w = words[i]
        flag = w.split("=", 1)[0]
        if flag in OWN_FLAGS:
            i += 2 if (OWN_FLAGS[flag] and "=" not in w) else 1
            continue
        out.append(w)
        i += 1
    return out


def run_dirs(paths: list[str]) -> list[Path]:
    """The validate output folders named, or found one level down as <run>/track-mix (validate_settings' layout)."""
    out = []
    for p in map(Path, paths):
        if (p / FILES["summary"]).is_file():
            out.append(p)
        else:
            found = sorted(q.parent.parent for q in p.glob(f"*/track-mix/{FILES['summary']}"))
            if not found:
                raise SystemExit(f"replay_budget: {p}: neither a `slotlab validate` output folder (no "
                                 f"validation.json) nor a folder of <run>/track-mix ones")
            out.extend(q / "track-mix" for q in found)
    return out


def read_summary(run: Path) -> dict:
    """A validate folder's validation.json; ValueError naming the file when it is not a JSON object."""
    path = run / FILES["summary"]
    data = read_json(path, "it as JSON")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a JSON object")
    return data


def real_run_of(run: Path, summary: dict) -> Path:
    """The real run a validate folder compared with: its own real/, or the one it reused (`--real-run`: validation.json
    `real_dir`, as given then, absolute or relative to the directory it was run from)."""
    if (run / "real").is_dir():
        return run / "real"
    reused = Path(str(summary.get("real_dir", "")))
    if summary.get("real_reused") and reused.is_dir():
        return reused
    raise ValueError(f"{run}: no real/ here, and validation.json's real_dir {str(reused)!r} is not a directory from "
                     f"here (a `--real-run` folder names its real run as given then: run from that directory)")


def resimulate(slotlab: str, run: Path, summary: dict, real: Path, track: SpeedTrack, budget: float,
               out: Path, prompt: bool = True) -> Path:
    """Re-simulate `run` (its validation.json `summary`, its real run and that run's `replayed_track`) with the
    replays of one path (`prompt`, as `thin_track`) thinned to `budget`; the folder of that re-simulation."""
    name = f"budget-{budget:g}" if prompt else f"decode-budget-{budget:g}"
    dest = out / name
    if (dest / FILES["errors"]).is_file():
        return dest
    thinned = out / f"real-{name}"
    if thinned.exists():
        shutil.rmtree(thinned)
    shutil.copytree(real, thinned)
    write_run_track(thinned, thin_track(track, budget, prompt))
    cmd = [slotlab, "validate", *validate_argv(str(summary.get("command", "")), run / FILES["summary"]),
           "--real-run", str(thinned), "--speed-correct", "track-mix", "--out", str(dest), "--quiet", "--no-plots"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-1500:]}")
    return dest


def figures(dest: Path, first_request: int) -> dict[str, float]:
    """One re-simulation's aggregate errors, per-request median |errors| and its first request's TTFT error."""
    per, errors, _ = read_validation(dest)
    err = errors.set_index(["metric", "stat"])["rel_err"]
    row = {f"{m}_{s}": float(err.get((m, s), math.nan)) for m, s in AGG}
    for m in ("ttft", "tpot", "e2e"):
        row[f"{m}_req"] = float(per[f"{m}_rel_err"].abs().median())
    first = per.loc[per["request"] == first_request, "ttft_rel_err"]
    row["ttft_first"] = float(first.iloc[0]) if len(first) else math.nan
    return row


def report(df: pd.DataFrame, path: str = "prompt") -> str:
    lines = [f"{df['run'].nunique()} runs re-simulated with their {path} replays thinned to each budget "
             f"(the same real runs throughout)", "",
             f"| {path} budget | aggregates within 3% | TTFT · TPOT · E2E within 3% | median abs error P50 / P90: "
             "TTFT "
             "· TPOT · E2E | per request TTFT / TPOT / E2E | first request TTFT |", "|---|---|---|---|---|---|"]
    for b, g in df.groupby("budget", sort=False):
        ok = {m: int(sum((g[f"{m}_{s}"].abs() <= 0.03).sum() for s in ("p50", "p90"))) for m in ("ttft", "tpot", "e2e")}
        med = " · ".join(f"{100 * g[f'{m}_p50'].abs().median():.1f} / {100 * g[f'{m}_p90'].abs().median():.1f}"
                         for m in ("ttft", "tpot", "e2e"))
        req = " / ".join(f"{100 * g[f'{m}_req'].median():.1f}" for m in ("ttft", "tpot", "e2e"))
        lines.append(f"| {b:g} | {sum(ok.values())}/{6 * len(g)} | {ok['ttft']} · {ok['tpot']} · {ok['e2e']} of "
                     f"{2 * len(g)} | {med} | {req} | {100 * g['ttft_first'].abs().median():.1f} |")
    lines += ["", "TTFT P50 / P90 error per run (%):", ""]
    piv = df.pivot(index="run", columns="budget", values=["ttft_p50", "ttft_p90"])
    for run in piv.index:
        cells = "  ".join(f"{b:g}: {100 * piv.loc[run, ('ttft_p50', b)]:+5.1f} / "
                          f"{100 * piv.loc[run, ('ttft_p90', b)]:+5.1f}"
                          for b in df["budget"].unique())
        lines.append(f"  {run:28s} {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="RUN_DIR", help="slotlab validate output folders (see above)")
    ap.add_argument("--path", choices=tuple(PATHS), default="prompt",
                    help="whose replays to thin: the steps with prompt tokens (default) or the decode steps (a run "
                         "made with `validate --replay-decode 1`, the default)")
    ap.add_argument("--budgets", default=None,
                    help="budgets to compare, fractions of the path's step time in [0, 1] (default: 1,0.5,0 for "
                         "the prompt path, 1,0.15 for the decode path)")
    ap.add_argument("--out", default="replay_budget", help="where the re-simulations go (default ./replay_budget)")
    ap.add_argument("--slotlab", default=None, metavar="CMD", help="the slotlab command (default: the one beside "
                                                                   "this Python)")
    args = ap.parse_args(argv)
    spec = args.budgets if args.budgets is not None else DEFAULT_BUDGETS[args.path]
    prompt = PATHS[args.path]
    try:
        budgets = [float(b) for b in spec.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--budgets: a comma-separated list of numbers, got {spec!r}")
    if not budgets or any(not 0 <= b <= 1 for b in budgets):
        ap.error(f"--budgets: each a fraction of the {args.path} step time in [0, 1], got {spec!r}")
    from validate_settings import slotlab     # the slotlab beside this Python, as the campaigns run it
    runs = run_dirs(args.runs)
    names = [f"{r.parent.name}/{r.name}" if r.name == "track-mix" else r.name for r in runs]
    if len(set(names)) < len(names):
        names = [str(r) for r in runs]
    rows = []
    for run, name in zip(runs, names):
        try:                                # each run's files read once, for all the budgets
            summary = read_summary(run)
            real = real_run_of(run, summary)
            track = replayed_track(real, prompt)
            dests = [resimulate(args.slotlab or slotlab(), run, summary, real, track, b,
                                Path(args.out) / name.replace("/", "_"), prompt) for b in budgets]
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"replay_budget: {e}") from e
        requests = pd.read_parquet(real / "requests.parquet")
        first = int(requests.sort_values("arrival_s", kind="stable")["request"].iloc[0])
        for b, dest in zip(budgets, dests):
            rows.append({"run": name, "path": args.path, "budget": b, **figures(dest, first)})
            print(f"  {name}: budget {b:g} re-simulated", flush=True)
    df = pd.DataFrame(rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    df.to_csv(Path(args.out) / "summary.csv", index=False)
    print(report(df, args.path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
