"""The speed probe's record and arithmetic (experiments/speed_probe.py): reading and writing it, the ratios
now / calibration from given timings, and when validate warns."""

import json
import math
import re
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.calibrate import probe_points
from experiments.speed_probe import (
    PROBE_FILE,
    SPEED_THRESHOLD,
    TRACK_FILE,
    ProbeShape,
    SpeedProbe,
    SpeedTrack,
    TrackPass,
    calibration_probe,
    format_speed,
    grid_offset,
    probe_mismatch,
    read_run_probes,
    read_run_track,
    speed_report,
    speed_warnings,
    time_ratio,
    track_span,
    track_knots,
    write_run_probes,
    write_run_track,
)
from experiments.validate import MEASURED_CALIBRATION
from sim.latency import ParametricLatency, save_calibration
from sim.latency_spec import get_latency_model

LABELS = [p.label for p in probe_points()]
CAL_S = dict(zip(LABELS, (0.036, 0.045, 0.128)))
MEASURED_ON = {"machine": "test", "cpu": "test", "threads": 1, "engine": "slotlab numpy", "model": "tiny.gguf",
               "date": "2025-01-01", "notes": "hand-made for tests"}


def make_probe(medians, threads=1, model="tiny.gguf", load=(0.5, 0.4, 0.3)):
    shapes = tuple(ProbeShape(label, m, (m, m * 1.1, m * 0.9)) for label, m in medians.items())
    return SpeedProbe(shapes, "test", load, load, "2026-01-01T00:00:00+00:00", 0.5, threads, model, "test")


def scaled(medians, ratios):
    """The medians each multiplied by its ratio (one ratio for all when a number)."""
    if isinstance(ratios, (int, float)):
        ratios = [ratios] * len(medians)
    return {label: m * r for (label, m), r in zip(medians.items(), ratios)}


def test_probe_shapes_are_in_the_full_calibration_grid():
    from experiments.calibrate import calibration_grid
    assert LABELS == ["1x decode @256", "4x decode @256", "prompt 64"]
    assert set(probe_points()) <= set(calibration_grid())


def test_probe_round_trips_through_its_dict():
    probe = make_probe(CAL_S)
    back = SpeedProbe.from_dict(json.loads(json.dumps(probe.to_dict())), "x.json")
    assert back == probe and back.medians_s == CAL_S


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("shapes"), "probe.shapes"),
    (lambda d: d["shapes"][1].update(median_s=0), "probe.shapes[1].median_s"),
    (lambda d: d["shapes"][0].update(median_s="fast"), "probe.shapes[0].median_s"),
    (lambda d: d["shapes"][2].pop("label"), "probe.shapes[2].label"),
    (lambda d: d["shapes"].append(dict(d["shapes"][0])), "probe.shapes"),
    (lambda d: d.update(threads=0), "probe.threads"),
    (lambda d: d.update(when=None), "probe.when"),
    (lambda d: d["load"].update(before="high"), "probe.load.before"),
])
def test_a_malformed_probe_names_file_and_field(edit, field):
    data = make_probe(CAL_S).to_dict()
    edit(data)
    with pytest.raises(ValueError, match=re.escape(f"cal.json: field '{field}' ")):
        SpeedProbe.from_dict(data, "cal.json")


def test_calibration_files_without_a_probe_still_load(tmp_path):
    old = tmp_path / "old.json"
    save_calibration(ParametricLatency(1e-3, 2e-5, 3e-4, 1e-8), old, MEASURED_ON)
    assert calibration_probe(old) is None
    assert get_latency_model(f"parametric:{old}").a_s == 1e-3
    shipped = calibration_probe(MEASURED_CALIBRATION)              # the shipped calibration carries one
    assert shipped is not None and shipped.threads == 2
    get_latency_model(f"parametric:{MEASURED_CALIBRATION}")


def test_a_calibration_files_probe_is_read_back(tmp_path):
    path = tmp_path / "cal.json"
    save_calibration(ParametricLatency(1e-3, 2e-5, 3e-4, 1e-8), path, MEASURED_ON)
    data = json.loads(path.read_text())
    data["probe"] = make_probe(CAL_S).to_dict()
    path.write_text(json.dumps(data))
    assert calibration_probe(path) == make_probe(CAL_S)
    assert get_latency_model(f"parametric:{path}").a_s == 1e-3    # the model's readers ignore the field


