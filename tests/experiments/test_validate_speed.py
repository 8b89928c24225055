"""`slotlab validate` and the speed probe on a tiny random-weight GGUF: validation.json's `speed_probe`, the
warning when the machine's speed differs from the calibration's, the refusals of `--speed-correct probe`, and
that the correction multiplies the simulated times by exactly the factor. The probe's timings are injected
(`run_validate(..., speed_probe=)`), so the ratios are known exactly and do not depend on this machine's load."""

import contextlib
import io
import json
import math
import shutil

import pandas as pd
import pytest

from experiments.repeat_floor import FLOOR_MIN_REPLAYS
from experiments.speed_probe import (
    PROBE_FILE,
    SPEED_THRESHOLD,
    TRACK_EVERY_S,
    SpeedTrack,
    TrackPass,
    read_run_probes,
    read_run_track,
    write_run_probes,
    write_run_track,
)
from experiments.validate import read_validation, run_validate
from sim.latency import ParametricLatency, save_calibration
from tests.experiments.test_speed_probe import (
    CAL_S,
    GRID_SLOWER,
    LABELS,
    MEASURED_ON,
    make_probe,
    scaled,
    with_grid,
)
from tests.experiments.test_validate import parse

BEFORE, AFTER = 1.2, 1.3                      # injected: step times x1.2 before the real run, x1.3 after
FACTOR = math.sqrt(BEFORE * AFTER)           # ratio.mean, what --speed-correct probe multiplies by
SPEED_WARNING = "the machine's speed differs from when"
DRIFT_WARNING = "the machine's speed moved during the real run (speed probe after / before"   # not the step log's


def write_trace(path):
    """Every request arrives at t = 0: the simulator's decisions then follow from the order of events alone,
    and multiplying every step time by one factor multiplies every event time by it without reordering any (no
    arrival can fall between other events). 5 requests on 2 slots: some wait for a slot."""
    rows = [(30, 4), (12, 6), (25, 3), (18, 5), (20, 4)]
    path.write_text("".join(json.dumps({"arrival_s": 0.0, "n_prompt": p, "n_output": o}) + "\n" for p, o in rows))
    return path


def injected(*ratios):
    """A `speed_probe` for run_validate: the calibration's medians times each ratio in turn (one call each)."""
    probes = iter([make_probe(scaled(CAL_S, r)) for r in ratios])
    calls = []

    def probe(model):
        calls.append(model)
        return next(probes)

    probe.calls = calls
    return probe


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    """A calibration file with a probe, one without, the workload's options, and one real run measured with the
    injected probes (its stderr kept)."""
    root = tmp_path_factory.mktemp("speed")
    plain = root / "plain.json"
    save_calibration(ParametricLatency(1e-3, 2e-5, 3e-4, 1e-8), plain, MEASURED_ON)
    cal = root / "cal.json"
    data = json.loads(plain.read_text())
    data["probe"] = make_probe(CAL_S).to_dict()
    cal.write_text(json.dumps(data))
    options = ["-m", tiny, "--threads", "1", "--quiet", "--no-plots", "--trace", str(write_trace(root / "t.jsonl")),
               "-np", "2", "-c", "512", "--seed", "5"]
    probe = injected(BEFORE, AFTER)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = run_validate(parse(*options, "--latency", f"parametric:{cal}", "--out", str(root / "v")),
                          speed_probe=probe)
    assert rc == 0, err.getvalue()
    return {"root": root, "cal": cal, "plain": plain, "options": options, "out": root / "v",
            "stderr": err.getvalue(), "probe_calls": probe.calls}


def validate(setup, out, *extra, cal=None, speed_probe=None):
    return run_validate(parse(*setup["options"], "--latency", f"parametric:{cal or setup['cal']}",
                              "--out", str(out), *extra), speed_probe=speed_probe)


def test_the_probe_runs_on_the_loaded_engine_before_and_after_the_real_run(setup):
    before, after = setup["probe_calls"]
    assert before is after and before.n_threads == 1          # one model, loaded once for probes and run
    stored = read_run_probes(setup["out"] / "real")
    assert stored == (make_probe(scaled(CAL_S, BEFORE)), make_probe(scaled(CAL_S, AFTER)))


def test_validation_json_has_the_speed_probe(setup):
    _, _, summary = read_validation(setup["out"])
    speed = summary["speed_probe"]
    assert speed["calibration"] == make_probe(CAL_S).to_dict()
    assert speed["before"] == make_probe(scaled(CAL_S, BEFORE)).to_dict()
    assert speed["after"] == make_probe(scaled(CAL_S, AFTER)).to_dict()
    r = speed["ratio"]
    # ratios of medians that were multiplied by the ratio: exact up to one rounding each, then a geometric mean
    assert r["before"] == pytest.approx(BEFORE, rel=1e-12) and r["after"] == pytest.approx(AFTER, rel=1e-12)
    assert r["mean"] == pytest.approx(FACTOR, rel=1e-12) and r["during"] == pytest.approx(AFTER / BEFORE, rel=1e-12)
    assert set(speed["per_shape"]) == {"before", "after"}
    assert speed["per_shape"]["before"] == pytest.approx(dict.fromkeys(LABELS, BEFORE), rel=1e-12)
    assert speed["correct"] == "off" and speed["factor"] == 1.0
    assert speed["calibration_unusable"] is None and speed["run_probes"] == "measured with this real run"
    assert summary["latency_model"]["kind"] == "parametric"            # off: the simulator's model unscaled


