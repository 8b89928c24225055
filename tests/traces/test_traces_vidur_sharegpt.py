from traces import read_trace


def test_vidur_reads_arrivals_and_lengths_ignoring_extra_columns(write):
    text = "arrived_at,num_prefill_tokens,num_decode_tokens,extra\n0.5,100,20,x\n1.25,200,30,y\n"
    t = read_trace(write("v.csv", text))
    assert t.format == "vidur"
    assert [(r.arrival_s, r.n_prompt, r.n_output) for r in t] == [(0.5, 100, 20), (1.25, 200, 30)]


def test_splitwise_is_an_alias_of_vidur(write):
    text = "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,2\n"
    assert read_trace(write("s.csv", text), format="splitwise").format == "vidur"


def test_sharegpt_stats_has_lengths_and_all_arrivals_at_zero(write):
    text = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,992,0.08\n290,905,1195,0.32\n"
    t = read_trace(write("s.csv", text))
    assert t.format == "sharegpt_stats"
    assert [(r.arrival_s, r.n_prompt, r.n_output) for r in t] == [(0.0, 74, 918), (0.0, 290, 905)]


def test_real_sharegpt_stats_file(shared_trace):
    t = read_trace(shared_trace("sharegpt_8k_filtered_stats_llama2_tokenizer.csv"))
    assert t.format == "sharegpt_stats" and len(t) == 30731