def test_run_probes_are_stored_with_the_run(tmp_path):
    assert read_run_probes(tmp_path) is None
    before, after = make_probe(scaled(CAL_S, 1.1)), make_probe(scaled(CAL_S, 1.2))
    assert write_run_probes(tmp_path, before, after) == tmp_path / PROBE_FILE
    assert read_run_probes(tmp_path) == (before, after)


def test_ratio_is_the_geometric_mean_of_the_shapes_ratios():
    got = time_ratio(make_probe(scaled(CAL_S, [1.1, 1.6, 0.9])), make_probe(CAL_S))
    assert got["per_shape"] == pytest.approx(dict(zip(LABELS, [1.1, 1.6, 0.9])), rel=1e-12)
    assert got["ratio"] == pytest.approx((1.1 * 1.6 * 0.9) ** (1 / 3), rel=1e-12)


def test_ratio_uses_the_shapes_both_probes_measured():
    now = make_probe({**scaled(CAL_S, 2.0), "prompt 999": 5.0})
    ref = make_probe({LABELS[0]: CAL_S[LABELS[0]], "old shape": 1.0})
    assert time_ratio(now, ref) == {"ratio": pytest.approx(2.0, rel=1e-12),
                                    "per_shape": {LABELS[0]: pytest.approx(2.0, rel=1e-12)}}
    with pytest.raises(ValueError, match="share no shape"):
        time_ratio(make_probe({"a": 1.0}), make_probe({"b": 1.0}))


def test_report_gives_before_after_their_mean_and_the_drift_during_the_run():
    report = speed_report(make_probe(CAL_S), make_probe(scaled(CAL_S, 1.2)), make_probe(scaled(CAL_S, 1.5)))
    r = report["ratio"]
    assert r["before"] == pytest.approx(1.2, rel=1e-12) and r["after"] == pytest.approx(1.5, rel=1e-12)
    assert r["mean"] == pytest.approx(math.sqrt(1.2 * 1.5), rel=1e-12)
    assert r["during"] == pytest.approx(1.5 / 1.2, rel=1e-12)
    assert report["calibration"]["shapes"][0]["label"] == LABELS[0] and report["threshold"] == SPEED_THRESHOLD
    assert set(report["per_shape"]) == {"before", "after"}


GRID_SLOWER = [1.2, 1.1, 1.0]                # the grid's medians of the probe's shapes / the probe's own


def with_grid(probe, slower=GRID_SLOWER):
    """`probe` with grid medians: each shape's median times its factor in `slower` (the grid ran slower)."""
    shapes = tuple(ProbeShape(s.label, s.median_s, s.samples_s, s.median_s * f) for s, f in zip(probe.shapes, slower))
    return SpeedProbe(shapes, *(getattr(probe, f) for f in ("statistic", "load_before", "load_after", "when",
                                                               "wall_s", "threads", "model", "engine")))


def test_grid_ratio_is_the_probe_ratio_times_the_calibration_probes_offset_from_its_grid():
    cal = with_grid(make_probe(CAL_S))
    offset = (1 / 1.2 * 1 / 1.1 * 1 / 1.0) ** (1 / 3)
    assert grid_offset(cal) == pytest.approx(offset, rel=1e-12)
    report = speed_report(cal, make_probe(scaled(CAL_S, 1.1)), make_probe(scaled(CAL_S, 1.3)))
    r = report["ratio"]
    assert r["mean"] == pytest.approx(math.sqrt(1.1 * 1.3), rel=1e-12)
    assert r["grid_offset"] == pytest.approx(offset, rel=1e-12)
    assert r["grid"] == pytest.approx(math.sqrt(1.1 * 1.3) * offset, rel=1e-12)
    assert f"now / the calibration grid's medians x{r['grid']:.3f}" in format_speed(report, r["grid"])
    assert SpeedProbe.from_dict(cal.to_dict(), "cal.json") == cal         # the grid medians are stored


def test_a_calibration_probe_without_grid_medians_gives_no_grid_ratio():
    report = speed_report(make_probe(CAL_S), make_probe(CAL_S), make_probe(CAL_S))
    assert grid_offset(make_probe(CAL_S)) is None
    assert report["ratio"]["grid_offset"] is None and report["ratio"]["grid"] is None
    assert report["ratio"]["mean"] == pytest.approx(1.0, rel=1e-12)