def test_a_ratio_off_one_is_warned_about(setup):
    err = setup["stderr"]
    assert f"warning: {SPEED_WARNING}" in err and f"x{BEFORE:.3f} before and x{AFTER:.3f} after" in err
    assert f"--speed-correct probe --real-run {setup['out'] / 'real'}" in err
    # after / before = 1.083 is also more than the threshold away from 1: the speed moved during the run
    assert AFTER / BEFORE - 1 > SPEED_THRESHOLD and f"{DRIFT_WARNING} x{AFTER / BEFORE:.3f}" in err


def test_no_speed_warning_within_the_threshold(setup, tmp_path, capsys):
    real = tmp_path / "real"
    shutil.copytree(setup["out"] / "real", real)
    inside = 1 + SPEED_THRESHOLD / 2
    write_run_probes(real, make_probe(scaled(CAL_S, inside)), make_probe(scaled(CAL_S, inside)))
    assert validate(setup, tmp_path / "v", "--real-run", str(real)) == 0
    err = capsys.readouterr().err
    assert SPEED_WARNING not in err and DRIFT_WARNING not in err
    _, _, summary = read_validation(tmp_path / "v")
    assert summary["speed_probe"]["ratio"]["mean"] == pytest.approx(inside, rel=1e-12)
    assert summary["speed_probe"]["run_probes"] == f"stored with the real run ({PROBE_FILE})"


def test_speed_correct_needs_a_calibration_with_a_probe(setup, tmp_path, capsys):
    probe = injected(1.0, 1.0)
    assert validate(setup, tmp_path / "v", "--speed-correct", "probe", cal=setup["plain"], speed_probe=probe) == 2
    assert "--speed-correct probe needs a calibration with a speed probe" in capsys.readouterr().err
    assert probe.calls == [] and not (tmp_path / "v").exists()          # refused before the engine runs


def test_speed_correct_needs_the_real_runs_probes(setup, tmp_path, capsys):
    real = tmp_path / "real"
    shutil.copytree(setup["out"] / "real", real)
    (real / PROBE_FILE).unlink()
    assert validate(setup, tmp_path / "v", "--speed-correct", "probe", "--real-run", str(real)) == 2
    assert f"{real} has no {PROBE_FILE}" in capsys.readouterr().err
    assert validate(setup, tmp_path / "v", "--real-run", str(real)) == 0      # off: only no ratio to report
    _, _, summary = read_validation(tmp_path / "v")
    assert summary["speed_probe"]["before"] is None and summary["speed_probe"]["run_probes"] is None


def test_speed_correct_refuses_a_probe_of_another_thread_count(setup, tmp_path, capsys):
    real = tmp_path / "real"
    shutil.copytree(setup["out"] / "real", real)
    write_run_probes(real, make_probe(CAL_S, threads=2), make_probe(CAL_S, threads=2))
    assert validate(setup, tmp_path / "v", "--speed-correct", "probe", "--real-run", str(real)) == 2
    assert "is not comparable with this run: the calibration's speed probe ran 1 thread" in capsys.readouterr().err


def test_speed_correct_is_refused_with_a_recorded_trace(tmp_path, capsys):
    from experiments.cli import main
    from tests.experiments.test_validate_recorded import write_recorded
    trace = write_recorded(tmp_path / "r.jsonl")
    assert main(["validate", "--recorded", str(trace), "--latency", "constant:0.01", "--speed-correct", "probe",
                 "--out", str(tmp_path / "v")]) == 2
    assert "a recorded trace has none" in capsys.readouterr().err and not (tmp_path / "v").exists()


def test_speed_correct_multiplies_the_simulated_times_by_the_factor(setup, tmp_path):
    real = str(setup["out"] / "real")
    assert validate(setup, tmp_path / "off", "--real-run", real) == 0
    assert validate(setup, tmp_path / "probe", "--real-run", real, "--speed-correct", "probe") == 0
    _, _, summary = read_validation(tmp_path / "probe")
    speed = summary["speed_probe"]
    assert speed["correct"] == "probe" and speed["factor"] == speed["ratio"]["mean"]
    assert speed["factor"] == pytest.approx(FACTOR, rel=1e-12)
    assert summary["latency_model"]["kind"] == "scaled" and summary["latency_model"]["factor"] == speed["factor"]
    off, probe = (pd.read_parquet(tmp_path / d / "sim" / "requests.parquet").sort_values("request")
                  .reset_index(drop=True) for d in ("off", "probe"))
    # all arrivals at t = 0 (write_trace): the same decisions, and every time a sum of step durations each
    # multiplied by the factor. The simulator's clock counts whole nanoseconds (sim/driver.py rounds every
    # step's duration), so a sum of n steps is off its exact value by at most n * 0.5 ns in each run: probe vs
    # factor * off within (1 + factor) * 0.5 ns per step of the run (float summation adds far less)
    for col in ("request", "slot", "n_cached", "n_output", "finish"):
        assert list(probe[col]) == list(off[col])
    assert (off["ttft_s"] > 0).all() and (off["queue_s"] > 0).any()     # some requests waited for a slot
    n_steps = summary["sim_steps"]
    assert n_steps == read_validation(tmp_path / "off")[2]["sim_steps"]
    bound = (1 + speed["factor"]) * 0.5e-9 * n_steps
    assert bound < 1e-4 * off["ttft_s"].min()                           # far below the factor's effect
    for col in ("ttft_s", "e2e_s", "queue_s"):
        assert list(probe[col]) == pytest.approx(list(speed["factor"] * off[col]), rel=0, abs=bound), col
    # tpot = (e2e - ttft) / (n_output - 1): twice the bound over at least one token
    assert list(probe["tpot_s"]) == pytest.approx(list(speed["factor"] * off["tpot_s"]), rel=0, abs=2 * bound)


