"""The speed probe: a few fixed engine step shapes timed when a latency model is calibrated and again around a
validation's real run, so that `slotlab validate` can say how much slower or faster the machine runs than it
did at calibration, and (`--speed-correct probe`) scale the simulator's step times by that ratio (or, with
`--speed-correct grid`, by the ratio to the calibration grid's own medians of the same shapes).

The shapes and their measurement are `experiments.calibrate`'s (`probe_points`, `measure_probe`: calibrate's
own bench and interleaved passes). This module holds the record (`SpeedProbe`), where it is stored (a
calibration file's `probe` field, a real run's `speed_probe.json`) and the arithmetic of the ratios and the
warnings. See docs/validation_sim.md §6 for what one factor can and cannot correct.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.results import read_json
from sim.latency_physical import read_calibration_json

PROBE_FILE = "speed_probe.json"    # beside a real run's results (validate's real/): the probes around that run
SPEED_THRESHOLD = 0.05             # warn when a ratio is off 1 (or before and after differ) by more than this


@dataclass(frozen=True, slots=True)
class ProbeShape:
    """One probe shape's measurement: its label (`GridPoint.label`), median and samples (seconds); for a
    calibration's probe, the calibration grid's own median of the same shape when the grid has it."""

    label: str
    median_s: float
    samples_s: tuple[float, ...] = ()
    grid_median_s: float | None = None


@dataclass(frozen=True, slots=True)
class SpeedProbe:
    """One measurement of the probe: every shape's median, the load average before and after, when, how long it
    took, and what it ran on (thread count, model file name, engine threading)."""

    shapes: tuple[ProbeShape, ...]
    statistic: str
    load_before: tuple[float, ...]
    load_after: tuple[float, ...]
    when: str
    wall_s: float
    threads: int | None
    model: str
    engine: str = ""

    @property
    def medians_s(self) -> dict[str, float]:
        return {s.label: s.median_s for s in self.shapes}

    def to_dict(self) -> dict[str, Any]:
        shapes = []
        for s in self.shapes:
            row: dict[str, Any] = {"label": s.label, "median_s": s.median_s, "samples_s": list(s.samples_s)}
            if s.grid_median_s is not None:
                row["grid_median_s"] = s.grid_median_s
            shapes.append(row)
        return {"shapes": shapes, "statistic": self.statistic,
                "load": {"before": list(self.load_before), "after": list(self.load_after)},
                "when": self.when, "wall_s": self.wall_s, "threads": self.threads, "model": self.model,
                "engine": self.engine}

    @classmethod
    def from_dict(cls, data: object, where: str, field: str = "probe") -> SpeedProbe:
        """The probe of a JSON object; ValueError naming `where` and the dotted field when malformed."""
        def bad(name: str, what: str) -> ValueError:
            return ValueError(f"{where}: field '{field}.{name}' {what}")

        if not isinstance(data, dict):
            raise ValueError(f"{where}: field '{field}' must be a JSON object")
        rows = data.get("shapes")
        if not isinstance(rows, list) or not rows:
            raise bad("shapes", "must be a non-empty list")
        shapes = []
        for i, row in enumerate(rows):
            if not isinstance(row, dict) or not isinstance(row.get("label"), str):
                raise bad(f"shapes[{i}].label", "must be a string (each shape an object with a label)")
            median = _positive(row.get("median_s"), lambda what: bad(f"shapes[{i}].median_s", what))
            samples = row.get("samples_s", [])
            if not isinstance(samples, list):
                raise bad(f"shapes[{i}].samples_s", "must be a list of seconds")
            grid = row.get("grid_median_s")
            shapes.append(ProbeShape(
                row["label"], median,
                tuple(_positive(x, lambda what: bad(f"shapes[{i}].samples_s", what)) for x in samples),
                None if grid is None else _positive(grid, lambda what: bad(f"shapes[{i}].grid_median_s", what))))
        if len({s.label for s in shapes}) != len(shapes):
            raise bad("shapes", "has a label twice")
        threads = data.get("threads")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise bad("threads", f"must be an integer >= 1 or null, got {threads!r}")
        for name in ("when", "model"):
            if not isinstance(data.get(name), str):
                raise bad(name, f"must be a string, got {data.get(name)!r}")
        load = data.get("load", {})
        if not isinstance(load, dict):
            raise bad("load", "must be a JSON object")
        loads = {}
        for name in ("before", "after"):
            value = load.get(name, [])
            if not isinstance(value, list) or not all(is_number(x) for x in value):
                raise bad(f"load.{name}", "must be a list of numbers")
            loads[name] = tuple(float(x) for x in value)
        wall = data.get("wall_s", 0.0)
        if not is_number(wall):
            raise bad("wall_s", f"must be a number, got {wall!r}")
        return cls(tuple(shapes), str(data.get("statistic", "")), loads["before"], loads["after"], data["when"],
                   float(wall), threads, data["model"], str(data.get("engine", "")))


def is_number(x: object) -> bool:
    """A finite int or float, not a bool (JSON fields read from files)."""
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)


def _positive(x: object, bad: Any) -> float:
    if not is_number(x) or x <= 0:
        raise bad(f"must be a finite number of seconds > 0, got {x!r}")
    return float(x)


def format_probe(probe: SpeedProbe) -> str:
    """One line: each shape's median, and how they compare with the calibration grid's own medians."""
    shapes = ", ".join(f"{s.label} {1000 * s.median_s:.1f} ms" for s in probe.shapes)
    line = f"speed probe ({probe.statistic}; {probe.wall_s:.1f} s): {shapes}"
    both = [s for s in probe.shapes if s.grid_median_s is not None]
    if both:
        ratio = geomean([s.median_s / s.grid_median_s for s in both])
        line += f"; probe / the grid's median of the same {len(both)} shapes x{ratio:.3f}"
    return line


# --- where probes are stored -------------------------------------------------------------------------------


def calibration_probe(path: str | Path) -> SpeedProbe | None:
    """The `probe` of a calibration file; None for a file written before the probe existed (no field)."""
    data = read_calibration_json(path)
    if data.get("probe") is None:
        return None
    return SpeedProbe.from_dict(data["probe"], str(path))


def write_run_probes(run_dir: str | Path, before: SpeedProbe, after: SpeedProbe) -> Path:
    """Store the probes measured immediately before and after a real run with that run's files, so that a
    later `validate --real-run` compares (and corrects) with the machine's speed of that run."""
    path = Path(run_dir) / PROBE_FILE
    path.write_text(json.dumps({"before": before.to_dict(), "after": after.to_dict()}, indent=2) + "\n",
                    encoding="utf-8")
    return path


