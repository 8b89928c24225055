"""Parity: a run recorded by `slotlab record` in front of `slotlab serve` (tiny model, in-process), replayed in
the simulator with the server's own step times, gives the server's decision log, event for event.

What the simulator takes from where:
- the requests (prompt ids, generated ids, parameters) from the recorded trace only;
- the step times from the server's decision log: a `StepTape` latency model ends simulated step k exactly
  when the server started step k+1 (its `batch` events), so every simulated step starts when the real one did;
- the arrival times from the server's `submit` events, moved to the start of the first step that could see
  the request (minus 1 µs). The proxy's `arrival_s` is earlier by the HTTP hop and the request parsing
  (about a millisecond), enough to put an arrival on the other side of a step boundary, which changes the
  batch; the server's own clock is the one its decisions followed.

What still differs, by construction: event *times* of commits and submits (the simulator commits a step
when the next one starts; the server committed it slightly earlier, then routed tokens). The test compares
each event's kind and fields exactly, and the times of the step-start events (`batch`) to 1 µs.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace

import httpx

from engine.core import Recorder
from experiments.record_cli import BackgroundRecorder
from sim.driver import Simulation
from traces import Trace, read_trace

USERS, TURNS = 4, 3


class StepTape:
    """A latency model that replays recorded step boundaries: the k-th step (with forward calls) ends at the
    recorded start of step k+1 (the last one at `last_end_s`). `clock()` is the simulation's time in seconds."""

    def __init__(self, starts_s: list[float], last_end_s: float, clock) -> None:
        self.starts = starts_s
        self.last_end = last_end_s
        self.clock = clock
        self.k = 0

    def step_time_s(self, cost) -> float:
        k = self.k
        self.k += 1
        end = self.starts[k + 1] if k + 1 < len(self.starts) else self.last_end
        return max(0.0, end - self.clock())

    def decode_only_times_s(self, *a):          # fast-forward is off for a tape
        raise NotImplementedError

    def describe(self) -> dict:
        return {"kind": "step_tape", "n_steps": len(self.starts)}


def run_users(base_url: str) -> None:
    """USERS chat-like sessions in parallel threads, native /completion with text prompts that grow by the
    previous reply: slots get reused, taken by others, saved to and restored from the prompt cache."""
    errors = []

    def user(u: int) -> None:
        time.sleep(0.015 * u)
        prompt = f"System {u % 2}: the rules are simple. " * 3 + f"User {u} asks"
        try:
            with httpx.Client(base_url=base_url, timeout=60) as c:
                for k in range(TURNS):
                    r = c.post("/completion", json={"prompt": prompt, "n_predict": 6 + 2 * u, "seed": 10 * u + k})
                    r.raise_for_status()
                    prompt += r.json()["content"] + f" and then {k}"
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(USERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


def test_recorded_serve_run_replays_with_the_identical_decision_log(start_server, tmp_path):
    srv = start_server(n_parallel=2, n_ctx=1024)
    st = srv.state
    log = Recorder()
    submitted = []

    def attach() -> None:             # the server's decision log, and its tasks as they are submitted
        core = st.core
        core.rec = log
        if core.cache is not None:
            core.cache.recorder = log
        submit = core.submit

        def logged(task, now_s):
            out = submit(task, now_s)
            submitted.append(out)
            return out
        core.submit = logged

    st.engine.call(attach).result(10)
    path = tmp_path / "trace.jsonl"
    rec = BackgroundRecorder(srv.base_url, path).start()
    try:
        run_users(rec.base_url)
        t_end = time.monotonic() + 10
        while sum(1 for _ in open(path)) < USERS * TURNS + 1 and time.monotonic() < t_end:
            time.sleep(0.02)
    finally:
        rec.stop()
    real = list(log.events)
    trace = read_trace(path)
    assert len(trace) == USERS * TURNS and len(submitted) == USERS * TURNS

    # the trace alone gives each request's prompt and generated ids: match them with the server's tasks
    by_ids = {(r.prompt_tokens, r.output_tokens): r for r in trace}
    assert len(by_ids) == len(trace)
    ordered = [by_ids[(tuple(t.tokens), tuple(t.generated))] for t in submitted]    # KeyError = a wrong id
    for r, t in zip(ordered, submitted):
        assert (r.recorded["id_slot"], r.recorded["n_cached"]) == (t.slot_id, t.n_prompt_cached)

    # step boundaries and the arrival clock from the server's log
    starts = [t for t, kind, _ in real if kind == "batch"]
    last_end = max(t for t, kind, _ in real if kind == "finish")
    submits = [t for t, kind, _ in real if kind == "submit"]
    t0 = starts[0] - 1.0
    seen = [next(s for s in starts if s >= a) for a in submits]
    requests = [replace(r, index=i, arrival_s=s - t0 - 1e-6) for i, (r, s) in enumerate(zip(ordered, seen))]
    workload = Trace(requests, "native", str(path))

    cfg = replace(st.options.config, **st.model.config_facts())
    sim_log = Recorder()
    sim: Simulation | None = None
    tape = StepTape([s - t0 for s in starts], last_end - t0, lambda: sim.now_s)
    sim = Simulation(cfg, tape, fast_forward=False, recorder=sim_log)
    res = sim.run(workload)

    assert tape.k == len(starts)                                  # one simulated step per real step
    kinds_fields = lambda events: [(k, json.dumps(f, sort_keys=True, default=str)) for _, k, f in events]  # noqa: E731
    got, want = kinds_fields(sim_log.events), kinds_fields(real)
    first_diff = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert got == want, f"first difference at event {first_diff}: sim {got[first_diff:first_diff + 3]} " \
                        f"real {want[first_diff:first_diff + 3]}"
    sim_starts = [t for t, kind, _ in sim_log.events if kind == "batch"]
    assert max(abs(a - (b - t0)) for a, b in zip(sim_starts, starts)) < 1.5e-6   # the first: at its arrival
    kinds = {k for _, k, _ in real}
    assert {"select", "launch", "prompt", "batch", "finish", "cache_save"} <= kinds      # the run exercised them
    rows = {r["request"]: r for r in res.requests}
    for i, r in enumerate(requests):
        assert (rows[i]["slot"], rows[i]["n_cached"], rows[i]["n_output"]) == \
            (r.recorded["id_slot"], r.recorded["n_cached"], r.n_output)