def test_report_without_a_calibration_probe_still_gives_the_drift():
    report = speed_report(None, make_probe(CAL_S), make_probe(scaled(CAL_S, 1.1)))
    assert report["ratio"]["before"] is None and report["ratio"]["mean"] is None
    assert report["ratio"]["during"] == pytest.approx(1.1, rel=1e-12)
    assert "calibration has none" in format_speed(report, 1.0)


def warnings_for(before, after, correct="off"):
    report = speed_report(make_probe(CAL_S), make_probe(scaled(CAL_S, before)), make_probe(scaled(CAL_S, after)))
    return speed_warnings(report, "parametric:cal.json", correct, report["ratio"]["mean"], "runs/v1/real")


def test_no_warning_within_the_threshold():
    inside = 1 + SPEED_THRESHOLD * 0.9
    assert warnings_for(inside, inside) == [] and warnings_for(1 / inside, 1 / inside) == []


def test_a_slower_machine_is_warned_about_with_what_to_do():
    (text,) = warnings_for(1.45, 1.45)
    assert "speed differs from when parametric:cal.json was calibrated" in text
    assert "x1.450 before and x1.450 after" in text
    assert "slotlab calibrate" in text and "--speed-correct probe --real-run runs/v1/real" in text


def test_a_correction_names_the_factor_and_what_it_cannot_do():
    (text,) = warnings_for(1.3, 1.3, correct="probe")
    assert "multiplied by x1.300" in text and "contention" in text


def test_speed_moving_during_the_run_is_warned_about():
    during = 1 + SPEED_THRESHOLD * 1.5
    texts = warnings_for(1.0, during)
    assert len(texts) == 2 and "moved during the real run" in texts[1] and f"x{during:.3f}" in texts[1]


def test_a_probe_of_another_thread_count_or_model_is_not_comparable():
    probe = make_probe(CAL_S, threads=2, model="SmolLM2.gguf")
    assert probe_mismatch(probe, "/m/SmolLM2.gguf", 2) is None
    assert probe_mismatch(probe, "/m/SmolLM2.gguf", 1) == "speed probe ran 2 threads (this run: 1)"
    assert "model SmolLM2.gguf (this run: tiny.gguf)" in probe_mismatch(probe, "/t/tiny.gguf", 2)


# --- the speed track ---------------------------------------------------------------------------------------


REFERENCE = {label: m * f for (label, m), f in zip(CAL_S.items(), (0.9, 1.0, 1.1))}   # a model's probe-shape times


def track_of(clock_ratios, every=10.0):
    """A track with one pass per (clock_s, ratio): every shape at REFERENCE's time times the ratio."""
    return SpeedTrack(every, tuple(TrackPass(c, 10.0 * i, scaled(REFERENCE, r), 0.5)
                                   for i, (c, r) in enumerate(clock_ratios)))


PROMPT = [LABELS[2]]                          # "prompt 64": the probe's one prompt shape


def test_track_knots_run_from_the_probe_before_through_the_passes_to_the_probe_after():
    before, after = make_probe(scaled(REFERENCE, 1.1)), make_probe(scaled(REFERENCE, 1.3))
    ratios = [1.0, 1.2, 2.0, 1.2, 1.1]
    k = track_knots(REFERENCE, before, after, track_of(zip((5.0, 15.0, 25.0, 35.0, 45.0), ratios)), 50.0,
                    prompt_labels=PROMPT, smooth=3)
    assert k["clock_s"] == [0.0, 5.0, 15.0, 25.0, 35.0, 45.0, 50.0] and k["n_in_run"] == 5
    # a knot's raw factor: its step times / the model's times of the same shapes
    assert k["raw"] == pytest.approx([1.1, *ratios, 1.3], rel=1e-12)
    # centred medians of 3 (of 2 at the ends): the one pass at x2.0 is smoothed away
    assert k["factor"] == pytest.approx([1.05, 1.1, 1.2, 1.2, 1.2, 1.2, 1.2], rel=1e-12)
    assert k["factor_prompt"] == pytest.approx(k["factor"], rel=1e-12)     # every shape moved alike
    assert k["range"] == [min(k["factor"]), max(k["factor"])] and k["every_s"] == 10.0
    assert k["reference_s"] == REFERENCE and k["prompt_labels"] == PROMPT


