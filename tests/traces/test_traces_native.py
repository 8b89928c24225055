import dataclasses
import json

import pytest

from traces import Trace, TraceFormatError, TraceRequest, read_trace, write_native_jsonl


def sample_trace():
    return Trace([
        TraceRequest(0, 0.0, 3, 8, session_id="u1", prompt_tokens=(5, 6, 7)),
        TraceRequest(1, 0.1 + 0.2, 700, 16, block_hashes=(5, -6, 2**70), block_size=256),
        TraceRequest(2, 1e-9 + 2.0, 412, 0),
    ], "synthetic", "mem")


def without_line(t):
    return [dataclasses.replace(r, source_line=0) for r in t]


def test_native_round_trip_preserves_requests(tmp_path):
    p = tmp_path / "t.jsonl"
    write_native_jsonl(sample_trace(), p)
    back = read_trace(p)
    assert back.format == "native"
    assert without_line(back) == without_line(sample_trace())


def test_native_round_trip_through_gzip(tmp_path):
    p = tmp_path / "t.jsonl.gz"
    write_native_jsonl(sample_trace(), p)
    assert without_line(read_trace(p)) == without_line(sample_trace())


def test_native_without_header_line_is_detected(write):
    p = write("n.jsonl", '{"arrival_s": 0, "n_prompt": 4, "n_output": 2}\n')
    assert read_trace(p)[0].n_prompt == 4


def test_native_prompt_tokens_set_n_prompt(write):
    r = read_trace(write("n.jsonl", '{"arrival_s": 0, "prompt_tokens": [1, 2, 3], "n_output": 2}\n'))[0]
    assert (r.n_prompt, r.prompt_tokens) == (3, (1, 2, 3))


def test_native_n_prompt_must_match_prompt_tokens(write):
    p = write("n.jsonl", '{"arrival_s": 0, "prompt_tokens": [1, 2], "n_prompt": 5, "n_output": 2}\n')
    with pytest.raises(TraceFormatError, match=r"n.jsonl:1: field 'n_prompt'"):
        read_trace(p)


def test_native_rejects_unknown_fields(write):
    p = write("n.jsonl", '{"arrival_s": 0, "n_prompt": 4, "n_ouput": 2}\n')
    with pytest.raises(TraceFormatError, match=r"n.jsonl:1: field 'n_ouput'"):
        read_trace(p, format="native")


def test_native_block_hashes_need_a_block_size(write):
    p = write("n.jsonl", '{"arrival_s": 0, "n_prompt": 4, "n_output": 1, "block_hashes": [1]}\n')
    with pytest.raises(TraceFormatError, match="field 'block_size'"):
        read_trace(p, format="native")


def test_native_wrong_version_is_an_error_even_when_skipping(write):
    p = write("n.jsonl", json.dumps({"slotlab_native": 2}) + '\n{"arrival_s": 0, "n_prompt": 1, "n_output": 1}\n')
    with pytest.raises(TraceFormatError, match="slotlab_native"):
        read_trace(p, skip_bad_rows=True)


# --- recorded traffic: output_tokens, sampling, recorded; lines in end order --------------------------------

RECORDED = ('{"slotlab_native": 1, "line_order": "end"}\n'
            '{"arrival_s": 0.5, "prompt_tokens": [1, 2, 3], "output_tokens": [4, 2], "sampling": {"n_predict": 4, '
            '"ignore_eos": false, "temperature": 0.8}, "recorded": {"endpoint": "/completion", "end_s": 0.9, '
            '"id_slot": 1, "n_cached": 0, "stop_type": "eos", "timings": {"prompt_ms": 1.5, "predicted_n": 2}}}\n'
            '{"arrival_s": 0.1, "prompt_tokens": [1, 2], "n_output": 3}\n')


def test_native_recorded_fields_and_end_order(write):
    t = read_trace(write("r.jsonl", RECORDED))
    assert [r.arrival_s for r in t] == [0.1, 0.5] and [r.index for r in t] == [0, 1]
    assert [r.source_line for r in t] == [3, 2]
    r = t[1]
    assert r.output_tokens == (4, 2) and r.n_output == 2
    assert r.sampling == {"n_predict": 4, "ignore_eos": False, "temperature": 0.8}
    assert r.recorded["id_slot"] == 1 and r.recorded["timings"]["prompt_ms"] == 1.5
    assert t[0].output_tokens is None and t[0].sampling is None and t[0].recorded is None


def test_native_recorded_round_trip(write, tmp_path):
    t = read_trace(write("r.jsonl", RECORDED))
    write_native_jsonl(t, tmp_path / "back.jsonl")
    assert without_line(read_trace(tmp_path / "back.jsonl")) == without_line(t)


def test_native_arrival_order_still_enforced_without_the_end_order_header(write):
    body = RECORDED.split("\n", 1)[1]
    with pytest.raises(TraceFormatError, match=r"r.jsonl:2: field 'arrival_s': expected a time not before"):
        read_trace(write("r.jsonl", body), format="native")


@pytest.mark.parametrize("row, field", [
    ('"output_tokens": [1, "x"]', "output_tokens"),
    ('"output_tokens": [1, 2], "n_output": 3', "n_output"),
    ('"n_output": 1, "sampling": [1]', "sampling"),
    ('"n_output": 1, "sampling": {"ignore_eos": 1}', "sampling.ignore_eos"),
    ('"n_output": 1, "sampling": {"n_predict": -2}', "sampling.n_predict"),
    ('"n_output": 1, "sampling": {"id_slot": 0.5}', "sampling.id_slot"),
    ('"n_output": 1, "recorded": {"end_s": -1}', "recorded.end_s"),
    ('"n_output": 1, "recorded": {"id_slot": "a"}', "recorded.id_slot"),
    ('"n_output": 1, "recorded": {"timings": {"prompt_ms": "1"}}', "recorded.timings"),
    ('"n_output": 1, "recorded": {"slot": 1}', "recorded.slot"),
])
def test_native_recorded_field_errors_name_file_line_and_field(write, row, field):
    p = write("bad.jsonl", '{"arrival_s": 0, "n_prompt": 1, "n_output": 1}\n{"arrival_s": 1, "n_prompt": 1, '
              + row + "}\n")
    with pytest.raises(TraceFormatError, match=rf"bad.jsonl:2: field '{field}'") as e:
        read_trace(p, format="native")
    assert (e.value.line, e.value.field) == (2, field)


def test_native_bad_line_order_is_a_file_error(write):
    p = write("h.jsonl", '{"slotlab_native": 1, "line_order": "random"}\n{"arrival_s": 0, "n_prompt": 1, '
              '"n_output": 1}\n')
    with pytest.raises(TraceFormatError, match="line_order"):
        read_trace(p, skip_bad_rows=True)