def read_run_probes(run_dir: str | Path) -> tuple[SpeedProbe, SpeedProbe] | None:
    """(before, after) probes of a real run; None when the run has none (a `slotlab replay`, or a validate of
    before the probe)."""
    path = Path(run_dir) / PROBE_FILE
    if not path.is_file():
        return None
    where = str(path)
    data = read_json(path, "the speed probes")
    if not isinstance(data, dict):
        raise ValueError(f"{where}: top level must be a JSON object")
    return (SpeedProbe.from_dict(data.get("before"), where, "before"),
            SpeedProbe.from_dict(data.get("after"), where, "after"))


# --- ratios ------------------------------------------------------------------------------------------------


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


GRID_OFFSET_WARN = 0.10           # calibrate warns when its probe and its grid differ by more than this


def grid_offset_warning(calibration: SpeedProbe, threshold: float = GRID_OFFSET_WARN) -> str | None:
    """What calibrate says when the speed probe measured right after its grid disagrees with the grid's own
    medians of the same shapes by more than `threshold` (None otherwise, or without grid medians): the machine's
    speed moved within seconds, and the calibration holds the grid's speed, which later runs may not see."""
    offset = grid_offset(calibration)
    if offset is None or abs(offset - 1.0) <= threshold:
        return None
    faster = "faster" if offset < 1 else "slower"
    return (f"the speed probe measured right after the grid ran x{offset:.3f} of the grid's medians of the same "
            f"shapes ({faster}, more than {100 * threshold:.0f}% apart): the machine's speed moved between them, "
            "and the fitted models hold the grid's speed; recalibrate, or validate with --speed-correct grid "
            "(which rescales by this offset)")


def time_ratio(now: SpeedProbe, ref: SpeedProbe) -> dict[str, Any]:
    """now / ref step time per shape both measured (by label) and their geometric mean (`ratio`: > 1 = the
    machine is slower now). ValueError when they share no shape."""
    mine, theirs = now.medians_s, ref.medians_s
    common = [label for label in theirs if label in mine]
    if not common:
        raise ValueError(f"the probes share no shape (now: {sorted(mine)}, reference: {sorted(theirs)})")
    per_shape = {label: mine[label] / theirs[label] for label in common}
    return {"ratio": geomean(list(per_shape.values())), "per_shape": per_shape}


def grid_offset(calibration: SpeedProbe) -> float | None:
    """The calibration probe's step time / the calibration grid's own median, geometric mean over the shapes
    the grid also measured (< 1: the grid ran slower than its probe); None when it has none (--quick grid)."""
    both = [s for s in calibration.shapes if s.grid_median_s is not None]
    return geomean([s.median_s / s.grid_median_s for s in both]) if both else None


def probe_mismatch(probe: SpeedProbe, model: str, threads: int) -> str | None:
    """Why a calibration's probe cannot be compared with a run of `model` at `threads` (another thread count
    or model file), or None."""
    differences = []
    if probe.threads is not None and probe.threads != threads:
        differences.append(f"{probe.threads} thread{'s' if probe.threads != 1 else ''} (this run: {threads})")
    if probe.model and Path(probe.model).name != Path(model).name:
        differences.append(f"model {Path(probe.model).name} (this run: {Path(model).name})")
    return None if not differences else "speed probe ran " + " and ".join(differences)


