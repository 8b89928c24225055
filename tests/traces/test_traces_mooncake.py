import json

import pytest

from traces import PromptMaterializer, TokenSpace, read_trace


def mooncake_text(rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 700, "output_length": 4, "hash_ids": [0, 3]},
]


def test_mooncake_timestamps_are_milliseconds(write):
    assert [r.arrival_s for r in read_trace(write("m.jsonl", mooncake_text(ROWS)))] == [0.0, 1.5]


def test_mooncake_keeps_hashes_with_512_token_blocks(write):
    r = read_trace(write("m.jsonl", mooncake_text(ROWS)))[0]
    assert (r.n_prompt, r.n_output, r.block_hashes, r.block_size) == (1100, 6, (0, 1, 2), 512)


def test_mooncake_equal_hashes_give_identical_token_blocks(write):
    t = read_trace(write("m.jsonl", mooncake_text(ROWS)))
    m = PromptMaterializer(TokenSpace(), seed=7)
    a, b = m.prompt(t[0]), m.prompt(t[1])
    assert a[:512] == b[:512]                 # shared block 0 -> shared 512-token prefix
    assert a[512:1024] != b[512:1024]         # blocks 1 and 3 differ


def test_mooncake_prompt_has_n_prompt_tokens_with_last_block_cut(write):
    t = read_trace(write("m.jsonl", mooncake_text(ROWS)))
    m = PromptMaterializer(TokenSpace(), seed=7)
    assert [len(m.prompt(r)) for r in t] == [1100, 700]
    assert m.prompt(t[0])[1024:] == m.block(2, 512)[:76]


def test_real_mooncake_trace_shares_prefixes(shared_trace):
    t = read_trace(shared_trace("mooncake_synthetic_trace.jsonl"))
    assert t.format == "mooncake" and len(t) == 3993 and t[0].arrival_s == 0.0
    m = PromptMaterializer(TokenSpace(), seed=0)
    first_block = {}
    for r in t.head(300):
        first_block.setdefault(r.block_hashes[0], []).append(r)
    shared = next(rs for rs in first_block.values() if len(rs) > 1)
    assert m.prompt(shared[0])[:512] == m.prompt(shared[1])[:512]
    assert t.mean_rps == pytest.approx(3.9, abs=0.1)