def test_track_knots_give_the_decode_and_the_prompt_path_a_factor_each():
    # decode shapes at x1.0 and x1.25 of the model's times, the prompt shape at x1.5
    ratios = (1.0, 1.25, 1.5)
    k = track_knots(REFERENCE, make_probe(scaled(REFERENCE, ratios)), make_probe(scaled(REFERENCE, 1.0)), None,
                    1.0, prompt_labels=PROMPT, smooth=1)
    assert k["raw"][0] == pytest.approx(1.25 ** 0.5, rel=1e-12)             # geometric mean of the decode shapes
    assert k["raw_prompt"] == pytest.approx([1.5, 1.0], rel=1e-12) and k["range_prompt"] == pytest.approx([1.0, 1.5])
    # without prompt labels, every shape counts for both paths
    k = track_knots(REFERENCE, make_probe(scaled(REFERENCE, ratios)), make_probe(scaled(REFERENCE, 1.0)), None,
                    1.0, smooth=1)
    assert k["raw"][0] == pytest.approx((1.0 * 1.25 * 1.5) ** (1 / 3), rel=1e-12) and k["raw_prompt"] == k["raw"]


def test_track_knots_without_passes_are_the_probes_before_and_after():
    k = track_knots(REFERENCE, make_probe(scaled(REFERENCE, 1.0)), make_probe(scaled(REFERENCE, 1.2)), None, 30.0,
                    prompt_labels=PROMPT, smooth=1)
    assert k["clock_s"] == [0.0, 30.0] and k["n_in_run"] == 0 and k["every_s"] is None
    assert k["factor"] == pytest.approx([1.0, 1.2], rel=1e-12)


def test_track_knots_need_a_decode_shape_in_common_with_the_reference():
    with pytest.raises(ValueError, match="shares no decode shape with the latency model's probe shapes"):
        track_knots({"other shape": 0.1}, make_probe(CAL_S), make_probe(CAL_S), None, 1.0)
    # a knot without the prompt shape takes its decode factor for both paths
    only_decode = make_probe({label: v for label, v in scaled(REFERENCE, 1.2).items() if label not in PROMPT})
    k = track_knots(REFERENCE, only_decode, make_probe(REFERENCE), None, 1.0, prompt_labels=PROMPT, smooth=1)
    assert k["raw_prompt"] == pytest.approx([1.2, 1.0], rel=1e-12)


def test_speed_track_round_trips_through_its_file(tmp_path):
    track = track_of([(1.5, 1.0), (12.0, 1.1)])
    write_run_track(tmp_path, track)
    assert read_run_track(tmp_path) == track and (tmp_path / TRACK_FILE).is_file()
    assert read_run_track(tmp_path / "nothing") is None


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("every_s"), "'every_s'"),
    (lambda d: d.update(passes={}), "'passes'"),
    (lambda d: d["passes"][1].update(clock_s="x"), "'passes[1].clock_s'"),
    (lambda d: d["passes"][0].update(shapes_s={}), "'passes[0].shapes_s'"),
    (lambda d: d["passes"][0]["shapes_s"].update({LABELS[0]: -1.0}), f"'passes[0].shapes_s.{LABELS[0]}'"),
    (lambda d: d["passes"].reverse(), "in clock order"),
    (lambda d: d.update(repeats=0), "'repeats'"),
])
def test_a_malformed_speed_track_names_file_and_field(tmp_path, edit, field):
    data = track_of([(1.5, 1.0), (12.0, 1.1)]).to_dict()
    edit(data)
    assert_refused_naming(tmp_path, data, field)


def assert_refused_naming(run_dir, data, field):
    """Reading `data` as run_dir's speed track is refused with an error naming the file and `field`."""
    (run_dir / TRACK_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=re.escape(str(run_dir / TRACK_FILE))) as err:
        read_run_track(run_dir)
    assert field in str(err.value)


def test_format_speed_gives_the_tracks_range():
    report = speed_report(make_probe(CAL_S), make_probe(scaled(CAL_S, 1.0)), make_probe(scaled(CAL_S, 1.2)))
    report["track"] = track_knots(REFERENCE, make_probe(scaled(REFERENCE, 1.0)), make_probe(scaled(REFERENCE, 1.2)),
                                  track_of([(3.0, 1.05)]), 9.0, prompt_labels=PROMPT)
    lo, hi = report["track"]["range"]
    plo, phi = report["track"]["range_prompt"]
    span = f"decode x{lo:.3f}-x{hi:.3f}, prompt x{plo:.3f}-x{phi:.3f}"
    assert f"1 passes during, after; / the model's times) {span}" in format_speed(report, 1.0)
    report["correct"] = "track"
    assert format_speed(report, 1.0).endswith(f"simulator step times {span}, following the run's clock")


