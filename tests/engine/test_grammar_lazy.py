"""Lazy grammars (`grammar_lazy` + triggers): sampling is free until a trigger fires, then the grammar
constrains from the trigger on, fed with the trigger text as upstream's `llama_grammar_accept_impl`
(src/llama-grammar.cpp) feeds it. A tiny vocabulary and greedy sampling make every step's choice explicit:
each step's logits put the largest value on the token the test wants unless the grammar forbids it."""

from __future__ import annotations

import re

import numpy as np
import pytest

from engine.model.grammar import (TRIGGER_PATTERN, TRIGGER_PATTERN_FULL, TRIGGER_TOKEN, TRIGGER_WORD,
                                  GrammarError, GrammarTrigger, LazyConstraint, compile_trigger_patterns, from_gbnf)
from engine.model.sampling import Sampler, SamplingParams

PIECES = [b"a", b"b", b"x", b"y", b"1", b"2", b"ya", b"<t>", b"</s>", b"<", b"t", b">", b"/", b"s"]
A, B, X, Y, ONE, TWO, YA, T, EOG = range(9)


class _Tok:
    """a b x y 1 2 ya, a control token <t>, the end-of-generation token </s>, and the characters that spell
    those two as normal text."""

    n_vocab, eos_id, bos_id, eog_ids = len(PIECES), EOG, None, frozenset({EOG})

    def token_to_piece(self, i, special=True):
        return PIECES[i] if special or i not in (T, EOG) else b""

    def is_control(self, i):
        return i in (T, EOG)

    def tokenize(self, text, add_special=False, parse_special=False):
        data, out = text.encode(), []
        normal = [(p, i) for i, p in enumerate(PIECES) if i not in (T, EOG)]
        while data:                                     # greedy longest match over the normal tokens
            p, i = max(((p, i) for p, i in normal if data.startswith(p)), key=lambda pi: len(pi[0]))
            out.append(i)
            data = data[len(p):]
        return out


def _want(token: int, second: int | None = None) -> np.ndarray:
    """Logits whose greedy choice is `token`, then `second`, then the rest by id."""
    row = -np.arange(len(PIECES), dtype=np.float32) * 0.01
    row[token] = 10.0
    if second is not None:
        row[second] = 5.0
    return row


def _sampler(grammar: str, triggers, lazy: bool = True) -> Sampler:
    params = SamplingParams(temperature=0.0, grammar=from_gbnf(grammar), grammar_lazy=lazy,
                            grammar_triggers=tuple(triggers))
    return Sampler(params, len(PIECES), frozenset({EOG}), tokenizer=_Tok())


def _run(s: Sampler, rows) -> list[int]:
    return [s.sample(r).token for r in rows]


def test_free_until_a_pattern_fires_then_constrained():
    s = _sampler('root ::= "x" [12]', [GrammarTrigger(TRIGGER_PATTERN, "x")])
    got = _run(s, [_want(A), _want(A), _want(B), _want(X), _want(A, TWO), _want(A, ONE)])
    # a, a, b are outside the grammar but free; x fires and is fed; then "a" is masked; then only EOG
    assert got == [A, A, B, X, TWO, EOG]


def test_eager_grammar_for_comparison_masks_from_the_first_token():
    s = _sampler('root ::= "x" [12]', [GrammarTrigger(TRIGGER_PATTERN, "x")], lazy=False)
    assert _run(s, [_want(A), _want(A, TWO)]) == [X, TWO]


def test_the_first_non_empty_capture_group_starts_the_constrained_text():
    # pattern y(x): the grammar is fed "x" (the group), not "yx" (the match)
    s = _sampler('root ::= "x" [12]', [GrammarTrigger(TRIGGER_PATTERN, "y(x)")])
    assert _run(s, [_want(A), _want(Y), _want(X), _want(B, ONE)]) == [A, Y, X, ONE]
    # without a group the match start counts: "yx" is fed
    s = _sampler('root ::= "yx" [12]', [GrammarTrigger(TRIGGER_PATTERN, "yx")])
    assert _run(s, [_want(A), _want(Y), _want(X), _want(B, ONE)]) == [A, Y, X, ONE]


