"""Schemathesis over every endpoint of the API's OpenAPI description (engine/http/openapi.py): no 5xx but
upstream's documented ones, and the server still healthy afterwards. Bounded: a few dozen examples per
operation (about a minute in all); CI runs it derandomized (HYPOTHESIS_PROFILE=ci)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from engine.http.openapi import document

SCHEMA = schemathesis.openapi.from_dict(document())
NOT_SUPPORTED = ("/embeddings", "/rerank")          # 501 as upstream without --embeddings / --reranking
# a lazy grammar's trigger text that the grammar rejects: upstream's post_decode() fails too (500)
UPSTREAM_500 = ("[json.exception.", "Cannot use both json_schema and grammar",
                "sampling failed: GrammarError: the text that fired")


@pytest.fixture(scope="module")
def fuzz_server(start_server, tmp_path_factory):
    return start_server(n_parallel=2, n_ctx=1024, endpoint_metrics=True, endpoint_props=True,
                        slot_save_path=str(tmp_path_factory.mktemp("fuzz-slots")))


def documented(path: str, status: int, body: object) -> bool:
    """A 5xx that upstream gives too: 501 for a disabled feature, 500 for nlohmann JSON exceptions."""
    if status == 501:
        return path in NOT_SUPPORTED
    if status == 500 and isinstance(body, dict):
        message = (body.get("error") or {}).get("message", "")
        return isinstance(message, str) and message.startswith(UPSTREAM_500)
    return False


@SCHEMA.parametrize()
@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_undocumented_server_error(case, fuzz_server):
    response = case.call(base_url=fuzz_server.base_url, timeout=30)
    if response.status_code >= 500:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        assert documented(case.path, response.status_code, body), (case.method, case.path, case.body,
                                                                    response.status_code, body)


def test_the_server_is_healthy_after_the_fuzzing(fuzz_server):
    with httpx.Client(base_url=fuzz_server.base_url, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok"}
        r = c.post("/completion", json={"prompt": "Hello", "n_predict": 2})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
        assert not any(s["is_processing"] for s in c.get("/slots").json())
