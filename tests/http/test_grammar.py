"""Grammar-constrained sampling (`grammar`, `json_schema`, `response_format`) through llguidance, with
upstream's request fields, rejection-sampling order and error answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.model.grammar import Constraint, from_gbnf, from_json_schema
from engine.model.sampling import Sampler, SamplingParams


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_gbnf_grammar_constrains_every_sampled_completion(client, seed):
    r = client.post("/completion", json={"prompt": "Hello", "n_predict": 12, "temperature": 1.5, "seed": seed,
                                         "grammar": 'root ::= ("yes" | "no") " " [0-9]'})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"][:-1] in ("yes ", "no ") and body["content"][-1].isdigit(), body["content"]
    assert body["stop_type"] == "eos"                      # a complete grammar allows only end of generation
    assert body["generation_settings"]["grammar"] == 'root ::= ("yes" | "no") " " [0-9]'


def test_json_schema_gives_valid_json(client):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    r = client.post("/completion", json={"prompt": "Hello", "n_predict": 40, "temperature": 1.0, "seed": 7,
                                         "json_schema": schema})
    body = r.json()
    if body["stop_type"] == "eos":
        obj = json.loads(body["content"])
        assert set(obj) == {"a", "b"} and isinstance(obj["a"], int) and obj["b"] in ("x", "y")
    else:                                                   # the budget ran out mid-object: still a prefix
        assert body["content"].startswith("{")


def test_chat_response_format_json_object_and_json_schema(client):
    msgs = [{"role": "user", "content": "Give me JSON"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 30, "seed": 3,
                                                   "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].lstrip().startswith("{")
    r = client.post("/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 30, "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "array"}}}})
    assert r.json()["choices"][0]["message"]["content"].lstrip().startswith("[")


@pytest.mark.parametrize("body, status, message", [
    ({"prompt": "Hi", "grammar": "root ::= foo"}, 400, "Failed to initialize samplers: failed to parse grammar"),
    ({"prompt": "Hi", "grammar": 'root ::= "a'}, 400, "Failed to initialize samplers: failed to parse grammar"),
])
def test_invalid_grammar_is_upstreams_400(client, body, status, message):
    r = client.post("/completion", json=body)
    assert r.status_code == status and r.json()["error"]["message"] == message
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_chat_errors_as_upstream(client):
    msgs = [{"role": "user", "content": "x"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "response_format": {"type": "yaml"}})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == 'response_format type must be one of "text" or "json_object", but got: yaml'
    r = client.post("/v1/chat/completions", json={"messages": msgs, "json_schema": {}, "grammar": 'root ::= "a"'})
    assert r.status_code == 500 and r.json()["error"]["message"] == "Cannot use both json_schema and grammar"


def test_grammar_key_wins_over_json_schema_as_in_server_schema():
    p = SamplingParams.from_request({"grammar": 'root ::= "a"', "json_schema": {"type": "array"}})
    assert p.grammar_source == 'root ::= "a"'


class _Tok:
    """A 5-token vocabulary: a, b, c, a double quote and an end-of-generation token."""

    n_vocab, eos_id, bos_id, eog_ids = 5, 4, None, frozenset({4})

    def token_to_piece(self, i, special=True):
        return [b"a", b"b", b"c", b'"', b"</s>"][i]

    def is_control(self, i):
        return i == 4

    def tokenize(self, text, add_special=False, parse_special=False):
        return ['abc"'.index(ch) for ch in text]


def test_rejection_sampling_keeps_an_accepted_token_and_masks_only_after_a_rejection():
    tok = _Tok()
    g = from_gbnf('root ::= "b" "c"')
    params = SamplingParams(temperature=0.0, grammar=g)
    s = Sampler(params, 5, frozenset({4}), tokenizer=tok)
    logits = np.array([5.0, 1.0, 0.0, 0.0, -1.0], np.float32)   # greedy pick "a" is not allowed: masked -> "b"
    assert s.sample(logits).token == 1
    assert s.sample(np.array([0.0, 0.0, 9.0, 0.0, 0.0], np.float32)).token == 2     # accepted as is
    assert s.sample(np.array([9.0, 9.0, 9.0, 9.0, -5.0], np.float32)).token == 4    # done: only EOG remains


def test_constraint_masks_what_the_schema_forbids():
    c = Constraint(from_json_schema({"enum": ["ab"]}), _Tok())
    assert c.allowed().tolist() == [False, False, False, True, False]     # a JSON string starts with a quote
    for t in (3, 0, 1):
        c.accept(t)
    assert c.allowed().tolist() == [False, False, False, True, False]     # "ab then only the closing quote
    c.accept(3)
    assert c.allowed().tolist() == [False, False, False, False, True]     # complete: only end of generation
