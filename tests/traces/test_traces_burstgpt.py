from traces import read_trace
from traces.readers import read_burstgpt

BURST = """Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type
5,s1,1.2,ChatGPT,472,18,490,Conversation log
45,,0.8,GPT-4,1087,0,1087,API log
118,s1,2.0,ChatGPT,417,276,693,Conversation log
"""


def test_burstgpt_keeps_its_own_timestamps(write):
    assert [r.arrival_s for r in read_burstgpt(write("b.csv", BURST))] == [5.0, 45.0, 118.0]


def test_burstgpt_keeps_session_ids_and_empty_means_none(write):
    assert [r.session_id for r in read_burstgpt(write("b.csv", BURST))] == ["s1", None, "s1"]


def test_burstgpt_keeps_failed_rows_with_zero_output(write):
    t = read_burstgpt(write("b.csv", BURST))
    assert (t[1].n_prompt, t[1].n_output) == (1087, 0) and t.n_skipped == 0


def test_burstgpt_model_filter_keeps_one_model(write):
    t = read_trace(write("b.csv", BURST), model="ChatGPT")
    assert [r.n_prompt for r in t] == [472, 417] and [r.index for r in t] == [0, 1] and t.n_skipped == 0


def test_burstgpt_v1_without_session_column(write):
    text = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n0,ChatGPT,10,5,15,x\n"
    t = read_trace(write("b.csv", text))
    assert t.format == "burstgpt" and t[0].session_id is None
