"""`slotlab validate --recorded`: a trace written by `slotlab record` simulated and compared per request."""

import json

import pandas as pd
import pytest

from experiments.cli import main
from experiments.validate import FILES, read_validation, recorded_requests
from traces import read_trace

EOS = 7


def rec(end_s, slot, cached, predicted_ms, predicted_n, prompt_ms, stop="limit", endpoint="/completion"):
    return {"endpoint": endpoint, "stream": False, "status": 200, "end_s": end_s, "first_byte_s": None,
            "id_slot": slot, "n_cached": cached, "stop_type": stop,
            "timings": {"cache_n": cached, "prompt_n": 4 - cached, "prompt_ms": prompt_ms,
                        "predicted_n": predicted_n, "predicted_ms": predicted_ms}}


def write_recorded(path):
    lines = [
        {"slotlab_native": 1, "origin_format": "recorded", "line_order": "end"},
        # written as requests end: r1 (arrived later) ended first
        {"arrival_s": 0.5, "prompt_tokens": [10, 11, 12, 14], "output_tokens": [30, 31],
         "recorded": rec(0.56, 1, 0, 10.0, 2, 30.0)},
        {"arrival_s": 0.0, "prompt_tokens": [10, 11, 12, 13], "output_tokens": [20, 21, EOS],
         "sampling": {"n_predict": 16}, "recorded": rec(0.7, 0, 0, 40.0, 3, 20.0, stop="eos")},
        {"arrival_s": 2.0, "prompt_tokens": [10, 11, 12, 13, 20, 21, 40], "n_output": 3,
         "recorded": {**rec(2.2, None, 6, 20.0, 3, 10.0, stop="length", endpoint="/v1/chat/completions"),
                      "id_slot": None}},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_recorded_table_reads_the_upstream_timings(tmp_path):
    t = read_trace(write_recorded(tmp_path / "r.jsonl"))
    df = recorded_requests(t)
    r0 = df.iloc[0]
    assert r0["e2e_s"] == pytest.approx(0.7) and r0["ttft_s"] == pytest.approx(0.7 - 0.04)
    assert r0["tpot_s"] == pytest.approx(0.02) and r0["queue_s"] == pytest.approx(0.66 - 0.02)
    assert list(df["slot"].fillna(-9)) == [0, 1, -9] and list(df["n_cached"]) == [0, 0, 6]


def test_validate_recorded_compares_request_by_request(tmp_path, capsys):
    trace = write_recorded(tmp_path / "r.jsonl")
    out = tmp_path / "val"
    rc = main(["validate", "--recorded", str(trace), "-np", "2", "-c", "512", "--latency", "constant:0.01",
               "--out", str(out), "--no-plots"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT" in text and "rec (s)" in text and "slot known for 2" in text
    per, errors, summary = read_validation(out)
    assert list(per["request"]) == [0, 1, 2] and summary["n_requests"] == 3
    assert summary["eog_ids_from_trace"] == [EOS] and summary["n_with_output_ids"] == 2
    assert summary["slot_known"] == 2 and summary["n_prompt_equal"]
    sim = pd.read_parquet(out / "sim" / "requests.parquet").sort_values("request")
    assert list(sim["finish"]) == ["eos", "limit", "limit"]            # the recorded EOS stopped r0
    assert list(sim["n_output"]) == [3, 2, 3]
    # simulated, r0 ends before r1 arrives, so r1 reuses r0's slot (3 common tokens): not what was recorded
    assert (per.loc[1, "n_cached_sim"], per.loc[1, "n_cached_real"], per.loc[1, "slot_sim"]) == (3, 0, 1)
    assert not per.loc[1, "n_cached_match"] and per.loc[0, "n_cached_match"]
    assert (out / FILES["errors"]).is_file()


@pytest.mark.parametrize("extra, message", [
    (["--users", "3"], "--recorded replaces the workload: drop --users"),
    (["--real-run", "x"], "--recorded and --real-run"),
    (["--noise-floor", "x"], "--noise-floor compares two real engine runs"),
])
def test_validate_recorded_usage_errors(tmp_path, capsys, extra, message):
    trace = write_recorded(tmp_path / "r.jsonl")
    assert main(["validate", "--recorded", str(trace), "--latency", "constant:0.01", *extra]) == 2
    assert message in capsys.readouterr().err


def test_validate_recorded_needs_a_recorded_trace(tmp_path, capsys):
    p = tmp_path / "plain.jsonl"
    p.write_text('{"arrival_s": 0, "n_prompt": 3, "n_output": 2}\n')
    assert main(["validate", "--recorded", str(p), "--latency", "constant:0.01"]) == 2
    assert "no recorded requests" in capsys.readouterr().err
