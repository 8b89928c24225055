"""benchmarks/replay_budget.py: a run's prompt (or decode) replays thinned exactly as the in-run probe's credit rule
would have made them at a smaller budget, the refusal of a run that did not replay every step of the path, and a
re-simulation of the tiny model's real run at budgets 1 and 0."""

import json
import shutil

import pandas as pd
import pytest

from engine.model import load
from experiments.calibrate import GridPoint, InRunProbe, MixCredit, replay_sampling
from experiments.speed_probe import SpeedTrack, TrackPass, read_run_track, write_run_track
from tests.benchmark_scripts import load as load_script
from tests.experiments.test_calibrate import TASKS, FixedReplay, ones
from tests.experiments.test_validate_speed import setup, validate  # noqa: F401  (setup: the tiny model's real run)


@pytest.fixture(scope="module")
def rb():
    return load_script("replay_budget")


def test_mix_credit_replays_a_step_when_its_share_so_far_covers_it():
    c = MixCredit(0.5)
    assert not c.offer(1.0)                 # credit 0.5 < 1
    assert c.offer(0.4)                     # 0.7 >= 0.4
    c.spend(0.4)                            # 0.3
    assert not c.offer(0.9)                 # 0.75 < 0.9
    assert MixCredit(1.0).offer(5.0) and all(MixCredit(1.0).offer(s) for s in (0.1, 9.0))
    assert not MixCredit(0.0).offer(0.1)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        MixCredit(1.5)


def test_thinning_a_budget_one_track_keeps_the_replays_the_probe_makes_at_that_budget(tiny, rb):
    from experiments.calibrate import build_plan as plan_of
    model = load(tiny, n_threads=1)
    decode = plan_of(GridPoint("decode", decode=(40,)), ones, TASKS)
    prompt = plan_of(GridPoint("prefill", prompt=((0, 32),)), ones, TASKS)
    # prompt steps of uneven lengths, each replayed 10% slower than it ran, between decode steps
    steps = [(decode, 0.01), (prompt, 0.30), (decode, 0.01), (prompt, 0.05), (prompt, 0.12), (decode, 0.01),
             (prompt, 0.60), (prompt, 0.02), (prompt, 0.02), (prompt, 0.25), (decode, 0.01), (prompt, 0.08)] * 3

    def run(budget_prompt, budget=1.0):
        probe = InRunProbe(model, replay_sampling(model, 0.0, 0), 100.0, clock=lambda: 0.0, budget=budget,
                           budget_prompt=budget_prompt)
        probe.start(lambda: 0.0)
        for plan, seconds in steps:
            probe.mix_bench = FixedReplay(1.1 * seconds)
            probe(plan, seconds)
        return probe._pending

    def two_passes(replays, cut):        # the credit runs on across passes, as the probe's does
        return SpeedTrack(10.0, (TrackPass(1.0, 1.0, {"x": 0.1}, 0.0, tuple(replays[:cut])),
                                 TrackPass(2.0, 2.0, {"x": 0.1}, 0.0, tuple(replays[cut:]))))

    def thinned(track, budget, path=True):
        return [m for p in rb.thin_track(track, budget, prompt=path).passes for m in p.mix]

    def shapes(replays):
        return [(m.prompt, m.step_s) for m in replays]

    every = run(1.0)
    assert sum(m.prompt for m in every) == sum(plan is prompt for plan, _ in steps)
    track = two_passes(every, 9)
    for budget in (0.5, 0.25, 0.0):
        assert shapes(thinned(track, budget)) == shapes(run(budget)), budget
    assert thinned(track, 1.0) == list(every)
    assert not any(m.prompt for m in thinned(track, 0.0))
    # the decode path: decode steps of uneven lengths (the prompt path's replays kept as they are)
    steps = [(decode, 0.01), (decode, 0.03), (prompt, 0.2), (decode, 0.012), (decode, 0.05), (decode, 0.008),
             (decode, 0.02), (prompt, 0.1), (decode, 0.011)] * 4
    every = run(1.0)
    assert sum(not m.prompt for m in every) == sum(plan is decode for plan, _ in steps)
    track = two_passes(every, 13)
    for budget in (0.5, 0.15, 0.0):
        assert shapes(thinned(track, budget, False)) == shapes(run(1.0, budget)), budget
        assert sum(m.prompt for m in thinned(track, budget, False)) == sum(plan is prompt for plan, _ in steps)
    assert 0 < sum(not m.prompt for m in thinned(track, 0.15, False)) < 10