def test_a_speed_that_moved_and_came_back_is_warned_about_from_the_track():
    before = after = make_probe(scaled(REFERENCE, 1.0))
    report = speed_report(make_probe(CAL_S), before, after)
    moved = track_of([(5.0, 1.0), (10.0, 1.3), (15.0, 1.3), (20.0, 1.3), (25.0, 1.0)])
    report["track"] = track_knots(REFERENCE, before, after, moved, 30.0, prompt_labels=PROMPT)
    (text,) = [w for w in speed_warnings(report, "parametric:cal.json", "off", 1.0, "V/real")
               if "while the probes before and after it agree" in w]
    lo, hi = report["track"]["range"]
    assert f"x{lo:.3f}-x{hi:.3f}" in text and "`--speed-correct track --real-run V/real` follows it" in text
    report["track"] = track_knots(REFERENCE, before, after, track_of([(5.0, 1.01), (10.0, 1.02)]), 30.0)
    assert not any("while the probes" in w for w in speed_warnings(report, "x", "off", 1.0))


def test_calibrate_warns_when_its_probe_and_its_grid_disagree():
    from experiments.speed_probe import GRID_OFFSET_WARN, grid_offset_warning
    probe = make_probe(CAL_S)
    assert grid_offset_warning(probe) is None                                    # no grid medians (--quick)
    assert grid_offset_warning(with_grid(probe, [1.05, 1.0, 0.97])) is None      # within the threshold
    slower = [1.25, 1.3, 1.2]                                                    # the grid ran ~25% slower
    text = grid_offset_warning(with_grid(probe, slower))
    offset = (1 / (1.25 * 1.3 * 1.2)) ** (1 / 3)
    assert text is not None and f"x{offset:.3f}" in text and "faster" in text and "--speed-correct grid" in text
    assert "slower" in grid_offset_warning(with_grid(probe, [0.8, 0.8, 0.8]))
    edge = 1 / (1 - GRID_OFFSET_WARN)                                            # offset 1 - threshold: not beyond it
    assert grid_offset_warning(with_grid(probe, [edge * 0.999] * 3)) is None
    assert grid_offset_warning(with_grid(probe, [edge * 1.01] * 3)) is not None


# --- the mix: the run's own steps replayed during the passes -----------------------------------------------


DECODE_CALL = (((0, 300, 1, True, False), (1, 120, 1, True, False)),)      # two sequences' decodes in one call
PROMPT_CALL = (((0, 0, 64, True, True),),)                                  # a prompt chunk


def mix_track(passes, every=10.0):
    """A track whose pass i replayed the (clock_s, prompt, measured_s) of passes[i] (step_s 0.02 each)."""
    from experiments.speed_probe import MixSample
    return SpeedTrack(every, tuple(
        TrackPass(max([c for c, _, _ in row], default=0.0), 10.0 * (i + 1), dict(REFERENCE), 0.5,
                  tuple(MixSample(PROMPT_CALL if prompt else DECODE_CALL, prompt, t, 0.02, c) for c, prompt, t in row))
        for i, row in enumerate(passes)))


def model_times_of(passes):
    """The model charges 0.01 s for every decode replay and 0.05 s for every prompt replay."""
    return [[0.05 if prompt else 0.01 for _, prompt, _ in row] for row in passes]


def test_mix_knots_are_the_means_of_each_windows_replays_over_the_models_times():
    from experiments.speed_probe import mix_knots
    passes = [[(1.0, False, 0.011), (4.0, False, 0.012), (8.0, False, 0.013), (9.0, True, 0.06)],
              [(12.0, False, 0.010), (15.0, True, 0.05), (25.0, True, 0.045)],
              [(18.0, True, 0.07)]]            # the window [10, 20) spans two passes
    k = mix_knots(mix_track(passes), model_times_of(passes))
    assert k["source"] == "mix" and k["clock_s"] == [5.0, 15.0, 25.0] and k["n_in_run"] == 3 and k["every_s"] == 10
    assert k["raw"][:2] == pytest.approx([1.2, 1.0]) and k["raw"][2] is None     # window 2: no decode replay
    assert k["factor"] == pytest.approx([1.2, 1.0, 1.0])                          # ... the nearest window's
    assert k["raw_prompt"] == pytest.approx([1.2, 1.2, 0.9]) and k["factor_prompt"] == k["raw_prompt"]
    assert k["n_replays"] == 8 and k["range"] == [1.0, 1.2]
    # replay / the run's own step time: the median over every replay (step_s 0.02)
    assert k["replay_over_step"] == pytest.approx(statistics.median(t / 0.02 for row in passes for _, _, t in row))
    k5 = mix_knots(mix_track(passes), model_times_of(passes), every_s=30.0)       # one window
    assert k5["clock_s"] == [15.0] and k5["raw"] == pytest.approx([1.15]) and k5["raw_prompt"] == pytest.approx([1.125])
    # the mean, not the median: one slow replay moves its window's factor
    slow = [[(1.0, False, 0.010), (2.0, False, 0.010), (3.0, False, 0.040)]]
    assert mix_knots(mix_track(slow), model_times_of(slow))["raw"] == pytest.approx([2.0])


