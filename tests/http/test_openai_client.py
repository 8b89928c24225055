"""The official `openai` client against the OpenAI-compatible endpoints."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.http.test_native_endpoints import sse_events


@pytest.fixture()
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_text_completion_with_usage(oai):
    r = oai.completions.create(model="x", prompt="Hello the", max_tokens=5, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].finish_reason == "length" and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens == 5 and r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.model == "x"                                  # the requested model name is echoed


def test_chat_completion_and_cached_tokens_on_repeat(oai):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something about cats"}]
    first = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("length", "stop")
    again = oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == again.usage.prompt_tokens - 1         # all but the last prompt token reused
    assert again.choices[0].message.content == first.choices[0].message.content


def test_chat_streaming_role_delta_first_then_content_and_usage(oai):
    stream = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_text_completion_streaming_ends_with_done(server):
    with httpx.stream("POST", server.base_url + "/v1/completions", timeout=60,
                      json={"prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 3
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-2])


def test_chat_logprobs_and_n_choices(oai):
    r = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    logprobs=True, top_logprobs=3, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    lp = r.choices[0].logprobs.content
    assert len(lp) == 2 and len(lp[0].top_logprobs) == 3
    assert r.usage.completion_tokens == 4


def test_openai_client_sees_errors_as_exceptions(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="x", prompt="Hello", max_tokens=-5)
    assert "Value must be between -1" in str(e.value)
