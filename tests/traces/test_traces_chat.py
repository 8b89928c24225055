import dataclasses

import pytest

from traces import (ChatWorkload, TokenSpace, ZipfLength, chat_sessions, default_chat_workload,
                    load_chat_workload, save_chat_workload)
from traces.errors import TraceFormatError

SPACE = TokenSpace(reserved=frozenset({0, 1, 2}))


def small(seed=0, **kw):
    args = dict(n_users=20, turns_per_user=(2, 5), think_time_s=3.0, system_prompt_pool=3,
                system_prompt_len=(100, 200), user_tokens=(10, 50), output_tokens=ZipfLength(5, 400),
                start_spread_s=10.0, seed=seed)
    return chat_sessions(**{**args, **kw})


def test_chat_sessions_are_deterministic_per_seed():
    assert small(1) == small(1) and small(1) != small(2)


def test_sessions_are_numbered_in_start_order_within_the_spread():
    w = small()
    starts = [s.start_s for s in w.sessions]
    assert starts == sorted(starts) and 0 <= starts[0] and starts[-1] <= 10.0
    assert [s.session_id for s in w.sessions][:2] == ["user-000", "user-001"]


def test_turn_counts_respect_the_range_and_first_turn_has_no_think_time():
    w = small()
    assert all(2 <= len(s.turns) <= 5 and s.turns[0].think_s == 0.0 for s in w.sessions)


def test_fixed_turn_count():
    assert {len(s.turns) for s in small(turns_per_user=3).sessions} == {3}


def test_think_time_has_the_requested_mean():
    w = small(n_users=2000, think_time_s=5.0)
    thinks = [t.think_s for s in w.sessions for t in s.turns[1:]]
    assert sum(thinks) / len(thinks) == pytest.approx(5.0, rel=0.05)


def test_system_prompts_come_from_the_pool():
    w = small()
    assert len(w.system_prompt_lengths) == 3 and {s.system_prompt_id for s in w.sessions} <= {0, 1, 2}


def test_token_functions_are_pure_and_sized():
    w = small()
    s = w.sessions[4]
    assert w.user_tokens(s.session_id, 1, SPACE) == small().user_tokens(s.session_id, 1, SPACE)
    assert len(w.user_tokens(s.session_id, 1, SPACE)) == s.turns[1].n_user
    assert len(w.system_prompt_tokens(2, SPACE)) == w.system_prompt_lengths[2]


def test_sessions_with_the_same_system_prompt_share_it_as_prefix():
    w = small()
    a, b = [s for s in w.sessions if s.system_prompt_id == w.sessions[0].system_prompt_id][:2]
    n_sys = w.system_prompt_lengths[a.system_prompt_id]
    pa, pb = w.prompt_tokens(a.session_id, 0, SPACE), w.prompt_tokens(b.session_id, 0, SPACE)
    assert pa[:n_sys] == pb[:n_sys] and pa[n_sys:n_sys + 5] != pb[n_sys:n_sys + 5]


def test_next_turn_prompt_extends_the_previous_prompt_and_reply():
    w = small()
    sid = w.sessions[0].session_id
    p0, p1 = w.prompt_tokens(sid, 0, SPACE), w.prompt_tokens(sid, 1, SPACE)
    assert p1 == p0 + w.reply_tokens(sid, 0, SPACE) + w.user_tokens(sid, 1, SPACE)


def test_prompt_uses_the_given_replies():
    w = small()
    sid = w.sessions[0].session_id
    p1 = w.prompt_tokens(sid, 1, SPACE, replies=[[42, 43]])
    assert p1 == w.prompt_tokens(sid, 0, SPACE) + [42, 43] + w.user_tokens(sid, 1, SPACE)


def test_chat_tokens_avoid_reserved_ids():
    w = small()
    toks = [t for s in w.sessions for k in range(len(s.turns)) for t in w.prompt_tokens(s.session_id, k, SPACE)]
    assert not set(toks) & SPACE.reserved


def test_default_workload_matches_its_documented_shape():
    w = default_chat_workload()
    assert len(w.sessions) == 32 and len(w.system_prompt_lengths) == 4
    assert all(4 <= len(s.turns) <= 8 for s in w.sessions)
    assert all(200 <= n <= 500 for n in w.system_prompt_lengths)
    assert all(20 <= t.n_user <= 120 and 30 <= t.n_output <= 150 for s in w.sessions for t in s.turns)
    assert 4 * w.max_context_tokens <= 8192     # 4 auto slots on SmolLM2's 8192 unified cells never overflow


def test_duplicate_session_ids_are_rejected():
    w = small(n_users=2)
    with pytest.raises(ValueError, match="unique"):
        ChatWorkload((w.sessions[0], w.sessions[0]), w.system_prompt_lengths, 0)


@pytest.mark.parametrize("name", ["w.json", "w.jsonl"])
def test_chat_workload_save_load_round_trip(tmp_path, name):
    w = small(3)
    save_chat_workload(w, tmp_path / name)
    assert load_chat_workload(tmp_path / name) == w
    s0 = w.sessions[0]                                    # a pinned turn (validate --arrivals real) keeps its time
    pinned = dataclasses.replace(w, sessions=(dataclasses.replace(
        s0, turns=(s0.turns[0], dataclasses.replace(s0.turns[1], send_at_s=12.5), *s0.turns[2:])), *w.sessions[1:]))
    save_chat_workload(pinned, tmp_path / name)
    back = load_chat_workload(tmp_path / name)
    assert back == pinned and back.sessions[0].turns[1].send_at_s == 12.5 and back.sessions[1].turns[1].send_at_s is None


def test_chat_workload_load_names_line_and_field(write):
    p = write("w.jsonl", '{"slotlab_chat_workload": 1, "seed": 0, "system_prompt_lengths": [10]}\n'
                         '{"session_id": "a", "start_s": 0, "system_prompt_id": 0, "turns": [{"n_user": 1}]}\n')
    with pytest.raises(TraceFormatError, match=r"w.jsonl:2: field 'n_output'"):
        load_chat_workload(p)


def test_chat_workload_load_rejects_other_files(write):
    with pytest.raises(TraceFormatError, match="slotlab_chat_workload"):
        load_chat_workload(write("w.jsonl", '{"arrival_s": 0}\n'))
