"""Hypothesis pass over /completion request bodies: no 5xx for any well-formed JSON body.

(A malformed JSON body is a 500 upstream and here; it is tested in test_errors.py, not fuzzed.)
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                      st.floats(allow_nan=False, allow_infinity=False, width=64), st.text(max_size=8))
JSON_ANY = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=8)
SMALL_INT = st.one_of(st.none(), st.integers(-3, 6), JSON_LEAF)
FIELDS = {
    "n_predict": SMALL_INT, "max_tokens": SMALL_INT, "temperature": JSON_LEAF, "top_k": JSON_LEAF,
    "top_p": JSON_LEAF, "min_p": JSON_LEAF, "seed": JSON_LEAF, "stop": st.one_of(JSON_ANY, st.lists(st.text(max_size=3))),
    "n_probs": st.one_of(st.integers(-2, 5), JSON_LEAF), "logit_bias": JSON_ANY, "ignore_eos": JSON_LEAF,
    "cache_prompt": JSON_LEAF, "id_slot": JSON_LEAF, "n_keep": JSON_LEAF, "n_discard": JSON_LEAF,
    "n_cmpl": st.one_of(st.integers(-1, 5), JSON_LEAF), "n": JSON_LEAF, "stream": st.one_of(st.booleans(), JSON_LEAF),
    "stream_options": JSON_ANY, "return_tokens": JSON_LEAF, "response_fields": JSON_ANY,
    "timings_per_token": JSON_LEAF, "return_progress": JSON_LEAF, "post_sampling_probs": JSON_LEAF,
    "repeat_penalty": JSON_LEAF, "repeat_last_n": JSON_LEAF, "mirostat": JSON_LEAF, "samplers": JSON_ANY,
    "typical_p": JSON_LEAF, "dynatemp_range": st.floats(-3, 3), "xtc_probability": JSON_LEAF,
    "presence_penalty": JSON_LEAF, "frequency_penalty": JSON_LEAF, "n_cache_reuse": JSON_LEAF,
    "grammar_lazy": JSON_LEAF, "preserved_tokens": st.one_of(JSON_ANY, st.lists(st.text(max_size=6), max_size=3)),
    "grammar_triggers": st.one_of(JSON_ANY, st.lists(st.fixed_dictionaries(
        {"type": st.one_of(st.integers(-1, 4), JSON_LEAF), "value": st.one_of(st.text(max_size=6), JSON_LEAF)},
        optional={"token": JSON_LEAF}), max_size=3)),
}
PROMPT = st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 400), max_size=30),
                   st.lists(st.one_of(st.text(max_size=10), st.integers(0, 296)), max_size=5), JSON_ANY)


@st.composite
def bodies(draw):
    body = {}
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=8, unique=True)):
        body[name] = draw(FIELDS[name])
    if draw(st.booleans()) or not body:
        body["prompt"] = draw(PROMPT)
    if draw(st.integers(0, 9)) == 0:
        body[draw(st.text(max_size=5))] = draw(JSON_ANY)
    return body


@pytest.fixture(scope="module")
def fuzz_server(start_server):
    # -n 8: a request that leaves n_predict at its default stays short
    return start_server(n_parallel=4, n_ctx=2048, n_predict=8)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies())
def test_completion_never_answers_5xx_to_well_formed_json(fuzz_server, body):
    r = httpx.post(fuzz_server.base_url + "/completion", content=json.dumps(body), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text[:500])
    if r.status_code != 200:
        assert list(r.json()["error"])[:3] == ["code", "message", "type"]
    elif r.headers["content-type"].startswith("application/json"):
        r.json()