def test_speed_correct_grid_needs_the_grids_medians_of_the_probes_shapes(setup, tmp_path, capsys):
    probe = injected(1.0, 1.0)
    assert validate(setup, tmp_path / "v", "--speed-correct", "grid", speed_probe=probe) == 2
    assert "grid did not measure the speed probe's shapes (a --quick calibration)" in capsys.readouterr().err
    assert probe.calls == [] and not (tmp_path / "v").exists()          # refused before the engine runs


def test_speed_correct_grid_multiplies_by_the_ratio_to_the_grids_medians(setup, tmp_path):
    cal = tmp_path / "cal_grid.json"
    data = json.loads(setup["cal"].read_text())
    data["probe"] = with_grid(make_probe(CAL_S)).to_dict()
    cal.write_text(json.dumps(data))
    real = str(setup["out"] / "real")                                   # its probes: x1.2 before, x1.3 after
    assert validate(setup, tmp_path / "g", "--real-run", real, "--speed-correct", "grid", cal=cal) == 0
    _, _, summary = read_validation(tmp_path / "g")
    speed = summary["speed_probe"]
    offset = math.prod(1 / f for f in GRID_SLOWER) ** (1 / len(GRID_SLOWER))
    assert speed["correct"] == "grid" and speed["factor"] == speed["ratio"]["grid"]
    assert speed["factor"] == pytest.approx(FACTOR * offset, rel=1e-12)
    assert summary["latency_model"]["kind"] == "scaled" and summary["latency_model"]["factor"] == speed["factor"]



# --- --speed-correct track ----------------------------------------------------------------------------------


def model_times(setup):
    """What the setup's calibration model charges for the probe's shapes (the reference of the track)."""
    from experiments.calibrate import probe_predictions
    from sim.latency_spec import get_latency_model
    kv = json.loads((setup["out"] / "real" / "config.json").read_text())["server_config"]["kv_bytes_per_token"]
    return probe_predictions(get_latency_model(f"parametric:{setup['cal']}"), kv)


def test_the_real_run_stores_its_speed_track(setup):
    track = read_run_track(setup["out"] / "real")
    # a run of a second: no pass was due during it; the one after its last step holds the run's replays
    assert track is not None and track.every_s == TRACK_EVERY_S and len(track.passes) == 1
    (last,) = track.passes
    assert last.mix and all(m.measured_s > 0 and m.step_s > 0 for m in last.mix)
    steps = pd.read_parquet(setup["out"] / "real" / "steps.parquet")
    ends = set((steps["clock_s"] + steps["elapsed_s"]).round(9))
    assert all(round(m.clock_s, 9) in ends for m in last.mix)       # each replay right after a step of the run
    _, _, summary = read_validation(setup["out"])
    fixed = summary["speed_probe"]["track"]                   # the fixed shapes' knots: before, the pass, after
    assert fixed["source"] == "fixed" and fixed["n_in_run"] == 1 and len(fixed["clock_s"]) == 3
    assert fixed["reference_s"] == pytest.approx(model_times(setup))
    k = summary["speed_probe"]["track_mix"]                   # the replays' knots: one pass
    assert k["source"] == "mix" and k["n_in_run"] == 1 and k["n_replays"] == len(last.mix)


def test_probe_predictions_are_the_models_times_of_the_probes_plans():
    from experiments.calibrate import probe_points, probe_predictions
    from sim.latency import ConstantLatency
    times = probe_predictions(ConstantLatency(0.01, 1e-3), 1000)
    # 1x decode: 1 token; 4x decode: 4 tokens; prompt 64: 64 tokens
    assert times == pytest.approx(dict(zip([p.label for p in probe_points()], (0.011, 0.014, 0.074))), rel=1e-12)