def speed_report(calibration: SpeedProbe | None, before: SpeedProbe | None, after: SpeedProbe | None, *,
                 threshold: float = SPEED_THRESHOLD) -> dict[str, Any]:
    """validation.json's `speed_probe`: the three probes, the ratios now / calibration before and after the real
    run (geometric mean over shapes, and per shape), their geometric mean (`ratio.mean`, the factor
    `--speed-correct probe` applies) and after / before (`ratio.during`: how far the speed moved during the
    run); `ratio.grid_offset` (`grid_offset`) and `ratio.grid` = mean x grid_offset, the factor `--speed-correct
    grid` applies. A ratio is None when a probe is missing."""
    out: dict[str, Any] = {
        "calibration": None if calibration is None else calibration.to_dict(),
        "before": None if before is None else before.to_dict(),
        "after": None if after is None else after.to_dict(),
        "ratio": {"before": None, "after": None, "mean": None, "during": None, "grid_offset": None, "grid": None},
        "per_shape": {}, "threshold": threshold,
        "definition": "step time now / at calibration (> 1: the machine is slower now), geometric mean over the "
                      "probe's shapes; mean = geometric mean of before and after; during = after / before; "
                      "grid_offset = the calibration's probe / its grid's medians of the same shapes; grid = mean "
                      "x grid_offset (the step time now / the grid's, the factor of --speed-correct grid)",
    }
    r = out["ratio"]
    if before is not None and after is not None:
        r["during"] = time_ratio(after, before)["ratio"]
    if calibration is not None:
        for name, probe in (("before", before), ("after", after)):
            if probe is not None:
                got = time_ratio(probe, calibration)
                r[name], out["per_shape"][name] = got["ratio"], got["per_shape"]
        if r["before"] is not None and r["after"] is not None:
            r["mean"] = math.sqrt(r["before"] * r["after"])
        r["grid_offset"] = grid_offset(calibration)
        if r["mean"] is not None and r["grid_offset"] is not None:
            r["grid"] = r["mean"] * r["grid_offset"]
    return out


def speed_warnings(report: Mapping[str, Any], latency: str, correct: str, factor: float,
                   real_dir: str | Path = "DIR") -> list[str]:
    """What the user should know and do about the speed probe's figures (empty when all is within the
    threshold); `real_dir`: the real run's directory, for the command that reuses it."""
    r, threshold = report["ratio"], report["threshold"]
    out = []
    if correct == "steps":
        out.append("--speed-correct steps gave the simulator the speed the real run itself measured (its steps' "
                   "measured / predicted ratio per window of its clock): the errors below are the latency model's "
                   "across step shapes, the closed loop's and the decisions', at a speed the simulator could not "
                   "know in advance. A diagnostic of what the machine's drift costs, not a prediction of this run; "
                   "compare with --speed-correct off or track for that")
    off = [name for name in ("before", "after") if r[name] is not None and abs(r[name] - 1) > threshold]
    if off:
        figures = " and ".join(f"x{r[name]:.3f} {name}" for name in ("before", "after") if r[name] is not None)
        text = (f"the machine's speed differs from when {latency} was calibrated: the speed probe's step times "
                f"were {figures} the real run (now / calibration, > 1 = slower now; threshold "
                f"{100 * threshold:.0f}%): ")
        if correct == "steps":
            text += ("the simulator's step times were multiplied by the real run's own measured speed "
                     "(--speed-correct steps)")
        elif correct == "track-mix":
            text += ("the simulator's step times were multiplied by a factor following the run's clock, measured "
                     "by replaying a sample of the run's own steps during it (--speed-correct track-mix); its knots "
                     "scatter by several percent, so recalibrate (`slotlab calibrate`) right before validating "
                     "for figures")
        elif correct == "track":
            text += ("the simulator's step times were multiplied by a factor following the run's clock "
                     "(--speed-correct track); it does not follow contention that slows some step terms more than "
                     "others, so recalibrate (`slotlab calibrate`) right before validating for figures")
        elif correct in ("probe", "grid"):
            text += (f"the simulator's step times were multiplied by x{factor:.3f} (--speed-correct {correct}); one "
                     "factor does not follow contention that slows some step terms more than others, so "
                     "recalibrate (`slotlab calibrate`) right before validating for figures")
        else:
            text += ("the simulator's step times are off by about that much. Recalibrate (`slotlab calibrate`) "
                     "right before validating, or rerun with `--speed-correct probe --real-run "
                     f"{real_dir}` (the same real run, no engine rerun) to scale the step times by the measured "
                     "ratio")
        out.append(text)
    during = r["during"]
    if during is not None and abs(during - 1) > threshold:
        fix = (f"--speed-correct {correct} follows it through the probe passes taken during the run"
               if correct in ("track", "track-mix")
               else "no single factor corrects them: `--speed-correct track --real-run "
                    f"{real_dir}` follows the speed through the probe passes taken during the run")
        out.append(f"the machine's speed moved during the real run (speed probe after / before x{during:.3f}, "
                   f"more than {100 * threshold:.0f}%): the real run's step times mix speeds; {fix}; or rerun on a "
                   "steadier machine (validation.json real_step_errors.drift shows when the speed moved)")
    track = report.get("track")
    if track and track["n_in_run"] and (during is None or abs(during - 1) <= threshold):
        lo, hi = track["range"]
        if hi / lo - 1 > threshold:              # moved and came back: the probes around the run cannot see it
            fix = (f"--speed-correct {correct} follows it" if correct in ("track", "track-mix") else
                   f"`--speed-correct track --real-run {real_dir}` follows it")
            out.append(f"the machine's speed moved during the real run while the probes before and after it "
                       f"agree: the probe passes taken during it read x{lo:.3f}-x{hi:.3f} of the latency model's "
                       f"times on the decode shapes (more than {100 * threshold:.0f}% apart); {fix}")
    return out


