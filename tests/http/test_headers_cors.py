"""Header names byte-identical to llama-server's, and CORS as upstream's pre-routing handler
(`server_http_context::init`, tools/server/server-http.cpp) with the `--cors-*` options."""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

import httpx
import pytest

from engine.http.app import cors_origin, header_name, origin_is_localhost


def raw(srv, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None):
    """(status, [(name, value)] exactly as sent, body) over a plain socket client (no name folding)."""
    u = urlsplit(srv.base_url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request(method, u.path + path, body=body, headers=headers or {})
    r = conn.getresponse()
    out = r.status, r.getheaders(), r.read()
    conn.close()
    return out


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server(endpoint_metrics=True)


def test_header_names_are_spelled_as_upstream(srv):
    status, headers, _ = raw(srv, "GET", "/metrics", {"Origin": "http://a.b"})
    names = [k for k, _ in headers]
    assert status == 200
    for want in ("Server", "Access-Control-Allow-Origin", "Process-Start-Time-Unix", "Content-Type"):
        assert want in names, names
    assert all(n == header_name(n.encode()).decode() for n in names)
    _, headers, _ = raw(srv, "OPTIONS", "/completion", {"Origin": "http://a.b"})
    names = {k for k, _ in headers}
    assert {"Access-Control-Allow-Credentials", "Access-Control-Allow-Methods",
            "Access-Control-Allow-Headers", "Access-Control-Allow-Origin"} <= names


def test_streamed_responses_keep_the_spelling_too(srv):
    _, headers, body = raw(srv, "POST", "/completion", {"Content-Type": "application/json"},
                           b'{"prompt": "Hi", "n_predict": 2, "stream": true}')
    assert "Content-Type" in {k for k, _ in headers} and b"data: " in body


def test_default_cors_echoes_any_origin_with_credentials_and_an_empty_value_without_origin(srv):
    _, headers, _ = raw(srv, "GET", "/health")
    assert ("Access-Control-Allow-Origin", "") in headers
    r = httpx.options(srv.base_url + "/v1/chat/completions", headers={"Origin": "https://example.org"})
    assert r.headers["access-control-allow-origin"] == "https://example.org"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert r.headers["access-control-allow-headers"] == "*"


def test_cors_options_set_methods_headers_and_credentials(start_server):
    s = start_server(cors_methods="GET, POST", cors_headers="Content-Type", cors_credentials=False)
    r = httpx.options(s.base_url + "/completion", headers={"Origin": "https://example.org"})
    assert r.headers["access-control-allow-origin"] == "*"         # no credentials: the literal, not an echo
    assert r.headers["access-control-allow-credentials"] == "false"
    assert r.headers["access-control-allow-methods"] == "GET, POST"
    assert r.headers["access-control-allow-headers"] == "Content-Type"


@pytest.mark.parametrize("origin, local", [
    ("http://localhost", True), ("http://localhost:5173", True), ("https://127.0.0.1:8443/x", True),
    ("http://[::1]:8080", True), ("http://user@localhost:3000", True), ("http://localhost.evil.com", False),
    ("http://evil.com/localhost", False), ("ftp://localhost", False), ("localhost:3000", False),
    ("http://localhost:abc", False), ("http://[::1", False), ("http://127.0.0.2", False),
])
def test_localhost_origins_as_upstream_parses_them(origin, local):
    assert origin_is_localhost(origin) is local
    assert cors_origin("localhost", True, origin) == (origin if local else None)


def test_cors_origin_rules():
    assert cors_origin("*", True, "http://x.y") == "http://x.y"
    assert cors_origin("*", True, None) == ""
    assert cors_origin("*", False, "http://x.y") == "*"
    assert cors_origin("https://app.example", True, "http://x.y") == "https://app.example"
    assert cors_origin("localhost", True, None) is None


def test_health_is_public_but_a_prefixed_health_is_not_as_upstream(start_server):
    s = start_server(api_keys=("k",), api_prefix="/llm")
    assert httpx.get(s.base_url + "/health").status_code == 401      # upstream compares the unprefixed path
    assert httpx.get(s.base_url + "/health", headers={"Authorization": "Bearer k"}).status_code == 200


def test_user_info_is_cut_from_the_authority_only():
    """Deliberate difference from upstream's parser, which finds '@' anywhere in the URL."""
    assert not origin_is_localhost("http://evil.example/@localhost")
