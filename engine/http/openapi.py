"""An OpenAPI 3 description of the llama-server API this server implements (request shapes only).

llama-server publishes no schema, and neither does this server (a route upstream does not have would answer
differently from it); the document is for tools: `tests/http/test_schemathesis.py` fuzzes every endpoint
from it, and a client generator can read it (`python -m engine.http.openapi > openapi.json`). The request
bodies list the fields upstream reads (server-schema.cpp, server-common.cpp); every body also accepts
other keys, as upstream ignores unknown ones.
"""

from __future__ import annotations

import json
import sys
from typing import Any

_PROMPT = {"oneOf": [
    {"type": "string"},
    {"type": "array", "items": {"oneOf": [{"type": "integer"}, {"type": "string"}]}},
    {"type": "array", "items": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}},
                                          {"type": "object", "properties": {"prompt_string": {"type": "string"}}}]}},
    {"type": "object", "properties": {"prompt_string": {"type": "string"}}, "required": ["prompt_string"]},
]}
_SAMPLING = {
    "temperature": {"type": "number"}, "top_k": {"type": "integer"}, "top_p": {"type": "number"},
    "min_p": {"type": "number"}, "seed": {"type": "integer"}, "repeat_penalty": {"type": "number"},
    "repeat_last_n": {"type": "integer"}, "presence_penalty": {"type": "number"},
    "frequency_penalty": {"type": "number"}, "mirostat": {"type": "integer"}, "typical_p": {"type": "number"},
    "n_probs": {"type": "integer"}, "min_keep": {"type": "integer"}, "post_sampling_probs": {"type": "boolean"},
    "ignore_eos": {"type": "boolean"}, "logit_bias": {}, "samplers": {}, "xtc_probability": {"type": "number"},
    "dynatemp_range": {"type": "number"}, "grammar": {"type": "string"}, "json_schema": {"type": "object"},
    "grammar_lazy": {"type": "boolean"}, "preserved_tokens": {"type": "array", "items": {"type": "string"}},
    "grammar_triggers": {"type": "array", "items": {"type": "object", "required": ["type", "value"], "properties": {
        "type": {"type": "integer", "enum": [0, 1, 2, 3]}, "value": {"type": "string"},
        "token": {"type": "integer"}}}},
}
_COMMON = {
    "stream": {"type": "boolean"}, "cache_prompt": {"type": "boolean"}, "id_slot": {"type": "integer"},
    "n_keep": {"type": "integer"}, "n_discard": {"type": "integer"}, "n_cmpl": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "return_tokens": {"type": "boolean"}, "return_progress": {"type": "boolean"},
    "timings_per_token": {"type": "boolean"}, "n_cache_reuse": {"type": "integer"},
    "response_fields": {"type": "array", "items": {"type": "string"}},
}
_MESSAGES = {"type": "array", "items": {"type": "object", "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
    "content": {"oneOf": [{"type": "string"}, {"type": "null"},
                          {"type": "array", "items": {"type": "object", "properties": {
                              "type": {"type": "string"}, "text": {"type": "string"}}}}]}}}}
_CHAT = {"messages": _MESSAGES, "max_tokens": {"type": "integer", "minimum": -1, "maximum": 16},
         "add_generation_prompt": {"type": "boolean"}, "continue_final_message": {},
         "response_format": {"type": "object"}, "logprobs": {"type": "boolean"},
         "top_logprobs": {"type": "integer"}, "chat_template_kwargs": {"type": "object"}}


def _body(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = list(required)
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def _op(summary: str, body: dict[str, Any] | None = None, params: list | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"},
                                                            "400": {"description": "invalid request"}}}
    if body is not None:
        op["requestBody"] = body
    if params:
        op["parameters"] = params
    return op


def document() -> dict[str, Any]:
    """The OpenAPI document (paths without --api-prefix)."""
    completion = _body({"prompt": _PROMPT, "n_predict": {"type": "integer", "minimum": -1, "maximum": 16},
                        **_COMMON, **_SAMPLING}, ("prompt",))
    oai_completion = _body({"prompt": _PROMPT, "max_tokens": {"type": "integer", "minimum": -1, "maximum": 16},
                            "model": {"type": "string"}, **_COMMON, **_SAMPLING}, ("prompt",))
    chat = _body({**_CHAT, **_COMMON, **_SAMPLING}, ("messages",))
    get = {"get": _op("read-only")}
    paths: dict[str, Any] = {
        "/health": {"get": _op("health")}, "/v1/health": {"get": _op("health")},
        "/props": get, "/models": get, "/v1/models": get, "/slots": get, "/metrics": get,
        "/completion": {"post": _op("native completion", completion)},
        "/completions": {"post": _op("native completion", completion)},
        "/v1/completions": {"post": _op("OpenAI text completion", oai_completion)},
        "/chat/completions": {"post": _op("OpenAI chat", chat)},
        "/v1/chat/completions": {"post": _op("OpenAI chat", chat)},
        "/chat/completions/input_tokens": {"post": _op("chat prompt token count", chat)},
        "/tokenize": {"post": _op("tokenize", _body({"content": _PROMPT, "add_special": {"type": "boolean"},
                                                     "parse_special": {"type": "boolean"},
                                                     "with_pieces": {"type": "boolean"}}))},
        "/detokenize": {"post": _op("detokenize", _body({"tokens": {"type": "array",
                                                                    "items": {"type": "integer"}}}))},
        "/apply-template": {"post": _op("render a chat", _body({"messages": _MESSAGES}, ("messages",)))},
        "/slots/{id_slot}": {"post": _op("slot action", _body({"filename": {"type": "string"}}), [
            {"name": "id_slot", "in": "path", "required": True, "schema": {"type": "integer"}},
            {"name": "action", "in": "query", "required": True,
             "schema": {"type": "string", "enum": ["save", "restore", "erase"]}}])},
        "/embeddings": {"post": _op("not supported (501)", _body({"input": {"type": "string"}}))},
        "/rerank": {"post": _op("not supported (501)", _body({"query": {"type": "string"}}))},
    }
    return {"openapi": "3.0.3", "info": {"title": "slotlab serve (llama-server API)", "version": "1"},
            "paths": paths}


if __name__ == "__main__":
    json.dump(document(), sys.stdout, indent=1)
    sys.stdout.write("\n")
