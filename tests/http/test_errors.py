"""Every error status the API answers, with upstream's body shape `{"error": {"code", "message", "type"}}`."""

from __future__ import annotations

import threading

import httpx
import pytest

from engine.model import load


def assert_error(r: httpx.Response, status: int, etype: str, message: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert list(err)[:3] == ["code", "message", "type"]
    assert err["code"] == status and err["type"] == etype
    if message is not None:
        assert message in err["message"]
    return err


@pytest.mark.parametrize("field,value,lo,hi", [("n_predict", -2, -1, 2147483647), ("n_keep", -3, -1, 2147483647),
                                               ("n_discard", -1, 0, 2147483647), ("n_cmpl", 5, 1, 4),
                                               ("n", 0, 1, 4), ("max_tokens", -9, -1, 2147483647)])
def test_hard_limit_fields_answer_400_value_must_be_between(client, field, value, lo, hi):
    r = client.post("/completion", json={"prompt": "Hello", field: value})
    assert_error(r, 400, "invalid_request_error",
                 f"Field '{field}': Value must be between {lo} <= value <= {hi}, but got {value}")


def test_soft_limit_fields_are_clamped_and_null_means_default(client):
    r = client.post("/completion", json={"prompt": "Hello", "n_predict": 1, "top_p": 7, "top_k": -4,
                                         "temperature": -1, "min_p": None, "seed": None})
    gs = r.json()["generation_settings"]
    assert gs["top_p"] == 1.0 and gs["top_k"] == 0 and gs["temperature"] == 0.0
    assert gs["min_p"] == 0.05000000074505806 and gs["seed"] == 4294967295


def test_wrong_field_type_is_400(client):
    assert_error(client.post("/completion", json={"prompt": "Hello", "n_predict": "x"}), 400,
                 "invalid_request_error", "Field 'n_predict'")
    assert_error(client.post("/completion", json={"prompt": "Hello", "stream": 1}), 400, "invalid_request_error")


def test_prompt_longer_than_the_slot_context_is_exceed_context_400(client):
    ids = [5] * 600
    r = client.post("/completion", json={"prompt": ids, "n_predict": 1})
    err = assert_error(r, 400, "exceed_context_size_error",
                       "request (600 tokens) exceeds the available context size (512 tokens)")
    assert err["n_prompt_tokens"] == 600 and err["n_ctx"] == 512


def test_stream_error_before_data_is_a_plain_json_error(client):
    r = client.post("/completion", json={"prompt": [5] * 600, "n_predict": 1, "stream": True})
    assert_error(r, 400, "exceed_context_size_error")
    assert r.headers["content-type"].startswith("application/json")


def test_invalid_token_ids_and_missing_prompt_are_400(client):
    assert_error(client.post("/completion", json={"prompt": [1, 99999]}), 400, "invalid_request_error",
                 "Prompt contains invalid tokens")
    assert_error(client.post("/completion", json={"n_predict": 1}), 400, "invalid_request_error", "prompt")
    assert_error(client.post("/completion", json={"prompt": {"a": 1}}), 400, "invalid_request_error")


def test_malformed_json_body_is_500_like_upstream(client):
    r = client.post("/completion", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 500, "server_error", "parse error")


def test_unknown_route_and_wrong_method_are_404_file_not_found(client):
    assert_error(client.get("/nope"), 404, "not_found_error", "File Not Found")
    assert_error(client.get("/completion"), 404, "not_found_error", "File Not Found")


def test_chat_errors(client):
    assert_error(client.post("/v1/chat/completions", json={"max_tokens": 1}), 400, "invalid_request_error",
                 "'messages' is required")
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                           "top_logprobs": 2}), 400, "invalid_request_error")


