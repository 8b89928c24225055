"""Middleware in upstream order: CORS, OPTIONS, loading, API key, 404; `Server: llama.cpp`; --api-prefix."""

from __future__ import annotations

import httpx
import pytest


def test_cors_echoes_the_request_origin(client):
    r = client.get("/health", headers={"Origin": "http://example.com"})
    assert r.headers["access-control-allow-origin"] == "http://example.com"
    assert client.get("/health").headers["access-control-allow-origin"] == ""     # upstream: empty, not absent


def test_options_preflight_is_200_with_cors_headers_and_no_key_check(start_server):
    srv = start_server(api_keys=("k1",))
    r = httpx.options(srv.base_url + "/completion", headers={"Origin": "http://a.b"})
    assert r.status_code == 200 and r.text == ""
    assert r.headers["content-type"].startswith("text/html")
    assert r.headers["access-control-allow-origin"] == "http://a.b"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"
    assert r.headers["server"] == "llama.cpp"


@pytest.fixture(scope="module")
def keyed(start_server):
    return start_server(api_keys=("secret1", "secret2"))


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "nope"}])
def test_api_key_is_required_except_for_health(keyed, headers):
    r = httpx.post(keyed.base_url + "/completion", json={"prompt": "Hello", "n_predict": 1}, headers=headers)
    assert r.status_code == 401
    assert r.json() == {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}
    assert httpx.get(keyed.base_url + "/health", headers=headers).status_code == 200
    assert httpx.get(keyed.base_url + "/v1/health", headers=headers).status_code == 200


@pytest.mark.parametrize("headers", [{"Authorization": "Bearer secret1"}, {"X-Api-Key": "secret2"},
                                     {"X-Api-Key": "Bearer secret2"}])
def test_valid_api_key_in_authorization_or_x_api_key(keyed, headers):
    r = httpx.post(keyed.base_url + "/completion", json={"prompt": "Hello", "n_predict": 1}, headers=headers)
    assert r.status_code == 200


def test_unknown_route_needs_the_key_first_then_is_404(keyed):
    assert httpx.get(keyed.base_url + "/nope").status_code == 401
    r = httpx.get(keyed.base_url + "/nope", headers={"X-Api-Key": "secret1"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_api_prefix_mounts_every_route_under_it(start_server):
    srv = start_server(api_prefix="/llm")
    root = srv.base_url[: -len("/llm")]
    assert httpx.get(srv.base_url + "/health").status_code == 200
    assert httpx.get(root + "/health").status_code == 404
    r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200


def test_cors_origins_literal_and_localhost(start_server):
    srv = start_server(cors_origins="localhost")
    ok = httpx.get(srv.base_url + "/health", headers={"Origin": "http://localhost:3000"})
    assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    bad = httpx.get(srv.base_url + "/health", headers={"Origin": "http://evil.com"})
    assert "access-control-allow-origin" not in bad.headers
