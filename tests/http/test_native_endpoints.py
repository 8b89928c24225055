"""Native endpoints: response shapes and key order, streaming, text endpoints.

Upstream shapes: `server_task_result_cmpl_final::to_json_non_oaicompat`, `task_params::to_json` and
`server_task_result_metrics::to_metrics` (tools/server/server-task.cpp); `/health`, `/props`, `/models`,
`/slots`, `/tokenize`, `/detokenize` in `server_routes::init_routes` (tools/server/server-context.cpp).
"""

from __future__ import annotations

import json

import httpx

from tests.http.conftest import wait_idle

NATIVE_KEYS = ["index", "content", "tokens", "id_slot", "stop", "model", "tokens_predicted", "tokens_evaluated",
               "generation_settings", "prompt", "has_new_line", "truncated", "stop_type", "stopping_word",
               "tokens_cached", "timings"]
TIMING_KEYS = ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
               "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]


def sse_events(resp: httpx.Response) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_health_answers_ok_with_the_llama_cpp_server_header(client):
    for path in ("/health", "/v1/health"):
        r = client.get(path)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        assert r.headers["server"] == "llama.cpp"


def test_completion_response_has_upstream_keys_in_order(client):
    r = client.post("/completion", json={"prompt": "Hello the", "n_predict": 5, "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    assert list(body) == NATIVE_KEYS
    assert list(body["timings"]) == TIMING_KEYS
    assert body["tokens"] == [] and body["stop"] is True and body["stop_type"] == "limit"
    assert body["tokens_predicted"] == 5 and body["timings"]["predicted_n"] == 5
    n_prompt = len(client.post("/tokenize", json={"content": "Hello the"}).json()["tokens"])
    assert body["tokens_evaluated"] == n_prompt
    assert body["tokens_cached"] == n_prompt + 5 - 1
    gs = body["generation_settings"]
    assert list(gs)[:4] == ["seed", "temperature", "dynatemp_range", "dynatemp_exponent"]
    assert gs["temperature"] == 0.800000011920929 and gs["n_predict"] == 5 and gs["max_tokens"] == 5
    assert {"bias": None, "token": 2} in gs["logit_bias"]          # ignore_eos bans every EOG id (-inf -> null)


def test_return_tokens_and_response_fields(client):
    r = client.post("/completion", json={"prompt": "Hello", "n_predict": 3, "ignore_eos": True,
                                         "return_tokens": True, "temperature": 0})
    assert len(r.json()["tokens"]) == 3
    r = client.post("/completion", json={"prompt": "Hello", "n_predict": 2,
                                         "response_fields": ["content", "generation_settings/n_predict", "nope"]})
    assert list(r.json()) == ["content", "generation_settings/n_predict"]
    assert r.json()["generation_settings/n_predict"] == 2


def test_prompt_as_token_ids_and_mixed_array(client):
    ids = client.post("/tokenize", json={"content": "Hello the world"}).json()["tokens"]
    a = client.post("/completion", json={"prompt": ids, "n_predict": 4, "temperature": 0, "ignore_eos": True,
                                         "cache_prompt": False}).json()
    b = client.post("/completion", json={"prompt": "Hello the world", "n_predict": 4, "temperature": 0,
                                         "ignore_eos": True, "cache_prompt": False}).json()
    assert a["content"] == b["content"] and a["tokens_evaluated"] == len(ids)
    mixed = client.post("/completion", json={"prompt": ["Hello", ids[-1]], "n_predict": 1}).json()
    assert mixed["tokens_evaluated"] == len(client.post("/tokenize", json={"content": "Hello"}).json()["tokens"]) + 1


def test_several_prompts_return_an_array_in_prompt_order(client):
    r = client.post("/completion", json={"prompt": ["Hello", "the cat"], "n_predict": 2, "ignore_eos": True})
    body = r.json()
    assert isinstance(body, list) and [b["index"] for b in body] == [0, 1]


def test_identical_prompt_reuses_all_but_one_token(client):
    prompt = "in the house of the cat is on"
    client.post("/completion", json={"prompt": prompt, "n_predict": 2, "id_slot": 1})
    again = client.post("/completion", json={"prompt": prompt, "n_predict": 2, "id_slot": 1}).json()
    n = again["tokens_evaluated"]
    assert again["timings"]["cache_n"] == n - 1 and again["timings"]["prompt_n"] == 1   # upstream's n_past--


def test_stop_string_stops_generation_and_is_cut(client):
    base = client.post("/completion", json={"prompt": "Hello", "n_predict": 12, "temperature": 0,
                                            "ignore_eos": True, "cache_prompt": False}).json()["content"]
    word = base[3:5]
    if not word.strip("\ufffd"):
        return
    r = client.post("/completion", json={"prompt": "Hello", "n_predict": 12, "temperature": 0, "ignore_eos": True,
                                         "stop": [word], "cache_prompt": False}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == word
    assert r["content"] == base[:base.index(word)]


def test_n_probs_reports_token_probabilities(client):
    r = client.post("/completion", json={"prompt": "Hello", "n_predict": 3, "n_probs": 2, "ignore_eos": True})
    probs = r.json()["completion_probabilities"]
    assert len(probs) == 3
    assert list(probs[0]) == ["id", "token", "bytes", "logprob", "top_logprobs"]
    assert len(probs[0]["top_logprobs"]) == 2 and list(probs[0]["top_logprobs"][0]) == ["id", "token", "bytes",
                                                                                        "logprob"]


def test_native_stream_sends_partials_then_a_full_final_event_without_done(client):
    with client.stream("POST", "/completion", json={"prompt": "Hello the", "n_predict": 6, "stream": True,
                                                    "ignore_eos": True, "temperature": 0}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert "[DONE]" not in events
    *partials, final = events
    for p in partials:
        assert list(p)[:7] == ["index", "content", "tokens", "stop", "id_slot", "tokens_predicted",
                               "tokens_evaluated"]
        assert p["stop"] is False and p["id_slot"] == -1 and len(p["tokens"]) == 1
    assert list(final) == NATIVE_KEYS and final["content"] == "" and final["tokens_predicted"] == 6
    streamed = "".join(p["content"] for p in partials)
    whole = client.post("/completion", json={"prompt": "Hello the", "n_predict": 6, "ignore_eos": True,
                                             "temperature": 0}).json()["content"]
    assert whole.startswith(streamed)


def test_return_progress_reports_prompt_processing(client):
    with client.stream("POST", "/completion", json={"prompt": "the cat " * 20, "n_predict": 1, "stream": True,
                                                    "return_progress": True, "cache_prompt": False}) as r:
        events = sse_events(r)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress and progress[0]["processed"] == progress[0]["cache"]
    assert progress[-1]["processed"] == progress[-1]["total"]


def test_tokenize_with_pieces_and_detokenize_round_trip(client):
    r = client.post("/tokenize", json={"content": "Hello <|im_end|>", "with_pieces": True}).json()
    assert all(list(t) == ["id", "piece"] for t in r["tokens"])
    assert r["tokens"][-1] == {"id": 2, "piece": "<|im_end|>"}
    ids = [t["id"] for t in r["tokens"]]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"content": "Hello <|im_end|>"}
    assert client.post("/tokenize", json={}).json() == {"tokens": []}
    raw = client.post("/tokenize", json={"content": [200], "with_pieces": True}).json()["tokens"][0]["piece"]
    assert isinstance(raw, list)                      # a lone non-UTF-8 byte comes back as byte values


def test_apply_template_renders_chatml(client):
    r = client.post("/apply-template", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["prompt"].endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_props_models_and_slots_shapes(client, server):
    props = client.get("/props").json()
    assert list(props)[:3] == ["default_generation_settings", "total_slots", "model_alias"]
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 512
    assert "stop" not in props["default_generation_settings"]["params"]       # only_metrics form
    models = client.get("/v1/models").json()
    assert client.get("/models").json()["data"][0]["id"] == models["data"][0]["id"] == "tiny.gguf"
    assert models["data"][0]["owned_by"] == "llamacpp" and models["object"] == "list"
    client.post("/completion", json={"prompt": "Hello", "n_predict": 1})
    slots = wait_idle(client)
    assert len(slots) == 4 and all(list(s)[:4] == ["id", "n_ctx", "speculative", "is_processing"] for s in slots)
    used = [s for s in slots if "id_task" in s]
    assert used and isinstance(used[0]["next_token"], list)
    assert used[0]["next_token"][0] == {"has_next_token": False, "has_new_line": False, "n_remain": -1,
                                        "n_decoded": 0}


def test_metrics_text_has_upstream_names_help_and_type(client):
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.splitlines()
    assert lines[0] == "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed."
    assert lines[1] == "# TYPE llamacpp:prompt_tokens_total counter"
    names = [ln.split()[0] for ln in lines if not ln.startswith("#")]
    for name in ("prompt_tokens_total", "tokens_predicted_total", "n_decode_total", "prompt_tokens_seconds",
                 "predicted_tokens_seconds", "requests_processing", "requests_deferred", "n_busy_slots_per_decode"):
        assert "llamacpp:" + name in names


def test_timings_per_token_adds_timings_to_stream_partials(client):
    with client.stream("POST", "/completion", json={"prompt": "Hello", "n_predict": 3, "stream": True,
                                                    "ignore_eos": True, "timings_per_token": True}) as r:
        events = sse_events(r)
    assert all("timings" in e for e in events)


def test_n_cmpl_returns_one_result_per_completion_sharing_the_prompt(client):
    r = client.post("/completion", json={"prompt": "Hello the cat", "n_predict": 3, "n_cmpl": 3,
                                         "ignore_eos": True, "seed": 7})
    body = r.json()
    assert [b["index"] for b in body] == [0, 1, 2]
    assert len({b["id_slot"] for b in body}) == 3 and all(b["tokens_predicted"] == 3 for b in body)
    wait_idle(client)


def test_completions_without_v1_is_the_native_endpoint(client):
    """Upstream routes `/completions` to `post_completions` (native body with `content`); only
    `/v1/completions` speaks the OpenAI shape."""
    body = {"prompt": "Hello", "n_predict": 3, "temperature": 0}
    native = client.post("/completions", json=body).json()
    assert "content" in native and "tokens_predicted" in native and "object" not in native
    assert native["content"] == client.post("/completion", json=body).json()["content"]
    oai = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0}).json()
    assert oai["object"] == "text_completion"


def test_progress_events_carry_timings_with_timings_per_token(client):
    """Upstream attaches the slot's stats to every partial result when timings_per_token is on (progress
    events included), and to none otherwise."""
    body = {"prompt": "the dog " * 20, "n_predict": 1, "stream": True, "return_progress": True,
            "cache_prompt": False}
    with client.stream("POST", "/completion", json={**body, "timings_per_token": True}) as r:
        events = [e for e in sse_events(r) if "prompt_progress" in e]
    assert events and all("timings" in e for e in events)
    last = events[-1]
    assert last["timings"]["prompt_n"] == last["prompt_progress"]["processed"] - last["prompt_progress"]["cache"]
    assert all(e["timings"]["predicted_n"] <= 1 for e in events)    # the last one comes with the first token
    with client.stream("POST", "/completion", json=body) as r:
        assert not any("timings" in e for e in sse_events(r) if "prompt_progress" in e)
