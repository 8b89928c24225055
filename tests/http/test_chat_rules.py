"""Chat request rules as upstream's `oaicompat_chat_params_parse` (tools/server/server-common.cpp): message
validation, `add_generation_prompt` / `continue_final_message`, assistant prefill, and the
`/chat/completions/input_tokens` count (`handle_count_tokens`)."""

from __future__ import annotations

import pytest

USER = {"role": "user", "content": "Hello"}


def template(client, **body):
    return client.post("/apply-template", json={"messages": [USER], **body})


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user"}], "All non-assistant messages must contain 'content'"),
    (["just a string"], "All non-assistant messages must contain 'content'"),
    ([{"role": "assistant"}], "Assistant message must contain either 'content' or 'tool_calls'!"),
    ([{"role": "user", "content": 5}], "Expected 'content' to be a string or an array"),
    ([USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
     "Cannot have 2 or more assistant messages at the end of the list."),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "image_url is not supported by this server"),
])
def test_malformed_messages_are_400(client, messages, message):
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == message


def test_missing_or_non_array_messages(client):
    assert client.post("/v1/chat/completions", json={}).json()["error"]["message"] == "'messages' is required"
    r = client.post("/v1/chat/completions", json={"messages": {"role": "user"}})
    assert r.status_code == 400 and r.json()["error"]["message"] == "Expected 'messages' to be an array"


def test_add_generation_prompt_and_continuation(client):
    with_gen = template(client).json()["prompt"]
    without = template(client, add_generation_prompt=False).json()["prompt"]
    assert with_gen.startswith(without) and len(with_gen) > len(without)
    assert template(client, add_generation_prompt="yes").json()["prompt"] == with_gen   # not a bool: default
    r = template(client, continue_final_message=True)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Cannot set both add_generation_prompt and continue_final_message to true."


def test_a_trailing_assistant_message_is_continued(client):
    msgs = [USER, {"role": "assistant", "content": "The answer is"}]
    prefilled = client.post("/apply-template", json={"messages": msgs}).json()["prompt"]
    assert prefilled == template(client).json()["prompt"] + "The answer is"
    explicit = client.post("/apply-template", json={"messages": msgs, "continue_final_message": True,
                                                    "add_generation_prompt": False}).json()["prompt"]
    assert explicit == prefilled


def test_input_tokens_counts_the_rendered_prompt(client):
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        r = client.post(path, json={"messages": [USER]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "response.input_tokens"
        prompt = template(client).json()["prompt"]
        want = client.post("/tokenize", json={"content": prompt, "add_special": True}).json()["tokens"]
        assert body["input_tokens"] == len(want)
        done = client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 1}).json()
        assert done["usage"]["prompt_tokens"] == body["input_tokens"]
    r = client.post("/chat/completions/input_tokens", json={"messages": [{"role": "user"}]})
    assert r.status_code == 400