def test_mix_knots_of_a_run_without_prompt_replays_use_the_decode_factor_on_both_paths():
    from experiments.speed_probe import mix_knots
    passes = [[(2.0, False, 0.013)], [], [(21.0, False, 0.011)]]
    k = mix_knots(mix_track(passes), model_times_of(passes))
    assert k["clock_s"] == [5.0, 15.0, 25.0] and k["raw"][1] is None
    assert k["factor"] == pytest.approx([1.3, 1.3, 1.1])       # the empty window: the nearest, the earlier on a tie
    assert k["raw_prompt"] == [None] * 3 and k["factor_prompt"] == pytest.approx(k["factor"])
    assert mix_knots(mix_track([[], []]), [[], []]) is None and mix_knots(None, []) is None


def test_mix_knots_fill_a_window_without_prompt_replays_with_the_median_of_the_nearest_ones():
    """A prompt replay prices its own shape, and the model's error on that shape rides along: a window without a
    prompt replay takes the median of the MIX_PROMPT_FILL nearest prompt replays, not the nearest one's."""
    from experiments.speed_probe import MIX_PROMPT_FILL, mix_knots
    assert MIX_PROMPT_FILL == 9
    # prompt replays at 1.0 .. 1.9 (ratio to the model's 0.05 s) in windows 0..9 of 1 s, none in windows 10, 11
    ratios = [1.0 + 0.1 * i for i in range(10)]
    passes = [[(i + 0.5, True, 0.05 * r), (i + 0.6, False, 0.01)] for i, r in enumerate(ratios)]
    passes.append([(10.5, False, 0.01), (11.5, False, 0.01)])
    k = mix_knots(mix_track(passes, every=1.0), model_times_of(passes), every_s=1.0)
    assert k["raw_prompt"][:10] == pytest.approx(ratios) and k["raw_prompt"][10:] == [None, None]
    assert k["factor_prompt"][:10] == pytest.approx(ratios)                # a window's own replays first
    # windows 10 and 11: the 9 nearest are the replays at 1.1 .. 1.9, median 1.5 (the nearest alone: 1.9)
    assert k["factor_prompt"][10:] == pytest.approx([1.5, 1.5])
    assert k["prompt_fill"] == 9
    # fewer prompt replays than that: the median of all of them
    few = [[(0.5, True, 0.05), (0.6, False, 0.01)], [(1.5, True, 0.10)], [(2.5, True, 0.06), (3.5, False, 0.01)]]
    k = mix_knots(mix_track(few, every=1.0), model_times_of(few), every_s=1.0)
    assert k["factor_prompt"] == pytest.approx([1.0, 2.0, 1.2, 1.2])


def test_mix_knots_leave_a_replays_copies_out_where_it_timed_them_apart():
    """A replay's prompt-cache save writes a new blob whose pages may be fresh (0.05 or 2 ns a byte on a VM), which
    the run's own saves do not share: where `copy_s` is known, the knot is the forward calls' time over the
    model's price of the forward calls alone (`mix_predictions` leaves the copies out then)."""
    import dataclasses
    from experiments.speed_probe import mix_knots
    passes = [[(1.0, True, 0.06), (2.0, True, 0.06)]]
    track = mix_track(passes)
    fast, slow = (dataclasses.replace(m, ops=(("save", 0, 700),), copy_s=c, measured_s=0.06 + c)
                  for m, c in zip(track.passes[0].mix, (0.001, 0.030)))
    timed = dataclasses.replace(track, passes=(dataclasses.replace(track.passes[0], mix=(fast, slow)),))
    k = mix_knots(timed, model_times_of(passes))                # the model's 0.05 s of the forward calls
    assert k["raw_prompt"] == pytest.approx([1.2])
    assert k["replay_over_step"] == pytest.approx((0.061 / 0.02 + 0.09 / 0.02) / 2)    # whole replays / steps
    untimed = dataclasses.replace(timed, passes=(dataclasses.replace(
        timed.passes[0], mix=tuple(dataclasses.replace(m, copy_s=None) for m in timed.passes[0].mix)),))
    k = mix_knots(untimed, model_times_of(passes))              # an older file: the whole replay over its price
    assert k["raw_prompt"] == pytest.approx([(0.061 + 0.09) / 2 / 0.05])