def track_span(knots: Mapping[str, Any]) -> str:
    """The range of a track's two factors as printed: decode x0.930-x1.260, prompt x1.010-x1.270."""
    (lo, hi), (plo, phi) = knots["range"], knots["range_prompt"]
    return f"decode x{lo:.3f}-x{hi:.3f}, prompt x{plo:.3f}-x{phi:.3f}"


def _load1(load: Sequence[float]) -> str:
    return f"{load[0]:.2f}" if load else "?"


def format_speed(report: Mapping[str, Any], factor: float, where: str = "") -> str:
    """One line for the terminal: the ratios, the loads, where the run's probes come from (`where`) and the
    factor the simulator's step times were multiplied by."""
    r, cal, before, after = report["ratio"], report["calibration"], report["before"], report["after"]
    if before is None:
        head = "speed probe: not measured with this real run"
    elif report.get("calibration_unusable"):
        head = f"speed probe: no ratio, the calibration's {report['calibration_unusable']}"
    elif cal is None:
        head = "speed probe: the calibration has none, no ratio"
    else:
        head = (f"speed probe, step time now / calibration (geometric mean over {len(report['per_shape']['before'])}"
                f" shapes): before x{r['before']:.3f}, after x{r['after']:.3f}; calibration's probe {cal['when']} "
                f"at load {_load1(cal['load']['after'])}")
        if r.get("grid") is not None:
            head += f"; now / the calibration grid's medians x{r['grid']:.3f}"
    if before is not None:
        head += f"; run's probes at load {_load1(before['load']['before'])} and {_load1(after['load']['after'])}"
    track, mix = report.get("track"), report.get("track_mix")
    if track:
        head += (f"; over the run (probe before, {track['n_in_run']} passes during, after; / the model's times) "
                 f"{track_span(track)}")
    if mix:
        head += (f"; the run's own steps replayed ({mix['n_replays']} replays in {mix['n_in_run']} windows of "
                 f"{mix['every_s']:g} s, replay / step x{mix['replay_over_step']:.3f}; / the model's times) "
                 f"{track_span(mix)}")
    if report.get("correct") == "track" and track:
        return f"{head}{where}; simulator step times {track_span(track)}, following the run's clock"
    if report.get("correct") == "track-mix" and mix:
        return f"{head}{where}; simulator step times {track_span(mix)}, following the run's clock (replays)"
    steps = report.get("steps_track")
    if report.get("correct") == "steps" and steps:
        return (f"{head}{where}; simulator step times {track_span(steps)}, the real run's own speed per "
                f"{steps['every_s']:g} s of its clock (an oracle)")
    return f"{head}{where}; simulator step times x{factor:.3f}"


# --- the speed track: the probe during the real run ---------------------------------------------------------

TRACK_FILE = "speed_track.json"    # beside a real run's results: the probe passes taken during that run
TRACK_EVERY_S = 10.0               # validate's default: one probe pass every this many wall seconds of the run
TRACK_SMOOTH = 5                   # knots in the centred rolling median of the track's factors
TRACK_REPEATS = 3                  # executions of each shape per pass (interleaved rounds; the median is kept)


# A step shape as the mix replays it: its forward calls in order, each a tuple of chunks (sequence index in order of
# first appearance, pos0, n_tokens, samples: the chunk asks for logits, is_prompt)
MixCall = tuple[tuple[int, int, int, bool, bool], ...]
# A step's prompt-cache copy as the mix replays it, before its forward calls: ("save" | "load", sequence index,
# cells copied). Context shifts' K re-rotation is not replayed (the latency model prices it).
MixOp = tuple[str, int, int]
MIX_OP_KINDS = ("save", "load")
# track-mix: a window without a prompt replay of its own takes the median of this many prompt replays nearest it.
# A replay's ratio to the model carries the model's error on that one shape; the nearest window's single replay
# priced the run's other prompt steps 6.5% off (median), the median of the 9 nearest 4.3% (docs/validation_sim.md §13)
MIX_PROMPT_FILL = 9