def with_track(setup, tmp_path, ratio_of_pass, before=1.0, after=1.0, n=3):
    """A copy of the setup's real run whose probes and passes run at the given ratios to the model's times."""
    ref = model_times(setup)
    real = tmp_path / "real"
    shutil.copytree(setup["out"] / "real", real)
    write_run_probes(real, make_probe(scaled(ref, before)), make_probe(scaled(ref, after)))
    write_run_track(real, SpeedTrack(5.0, tuple(TrackPass(c, 5.0 * i, scaled(ref, r), 0.5)
                                                for i, (c, r) in enumerate(ratio_of_pass(n)))))
    return real


def test_speed_correct_track_with_a_flat_track_multiplies_by_its_factor(setup, tmp_path):
    ratio = 1.25
    real = with_track(setup, tmp_path, lambda n: [(0.2 * i, ratio) for i in range(1, n + 1)], ratio, ratio)
    assert validate(setup, tmp_path / "off", "--real-run", str(real)) == 0
    assert validate(setup, tmp_path / "track", "--real-run", str(real), "--speed-correct", "track",
                    cal=setup["plain"]) == 0                         # no calibration probe needed
    _, _, summary = read_validation(tmp_path / "track")
    speed, model = summary["speed_probe"], summary["latency_model"]
    assert speed["correct"] == "track" and speed["track"]["n_in_run"] == 3
    assert model["kind"] == "tracked" and model["times_s"] == speed["track"]["clock_s"]
    assert model["factors"] == pytest.approx([ratio] * 5, rel=1e-12) and speed["factor"] == pytest.approx(ratio)
    assert model["prompt_factors"] == pytest.approx([ratio] * 5, rel=1e-12)
    assert speed["track"]["prompt_labels"] == ["prompt 64"]
    off, track = (pd.read_parquet(tmp_path / d / "sim" / "requests.parquet").sort_values("request")
                  .reset_index(drop=True) for d in ("off", "track"))
    for col in ("slot", "n_cached", "finish"):
        assert list(track[col]) == list(off[col])
    for col in ("ttft_s", "e2e_s", "tpot_s"):                       # (the ns rounding bound of the probe test)
        assert list(track[col]) == pytest.approx(list(ratio * off[col]), rel=1e-6), col
    # the real run's steps priced at the factor of their clock: ratio x the unscaled model
    off_err = read_validation(tmp_path / "off")[2]["real_step_errors"]["all"]["busy_err"]
    assert summary["real_step_errors"]["all"]["busy_err"] == pytest.approx(ratio * (1 + off_err) - 1, rel=1e-9)


def with_replays(setup, tmp_path, ratio, fixed_ratio):
    """A copy of the setup's real run whose pass replays ran at `ratio` x the model's times of the same steps and
    whose fixed shapes (probes and the pass) at `fixed_ratio` x theirs."""
    import dataclasses
    from experiments.calibrate import mix_predictions
    from sim.latency_spec import get_latency_model
    real = with_track(setup, tmp_path, lambda n: [], fixed_ratio, fixed_ratio)
    track = read_run_track(setup["out"] / "real")
    kv = json.loads((real / "config.json").read_text())["server_config"]["kv_bytes_per_token"]
    predicted = mix_predictions(get_latency_model(f"parametric:{setup['cal']}"), kv, track)
    passes = tuple(dataclasses.replace(p, shapes_s=scaled(model_times(setup), fixed_ratio),
                                       mix=tuple(dataclasses.replace(m, measured_s=ratio * t + (m.copy_s or 0.0))
                                                 for m, t in zip(p.mix, pred)))
                   for p, pred in zip(track.passes, predicted))
    write_run_track(real, SpeedTrack(track.every_s, passes, track.repeats))
    return real


def test_speed_correct_track_mix_multiplies_by_the_replays_ratio_to_the_model(setup, tmp_path):
    ratio, fixed_ratio = 1.25, 1.6
    real = with_replays(setup, tmp_path, ratio, fixed_ratio)
    assert validate(setup, tmp_path / "off", "--real-run", str(real)) == 0
    assert validate(setup, tmp_path / "track", "--real-run", str(real), "--speed-correct", "track-mix") == 0
    speed = read_validation(tmp_path / "track")[2]["speed_probe"]
    assert speed["correct"] == "track-mix" and speed["factor"] == pytest.approx(ratio, rel=1e-12)
    assert speed["track_mix"]["factor_prompt"] == pytest.approx([ratio], rel=1e-12)
    assert speed["track"]["factor"] == pytest.approx([fixed_ratio] * 3, rel=1e-12)
    off, track = (pd.read_parquet(tmp_path / d / "sim" / "requests.parquet").sort_values("request")
                  .reset_index(drop=True) for d in ("off", "track"))
    for col in ("ttft_s", "e2e_s", "tpot_s"):
        assert list(track[col]) == pytest.approx(list(ratio * off[col]), rel=1e-6), col
    # track: the fixed shapes' knots, whatever the replays read
    assert validate(setup, tmp_path / "fixed", "--real-run", str(real), "--speed-correct", "track") == 0
    speed = read_validation(tmp_path / "fixed")[2]["speed_probe"]
    assert speed["correct"] == "track" and speed["factor"] == pytest.approx(fixed_ratio, rel=1e-12)
    fixed = pd.read_parquet(tmp_path / "fixed" / "sim" / "requests.parquet").sort_values("request")
    assert list(fixed["e2e_s"]) == pytest.approx(list(fixed_ratio * off["e2e_s"]), rel=1e-6)


