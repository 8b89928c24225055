"""OpenAI chat request -> completion request (`oaicompat_chat_params_parse`, server-common.cpp).

Renders `messages` with the model's chat template (jinja), maps `logprobs`/`top_logprobs` to `n_probs`, and
copies every other body key through so llama.cpp-specific parameters work on the OpenAI endpoint, except
`grammar_lazy`, `grammar_triggers` and `preserved_tokens`, which upstream takes from the template's output.
"""

from __future__ import annotations

from typing import Any

from engine.http.jsonutil import HTTPError, bad_request
from engine.core.errors import ErrorType
from engine.model.chat import ChatTemplate, TemplateError

DEFAULT_TOP_LOGPROBS = 20


def _content_text(content: Any) -> str:
    """A message's text: a string, null, or an array of text parts (other part types need a multimodal
    model: upstream's `oaicompat_content_load_media` answers as for a model without one)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("image_url", "input_audio", "input_video", "video_url"):
            raise bad_request(f"{kind} is not supported by this server")
        else:
            raise bad_request("unsupported content[].type")
    return "\n".join(parts)


def _messages(body: dict) -> list[dict]:
    """The message checks of `oaicompat_chat_params_parse` (tools/server/server-common.cpp), in its order."""
    if "messages" not in body:
        raise bad_request("'messages' is required")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise bad_request("Expected 'messages' to be an array")
    out = []
    for m in messages:
        msg = m if isinstance(m, dict) else {}
        role = msg.get("role") if isinstance(msg.get("role"), str) else ""
        if role != "assistant" and "content" not in msg:
            raise bad_request("All non-assistant messages must contain 'content'")
        if role == "assistant" and "content" not in msg and "tool_calls" not in msg:
            raise bad_request("Assistant message must contain either 'content' or 'tool_calls'!")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request("Expected 'content' to be a string or an array")
        out.append({**msg, "role": role, "content": _content_text(content)})
    return out


def render_messages(body: dict, template: ChatTemplate | None, bos_token: str, eos_token: str) -> str:
    """The prompt of a chat request. `add_generation_prompt` (default true) and `continue_final_message`
    follow upstream: a trailing assistant message is continued (prefill, llama-server's default
    `--prefill-assistant`), which turns the generation prompt off; asking for both is a 400."""
    msgs = _messages(body)
    if template is None:
        raise HTTPError(ErrorType.SERVER, "the model has no chat template")
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):       # json_value: a value of another type is the default
        add_generation_prompt = True
    cont = body.get("continue_final_message")
    continuing = cont is True or cont in ("content", "reasoning_content")    # common_chat_continuation_parse
    if not continuing and msgs and msgs[-1]["role"] == "assistant":
        if len(msgs) >= 2 and msgs[-2]["role"] == "assistant":
            raise bad_request("Cannot have 2 or more assistant messages at the end of the list.")
        continuing, add_generation_prompt = True, False
    if continuing and add_generation_prompt:
        raise bad_request("Cannot set both add_generation_prompt and continue_final_message to true.")
    if continuing and msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
        raise bad_request("Cannot continue an assistant message that contains tool calls.")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object")
    prefill = ""
    if continuing and msgs and msgs[-1]["role"] == "assistant":
        # the reply continues the last assistant message: the template renders the conversation before it
        # with the assistant's turn opened, and the message's text follows
        prefill = msgs.pop()["content"]
        add_generation_prompt = True
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
    # upstream sets these from the chat template's output (common_chat_params), overriding the body's; a
    # template without tool calls (the only kind served here) gives no lazy grammar and no preserved tokens
    data.update({"grammar_lazy": False, "grammar_triggers": [], "preserved_tokens": []})
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