def test_validate_argv_drops_the_options_the_script_sets(rb, tmp_path):
    cmd = ("slotlab validate --users 6 -np 1 --latency parametric:/c/cal.json --seed 5 --speed-correct track-mix "
           "--real-run /r/real --out=/o --quiet --no-plots --noise-floor /n/real --trace '/a b/t.jsonl'")
    assert rb.validate_argv(cmd, tmp_path) == ["--users", "6", "-np", "1", "--latency", "parametric:/c/cal.json",
                                               "--seed", "5", "--trace", "/a b/t.jsonl"]
    with pytest.raises(ValueError, match="not a slotlab validate command line"):
        rb.validate_argv("slotlab replay --users 6", tmp_path / "validation.json")


def test_a_run_without_every_prompt_step_replayed_is_refused(setup, rb, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    shutil.copytree(setup["out"], run)
    track = read_run_track(run / "real")
    prompts = [m for p in track.passes for m in p.mix if m.prompt]
    assert prompts, "the tiny run replays its prompt steps"
    dropped = prompts[0]
    write_run_track(run / "real", SpeedTrack(track.every_s, tuple(
        TrackPass(p.clock_s, p.wall_s, p.shapes_s, p.load1, tuple(m for m in p.mix if m is not dropped))
        for p in track.passes), track.repeats))
    with pytest.raises(ValueError, match=rf"{len(prompts) - 1} prompt replays for {len(prompts)} prompt steps"):
        rb.replayed_track(run / "real")
    # one decode replay fewer than decode steps: its decode path is refused
    decodes = [m for p in track.passes for m in p.mix if not m.prompt]
    dropped = decodes[-1]
    write_run_track(run / "real", SpeedTrack(track.every_s, tuple(
        TrackPass(p.clock_s, p.wall_s, p.shapes_s, p.load1, tuple(m for m in p.mix if m is not dropped))
        for p in track.passes), track.repeats))
    with pytest.raises(ValueError, match=rf"{len(decodes) - 1} decode replays for {len(decodes)} decode steps"):
        rb.replayed_track(run / "real", prompt=False)
    with pytest.raises(SystemExit, match="neither a `slotlab validate` output folder"):
        rb.run_dirs([str(tmp_path / "out")])
    (run / "validation.json").write_text('{"command": "slotlab validate"')               # cut short
    with pytest.raises(SystemExit, match=r"validation.json: cannot read it as JSON"):
        rb.main([str(run), "--out", str(tmp_path / "out")])
    # a campaign's folder (benchmarks/validate_settings.py --out): each <setting>-<seed>/track-mix in it
    for name in ("np4-7", "np1-7"):
        (tmp_path / "camp" / name / "track-mix").mkdir(parents=True)
        (tmp_path / "camp" / name / "track-mix" / "validation.json").write_text("{}")
    assert rb.run_dirs([str(tmp_path / "camp"), str(run)]) == [tmp_path / "camp" / "np1-7" / "track-mix",
                                                                 tmp_path / "camp" / "np4-7" / "track-mix", run]


def test_budgets_re_simulate_the_same_real_run_with_its_replays_thinned(setup, rb, tmp_path, capsys,  # noqa: F811
                                                                        monkeypatch):
    import dataclasses
    run = tmp_path / "run"
    shutil.copytree(setup["out"], run)
    # its replays made deterministic: the prompt steps' (the tiny run's are 4) set to 2, 1, 1, 1 ms, each replay as
    # long as its step, and no decode replay (whether the tiny run made one depends on this machine's timing)
    track = read_run_track(run / "real")
    times = iter([0.002, 0.001, 0.001, 0.001])
    write_run_track(run / "real", SpeedTrack(track.every_s, tuple(dataclasses.replace(p, mix=tuple(
        dataclasses.replace(m, step_s=t, measured_s=t + (m.copy_s or 0.0))
        for m in p.mix if m.prompt for t in [next(times)])) for p in track.passes), track.repeats))
    out = tmp_path / "rb"
    assert rb.main([str(run), "--budgets", "1,0.5", "--out", str(out)]) == 0
    df = pd.read_csv(out / "summary.csv")
    assert list(df["budget"]) == [1.0, 0.5] and list(df["run"]) == ["run", "run"]
    # budget 1 keeps the track as it is: the run re-simulated with its replays, as validate does it
    ref = tmp_path / "ref"
    assert validate(setup, ref, "--real-run", str(run / "real"), "--speed-correct", "track-mix") == 0
    before = pd.read_parquet(ref / "sim" / "requests.parquet").sort_values("request")
    again = pd.read_parquet(out / "run" / "budget-1" / "sim" / "requests.parquet").sort_values("request")
    assert list(again["ttft_s"]) == pytest.approx(list(before["ttft_s"]), rel=1e-12)
    # budget 0.5: the replays the credit rule keeps, the rest of the run's files as they were
    track = read_run_track(run / "real")
    half = read_run_track(out / "run" / "real-budget-0.5")
    assert half == rb.thin_track(track, 0.5)
    # credit 1 ms < 2 ms: not the first; 1.5 ms covers 1 ms, then 0.5 ms; 1 ms covers 1 ms, then 0; 0.5 ms: not
    assert [m.step_s for p in half.passes for m in p.mix] == [0.001, 0.001]
    steps = (out / "run" / "real-budget-0.5" / "steps.parquet").read_bytes()
    assert steps == (run / "real" / "steps.parquet").read_bytes()
    report = capsys.readouterr().out
    assert "| 1 |" in report and "| 0.5 |" in report and "first request TTFT" in report
    # without decode replays, budget 0 leaves the run nothing to follow, and validate's refusal is shown
    with pytest.raises(SystemExit, match="no probe pass that replayed the run's own steps"):
        rb.main([str(run), "--budgets", "0", "--out", str(out)])
    # a folder of a validate that reused its real run finds it through validation.json, from where it ran
    monkeypatch.chdir(tmp_path)
    assert rb.real_run_of(ref, json.loads((ref / "validation.json").read_text())) == run / "real"


def test_the_decode_path_thins_a_run_that_replayed_every_decode_step(setup, rb, tmp_path):  # noqa: F811
    # a real run of the tiny model with every decode step replayed (the probe's decode budget 1, the default)
    run = tmp_path / "run"
    assert validate(setup, run, "--speed-correct", "track-mix", "--replay-decode", "1") == 0
    track = rb.replayed_track(run / "real", prompt=False)
    decodes = [m for p in track.passes for m in p.mix if not m.prompt]
    assert len(decodes) > 5
    out = tmp_path / "rb"
    assert rb.main([str(run), "--path", "decode", "--budgets", "1,0.5", "--out", str(out)]) == 0
    df = pd.read_csv(out / "summary.csv")
    assert list(df["budget"]) == [1.0, 0.5] and set(df["path"]) == {"decode"}
    # budget 1: the run re-simulated with all its replays, as validate re-simulates it
    ref = tmp_path / "ref"
    assert validate(setup, ref, "--real-run", str(run / "real"), "--speed-correct", "track-mix") == 0
    before = pd.read_parquet(ref / "sim" / "requests.parquet").sort_values("request")
    again = pd.read_parquet(out / "run" / "decode-budget-1" / "sim" / "requests.parquet").sort_values("request")
    assert list(again["e2e_s"]) == pytest.approx(list(before["e2e_s"]), rel=1e-12)
    # budget 0.5: the decode replays the credit rule keeps, every prompt replay kept
    half = read_run_track(out / "run" / "real-decode-budget-0.5")
    assert half == rb.thin_track(track, 0.5, prompt=False)
    kept = [m for p in half.passes for m in p.mix]
    assert [m for m in kept if m.prompt] == [m for p in track.passes for m in p.mix if m.prompt]
    assert 0 < sum(not m.prompt for m in kept) < len(decodes)
