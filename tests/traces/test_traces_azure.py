import pytest

from traces import read_trace
from traces.readers import read_azure

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:16:01.0000000,879,55
"""


def test_azure_arrivals_are_relative_to_the_first_row(write):
    t = read_azure(write("a.csv", AZURE))
    assert [r.arrival_s for r in t] == pytest.approx([0.0, 4.314579, 14.31941])


def test_azure_columns_map_to_prompt_and_output(write):
    r = read_azure(write("a.csv", AZURE))[1]
    assert (r.index, r.n_prompt, r.n_output, r.source_line) == (1, 396, 109, 3)


def test_azure_2024_offset_suffix_is_accepted(write):
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.009930+00:00,10,2\n"
            "2024-05-10 00:00:01.5+00:00,20,3\n")
    assert [r.arrival_s for r in read_azure(write("a.csv", text))] == pytest.approx([0.0, 1.49007])


def test_azure_arrivals_cross_midnight(write):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 23:59:59.5,1,1\n2023-11-17 00:00:00.5,1,1\n"
    assert read_azure(write("a.csv", text))[1].arrival_s == pytest.approx(1.0)


def test_azure_utc_offsets_are_normalised(write):
    text = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 01:00:00+01:00,1,1\n"
            "2024-05-10 00:00:02Z,1,1\n")
    assert read_azure(write("a.csv", text))[1].arrival_s == pytest.approx(2.0)


def test_azure_gzip_file_is_read(tmp_path):
    import gzip
    p = tmp_path / "a.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write(AZURE)
    assert len(read_trace(p)) == 3


def test_real_azure_conversation_trace(shared_trace):
    t = read_trace(shared_trace("AzureLLMInferenceTrace_conv.csv"))
    assert t.format == "azure" and len(t) == 19366 and t.n_skipped == 0
    assert t[0].arrival_s == 0.0
    assert t.n_prompt_total / len(t) == pytest.approx(1155, abs=1)
    assert t.mean_rps == pytest.approx(5.5, abs=0.1)