def test_the_knot_window_cuts_the_runs_clock_for_track_mix_and_steps(setup, tmp_path, capsys):
    """--knot-window sets the windows of both run-following corrections (not the real run: a run recorded with the
    default is reused with any window); a window that is not a positive number of seconds is refused."""
    import math
    real = with_replays(setup, tmp_path, 1.25, 1.6)
    steps = pd.read_parquet(real / "steps.parquet")
    end = float((steps["clock_s"] + steps["elapsed_s"]).max())
    every = end / 4
    for correct, key in (("track-mix", "track_mix"), ("steps", "steps_track")):
        assert validate(setup, tmp_path / correct, "--real-run", str(real), "--speed-correct", correct,
                        "--knot-window", f"{every!r}") == 0
        knots = read_validation(tmp_path / correct)[2]["speed_probe"][key]
        assert knots["every_s"] == every and knots["clock_s"][:2] == pytest.approx([every / 2, 1.5 * every])
        assert len(knots["clock_s"]) <= math.ceil(end / every) + 1
    assert validate(setup, tmp_path / "bad", "--real-run", str(real), "--speed-correct", "track-mix",
                    "--knot-window", "0") == 2
    assert "--knot-window must be a number of seconds > 0, got 0.0" in capsys.readouterr().err


def test_speed_correct_track_mix_needs_a_run_whose_passes_replayed_its_steps(setup, tmp_path, capsys):
    real = with_track(setup, tmp_path, lambda n: [(0.2 * i, 1.0) for i in range(1, n + 1)])   # passes, no replays
    assert validate(setup, tmp_path / "v", "--real-run", str(real), "--speed-correct", "track-mix") == 2
    assert "has no probe pass that replayed the run's own steps" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


def test_speed_correct_track_follows_a_slower_second_half(setup, tmp_path):
    """A track that doubles the step times after the first request finished: every request that finished later
    takes longer than under a flat track, the first one not."""
    flat_real = with_track(setup, tmp_path / "a", lambda n: [])
    assert validate(setup, tmp_path / "flat", "--real-run", str(flat_real), "--speed-correct", "track") == 0
    flat = pd.read_parquet(tmp_path / "flat" / "sim" / "requests.parquet").set_index("request")
    first = flat["e2e_s"].idxmin()
    t_first = float(flat.loc[first, "e2e_s"])
    real = with_track(setup, tmp_path / "b", lambda n: [(t_first / 2, 1.0)]
                      + [(t_first + 1e-6 * i, 2.0) for i in range(1, 6)], after=2.0)
    assert validate(setup, tmp_path / "slow", "--real-run", str(real), "--speed-correct", "track") == 0
    slow = pd.read_parquet(tmp_path / "slow" / "sim" / "requests.parquet").set_index("request")
    assert slow.loc[first, "ttft_s"] == pytest.approx(flat.loc[first, "ttft_s"], rel=1e-9)
    others = flat.index.drop(first)
    assert (slow.loc[others, "e2e_s"] > 1.2 * flat.loc[others, "e2e_s"]).all()


def test_speed_correct_track_is_refused_with_the_passes_turned_off(setup, tmp_path, capsys):
    probe = injected(1.0, 1.0)
    assert validate(setup, tmp_path / "v", "--speed-correct", "track", "--probe-every", "0", speed_probe=probe) == 2
    assert "--probe-every 0 turns them off" in capsys.readouterr().err
    assert probe.calls == [] and not (tmp_path / "v").exists()


@pytest.mark.parametrize("every", ["-1", "nan"])
def test_probe_every_must_be_a_non_negative_number(setup, tmp_path, capsys, every):
    assert validate(setup, tmp_path / "v", "--probe-every", every, speed_probe=injected(1.0, 1.0)) == 2
    assert "--probe-every must be a number of seconds >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("share", ["1.5", "-0.1", "nan"])
def test_replay_decode_must_be_a_fraction(setup, tmp_path, capsys, share):
    assert validate(setup, tmp_path / "v", "--replay-decode", share, speed_probe=injected(1.0, 1.0)) == 2
    assert "--replay-decode must be a fraction of the decode step time in [0, 1]" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


def test_by_default_every_decode_step_is_replayed_and_replay_decode_takes_a_share(setup, tmp_path):
    from experiments.calibrate import MIX_BUDGET
    from experiments.flags import FLAGS
    assert MIX_BUDGET == 1.0 and next(f for f in FLAGS if "--replay-decode" in f.flags).default == MIX_BUDGET

    def decode_replays(run):
        from experiments.steplog import path_steps, read_steps
        track = read_run_track(run / "real")
        return sum(1 for p in track.passes for m in p.mix if not m.prompt), path_steps(read_steps(run / "real"), False)

    n_rep, n_steps = decode_replays(setup["out"])
    assert n_steps > 3 and n_rep == n_steps
    assert "--replay-decode" not in read_validation(setup["out"])[2]["command"]
    assert validate(setup, tmp_path / "v", "--replay-decode", "0.15", speed_probe=injected(1.0, 1.0)) == 0
    n_rep, n_steps = decode_replays(tmp_path / "v")
    assert n_rep < n_steps                      # below 1 a replay waits for its share to cover it: not the first
    assert "--replay-decode 0.15" in read_validation(tmp_path / "v")[2]["command"]


