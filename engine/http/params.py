"""Completion request parameters with llama-server's names, aliases, limits and null handling.

Mirrors `server_schema::eval_llama_cmpl_schema` (server-schema.cpp) for the fields slotlab serves, and
`tokenize_input_prompts` (server-common.cpp) for prompts. Hard-limit fields raise
"Field 'X': Value must be between lo <= value <= hi, but got v" (400); soft-limit fields are clamped (done by
`SamplingParams.from_request`); JSON null means "the server default".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from engine.http.jsonutil import bad_request, json_type_name
from engine.model.grammar import (TRIGGER_TOKEN, TRIGGER_TYPE_NAMES, TRIGGER_WORD, GrammarError, GrammarTrigger,
                                  compile_trigger_patterns)
from engine.model.sampling import SamplingParams

INT32_MAX = 2**31 - 1
MSG_BAD_PROMPT = ('"prompt" elements must be a string, a list of tokens, a JSON object containing a prompt '
                  'string, or a list of mixed strings & tokens.')
MSG_NO_MTMD = "Multimodal data provided, but model does not support multimodal requests."
MSG_SAMPLER_INIT = "Failed to initialize samplers: "


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


def parse_completion_params(data: dict, defaults: ServerDefaults, *, n_vocab: int, eog_ids, tokenize,
                            tokenize_special=None) -> CompletionParams:
    """Parse and validate a request body (already a JSON object). `tokenize(str)` resolves `logit_bias` keys;
    `tokenize_special(str)` (special-token text parsed, as `common_tokenize(vocab, s, false, true)`) reads
    `preserved_tokens` and trigger words."""
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
    init_error = ""        # a sampler-init error is found after every field is read, as upstream
    try:
        p.sampling = SamplingParams.from_request(data, defaults.sampling, n_vocab=n_vocab, eog_ids=eog_ids,
                                                 tokenize=tokenize)
    except ValueError as e:
        if not str(e).startswith(MSG_SAMPLER_INIT):
            raise bad_request(str(e)) from None
        init_error = str(e)
    except (TypeError, OverflowError) as e:
        raise bad_request(f"invalid sampling parameter: {e}") from None
    lazy = _parse_lazy(data, defaults.sampling, tokenize_special or tokenize)
    if init_error:
        raise bad_request(init_error)
    p.sampling = replace(p.sampling, **lazy)
    if p.sampling.grammar and p.sampling.grammar_triggers:
        try:        # common_sampler_init compiles the trigger patterns only for a grammar
            compile_trigger_patterns(p.sampling.grammar_triggers)
        except GrammarError as e:
            raise bad_request(f"{MSG_SAMPLER_INIT}{e}") from None
    p.ignore_eos = p.sampling.ignore_eos
    p.n_probs = p.sampling.n_probs
    p.post_sampling_probs = p.sampling.post_sampling_probs
    return p


class _FieldError(ValueError):
    """An error inside one field's handler; `handle_with_catch` prefixes it with "Field 'NAME': "."""


def _json_items(value: Any) -> list:
    """What nlohmann's range-for visits: an array's elements, an object's values, a primitive itself."""
    if isinstance(value, list):
        return value
    if isinstance(value, dict):
        return list(value.values())
    return [value]


def _at(obj: Any, key: str) -> Any:
    """nlohmann's `at(key)`."""
    if not isinstance(obj, dict):
        raise _FieldError(f"[json.exception.type_error.304] cannot use at() with {json_type_name(obj)}")
    if key not in obj:
        raise _FieldError(f"[json.exception.out_of_range.403] key '{key}' not found")
    return obj[key]


def _get_int(value: Any) -> int:
    """nlohmann's `get<int>()`: numbers (a fraction truncates) and booleans."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    if isinstance(value, float):
        raise _FieldError("value must be finite")
    raise _FieldError(f"[json.exception.type_error.302] type must be number, but is {json_type_name(value)}")


def _get_str(value: Any) -> str:
    if not isinstance(value, str):
        raise _FieldError(f"[json.exception.type_error.302] type must be string, but is {json_type_name(value)}")
    return value


def _trigger(obj: Any) -> GrammarTrigger:
    """`server_grammar_trigger(const json &)` (tools/server/server-common.h): `type` (an integer, see
    `common_grammar_trigger_type`), `value`, and `token` for a token trigger."""
    kind = _get_int(_at(obj, "type"))
    value = _get_str(_at(obj, "value"))
    token = _get_int(_at(obj, "token")) if kind == TRIGGER_TOKEN else -1
    if kind not in TRIGGER_TYPE_NAMES:
        # upstream casts any integer and asserts in common_sampler_init (the server aborts): refused here
        raise _FieldError(f"unknown grammar trigger type {kind} "
                          "(expected 0 token, 1 word, 2 pattern or 3 pattern_full)")
    return GrammarTrigger(kind, value, token)


def _parse_lazy(data: dict, base: SamplingParams, tokenize_special) -> dict:
    """`grammar_lazy`, `preserved_tokens`, `grammar_triggers` as server-schema.cpp reads them, in its order.

    A preserved token is a string that tokenizes (special text parsed) to one token; other strings are
    dropped. A word trigger that is one token becomes a token trigger, and that token must be preserved.
    `grammar_lazy` with an empty `grammar_triggers` is an error (an absent one is not: the grammar then never
    fires)."""
    lazy = _bool(data, "grammar_lazy", base.grammar_lazy)
    preserved = set(base.preserved_tokens)
    triggers = list(base.grammar_triggers)
    field_name = "preserved_tokens"
    try:
        if _present(data, "preserved_tokens"):
            for item in _json_items(data["preserved_tokens"]):
                ids = tokenize_special(_get_str(item))
                if len(ids) == 1:
                    preserved.add(ids[0])
        field_name = "grammar_triggers"
        if _present(data, "grammar_triggers"):
            for item in _json_items(data["grammar_triggers"]):
                t = _trigger(item)
                if t.type == TRIGGER_WORD:
                    ids = tokenize_special(t.value)
                    if len(ids) == 1:
                        if ids[0] not in preserved:
                            raise _FieldError(f"Grammar trigger word should be marked as preserved token: {t.value}")
                        t = GrammarTrigger(TRIGGER_TOKEN, t.value, ids[0])
                triggers.append(t)
            if lazy and not triggers:
                raise _FieldError("Error: no triggers set for lazy grammar!")
    except _FieldError as e:
        raise bad_request(f"Field '{field_name}': {e}") from None
    return {"grammar_lazy": lazy, "grammar_triggers": tuple(triggers), "preserved_tokens": tuple(sorted(preserved))}


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
