"""Every prompt shape upstream accepts (`tokenize_input_prompts`, tools/server/server-common.cpp), and its
400 answers for the ones it refuses."""

from __future__ import annotations

import pytest

from engine.http.params import MSG_BAD_PROMPT, MSG_NO_MTMD


def tokens_of(client, prompt, add_special=False) -> list[int]:
    return client.post("/tokenize", json={"content": prompt, "add_special": add_special}).json()["tokens"]


def evaluated(client, prompt) -> list[int]:
    """The token ids each prompt became, read back from the native response's `tokens_evaluated`/`prompt`."""
    r = client.post("/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return [o["tokens_evaluated"] for o in body] if isinstance(body, list) else [body["tokens_evaluated"]]


def test_string_tokens_and_mixed_are_one_prompt(client):
    hello, first = tokens_of(client, "Hello"), tokens_of(client, "Hello", add_special=True)
    assert evaluated(client, "Hello") == [len(first)]                        # special tokens in first place
    assert evaluated(client, [5, 6, 7]) == [3]
    assert evaluated(client, [5, "Hello", 7]) == [1 + len(hello) + 1]       # not first: no special tokens


def test_an_array_without_integers_is_one_prompt_per_element(client):
    hello, first = tokens_of(client, "Hello"), tokens_of(client, "Hello", add_special=True)
    got = evaluated(client, ["Hello", [5, 6], [9, "Hello"], {"prompt_string": "Hello"},
                             {"prompt_string": [3, "Hello"]}, []])
    assert got == [len(first), 2, 1 + len(hello), len(first), 1 + len(hello), 0]


def test_a_prompt_object_alone_is_one_prompt(client):
    assert evaluated(client, {"prompt_string": [4, 5, 6, 7]}) == [4]


@pytest.mark.parametrize("prompt, message", [
    ([], '"prompt" must not be empty'),
    ({"prompt_string": "Hi", "multimodal_data": ["aGVsbG8="]}, MSG_NO_MTMD),
    (5, MSG_BAD_PROMPT),
    ([["a", "b"]], MSG_BAD_PROMPT),                # strings only, inside an array of prompts
    ([1, 2.5], MSG_BAD_PROMPT),                    # integers and a fraction: neither tokens nor mixed
    ([True], MSG_BAD_PROMPT),
    ({"text": "Hi"}, MSG_BAD_PROMPT),
    ([{"prompt": "Hi"}], MSG_BAD_PROMPT),
])
def test_refused_shapes_answer_400_with_upstreams_message(client, prompt, message):
    r = client.post("/completion", json={"prompt": prompt, "n_predict": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"code": 400, "message": message, "type": "invalid_request_error"}


def test_the_openai_completions_endpoint_takes_the_same_shapes(client):
    r = client.post("/v1/completions", json={"prompt": ["Hello", [5, 6]], "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
