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