def test_disabled_endpoints_answer_501_with_upstream_messages(start_server):
    srv = start_server(endpoint_metrics=False, endpoint_slots=False, endpoint_props=False, slot_save_path="")
    with httpx.Client(base_url=srv.base_url) as c:
        assert_error(c.get("/metrics"), 501, "not_supported_error",
                     "This server does not support metrics endpoint. Start it with `--metrics`")
        assert_error(c.get("/slots"), 501, "not_supported_error",
                     "This server does not support slots endpoint. Start it with `--slots`")
        assert_error(c.post("/props", json={}), 501, "not_supported_error")
        assert_error(c.post("/slots/0?action=save", json={"filename": "a.bin"}), 501, "not_supported_error",
                     "This server does not support slots action. Start it with `--slot-save-path`")
        assert_error(c.post("/v1/embeddings", json={"input": "x"}), 501, "not_supported_error")
        assert c.get("/props").status_code == 200


def test_fail_on_no_slot_is_503_when_every_slot_is_busy(start_server):
    srv = start_server(n_parallel=1, n_ctx=4096)
    with httpx.Client(base_url=srv.base_url, timeout=60) as c:
        with c.stream("POST", "/completion", json={"prompt": "Hello", "n_predict": 3000, "ignore_eos": True,
                                                   "stream": True}) as r:
            lines = r.iter_lines()        # keep the iterator: dropping it closes the connection
            next(lines)
            assert_error(c.get("/slots?fail_on_no_slot=1"), 503, "unavailable_error", "no slot available")
            assert c.get("/slots").status_code == 200
        # the abandoned stream is cancelled: the slot becomes available again
        import time
        t_end = time.monotonic() + 5
        while c.get("/slots?fail_on_no_slot=1").status_code != 200:
            assert time.monotonic() < t_end
            time.sleep(0.05)


def test_503_loading_model_until_the_model_is_loaded(start_server, tiny_path):
    gate = threading.Event()

    def slow_loader(path, n_threads, numerics="f32"):
        gate.wait(30)
        return load(path, n_threads, numerics=numerics)

    srv = start_server(loader=slow_loader, wait=False)
    with httpx.Client(base_url=srv.base_url) as c:
        for path in ("/health", "/completion", "/v1/models"):
            r = c.get(path)
            assert_error(r, 503, "unavailable_error", "Loading model")
        assert c.options("/health").status_code == 200         # OPTIONS is answered before the loading check
        gate.set()
        assert srv.state.wait_ready(30)
        assert c.get("/health").json() == {"status": "ok"}


def test_a_failing_forward_pass_answers_500_and_the_server_keeps_serving(start_server):
    """A decode that raises fails the running request with a 500 (upstream: "decode() failed"); the engine
    starts from empty slots and the next request is served."""
    srv = start_server(n_parallel=2)
    backend = srv.state.backend
    real = backend.model.forward_batch
    calls = {"n": 0}

    def broken_once(kv, chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise FloatingPointError("injected failure")
        return real(kv, chunks)

    backend.model.forward_batch = broken_once
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            r = c.post("/completion", json={"prompt": "hello world", "n_predict": 4})
            assert r.status_code == 500
            assert "decode() failed: injected failure" in r.json()["error"]["message"]
            assert all(s["n_ctx"] > 0 and not s["is_processing"] for s in c.get("/slots").json())
            r = c.post("/completion", json={"prompt": "hello world", "n_predict": 4})
            assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
            assert r.json()["timings"]["cache_n"] == 0       # the failed step's tokens were not kept as cached
    finally:
        backend.model.forward_batch = real


def test_the_servers_kv_is_resident_unless_unified(start_server):
    """Per-slot KV: allocated and written whole at load, as llama.cpp's; unified (-np auto), each slot may use all
    of n_ctx, so the store stays lazy and only the cells in use are resident."""
    per_slot = start_server(n_parallel=2, n_ctx=256).state.backend.kv
    unified = start_server(n_parallel=-1, n_ctx=256).state.backend.kv
    assert per_slot.resident and per_slot.pool_k is not None
    assert not unified.resident and unified.pool_k is None
