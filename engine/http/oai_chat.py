"""OpenAI chat request -> completion request (`oaicompat_chat_params_parse`, server-common.cpp).

Renders `messages` with the model's chat template (jinja), maps `logprobs`/`top_logprobs` to `n_probs`, and
copies every other body key through so llama.cpp-specific parameters work on the OpenAI endpoint.
"""

from __future__ import annotations

from typing import Any

from engine.http.jsonutil import HTTPError, bad_request
from engine.core.errors import ErrorType
from engine.model.chat import ChatTemplate, TemplateError

DEFAULT_TOP_LOGPROBS = 20


def _content_text(msg: dict, i: int) -> str:
    content = msg.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}]: only text content parts are supported")
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad_request(f"messages[{i}]: 'content' must be a string, an array of parts or null")


def render_messages(body: dict, template: ChatTemplate | None, bos_token: str, eos_token: str) -> str:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("'messages' is required")
    if not isinstance(messages, list):
        raise bad_request("Expected 'messages' to be an array")
    if template is None:
        raise HTTPError(ErrorType.SERVER, "the model has no chat template")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}]: a message needs a string 'role'")
        msgs.append({**m, "content": _content_text(m, i)})
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise bad_request("'add_generation_prompt' must be a boolean")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object")
    prefill = ""
    if msgs and msgs[-1]["role"] == "assistant" and add_generation_prompt:
        # upstream's assistant prefill: the reply continues the last assistant message
        prefill = msgs.pop()["content"]
    reserved = {"messages", "add_generation_prompt", "bos_token", "eos_token"}
    try:
        prompt = template.apply(msgs, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                                eos_token=eos_token, **{k: v for k, v in kwargs.items() if k not in reserved})
    except TemplateError as e:
        raise HTTPError(ErrorType.SERVER, str(e)) from None
    return prompt + prefill


def _json_schema(body: dict) -> Any:
    """`json_schema` and `response_format` as `oaicompat_chat_params_parse` (tools/server/server-common.cpp)
    reads them: `json_object` (optionally with a `schema`), `json_schema` (its `json_schema.schema`), or
    `text`; an absent or empty schema with a JSON response format means any object."""
    schema = body.get("json_schema")
    grammar = body.get("grammar")
    if schema is not None and isinstance(grammar, str) and grammar:
        raise HTTPError(ErrorType.SERVER, "Cannot use both json_schema and grammar")
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        kind = fmt.get("type") if isinstance(fmt.get("type"), str) else ""
        if kind == "json_object":
            if "schema" in fmt or not schema:
                schema = fmt.get("schema") if fmt.get("schema") is not None else {}
        elif kind == "json_schema":
            wrapper = fmt.get("json_schema") if isinstance(fmt.get("json_schema"), dict) else {}
            schema = wrapper.get("schema") if wrapper.get("schema") is not None else {}
        elif kind not in ("", "text"):
            raise bad_request('response_format type must be one of "text" or "json_object", but got: ' + kind)
    if isinstance(schema, dict) and not schema:
        schema = {"type": "object"}
    return schema


def chat_to_completion(body: Any, template: ChatTemplate | None, bos_token: str, eos_token: str) -> dict:
    """The completion body for a chat request: `prompt` rendered, `n_probs` from logprobs/top_logprobs."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    tools = body.get("tools")
    if tools:
        raise bad_request("tools are not supported by slotlab")
    data = dict(body)
    schema = _json_schema(body)
    if schema is not None:
        data["json_schema"] = schema
    data["prompt"] = render_messages(body, template, bos_token, eos_token)
    logprobs = body.get("logprobs")
    top = body.get("top_logprobs")
    data.pop("logprobs", None)
    data.pop("top_logprobs", None)
    if logprobs is True:
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
            raise bad_request("'top_logprobs' must be an integer")
        data["n_probs"] = DEFAULT_TOP_LOGPROBS if top is None else top
    elif top is not None:
        raise bad_request("top_logprobs requires logprobs to be set to true")
    return data
