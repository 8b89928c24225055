"""Recorded traces (`slotlab record`): the simulator generates the recorded output tokens, EOS included."""

from engine.core import Recorder, ServerConfig
from sim.driver import Simulation
from sim.latency import ConstantLatency, ParametricLatency
from traces import Trace, TraceRequest

EOS = 7


def recorded_trace():
    # r0 stops on EOS after 3 tokens although it asked for 16; r1 runs to its limit; r2 asked for ignore_eos
    # (its EOS-looking token in the middle does not stop it); r3 has no ids (stand-in reply, n_output tokens)
    return Trace([
        TraceRequest(0, 0.0, 4, 3, prompt_tokens=(10, 11, 12, 13), output_tokens=(20, 21, EOS),
                     sampling={"n_predict": 16}),
        TraceRequest(1, 0.01, 3, 4, prompt_tokens=(10, 11, 14), output_tokens=(30, 31, 32, 33)),
        TraceRequest(2, 0.02, 2, 4, prompt_tokens=(40, 41), output_tokens=(50, EOS, 51, 52),
                     sampling={"ignore_eos": True}),
        TraceRequest(3, 1.0, 5, 6, prompt_tokens=(10, 11, 12, 13, 20)),
    ], "native", "test")


def run(fast_forward, latency=None):
    cfg = ServerConfig(n_ctx=1024, n_parallel=2, eog_ids=frozenset({EOS}))
    sim = Simulation(cfg, latency or ConstantLatency(0.01), fast_forward=fast_forward, recorder=Recorder())
    return sim, sim.run(recorded_trace())


def test_recorded_tokens_are_generated_and_eos_stops():
    sim, res = run(False)
    rows = {r["request"]: r for r in res.requests}
    assert [rows[i]["finish"] for i in range(4)] == ["eos", "limit", "limit", "limit"]
    assert [rows[i]["n_output"] for i in range(4)] == [3, 4, 4, 6]


def test_recorded_tokens_enter_the_slot_so_the_next_prompt_reuses_them():
    # r0's slot ends holding 10 11 12 13 20 21 (its EOS is sampled, never decoded); r2 takes that slot, which
    # is saved to the prompt cache first; r3's prompt extends r0's prompt with r0's first generated token and
    # finds that entry
    sim, res = run(False)
    rows = {r["request"]: r for r in res.requests}
    saves = [f for _, k, f in sim.recorder.events if k == "cache_save"]
    assert saves[0]["slot"] == rows[0]["slot"] and saves[0]["n_tokens"] == 6
    hits = [f for _, k, f in sim.recorder.events if k == "cache_hit"]
    assert hits and hits[0]["entry"] == saves[0]["entry"]
    assert rows[3]["n_cached"] == 4            # 5 common, the last prompt token is always re-evaluated


def test_fast_forward_gives_the_same_run_on_recorded_tokens():
    lat = ParametricLatency(a_s=0.004, b_prefill_s=2e-5, c_decode_s=1e-4, d_attn_s=1e-8)
    a, ra = run(False, lat)
    b, rb = run(True, lat)
    assert ra.requests == rb.requests
    assert [(k, f) for _, k, f in a.recorder.events] == [(k, f) for _, k, f in b.recorder.events]