def test_mix_predictions_price_a_replay_without_its_copies_where_it_timed_them_apart():
    import dataclasses
    from experiments.calibrate import mix_predictions
    from sim.latency import ParametricLatency
    lat = ParametricLatency(0.0, 1e-3, 0.0, 0.0, e_copy_s_per_byte=1e-6)
    track = mix_track([[(1.0, True, 0.1)]])
    m = dataclasses.replace(track.passes[0].mix[0], ops=(("save", 0, 10),))
    price = {}
    for copy_s in (None, 0.01):
        one = dataclasses.replace(track, passes=(dataclasses.replace(track.passes[0], mix=(
            dataclasses.replace(m, copy_s=copy_s),)),))
        (row,) = mix_predictions(lat, 100, one)
        price[copy_s] = row[0]
    assert price[0.01] == pytest.approx(64e-3)                     # 64 prompt tokens
    assert price[None] == pytest.approx(64e-3 + 10 * 100 * 1e-6, rel=1e-3)    # and the 1000 bytes it saves


def test_fill_nearest_takes_the_nearest_value_and_the_earlier_on_a_tie():
    from experiments.speed_probe import fill_nearest
    assert fill_nearest([None, 2.0, None, None, 5.0, None], [0.0] * 6) == [2.0, 2.0, 2.0, 5.0, 5.0, 5.0]
    assert fill_nearest([None, None], [7.0, 8.0]) == [7.0, 8.0]


def test_a_track_with_replays_round_trips_and_a_track_without_them_still_loads(tmp_path):
    import dataclasses
    track = mix_track([[(1.0, False, 0.011), (2.0, True, 0.06)], [(12.0, False, 0.012)]])
    first = track.passes[0]
    with_copies = dataclasses.replace(first.mix[1], ops=(("save", 0, 40), ("load", 0, 64)), copy_s=0.004)
    track = dataclasses.replace(track, passes=(dataclasses.replace(first, mix=(first.mix[0], with_copies)),
                                               *track.passes[1:]))
    write_run_track(tmp_path, track)
    assert read_run_track(tmp_path) == track
    data = json.loads((tmp_path / TRACK_FILE).read_text())
    assert "ops" not in data["passes"][0]["mix"][0] and data["passes"][0]["mix"][1]["ops"] == [["save", 0, 40],
                                                                                                ["load", 0, 64]]
    assert "copy_s" not in data["passes"][0]["mix"][0] and data["passes"][0]["mix"][1]["copy_s"] == 0.004
    assert "again_s" not in data["passes"][0]["mix"][0]                 # none made (validate without --replay-again)
    again = dataclasses.replace(track.passes[1].mix[0], again_s=0.0125, again_copy_s=0.001)
    with_again = dataclasses.replace(track, passes=(track.passes[0], dataclasses.replace(track.passes[1], mix=(again,))))
    write_run_track(tmp_path, with_again)
    assert read_run_track(tmp_path) == with_again
    assert json.loads((tmp_path / TRACK_FILE).read_text())["passes"][1]["mix"][0]["again_s"] == 0.0125
    write_run_track(tmp_path, track)
    del data["passes"][0]["mix"][1]["copy_s"]               # a file written before the copies were timed apart
    (tmp_path / TRACK_FILE).write_text(json.dumps(data))
    assert read_run_track(tmp_path).passes[0].mix[1].copy_s is None
    for row in data["passes"]:                              # a file written before the mix
        del row["mix"]
    (tmp_path / TRACK_FILE).write_text(json.dumps(data))
    assert all(p.mix == () for p in read_run_track(tmp_path).passes)