@dataclass(frozen=True, slots=True)
class MixSample:
    """One of the run's own steps replayed right after it (`experiments.calibrate.InRunProbe`): its forward calls
    (`calls`; its prompt-cache copies are `ops`, its other KV operations left out), whether it processes prompt tokens (`prompt`: the path of
    `TrackedLatency`), the replay's measured seconds, the seconds the run's step itself took (`step_s`: the two
    agree on a machine whose speed held between them) and the run's clock at the step's end (`clock_s`); `ops`:
    the step's prompt-cache copies, replayed (and timed) before its forward calls (`MixOp`; empty in files
    written before they were replayed, whose `measured_s` is the forward calls' alone); `copy_s`: the seconds
    of those copies within `measured_s` (0 without copies; None in files written before they were timed on
    their own), with, since 2026-12-07, the conversion of a loaded sequence's float32 shadow that the step
    after a load does (the calibration's load price holds it; in earlier files it is in the forward calls'
    part, docs/validation_sim.md §26); `again_s`: the seconds of a second execution of the same replay right
    after it (validate `--replay-again`; None without), which the knots do not use and the repeat floor reads to
    split a replay's scatter between the step and the replay (`experiments.repeat_floor.step_share`), and
    `again_copy_s` the seconds of its copies within it. The knots leave the copies' seconds out (`mix_knots`): a save on the
    bench writes a new blob it frees at once, and whether its pages are fresh decides its time (0.05 or 2 ns a
    byte on a VM), unlike the run's own saves (docs/validation_sim.md §15)."""

    calls: tuple[MixCall, ...]
    prompt: bool
    measured_s: float
    step_s: float
    clock_s: float
    ops: tuple[MixOp, ...] = ()
    copy_s: float | None = None
    again_s: float | None = None
    again_copy_s: float | None = None

    @property
    def forward_s(self) -> float:
        """The replay's forward calls' seconds: `measured_s` less its copies' (`copy_s`; all of it in files
        written before the copies were timed on their own, whose `copy_s` is None)."""
        return self.measured_s - (self.copy_s or 0.0)

    @property
    def compared_ops(self) -> tuple[MixOp, ...]:
        """The copies the knots compare with the model's price (`experiments.calibrate.mix_predictions`): none
        where their time is known apart (`forward_s` leaves it out), all of them in files without `copy_s`."""
        return self.ops if self.copy_s is None else ()

    def to_dict(self) -> dict[str, Any]:
        out = {"calls": [[list(c) for c in call] for call in self.calls], "prompt": self.prompt,
               "measured_s": self.measured_s, "step_s": self.step_s, "clock_s": self.clock_s}
        if self.ops:
            out["ops"] = [list(op) for op in self.ops]
        if self.copy_s is not None:
            out["copy_s"] = self.copy_s
        if self.again_s is not None:
            out["again_s"] = self.again_s
        if self.again_copy_s is not None:
            out["again_copy_s"] = self.again_copy_s
        return out

    @classmethod
    def from_dict(cls, data: object, bad: Any) -> MixSample:
        """`bad(name, what)` makes the ValueError naming the field."""
        if not isinstance(data, dict):
            raise bad("", "must be a JSON object")
        calls = data.get("calls")
        if not isinstance(calls, list) or not calls:
            raise bad("calls", "must be a non-empty list of forward calls")
        out = []
        for i, call in enumerate(calls):
            if not isinstance(call, list) or not call:
                raise bad(f"calls[{i}]", "must be a non-empty list of chunks")
            chunks = []
            for j, c in enumerate(call):
                ok = (isinstance(c, list) and len(c) == 5 and all(type(x) is int for x in c[:3])
                      and all(isinstance(x, bool) for x in c[3:]) and c[0] >= 0 and c[1] >= 0 and c[2] >= 1)
                if not ok:
                    raise bad(f"calls[{i}][{j}]", f"must be [seq >= 0, pos0 >= 0, n_tokens >= 1, samples, "
                                                  f"is_prompt], got {c!r}")
                chunks.append((c[0], c[1], c[2], c[3], c[4]))
            out.append(tuple(chunks))
        if not isinstance(data.get("prompt"), bool):
            raise bad("prompt", f"must be true or false, got {data.get('prompt')!r}")
        clock = data.get("clock_s")
        if isinstance(clock, bool) or not isinstance(clock, (int, float)) or not math.isfinite(clock) or clock < 0:
            raise bad("clock_s", f"must be a number of seconds >= 0, got {clock!r}")
        raw_ops = data.get("ops", [])
        if not isinstance(raw_ops, list):
            raise bad("ops", f"must be a list of prompt-cache copies, got {raw_ops!r}")
        ops = []
        for k, op in enumerate(raw_ops):
            if not (isinstance(op, list) and len(op) == 3 and op[0] in MIX_OP_KINDS
                    and all(type(x) is int for x in op[1:]) and op[1] >= 0 and op[2] >= 1):
                raise bad(f"ops[{k}]", f"must be [\"save\" or \"load\", seq >= 0, n_tokens >= 1], got {op!r}")
            ops.append((op[0], op[1], op[2]))
        measured = _positive(data.get("measured_s"), lambda w: bad("measured_s", w))
        copy_s = data.get("copy_s")
        if copy_s is not None and not (is_number(copy_s) and 0 <= copy_s < measured):
            raise bad("copy_s", f"must be the seconds of its copies, >= 0 and below measured_s ({measured}), "
                                f"got {copy_s!r}")
        again = data.get("again_s")
        again_s = None if again is None else _positive(again, lambda w: bad("again_s", w))
        again_copy = data.get("again_copy_s")
        if again_copy is not None and not (again_s is not None and is_number(again_copy) and 0 <= again_copy < again_s):
            raise bad("again_copy_s", f"must be the seconds of the second execution's copies, >= 0 and below "
                                      f"again_s ({again_s}), got {again_copy!r}")
        return cls(tuple(out), data["prompt"], measured, _positive(data.get("step_s"), lambda w: bad("step_s", w)),
                   float(clock), tuple(ops), None if copy_s is None else float(copy_s), again_s,
                   None if again_copy is None else float(again_copy))