# --- --speed-correct steps: the real run's own speed (an oracle) --------------------------------------------


def with_steps(setup, tmp_path, scale_of_clock):
    """A copy of the setup's real run whose logged step times are multiplied by scale_of_clock(clock_s)."""
    from experiments.steplog import STEPS_FILE
    real = tmp_path / "real"
    shutil.copytree(setup["out"] / "real", real)
    steps = pd.read_parquet(real / STEPS_FILE)
    steps["elapsed_s"] = steps["elapsed_s"] * [scale_of_clock(c) for c in steps["clock_s"]]
    steps.to_parquet(real / STEPS_FILE)
    return real, steps


def medians_of_ratio(setup, steps, prompt):
    """The median measured / predicted ratio of the charged steps with (prompt) or without prompt tokens."""
    from experiments.steplog import predict_steps
    from sim.latency_spec import get_latency_model
    predicted = predict_steps(steps, get_latency_model(f"parametric:{setup['plain']}"))
    ok = steps["charged"].to_numpy(bool) & (predicted > 0)
    ok &= (steps["n_prefill_tokens"].to_numpy() > 0) == prompt
    return float(pd.Series(steps["elapsed_s"].to_numpy()[ok] / predicted[ok]).median())


def test_speed_correct_steps_multiplies_by_the_real_runs_own_ratio(setup, tmp_path, capsys):
    """One window: the factors are the medians of measured / predicted over the run's decode steps and over its
    prompt steps; steps three times slower give factors three times larger, and simulated times three times
    longer (every arrival at t = 0: a uniform factor reorders nothing). No probe and no calibration probe needed."""
    base, steps1 = with_steps(setup, tmp_path / "a", lambda c: 1.0)
    slow, steps3 = with_steps(setup, tmp_path / "b", lambda c: 3.0)
    for real, out in ((base, "one"), (slow, "three")):
        (real / PROBE_FILE).unlink()
        assert validate(setup, tmp_path / out, "--real-run", str(real), "--speed-correct", "steps",
                        "--knot-window", "1000", cal=setup["plain"]) == 0
    assert "--speed-correct steps gave the simulator the speed the real run itself measured" in capsys.readouterr().err
    (_, _, one), (_, _, three) = read_validation(tmp_path / "one"), read_validation(tmp_path / "three")
    k1, k3 = one["speed_probe"]["steps_track"], three["speed_probe"]["steps_track"]
    assert one["speed_probe"]["correct"] == "steps" and k1["n_in_run"] == 1 and k1["clock_s"] == [500.0]
    assert k1["factor"] == [pytest.approx(medians_of_ratio(setup, steps1, prompt=False), rel=1e-12)]
    assert k1["factor_prompt"] == [pytest.approx(medians_of_ratio(setup, steps1, prompt=True), rel=1e-12)]
    assert k1["factor"] != k1["factor_prompt"]                     # two paths, two factors
    assert k3["factor"] == pytest.approx([3 * f for f in k1["factor"]], rel=1e-12)
    assert k3["factor_prompt"] == pytest.approx([3 * f for f in k1["factor_prompt"]], rel=1e-12)
    assert three["latency_model"]["kind"] == "tracked"
    a, b = (pd.read_parquet(tmp_path / d / "sim" / "requests.parquet").sort_values("request").reset_index(drop=True)
            for d in ("one", "three"))
    assert list(a["slot"]) == list(b["slot"]) and list(a["n_cached"]) == list(b["n_cached"])
    for col in ("ttft_s", "e2e_s"):
        assert list(b[col]) == pytest.approx(list(3 * a[col]), rel=1e-6), col


def test_speed_correct_steps_follows_a_slower_second_half(setup, tmp_path):
    """Windows of an eighth of the run: steps logged twice as slow from the middle of its clock on give the
    windows after it twice the factors, on either path, while the windows before keep the unscaled run's."""
    steps = pd.read_parquet(setup["out"] / "real" / "steps.parquet")
    end = float((steps["clock_s"] + steps["elapsed_s"]).max())
    half, every = end / 2, end / 8
    runs = {}
    for name, scale in (("flat", lambda c: 1.0), ("slow", lambda c: 2.0 if c >= half else 1.0)):
        real, _ = with_steps(setup, tmp_path / name, scale)
        assert validate(setup, tmp_path / f"v_{name}", "--real-run", str(real), "--speed-correct", "steps",
                        "--knot-window", f"{every!r}") == 0
        runs[name] = read_validation(tmp_path / f"v_{name}")[2]["speed_probe"]["steps_track"]
    flat, slow = runs["flat"], runs["slow"]
    assert len(flat["clock_s"]) in (8, 9)                          # 9 when end / every rounds above 8
    seen = {"before": 0, "after": 0}
    for path in ("raw", "raw_prompt"):                              # the windows that have steps of the path
        for c, f, s in zip(flat["clock_s"], flat[path], slow[path]):
            if f is None:
                assert s is None
            elif c + every / 2 <= half * (1 - 1e-12):                # a window wholly before the middle
                assert s == pytest.approx(f, rel=1e-12)
                seen["before"] += 1
            elif c - every / 2 >= half * (1 - 1e-12):                # wholly after
                assert s == pytest.approx(2 * f, rel=1e-12)
                seen["after"] += 1
    assert seen["before"] and seen["after"], seen


