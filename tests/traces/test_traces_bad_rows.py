import pytest

from traces import TraceFormatError, read_trace

HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
OK = "2023-11-16 18:15:46.6805900,374,44\n"


def test_bad_integer_names_file_line_and_field(write):
    p = write("trace.csv", HEAD + OK + "2023-11-16 18:15:47.0,abc,5\n")
    with pytest.raises(TraceFormatError) as e:
        read_trace(p)
    assert str(e.value).endswith("trace.csv:3: field 'ContextTokens': expected a non-negative integer, got 'abc'")
    assert (e.value.line, e.value.field) == (3, "ContextTokens")


def test_negative_length_is_rejected(write):
    with pytest.raises(TraceFormatError, match=r"trace.csv:2: field 'GeneratedTokens'.*got '-1'"):
        read_trace(write("trace.csv", HEAD + "2023-11-16 18:15:46.6,3,-1\n"))


def test_bad_timestamp_names_the_field(write):
    with pytest.raises(TraceFormatError, match=r"trace.csv:2: field 'TIMESTAMP': expected a timestamp"):
        read_trace(write("trace.csv", HEAD + "yesterday,3,1\n"))


def test_short_row_names_the_missing_column(write):
    with pytest.raises(TraceFormatError, match=r"trace.csv:3: field 'GeneratedTokens'"):
        read_trace(write("trace.csv", HEAD + OK + "2023-11-16 18:15:47.0,12\n"))


def test_time_going_backwards_is_an_error(write):
    p = write("trace.csv", HEAD + OK + "2023-11-16 18:15:40.0,1,1\n")
    with pytest.raises(TraceFormatError, match=r"trace.csv:3: field 'TIMESTAMP': expected a time not before"):
        read_trace(p)


def test_equal_timestamps_are_fine(write):
    assert len(read_trace(write("trace.csv", HEAD + OK + OK))) == 2


def test_blank_lines_are_not_rows(write):
    assert len(read_trace(write("trace.csv", HEAD + OK + "\n" + OK + "\n\n"))) == 2


def test_integral_floats_are_accepted_as_counts(write):
    assert read_trace(write("trace.csv", HEAD + "2023-11-16 18:15:46.6,374.0,44\n"))[0].n_prompt == 374


def test_skip_bad_rows_counts_and_keeps_messages(write):
    p = write("trace.csv", HEAD + OK + "x,1,1\n" + OK + "2023-11-16 18:15:47.0,1,?\n" + OK)
    t = read_trace(p, skip_bad_rows=True)
    assert (len(t), t.n_skipped) == (3, 2)
    assert "trace.csv:3: field 'TIMESTAMP'" in t.errors[0] and "trace.csv:5: field 'GeneratedTokens'" in t.errors[1]
    assert [r.index for r in t] == [0, 1, 2] and [r.source_line for r in t] == [2, 4, 6]


def test_skip_bad_rows_drops_rows_that_go_back_in_time(write):
    t = read_trace(write("trace.csv", HEAD + OK + "2023-11-16 18:15:40.0,1,1\n" + OK), skip_bad_rows=True)
    assert (len(t), t.n_skipped) == (2, 1)


def test_all_rows_bad_is_an_error_even_when_skipping(write):
    with pytest.raises(TraceFormatError, match="all 2 rows were bad"):
        read_trace(write("trace.csv", HEAD + "x,1,1\ny,1,1\n"), skip_bad_rows=True)


def test_invalid_json_line_names_file_and_line(write):
    p = write("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1,\n')
    with pytest.raises(TraceFormatError, match=r"m.jsonl:2: invalid JSON"):
        read_trace(p)


def test_mooncake_bad_hash_list_names_the_field(write):
    p = write("m.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}\n')
    with pytest.raises(TraceFormatError, match=r"m.jsonl:1: field 'hash_ids': expected a list of integers"):
        read_trace(p, format="mooncake")


def test_mooncake_missing_field_names_it(write):
    p = write("m.jsonl", '{"timestamp": 0, "input_length": 5, "hash_ids": []}\n')
    with pytest.raises(TraceFormatError, match=r"m.jsonl:1: field 'output_length'"):
        read_trace(p, format="mooncake")


def test_jsonl_skip_bad_rows_counts(write):
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
    t = read_trace(write("m.jsonl", good + "not json\n" + '{"timestamp": -1}\n' + good), skip_bad_rows=True)
    assert (len(t), t.n_skipped) == (2, 2)