def test_text_after_the_match_in_the_same_token_is_fed_too():
    # token "ya" fires pattern "y"; the grammar gets "ya" (from the match start to the end of the text),
    # so "a" is no longer allowed next
    s = _sampler('root ::= "ya" [12]', [GrammarTrigger(TRIGGER_PATTERN, "y")])
    assert _run(s, [_want(B), _want(YA), _want(A, TWO)]) == [B, YA, TWO]


def test_a_match_starting_inside_a_token_feeds_only_that_token_s_tail():
    # "ya" fires pattern "a" at byte 1: the grammar is fed "a" alone (a partial piece)
    s = _sampler('root ::= "a" [12]', [GrammarTrigger(TRIGGER_PATTERN, "a")])
    assert _run(s, [_want(B), _want(YA), _want(A, ONE)]) == [B, YA, ONE]


def test_a_word_is_matched_literally_across_tokens():
    s = _sampler('root ::= "y.x" [12]', [GrammarTrigger(TRIGGER_WORD, "y.x")])
    # "yax" does not contain the literal "y.x" (a regex would match it): still free
    assert _run(s, [_want(Y), _want(A), _want(X), _want(B)]) == [Y, A, X, B]
    s = _sampler('root ::= "ya" [12]', [GrammarTrigger(TRIGGER_WORD, "ya")])
    assert _run(s, [_want(B), _want(Y), _want(A), _want(A, TWO)]) == [B, Y, A, TWO]


def test_pattern_full_must_match_all_the_text_so_far():
    # "bax" contains a+x but is not a+x as a whole: a full pattern does not fire, so "b" stays free
    s = _sampler('root ::= "ax" [12]', [GrammarTrigger(TRIGGER_PATTERN_FULL, "a+x")])
    assert _run(s, [_want(B), _want(A), _want(X), _want(B)]) == [B, A, X, B]
    s = _sampler('root ::= "ax" [12]', [GrammarTrigger(TRIGGER_PATTERN, "a+x")])
    assert _run(s, [_want(B), _want(A), _want(X), _want(B, ONE)]) == [B, A, X, ONE]
    s = _sampler('root ::= "bax" [12]', [GrammarTrigger(TRIGGER_PATTERN_FULL, "[ab]+x")])
    assert _run(s, [_want(B), _want(A), _want(X), _want(B, ONE)]) == [B, A, X, ONE]


def test_a_trigger_token_fires_and_is_fed_as_its_text():
    # the control token <t> is fed as the text "<t>" (upstream's grammar reads the piece's text)
    s = _sampler('root ::= "<t>" [12]', [GrammarTrigger(TRIGGER_TOKEN, "<t>", T)])
    assert _run(s, [_want(A), _want(T), _want(A, TWO), _want(A)]) == [A, T, TWO, EOG]


def test_text_spelling_a_trigger_token_does_not_fire_it():
    # only the token itself fires a token trigger
    s = _sampler('root ::= "ab" [12]', [GrammarTrigger(TRIGGER_TOKEN, "ab", YA)])
    assert _run(s, [_want(A), _want(B), _want(X)]) == [A, B, X]


def test_without_triggers_a_lazy_grammar_never_constrains():
    s = _sampler('root ::= "x"', [])
    assert _run(s, [_want(A)] * 5) == [A] * 5


def test_a_trigger_text_the_grammar_rejects_raises():
    s = _sampler('root ::= "y" [12]', [GrammarTrigger(TRIGGER_PATTERN, "x")])
    s.sample(_want(A))
    with pytest.raises(GrammarError, match="trigger"):
        s.sample(_want(X))