def test_speed_correct_steps_needs_the_step_logs_clock(setup, tmp_path, capsys):
    real, steps = with_steps(setup, tmp_path, lambda c: 1.0)
    steps.drop(columns=["clock_s"]).to_parquet(real / "steps.parquet")
    assert validate(setup, tmp_path / "v", "--real-run", str(real), "--speed-correct", "steps") == 2
    assert "has none (a run written before the step log's clock_s)" in capsys.readouterr().err
    assert not (tmp_path / "v").exists()


def test_validation_json_has_the_repeat_floor_of_the_runs_replays(setup, tmp_path, capsys):
    """Every step of the run replayed: at exactly its own time, the floor is zero (an offset is not scatter); at
    +-10% in turn, a TTFT or E2E that is one step's share moves, and the floor says so; without replays, none."""
    from experiments.speed_probe import MixSample
    steps = pd.read_parquet(setup["out"] / "real" / "steps.parquet")
    steps = steps[steps["elapsed_s"] > 0]
    call = (((0, 0, 1, True, False),),)

    def run_with(cycle):
        """Every step replayed, each path's replays at the ratios of `cycle` in turn."""
        real = tmp_path / f"real{len(list(tmp_path.iterdir()))}"
        shutil.copytree(setup["out"] / "real", real)
        seen = {True: 0, False: 0}
        mix = []
        for c, e, p in steps[["clock_s", "elapsed_s", "n_prefill_tokens"]].itertuples(index=False):
            prompt = bool(p > 0)
            mix.append(MixSample(call, prompt, cycle[seen[prompt] % len(cycle)] * e, e, c + e))
            seen[prompt] += 1
        write_run_track(real, SpeedTrack(5.0, (TrackPass(1.0, 1.0, dict(CAL_S), 0.5, tuple(mix)),)))
        return real

    n = len(steps)
    assert validate(setup, tmp_path / "same", "--real-run", str(run_with([1.07]))) == 0
    floor = read_validation(tmp_path / "same")[2]["repeat_floor"]
    assert floor["n_replays"]["prompt"] + floor["n_replays"]["decode"] == n
    assert floor["offset"]["decode"] == pytest.approx(1.07, rel=1e-12)
    assert all(r["median_abs"] == pytest.approx(0.0, abs=1e-9) for r in floor["aggregate"])
    moving = run_with([1.1, 1.0, 1 / 1.1])
    assert validate(setup, tmp_path / "moves", "--real-run", str(moving)) == 0
    floor = read_validation(tmp_path / "moves")[2]["repeat_floor"]
    # centred on the path's median (1.0: the three ratios in turn, 3 or more decode steps), / sqrt 2
    assert floor["n_replays"]["decode"] >= 3
    assert floor["scatter"]["decode"] == pytest.approx(math.log(1.1) / math.sqrt(2), rel=1e-9)
    assert max(r["p90_abs"] for r in floor["aggregate"] if r["metric"] == "e2e") > 0.01
    capsys.readouterr()
    rc = run_validate(parse(*[o for o in setup["options"] if o != "--quiet"], "--latency",
                            f"parametric:{setup['cal']}", "--out", str(tmp_path / "loud"), "--real-run",
                            str(moving)))
    assert rc == 0 and "repeat floor (" in capsys.readouterr().out
    no_replays = with_track(setup, tmp_path / "x", lambda n: [(0.2, 1.0)])
    assert validate(setup, tmp_path / "none", "--real-run", str(no_replays)) == 0
    assert read_validation(tmp_path / "none")[2]["repeat_floor"] is None


def test_replay_again_times_every_replay_twice_and_the_floor_reads_the_split(setup, tmp_path, capsys):
    """--replay-again: each timed replay executed once more (real/speed_track.json again_s); the command line keeps
    the flag; the floor reports the replays executed twice per path and its split (measured with enough)."""
    assert validate(setup, tmp_path / "v", "--replay-again", speed_probe=injected(1.0, 1.0)) == 0
    mix = [m for p in read_run_track(tmp_path / "v" / "real").passes for m in p.mix]
    assert mix and all(m.again_s is not None and m.again_s > 0 for m in mix)
    _, _, data = read_validation(tmp_path / "v")
    assert "--replay-again" in data["command"]
    floor = data["repeat_floor"]
    for path, prompt in (("prompt", True), ("decode", False)):
        n = sum(1 for m in mix if m.prompt == prompt)
        assert floor["n_again"][path] == n
        assert floor["split"][path] == ("measured" if n >= FLOOR_MIN_REPLAYS else "even")
        assert 0.0 <= floor["step_share"][path] <= 1.0
    # without the probe there is nothing to execute again: refused before anything runs
    assert validate(setup, tmp_path / "off", "--replay-again", "--probe-every", "0") == 2
    assert "--replay-again executes the in-run probe's replays a second time: it needs the probe" in \
        capsys.readouterr().err
    assert not (tmp_path / "off").exists()
    # without the flag, no second executions and an even split
    assert all(m.again_s is None for p in read_run_track(setup["out"] / "real").passes for m in p.mix)
    plain = read_validation(setup["out"])[2]["repeat_floor"]
    assert plain["n_again"] == {"prompt": 0, "decode": 0} and set(plain["split"].values()) == {"even"}