@dataclass(frozen=True, slots=True)
class TrackPass:
    """One pass of the probe's shapes during a real run (one execution each, seconds by label): when on the run's
    own clock (`clock_s`, replay's simulated seconds: the axis the simulator's times are on), when in wall
    seconds since the run started, and the 1-minute load average then; `mix`: the run's own steps replayed since
    the pass before (`MixSample`; empty for a track of the fixed shapes only)."""

    clock_s: float
    wall_s: float
    shapes_s: dict[str, float]
    load1: float
    mix: tuple[MixSample, ...] = ()


@dataclass(frozen=True, slots=True)
class SpeedTrack:
    """Every probe pass taken during one real run, one each `every_s` wall seconds (between two steps), each
    the median of `repeats` executions per shape."""

    every_s: float
    passes: tuple[TrackPass, ...]
    repeats: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"every_s": self.every_s, "repeats": self.repeats,
                "passes": [{"clock_s": p.clock_s, "wall_s": p.wall_s, "shapes_s": dict(p.shapes_s),
                            "load1": p.load1, "mix": [m.to_dict() for m in p.mix]} for p in self.passes]}

    @classmethod
    def from_dict(cls, data: object, where: str) -> SpeedTrack:
        """The track of a JSON object; ValueError naming `where` and the field when malformed."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: top level must be a JSON object")
        every = data.get("every_s")
        if not is_number(every) or every < 0:
            raise ValueError(f"{where}: field 'every_s' must be a number >= 0, got {every!r}")
        rows = data.get("passes")
        if not isinstance(rows, list):
            raise ValueError(f"{where}: field 'passes' must be a list")
        passes = []
        for i, row in enumerate(rows):
            def bad(name: str, what: str) -> ValueError:
                return ValueError(f"{where}: field 'passes[{i}].{name}' {what}")
            if not isinstance(row, dict):
                raise bad("", "must be a JSON object")
            for name in ("clock_s", "wall_s", "load1"):
                if not is_number(row.get(name)) or not math.isfinite(row[name]):
                    raise bad(name, f"must be a finite number, got {row.get(name)!r}")
            shapes = row.get("shapes_s")
            if not isinstance(shapes, dict) or not shapes:
                raise bad("shapes_s", "must be a non-empty object of label: seconds")
            mix = row.get("mix", [])
            if not isinstance(mix, list):
                raise bad("mix", "must be a list of replayed steps")
            passes.append(TrackPass(float(row["clock_s"]), float(row["wall_s"]),
                                    {str(k): _positive(v, lambda what, k=k: bad(f"shapes_s.{k}", what))
                                     for k, v in shapes.items()}, float(row["load1"]),
                                    tuple(MixSample.from_dict(m, lambda name, what, j=j: bad(
                                        f"mix[{j}]" + (f".{name}" if name else ""), what))
                                          for j, m in enumerate(mix))))
        if any(b.clock_s < a.clock_s for a, b in zip(passes, passes[1:])):
            raise ValueError(f"{where}: field 'passes' must be in clock order")
        repeats = data.get("repeats", 1)
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"{where}: field 'repeats' must be an integer >= 1, got {repeats!r}")
        return cls(float(every), tuple(passes), repeats)


def write_run_track(run_dir: str | Path, track: SpeedTrack) -> Path:
    """Store the probe passes of a real run with that run's files (a later `validate --real-run` reuses them)."""
    path = Path(run_dir) / TRACK_FILE
    path.write_text(json.dumps(track.to_dict(), indent=2) + "\n", encoding="utf-8")
    return path


def read_run_track(run_dir: str | Path) -> SpeedTrack | None:
    """The probe passes of a real run; None when it has none (probing was off, or a run of before the track)."""
    path = Path(run_dir) / TRACK_FILE
    if not path.is_file():
        return None
    return SpeedTrack.from_dict(read_json(path, "the speed track"), str(path))