def test_the_constraint_stays_active_after_firing():
    c = LazyConstraint(from_gbnf('root ::= "x" [12] [12]'), _Tok(), [GrammarTrigger(TRIGGER_PATTERN, "x")])
    assert not c.active and c.allowed().all()          # awaiting: every token is allowed
    c.accept(A)
    c.accept(X)
    assert c.active
    assert c.allowed().tolist() == [i in (ONE, TWO) for i in range(len(PIECES))]
    c.accept(ONE)
    assert c.active and c.allowed().tolist() == [i in (ONE, TWO) for i in range(len(PIECES))]


@pytest.mark.parametrize("trigger, source", [
    (GrammarTrigger(TRIGGER_WORD, "a.b"), r"a\.b"),
    (GrammarTrigger(TRIGGER_PATTERN, "a.b"), "a.b"),
    (GrammarTrigger(TRIGGER_PATTERN_FULL, "a.b"), "^a.b$"),
    (GrammarTrigger(TRIGGER_PATTERN_FULL, "^a.b"), "^a.b$"),
    (GrammarTrigger(TRIGGER_PATTERN_FULL, "a.b$"), "^a.b$"),
    (GrammarTrigger(TRIGGER_PATTERN_FULL, ""), "^$"),
])
def test_trigger_patterns_as_common_sampler_init_builds_them(trigger, source):
    (pat,) = compile_trigger_patterns([trigger])
    assert pat.source == source


def test_a_bad_trigger_regex_is_a_grammar_error_naming_the_pattern():
    with pytest.raises(GrammarError, match=r"'a\(b'"):
        compile_trigger_patterns([GrammarTrigger(TRIGGER_PATTERN, "a(b")])


def test_trigger_json_as_upstream_reports_it():
    assert GrammarTrigger(TRIGGER_WORD, "ab").to_json() == {"type": 1, "value": "ab"}
    assert GrammarTrigger(TRIGGER_TOKEN, "<t>", 7).to_json() == {"type": 0, "value": "<t>", "token": 7}


def _fires_at(trigger: GrammarTrigger, tokens: list[int]) -> int | None:
    """The index of the token at which the trigger fires (the grammar accepts anything after "ya")."""
    c = LazyConstraint(from_gbnf('root ::= [a-z12<>/]*'), _Tok(), [trigger])
    for i, t in enumerate(tokens):
        c.accept(t)
        if c.active:
            return i
    return None


def test_a_word_fires_where_its_escaped_regex_would():
    # words are found by a literal search of the new text only; an escaped pattern is searched whole
    rng = np.random.default_rng(0)
    fired = 0
    for _ in range(60):
        tokens = rng.choice([A, B, Y, YA, X], size=12).tolist()
        for word in ("ya", "aya", "yy", "ab"):
            at = _fires_at(GrammarTrigger(TRIGGER_WORD, word), tokens)
            assert at == _fires_at(GrammarTrigger(TRIGGER_PATTERN, re.escape(word)), tokens), (word, tokens)
            fired += at is not None
    assert fired > 60                                   # the comparison saw many firings


@pytest.mark.parametrize("source, from_start", [
    (r"[\s\S]*?(ya)[\s\S]*", True), (r"[\s\S]*(a)", True), (r"[\S\s]*?b", True),
    (r"[\s\S]*?a|b", False),            # the run is in one branch only: b may match anywhere
    (r"[\s\S]*+a", False), (r"[\s\S]+?a", False), (r"a[\s\S]*", False), ("x", False),
])
def test_patterns_led_by_an_any_run_are_matched_from_the_start(source, from_start):
    (pat,) = compile_trigger_patterns([GrammarTrigger(TRIGGER_PATTERN, source)])
    assert pat.from_start is from_start
    searched = type(pat)(pat.source, pat.regex)            # the same pattern, always searched
    rng = np.random.default_rng(1)
    for _ in range(200):
        text = bytes(rng.choice(list(b"abxy"), size=int(rng.integers(0, 9))).tolist())
        assert pat.find(text) == searched.find(text), text
