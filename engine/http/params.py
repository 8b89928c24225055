"""Completion request parameters with llama-server's names, aliases, limits and null handling.

Mirrors `server_schema::eval_llama_cmpl_schema` (server-schema.cpp) for the fields slotlab serves, and
`tokenize_input_prompts` (server-common.cpp) for prompts. Hard-limit fields raise
"Field 'X': Value must be between lo <= value <= hi, but got v" (400); soft-limit fields are clamped (done by
`SamplingParams.from_request`); JSON null means "the server default".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.http.jsonutil import bad_request, json_type_name
from engine.model.sampling import SamplingParams

INT32_MAX = 2**31 - 1
MSG_BAD_PROMPT = ('"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt '
                  'string, or a list of mixed strings & tokens.')
MSG_NO_MTMD = "Multimodal data provided, but model does not support multimodal requests."


@dataclass(slots=True)
class CompletionParams:
    """Everything a completion request asks for, besides its prompt(s)."""

    n_predict: int = -1
    n_keep: int = 0
    n_discard: int = 0
    n_cmpl: int = 1
    n_cache_reuse: int = 0
    cache_prompt: bool = True
    id_slot: int = -1
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    return_tokens: bool = False
    return_progress: bool = False
    timings_per_token: bool = False
    post_sampling_probs: bool = False
    n_probs: int = 0
    verbose: bool = False
    stop: list[str] = field(default_factory=list)
    response_fields: list[str] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True, slots=True)
class ServerDefaults:
    """Per-request defaults that come from the command line (`params_base`)."""

    n_predict: int = -1
    n_keep: int = 0
    n_cache_reuse: int = 0
    cache_prompt: bool = True
    n_parallel: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    verbose: bool = False        # started with -v/--verbose: responses carry `__verbose` unless asked not to


def _present(data: dict, name: str) -> bool:
    return data.get(name) is not None


def _as_int(name: str, value: Any) -> int:
    # nlohmann's get<int>() accepts numbers (floats truncate) and booleans
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise bad_request(f"Field '{name}': value must be finite")
        return int(value)
    raise bad_request(f"Field '{name}': [json.exception.type_error.302] type must be number, "
                      f"but is {json_type_name(value)}")


def _hard_int(data: dict, names: tuple[str, ...], lo: int, hi: int, default: int) -> int:
    for name in names:
        if _present(data, name):
            v = _as_int(name, data[name])
            if v < lo or v > hi:
                raise bad_request(f"Field '{name}': Value must be between {lo} <= value <= {hi}, but got {v}")
            return v
    return default


def _bool(data: dict, name: str, default: bool) -> bool:
    if not _present(data, name):
        return default
    v = data[name]
    if not isinstance(v, bool):
        raise bad_request(f"Field '{name}': [json.exception.type_error.302] type must be boolean, "
                          f"but is {json_type_name(v)}")
    return v


def _stop(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list):
        out = []
        for w in value:
            if not isinstance(w, str):
                raise bad_request(f"Field 'stop': [json.exception.type_error.302] type must be string, "
                                  f"but is {json_type_name(w)}")
            if w:
                out.append(w)
        return out
    return []


def parse_completion_params(data: dict, defaults: ServerDefaults, *, n_vocab: int, eog_ids, tokenize) -> CompletionParams:
    """Parse and validate a request body (already a JSON object)."""
    p = CompletionParams()
    p.verbose = _bool(data, "verbose", defaults.verbose)
    p.timings_per_token = _bool(data, "timings_per_token", False)
    p.stream = _bool(data, "stream", False)
    opts = data.get("stream_options")
    if isinstance(opts, dict):
        p.include_usage = _bool(opts, "include_usage", False)
    p.cache_prompt = _bool(data, "cache_prompt", defaults.cache_prompt)
    p.return_tokens = _bool(data, "return_tokens", False)
    p.return_progress = _bool(data, "return_progress", False)
    _hard_int(data, ("sse_ping_interval",), -1, INT32_MAX, 30)
    p.n_predict = _hard_int(data, ("n_predict", "max_completion_tokens", "max_tokens"), -1, INT32_MAX,
                            defaults.n_predict)
    _hard_int(data, ("n_indent",), 0, INT32_MAX, 0)
    p.n_keep = _hard_int(data, ("n_keep",), -1, INT32_MAX, defaults.n_keep)
    p.n_discard = _hard_int(data, ("n_discard",), 0, INT32_MAX, 0)
    p.n_cmpl = _hard_int(data, ("n_cmpl", "n"), 1, defaults.n_parallel, 1)
    p.n_cache_reuse = _hard_int(data, ("n_cache_reuse",), 0, INT32_MAX, defaults.n_cache_reuse)
    _hard_int(data, ("t_max_predict_ms",), -1, 2**63 - 1, -1)
    rf = data.get("response_fields")
    if isinstance(rf, list) and all(isinstance(x, str) for x in rf):
        p.response_fields = list(rf)
    id_slot = data.get("id_slot")
    # json_value(): a value of the wrong type falls back to the default
    p.id_slot = id_slot if isinstance(id_slot, int) and not isinstance(id_slot, bool) else -1
    if _present(data, "stop"):
        p.stop = _stop(data["stop"])
    try:
        p.sampling = SamplingParams.from_request(data, defaults.sampling, n_vocab=n_vocab, eog_ids=eog_ids,
                                                 tokenize=tokenize)
    except ValueError as e:
        raise bad_request(str(e)) from None
    except (TypeError, OverflowError) as e:
        raise bad_request(f"invalid sampling parameter: {e}") from None
    p.ignore_eos = p.sampling.ignore_eos
    p.n_probs = p.sampling.n_probs
    p.post_sampling_probs = p.sampling.post_sampling_probs
    return p


def tokenize_prompts(prompt: Any, tokenize, n_vocab: int) -> list[list[int]]:
    """`tokenize_input_prompts` (tools/server/server-common.cpp): the prompt shapes upstream accepts.

    - `"text"`, `[12, 34, 56]`, `[12, "text", 56]` (mixed), `{"prompt_string": ...}` (either of those
      inside): one prompt;
    - an array with no integer in it: one prompt per element, each of the shapes above.
    Strings get special tokens only in the first position (BOS when the vocab adds it) and parse
    special-token text. A shape upstream refuses is a 400 with its message (`handle_completions_impl`
    answers every tokenization exception as an invalid request); `multimodal_data` gets upstream's answer
    for a model without a multimodal projector. Ids outside the vocabulary raise 400 "Prompt contains
    invalid tokens" (upstream checks this when launching the slot).
    """
    if isinstance(prompt, list) and not any(_is_int(x) for x in prompt):
        prompts = [_subprompt(p, tokenize) for p in prompt]
    else:
        prompts = [_subprompt(prompt, tokenize)]
    if not prompts:
        raise bad_request('"prompt" must not be empty')
    for ids in prompts:
        if any(t < 0 or t >= n_vocab for t in ids):
            raise bad_request("Prompt contains invalid tokens")
    return prompts


def _is_int(x: Any) -> bool:
    """nlohmann's is_number_integer: a JSON integer (not a bool, not a number with a fraction or exponent)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _subprompt(p: Any, tokenize) -> list[int]:
    """`tokenize_input_subprompt`: one prompt of any accepted shape."""
    if isinstance(p, str) or (isinstance(p, list) and any(isinstance(x, str) for x in p)
                              and any(_is_int(x) for x in p)):
        return _mixed(p if isinstance(p, list) else [p], tokenize)
    if isinstance(p, list) and all(_is_int(x) for x in p):
        return list(p)
    if isinstance(p, dict) and "prompt_string" in p:
        if "multimodal_data" in p:
            raise bad_request(MSG_NO_MTMD)
        inner = p["prompt_string"]
        if not isinstance(inner, (str, list)):
            raise bad_request(f"[json.exception.type_error.302] type must be string, but is {json_type_name(inner)}")
        return _mixed(inner if isinstance(inner, list) else [inner], tokenize)
    raise bad_request(MSG_BAD_PROMPT)


def _mixed(items: list, tokenize) -> list[int]:
    """A list of strings and token ids; only a string in the first position gets special tokens."""
    out: list[int] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.extend(tokenize(item, i == 0))
        elif _is_num(item):
            if isinstance(item, float) and not math.isfinite(item):
                raise bad_request(MSG_BAD_PROMPT)
            out.append(int(item))
        else:
            raise bad_request(MSG_BAD_PROMPT)
    return out