def _rolling_median(values: Sequence[float], width: int) -> list[float]:
    half = width // 2
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def track_knots(reference: Mapping[str, float], before: SpeedProbe, after: SpeedProbe, track: SpeedTrack | None,
                end_clock_s: float, prompt_labels: Collection[str] = (), smooth: int = TRACK_SMOOTH) -> dict[str, Any]:
    """The knots of `--speed-correct track` (sim.latency.TrackedLatency): the probe before the run at clock 0,
    each pass of `track` at its clock, the probe after the run at `end_clock_s`.

    Each knot's factor is its step times / `reference` (seconds by shape label: what the simulator's latency
    model charges for the probe's shapes, `experiments.calibrate.probe_predictions`), geometric mean over the
    shapes: the factor that makes the model's times those of the machine at that moment, on shapes fixed in
    advance (not the run's own steps). Two factors, one per compute path: `raw` over the decode shapes (those
    not in `prompt_labels`), for steps without prompt tokens; `raw_prompt` over the prompt shapes
    (`prompt_labels`), for steps with (the decode factor where there is no prompt shape). `factor` and
    `factor_prompt` are the centred rolling medians of `smooth` raw factors (one pass executes each shape
    once, and single executions vary by several percent). ValueError when a knot shares no decode shape with
    `reference`."""
    decode = [label for label in reference if label not in prompt_labels]
    prompt = [label for label in reference if label in prompt_labels]

    def factor(shapes_s: Mapping[str, float], labels: Sequence[str]) -> float | None:
        common = [label for label in labels if label in shapes_s]
        return geomean([shapes_s[label] / reference[label] for label in common]) if common else None

    passes = track.passes if track is not None else ()
    clock = [0.0] + [p.clock_s for p in passes] + [max(float(end_clock_s), passes[-1].clock_s if passes else 0.0)]
    knots = [before.medians_s] + [p.shapes_s for p in passes] + [after.medians_s]
    raw = [factor(k, decode) for k in knots]
    if any(r is None for r in raw):
        raise ValueError(f"a probe pass shares no decode shape with the latency model's probe shapes "
                         f"({sorted(next(k for k, r in zip(knots, raw) if r is None))} against {sorted(decode)})")
    raw_prompt = [factor(k, prompt) or r for k, r in zip(knots, raw)]
    smoothed = _rolling_median(raw, max(1, smooth))
    smoothed_prompt = _rolling_median(raw_prompt, max(1, smooth))
    return {"clock_s": clock, "raw": raw, "factor": smoothed, "raw_prompt": raw_prompt,
            "factor_prompt": smoothed_prompt, "n_in_run": len(passes),
            "every_s": None if track is None else track.every_s, "smooth": smooth,
            "range": [min(smoothed), max(smoothed)], "range_prompt": [min(smoothed_prompt), max(smoothed_prompt)],
            "reference_s": dict(reference), "prompt_labels": prompt, "source": "fixed",
            "definition": "knots: the probe before the run (clock 0), every pass during it, the probe after (the "
                          "run's end); raw = step time / the latency model's time of the same shape, geometric "
                          "mean over the decode shapes (raw_prompt: over the prompt shapes); factor, factor_prompt "
                          "= centred rolling medians of `smooth` raws; the simulator multiplies a step's time by "
                          "the factor of its path (factor_prompt when it processes prompt tokens) interpolated "
                          "at its clock"}


def fill_nearest(values: Sequence[float | None], fallback: Sequence[float]) -> list[float]:
    """`values` with each None replaced by the nearest (earlier on a tie) value that is not None; `fallback`
    when every value is None."""
    have = [i for i, v in enumerate(values) if v is not None]
    if not have:
        return [float(x) for x in fallback]
    return [float(v) if v is not None else float(values[min(have, key=lambda h: (abs(h - i), h))])
            for i, v in enumerate(values)]