@pytest.mark.parametrize("edit, field", [
    (lambda m: m.update(calls=[]), "'passes[0].mix[1].calls'"),
    (lambda m: m["calls"][0].append([0, 1, 0, True, False]), "'passes[0].mix[1].calls[0][1]'"),
    (lambda m: m["calls"][0][0].__setitem__(3, 1), "'passes[0].mix[1].calls[0][0]'"),
    (lambda m: m.update(prompt="yes"), "'passes[0].mix[1].prompt'"),
    (lambda m: m.update(measured_s=0.0), "'passes[0].mix[1].measured_s'"),
    (lambda m: m.pop("step_s"), "'passes[0].mix[1].step_s'"),
    (lambda m: m.update(clock_s=-1.0), "'passes[0].mix[1].clock_s'"),
    (lambda m: m.update(ops={"save": 3}), "'passes[0].mix[1].ops'"),
    (lambda m: m.update(ops=[["save", 0, 3], ["copy", 0, 3]]), "'passes[0].mix[1].ops[1]'"),
    (lambda m: m.update(ops=[["load", 0, 0]]), "'passes[0].mix[1].ops[0]'"),
    (lambda m: m.update(copy_s=-0.001), "'passes[0].mix[1].copy_s'"),
    (lambda m: m.update(copy_s=0.06), "'passes[0].mix[1].copy_s'"),         # all of measured_s (0.06)
    (lambda m: m.update(copy_s="0.01"), "'passes[0].mix[1].copy_s'"),
    (lambda m: m.update(again_s=0.0), "'passes[0].mix[1].again_s'"),
    (lambda m: m.update(again_s="0.05"), "'passes[0].mix[1].again_s'"),
    (lambda m: m.update(again_s=float("nan")), "'passes[0].mix[1].again_s'"),
    (lambda m: m.update(again_s=0.05, again_copy_s=0.05), "'passes[0].mix[1].again_copy_s'"),
    (lambda m: m.update(again_copy_s=0.001), "'passes[0].mix[1].again_copy_s'"),            # without again_s
])
def test_a_malformed_replay_names_file_and_field(tmp_path, edit, field):
    data = mix_track([[(1.0, False, 0.011), (2.0, True, 0.06)]]).to_dict()
    edit(data["passes"][0]["mix"][1])
    assert_refused_naming(tmp_path, data, field)


def test_format_speed_and_the_warnings_name_the_replays():
    from experiments.speed_probe import mix_knots
    report = speed_report(make_probe(CAL_S), make_probe(scaled(CAL_S, 1.2)), make_probe(scaled(CAL_S, 1.2)))
    passes = [[(5.0 + 10 * i, False, t)] for i, t in enumerate((0.010, 0.013, 0.013, 0.013, 0.010))]
    report["track_mix"] = mix_knots(mix_track(passes), model_times_of(passes))
    span = track_span(report["track_mix"])
    assert "the run's own steps replayed (5 replays in 5 windows of 10 s, replay / step x" in format_speed(report, 1.0)
    report["correct"] = "track-mix"
    assert format_speed(report, 1.0).endswith(f"simulator step times {span}, following the run's clock (replays)")
    (text,) = [w for w in speed_warnings(report, "parametric:cal.json", "track-mix", 1.0) if "were multiplied by" in w]
    assert "measured by replaying a sample of the run's own steps during it (--speed-correct track-mix)" in text


@settings(max_examples=200, deadline=None)
@given(samples=st.lists(st.tuples(st.integers(0, 40).map(lambda c: c / 4), st.floats(0.5, 2.0), st.booleans()),
                        min_size=1, max_size=60),
       k=st.integers(1, 12))
def test_the_prompt_fill_takes_what_sorting_every_prompt_sample_by_distance_takes(samples, k):
    """The fill looks only near each window's centre; it must pick the same k samples (ties: the earlier, then the
    smaller ratio) as sorting all of them."""
    from experiments.speed_probe import window_knots
    clock, ratio, prompt = zip(*samples)
    knots = window_knots(clock, ratio, prompt, 1.0, 10.5, statistics.fmean, prompt_fill=k)
    at = sorted((c, r) for c, r, p in samples if p)
    for centre, raw, got in zip(knots["clock_s"], knots["raw_prompt"], knots["factor_prompt"]):
        if raw is None and at:
            near = sorted(range(len(at)), key=lambda i: abs(at[i][0] - centre))[:k]
            assert got == statistics.median(at[i][1] for i in near)