def test_the_repeat_floor_with_the_schedule_free_resimulates_the_validation(setup, tmp_path, capsys):
    """`repeat_floor.dynamic`: --floor-draws re-simulations under the run's replay scatter, each compared with the
    undisturbed simulation. Replays at exactly their steps' times give the undisturbed run back every time; at
    +-10% in turn, the drawn runs move; 0 draws, none; a negative count is refused."""
    from experiments.speed_probe import MixSample
    steps = pd.read_parquet(setup["out"] / "real" / "steps.parquet")
    steps = steps[steps["elapsed_s"] > 0]
    call = (((0, 0, 1, True, False),),)

    def run_with(cycle, name):
        real = tmp_path / name
        shutil.copytree(setup["out"] / "real", real)
        mix = [MixSample(call, bool(p > 0), cycle[i % len(cycle)] * e, e, c + e) for i, (c, e, p) in
               enumerate(steps[["clock_s", "elapsed_s", "n_prefill_tokens"]].itertuples(index=False))]
        write_run_track(real, SpeedTrack(5.0, (TrackPass(1.0, 1.0, dict(CAL_S), 0.5, tuple(mix)),)))
        return real

    same = run_with([1.07], "same")
    assert validate(setup, tmp_path / "same", "--real-run", str(same), "--speed-correct", "track-mix",
                    "--floor-draws", "3") == 0
    dyn = read_validation(tmp_path / "same")[2]["repeat_floor"]["dynamic"]
    assert dyn["draws"] == 3 and dyn["decision_match_rate"] == 1.0
    assert all(r["median_abs"] == pytest.approx(0.0, abs=1e-12) and r["within_target"] == 1.0
               for r in dyn["aggregate"])
    moving = run_with([1.1, 1.0, 1 / 1.1], "moving")
    assert validate(setup, tmp_path / "moves", "--real-run", str(moving)) == 0       # the default: 16 draws
    dyn = read_validation(tmp_path / "moves")[2]["repeat_floor"]["dynamic"]
    assert dyn["draws"] == 16 and max(r["p90_abs"] for r in dyn["aggregate"]) > 0.01
    assert len(dyn["hits"]["per_draw"]) == 16
    errors = pd.read_csv(tmp_path / "moves" / "errors.csv")       # the simulator's own count, beside the draws'
    errors = errors[errors["stat"].isin(["p50", "p90"]) & errors["metric"].isin(["ttft", "tpot", "e2e"])]
    assert dyn["simulator_hits"] == int((errors["rel_err"].abs() <= 0.03).sum())
    assert validate(setup, tmp_path / "off", "--real-run", str(moving), "--floor-draws", "0") == 0
    assert "dynamic" not in read_validation(tmp_path / "off")[2]["repeat_floor"]
    capsys.readouterr()
    rc = run_validate(parse(*[o for o in setup["options"] if o != "--quiet"], "--latency",
                            f"parametric:{setup['cal']}", "--out", str(tmp_path / "loud"), "--real-run",
                            str(moving), "--floor-draws", "2"))
    out = capsys.readouterr().out
    assert rc == 0 and "repeat floor, the schedule free (2 re-simulations" in out and "; the simulator met " in out
    assert validate(setup, tmp_path / "bad", "--real-run", str(moving), "--floor-draws", "-1") == 2
    assert "--floor-draws must be a number of re-simulations >= 0" in capsys.readouterr().err
    # --floor-scatter replay: both floors drawn with a replay's whole scatter, said in validation.json
    assert validate(setup, tmp_path / "whole", "--real-run", str(moving), "--floor-draws", "2",
                    "--floor-scatter", "replay") == 0
    whole = read_validation(tmp_path / "whole")[2]["repeat_floor"]
    assert whole["scatter_of"] == "replay" and whole["dynamic"]["scatter_of"] == "replay"
    assert read_validation(tmp_path / "off")[2]["repeat_floor"]["scatter_of"] == "step"      # the default
    assert whole["scatter"]["prompt"] >= read_validation(tmp_path / "off")[2]["repeat_floor"]["scatter"]["prompt"]
    with pytest.raises(SystemExit):
        parse(*setup["options"], "--latency", f"parametric:{setup['cal']}", "--floor-scatter", "steps")
    assert "invalid choice: 'steps'" in capsys.readouterr().err
