import pytest

from traces import TraceFormatError, detect_format, read_trace

HEADERS = {
    "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n",
    "burstgpt": "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n",
    "vidur": "arrived_at,num_prefill_tokens,num_decode_tokens\n",
    "sharegpt_stats": "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n",
    "mooncake": '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n',
    "native": '{"arrival_s": 0.0, "n_prompt": 5, "n_output": 1}\n',
}


@pytest.mark.parametrize("fmt", sorted(HEADERS))
def test_format_is_detected_from_the_first_line(write, fmt):
    assert detect_format(write("t.txt", HEADERS[fmt])) == fmt


def test_detection_ignores_header_case_and_spaces(write):
    assert detect_format(write("t.csv", " timestamp , contexttokens,GENERATEDTOKENS\n")) == "azure"


def test_native_header_line_is_detected(write):
    assert detect_format(write("t.jsonl", '{"slotlab_native": 1}\n')) == "native"


def test_unknown_format_lists_formats_and_what_was_seen(write):
    with pytest.raises(TraceFormatError) as e:
        detect_format(write("odd.csv", "when,prompt,answer\n1,2,3\n"))
    msg = str(e.value)
    assert "odd.csv:1" in msg and "when,prompt,answer" in msg
    assert all(f in msg for f in HEADERS)


def test_empty_file_is_a_clear_error(write):
    with pytest.raises(TraceFormatError, match=r"e.csv: file is empty"):
        read_trace(write("e.csv", ""))


def test_empty_file_with_forced_format_is_a_clear_error(write):
    with pytest.raises(TraceFormatError, match="file is empty"):
        read_trace(write("e.jsonl", "\n\n"), format="mooncake")


def test_header_without_rows_is_an_error(write):
    with pytest.raises(TraceFormatError, match="no requests"):
        read_trace(write("h.csv", HEADERS["azure"]))


def test_forced_format_reports_missing_columns(write):
    with pytest.raises(TraceFormatError, match=r"v.csv:1: missing column\(s\) 'arrived_at'"):
        read_trace(write("v.csv", HEADERS["sharegpt_stats"] + "1,2,3,4\n"), format="vidur")


def test_unknown_format_name_lists_the_choices(write):
    with pytest.raises(ValueError, match="azure, burstgpt, vidur"):
        read_trace(write("t.csv", HEADERS["azure"]), format="csv")


def test_model_filter_on_other_formats_is_refused(write):
    with pytest.raises(ValueError, match="burstgpt"):
        read_trace(write("t.csv", HEADERS["azure"] + "2023-11-16 18:15:46.6,1,1\n"), model="GPT-4")