def window_knots(clock_s: Sequence[float], ratio: Sequence[float], prompt: Sequence[bool], every_s: float,
                 end_s: float, statistic: Callable[[Sequence[float]], float],
                 prompt_fill: int | None = None) -> dict[str, Any]:
    """Knots at the centres of windows of `every_s` seconds of a run's clock, up to `end_s`, from timed samples
    (at `clock_s`, measured / predicted `ratio`, on the prompt path or not): the `statistic` of each window's
    ratios per path (`raw`, `raw_prompt`; None where a window has none of a path), filled from the nearest
    window that has some (`factor`, `factor_prompt`; the other path's where the run has none of a path, the
    statistic over all samples where it has neither). With `prompt_fill`, a window without prompt samples takes
    the median of the `prompt_fill` prompt samples nearest its centre instead (the earlier on a tie). The
    windowing of `--speed-correct steps` (`steplog.step_knots`) and `track-mix` (`mix_knots`), in the keys of
    `track_knots`."""
    n = int(math.ceil(max(end_s, every_s) / every_s))
    values: list[tuple[list[float], list[float]]] = [([], []) for _ in range(n)]
    for c, r, is_prompt in zip(clock_s, ratio, prompt):
        values[min(int(c // every_s), n - 1)][bool(is_prompt)].append(float(r))
    raw = [float(statistic(v[0])) if v[0] else None for v in values]
    raw_prompt = [float(statistic(v[1])) if v[1] else None for v in values]
    overall = [float(statistic([float(r) for r in ratio]))] * n
    factor = fill_nearest(raw, fill_nearest(raw_prompt, overall))
    centres = [(w + 0.5) * every_s for w in range(n)]
    prompt_at = sorted((float(c), float(r)) for c, r, p in zip(clock_s, ratio, prompt) if p)
    if prompt_fill and prompt_at:
        clocks = [c for c, _ in prompt_at]

        def nearest_median(centre: float) -> float:
            # the k nearest lie within k places of centre's, widened to whole groups of equal clocks (whose order
            # decides a tie): sorting those few by distance picks what sorting all of them would
            at = bisect.bisect_left(clocks, centre)
            lo, hi = max(0, at - prompt_fill), min(len(clocks), at + prompt_fill)
            while lo > 0 and clocks[lo - 1] == clocks[lo]:
                lo -= 1
            while hi < len(clocks) and clocks[hi] == clocks[hi - 1]:
                hi += 1
            near = sorted(range(lo, hi), key=lambda i: abs(clocks[i] - centre))[:prompt_fill]
            return float(statistics.median(prompt_at[i][1] for i in near))
        factor_prompt = [v if v is not None else nearest_median(c) for v, c in zip(raw_prompt, centres)]
    else:
        factor_prompt = fill_nearest(raw_prompt, factor)
    return {"clock_s": centres, "raw": raw, "factor": factor,
            "raw_prompt": raw_prompt, "factor_prompt": factor_prompt, "n_in_run": n, "every_s": every_s,
            "smooth": 1, "range": [min(factor), max(factor)], "range_prompt": [min(factor_prompt), max(factor_prompt)],
            "reference_s": {}, "prompt_labels": []}


def mix_knots(track: SpeedTrack | None, predicted: Sequence[Sequence[float]],
              every_s: float | None = None) -> dict[str, Any] | None:
    """The knots of `--speed-correct track-mix` from the run's own steps replayed during it (`TrackPass.mix`).

    `predicted[i][j]`: what the latency model charges for pass i's j-th replay (`experiments.calibrate.
    mix_predictions`). The run's clock is cut into windows of `every_s` seconds (default: the track's
    `every_s`, as `--speed-correct steps` cuts it); a window's knot, at its centre, is the mean measured /
    predicted ratio of its replays without prompt tokens (`raw`) and with (`raw_prompt`), of their forward
    calls alone where their copies were timed on their own (`MixSample.copy_s`; `mix_predictions` then prices
    the forward calls alone: a copy's time on the bench depends on whether its blob's pages are fresh, which the
    run's own copies do not share, docs/validation_sim.md §15); a window without
    decode replays takes the nearest window's that has some, a window without prompt replays the median of the
    MIX_PROMPT_FILL prompt replays nearest it (few, and each carries the model's error on its own shape); a run
    without replays of a path takes the other path's. The mean, not the median: latency is a sum of step times, and the steps' slow tail (a step the host
    interrupted) is part of it; the latency model, fitted to medians, leaves it out (with the median, the
    simulated busy time came out 1-5% short, docs/validation_sim.md §11). The machine's speed measured on the
    shapes the run spent its time in, at the moments it spent it, priced by the model: unlike the fixed shapes' knots (`track_knots`), the model's error on the probe's shapes does not
    enter, and unlike `--speed-correct steps` it is a measurement of its own (the run's step times are not
    read). None when nothing was replayed."""
    rows = [] if track is None else [(m, t) for p, pred in zip(track.passes, predicted) for m, t in zip(p.mix, pred)
                                     if t > 0]
    if not rows:
        return None
    every = float(every_s if every_s is not None else track.every_s)
    knots = window_knots([m.clock_s for m, _ in rows], [m.forward_s / t for m, t in rows],
                         [m.prompt for m, _ in rows], every, max(m.clock_s for m, _ in rows), statistics.fmean,
                         prompt_fill=MIX_PROMPT_FILL)
    return {**knots, "n_replays": len(rows), "source": "mix", "prompt_fill": MIX_PROMPT_FILL,
            "replay_over_step": statistics.median(m.measured_s / m.step_s for m, _ in rows),
            "definition": "knots at the centres of windows of every_s seconds of the real run's clock; raw = the "
                          "mean, over the window's replays of the run's own steps (each right after its step), of "
                          "the replayed time / the latency model's time of the same step (both of its forward calls "
                          "alone where the replay timed its prompt-cache copies apart), over the replays without "
                          "prompt tokens (raw_prompt: with), None where a window has none (then the nearest "
                          "window's; on the prompt path the median of the prompt_fill nearest prompt replays); "
                          "factor, factor_prompt = raw, raw_prompt filled; replay_over_step = the median "
                          "replayed time / the run's own time of the same step"}
