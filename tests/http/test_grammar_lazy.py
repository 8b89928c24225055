"""`grammar_lazy`, `grammar_triggers` and `preserved_tokens` on the completion endpoints: parsed and checked
as upstream's server-schema.cpp does, reported in `generation_settings`, and acted on (the grammar constrains
only from a trigger on). The tiny model's output is forced with `logit_bias`: a +50 bias on one token makes
it the choice of every step that the grammar does not forbid."""

from __future__ import annotations

import re

import pytest

GRAMMAR = 'root ::= "x" [0-9] [0-9]'


def _tok(client, text: str) -> list[int]:
    return client.post("/tokenize", json={"content": text}).json()["tokens"]


def _x_bias(client) -> list:
    (x,) = _tok(client, "x")
    return [[x, 50.0]]


@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_constrained_only_from_the_trigger_on(client, path):
    # greedy x x x ...: the pattern xx(x) fires at the third x, whose group "x" is fed to the grammar; the
    # grammar then forbids x, so two digits follow and the grammar's end stops generation
    r = client.post(path, json={"prompt": "Hi", "n_predict": 20, "temperature": 0.0, "logit_bias": _x_bias(client),
                                "grammar": GRAMMAR, "grammar_lazy": True,
                                "grammar_triggers": [{"type": 2, "value": "xx(x)"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    text = body["content"] if path == "/completion" else body["choices"][0]["text"]
    assert re.fullmatch(r"xxx[0-9]{2}", text), text
    if path == "/completion":
        assert body["stop_type"] == "eos"


def test_the_same_grammar_not_lazy_constrains_from_the_first_token(client):
    r = client.post("/completion", json={"prompt": "Hi", "n_predict": 20, "temperature": 0.0,
                                         "logit_bias": _x_bias(client), "grammar": GRAMMAR,
                                         "grammar_triggers": [{"type": 2, "value": "xx(x)"}]})
    assert re.fullmatch(r"x[0-9]{2}", r.json()["content"]), r.json()["content"]


def test_lazy_grammar_whose_trigger_never_fires_leaves_output_free(client):
    r = client.post("/completion", json={"prompt": "Hi", "n_predict": 6, "temperature": 0.0,
                                         "logit_bias": _x_bias(client), "grammar": GRAMMAR, "grammar_lazy": True,
                                         "grammar_triggers": [{"type": 1, "value": "zz"}]})
    assert r.json()["content"] == "x" * 6


def test_a_one_token_word_is_a_token_trigger_that_must_be_preserved(client):
    (hello,) = _tok(client, "Hello")
    body = {"prompt": "Hi", "n_predict": 10, "temperature": 0.0, "logit_bias": [[hello, 50.0]],
            "grammar": 'root ::= "Hello" [0-9]', "grammar_lazy": True,
            "grammar_triggers": [{"type": 1, "value": "Hello"}]}
    r = client.post("/completion", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("Field 'grammar_triggers': Grammar trigger word should be marked as "
                                            "preserved token: Hello")
    r = client.post("/completion", json={**body, "preserved_tokens": ["Hello"]})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"Hello[0-9]", r.json()["content"]), r.json()["content"]
    gs = r.json()["generation_settings"]
    assert gs["grammar_triggers"] == [{"type": 0, "value": "Hello", "token": hello}]
    assert gs["preserved_tokens"] == [hello]


def test_generation_settings_report_the_parsed_values(client):
    (hello,) = _tok(client, "Hello")
    (im_start,) = _tok(client, "<|im_start|>")
    r = client.post("/completion", json={
        "prompt": "Hi", "n_predict": 1, "grammar": GRAMMAR, "grammar_lazy": True,
        "preserved_tokens": ["Hello", "<|im_start|>", "ab", ""],        # "ab" is two tokens: not kept
        "grammar_triggers": [{"type": 2, "value": "a(b)"}, {"type": 1, "value": "Hel"},
                             {"type": 1, "value": "Hello"}, {"type": 3.9, "value": "x+"},
                             {"type": 0, "value": "anything", "token": 5}]})
    assert r.status_code == 200, r.text
    gs = r.json()["generation_settings"]
    assert gs["grammar_lazy"] is True
    assert gs["grammar_triggers"] == [{"type": 2, "value": "a(b)"}, {"type": 1, "value": "Hel"},
                                      {"type": 0, "value": "Hello", "token": hello}, {"type": 3, "value": "x+"},
                                      {"type": 0, "value": "anything", "token": 5}]
    assert gs["preserved_tokens"] == sorted([hello, im_start])


def test_defaults_are_reported_when_absent(client):
    gs = client.post("/completion", json={"prompt": "Hi", "n_predict": 1}).json()["generation_settings"]
    assert (gs["grammar_lazy"], gs["grammar_triggers"], gs["preserved_tokens"]) == (False, [], [])


def test_a_preserved_control_token_is_rendered_in_the_text(client):
    (im_start,) = _tok(client, "<|im_start|>")
    body = {"prompt": "Hi", "n_predict": 2, "temperature": 0.0, "logit_bias": [[im_start, 60.0]]}
    assert client.post("/completion", json=body).json()["content"] == ""
    r = client.post("/completion", json={**body, "preserved_tokens": ["<|im_start|>"]})
    assert r.json()["content"] == "<|im_start|><|im_start|>"


E = "Field 'grammar_triggers': "


@pytest.mark.parametrize("extra, message", [
    ({"grammar_lazy": True, "grammar_triggers": []}, E + "Error: no triggers set for lazy grammar!"),
    ({"grammar_triggers": [{"type": "word", "value": "x"}]},
     E + "[json.exception.type_error.302] type must be number, but is string"),
    ({"grammar_triggers": [{"value": "x"}]}, E + "[json.exception.out_of_range.403] key 'type' not found"),
    ({"grammar_triggers": [{"type": 1}]}, E + "[json.exception.out_of_range.403] key 'value' not found"),
    ({"grammar_triggers": [{"type": 1, "value": 3}]},
     E + "[json.exception.type_error.302] type must be string, but is number"),
    ({"grammar_triggers": [{"type": 0, "value": "x"}]}, E + "[json.exception.out_of_range.403] key 'token' not found"),
    ({"grammar_triggers": ["x"]}, E + "[json.exception.type_error.304] cannot use at() with string"),
    ({"grammar_triggers": "x"}, E + "[json.exception.type_error.304] cannot use at() with string"),
    ({"grammar_triggers": [{"type": 7, "value": "x"}]},
     E + "unknown grammar trigger type 7 (expected 0 token, 1 word, 2 pattern or 3 pattern_full)"),
    ({"grammar_lazy": 1}, "Field 'grammar_lazy': [json.exception.type_error.302] type must be boolean, but is number"),
    ({"preserved_tokens": [3]},
     "Field 'preserved_tokens': [json.exception.type_error.302] type must be string, but is number"),
])
@pytest.mark.parametrize("path", ["/completion", "/v1/completions"])
def test_bad_lazy_fields_are_upstreams_400(client, path, extra, message):
    r = client.post(path, json={"prompt": "Hi", "n_predict": 1, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"code": 400, "message": message, "type": "invalid_request_error"}


def test_a_bad_trigger_regex_fails_sampler_init_only_with_a_grammar(client):
    bad = {"prompt": "Hi", "n_predict": 1, "grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "a(b"}]}
    r = client.post("/completion", json={**bad, "grammar": GRAMMAR})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert msg.startswith("Failed to initialize samplers: ") and "'a(b'" in msg, msg
    assert client.post("/completion", json=bad).status_code == 200     # no grammar: no patterns are compiled


def test_trigger_text_the_grammar_rejects_fails_that_request_with_500(client):
    r = client.post("/completion", json={"prompt": "Hi", "n_predict": 8, "temperature": 0.0,
                                         "logit_bias": _x_bias(client), "grammar": 'root ::= "y"',
                                         "grammar_lazy": True, "grammar_triggers": [{"type": 2, "value": "x"}]})
    assert r.status_code == 500
    assert "trigger" in r.json()["error"]["message"]
    assert client.post("/completion", json={"prompt": "Hi", "n_predict": 1}).status_code == 200


def test_chat_ignores_the_lazy_fields_as_upstream(client):
    # oaicompat_chat_params_parse sets grammar_lazy / grammar_triggers / preserved_tokens from the chat
    # template (a plain template: false, [], []), so the body's values do not count: the grammar is eager
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 20, "temperature": 0.0,
        "logit_bias": _x_bias(client), "grammar": GRAMMAR, "grammar_lazy": True, "grammar_triggers": [],
        "preserved_tokens": [7]})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"x[0-9]{2}", r.json()["choices"][0]["message"]["content"])
