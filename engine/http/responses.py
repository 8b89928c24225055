"""Response bodies in llama-server's shapes and key order (`server_task_result_cmpl_final/partial::to_json*`,
`task_params::to_json`, `result_timings::to_json`, `completion_token_output::probs_vector_to_json`).
"""

from __future__ import annotations

import math
import secrets
import string
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.core.types import STOP_EOS, STOP_WORD, Task
from engine.http.jsonutil import FLT_MAX
from engine.http.params import CompletionParams
from engine.model.sampling import SampleResult, SamplingParams
from engine.model.textstream import complete_utf8_prefix_len

BUILD_INFO = "b0-slotlab"          # system_fingerprint / build_info: this is not a llama.cpp build
DRY_SEQUENCE_BREAKERS = ["\n", ":", "\"", "*"]
_ALNUM = string.ascii_letters + string.digits


def gen_chatcmplid() -> str:
    return "chatcmpl-" + "".join(secrets.choice(_ALNUM) for _ in range(32))


def f32(x: float) -> float:
    """A C++ float printed as a double (e.g. 0.8 -> 0.800000011920929), as nlohmann::json does; a double
    beyond float range becomes +-inf, as the C++ conversion does."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


@dataclass(slots=True)
class TokenOut:
    """One generated token as the front end sees it: id, the text it released, its probabilities."""

    token: int
    text: str
    n_decoded: int
    probs: SampleResult | None = None
    sendable: bool = True      # False: the token ends inside a UTF-8 character (no stream event upstream)


@dataclass(slots=True)
class JobInfo:
    """What the response builders need to know about the request besides each task's results."""

    params: CompletionParams
    model: str
    cmpl_id: str = field(default_factory=gen_chatcmplid)
    created: int = field(default_factory=lambda: int(time.time()))


# --- timings ------------------------------------------------------------------------------------------------

def timings(task: Task, prompt_n: int | None = None) -> dict[str, Any]:
    """`result_timings::to_json`; generation rates use n_gen - 1 steps (the first token comes from the prompt).
    `prompt_n`: the prompt tokens processed so far, for a progress event (upstream counts them per batch)."""
    prompt_n = task.n_prompt_processed if prompt_n is None else prompt_n
    t_start, t_prompt, t_gen = task.t_start_s, task.t_prompt_last_s, task.t_gen_last_s
    prompt_ms = max(0.0, (t_prompt - t_start) * 1e3) if t_prompt >= 0 and t_start >= 0 else 0.0
    n_gen = task.n_decoded
    predicted_ms = max(1e-3, (t_gen - t_prompt) * 1e3) if t_prompt >= 0 and t_gen >= 0 else 1e-3
    steps = n_gen - 1
    return {
        "cache_n": task.n_prompt_cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n > 0 else 0.0,
        "prompt_per_second": 1e3 / prompt_ms * prompt_n if prompt_ms > 0 else 0.0,
        "predicted_n": n_gen,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / steps if steps > 0 else 0.0,
        "predicted_per_second": 1e3 / predicted_ms * steps if steps > 0 else 0.0,
    }


# --- generation settings ------------------------------------------------------------------------------------

def generation_settings(p: CompletionParams, only_metrics: bool = False, n_predict: int | None = None) -> dict:
    """`task_params::to_json`; the only_metrics form (for /slots and /props) drops the long fields."""
    s: SamplingParams = p.sampling
    n_pred = p.n_predict if n_predict is None else n_predict
    out: dict[str, Any] = {
        "seed": s.seed, "temperature": f32(s.temperature), "dynatemp_range": f32(s.dynatemp_range),
        "dynatemp_exponent": f32(s.dynatemp_exponent), "top_k": s.top_k, "top_p": f32(s.top_p),
        "min_p": f32(s.min_p), "top_n_sigma": f32(s.top_n_sigma), "xtc_probability": f32(s.xtc_probability),
        "xtc_threshold": f32(s.xtc_threshold), "typical_p": f32(s.typical_p), "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": f32(s.repeat_penalty), "presence_penalty": f32(s.presence_penalty),
        "frequency_penalty": f32(s.frequency_penalty), "dry_multiplier": f32(s.dry_multiplier),
        "dry_base": f32(s.dry_base), "dry_allowed_length": s.dry_allowed_length,
        "dry_penalty_last_n": s.dry_penalty_last_n,
    }
    if not only_metrics:
        out["dry_sequence_breakers"] = list(DRY_SEQUENCE_BREAKERS)
    out.update({"mirostat": s.mirostat, "mirostat_tau": f32(s.mirostat_tau), "mirostat_eta": f32(s.mirostat_eta),
                "adaptive_target": f32(-1.0), "adaptive_decay": f32(0.9)})
    if not only_metrics:
        out["stop"] = list(p.stop)
    out.update({"max_tokens": n_pred, "n_predict": n_pred, "n_keep": p.n_keep, "n_discard": p.n_discard,
                "ignore_eos": s.ignore_eos, "stream": p.stream})
    if not only_metrics:
        out["logit_bias"] = [{"bias": f32(b) if math.isfinite(b) else None, "token": t} for t, b in s.logit_bias]
    out.update({"n_probs": s.n_probs, "min_keep": s.min_keep})
    if not only_metrics:
        out.update({"grammar": s.grammar_source, "grammar_lazy": s.grammar_lazy,
                    "grammar_triggers": [t.to_json() for t in s.grammar_triggers],
                    "preserved_tokens": list(s.preserved_tokens)})
    out.update({
        "chat_format": "Content-only", "reasoning_format": "auto", "reasoning_in_content": False,
        "generation_prompt": "", "samplers": list(s.samplers), "speculative.types": ["none"],
        "timings_per_token": p.timings_per_token, "post_sampling_probs": s.post_sampling_probs,
        "backend_sampling": False, "lora": [],
    })
    return out


# --- token probabilities ------------------------------------------------------------------------------------

def _piece_text(piece: bytes) -> str:
    return piece[:complete_utf8_prefix_len(piece)].decode("utf-8", errors="replace")


def _logprob(x: float | None) -> float:
    return -FLT_MAX if x is None or x == -math.inf else x


def probs_json(outs: list[TokenOut], tokenizer, post_sampling: bool) -> list[dict[str, Any]]:
    """`probs_vector_to_json`: one item per token with its top candidates (logprob, or prob if post-sampling)."""
    key, top_key = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def value(lp: float | None) -> float:
        if post_sampling:
            return 0.0 if lp is None or lp == -math.inf else math.exp(lp)
        return _logprob(lp)

    items = []
    for o in outs:
        if o.probs is None:
            continue
        piece = tokenizer.token_to_piece(o.token, False)
        top = []
        for tid, lp in o.probs.probs or ():
            tp = tokenizer.token_to_piece(tid, False)
            top.append({"id": tid, "token": _piece_text(tp), "bytes": list(tp), key: value(lp)})
        items.append({"id": o.token, "token": _piece_text(piece), "bytes": list(piece), key: value(o.probs.logprob),
                      top_key: top})
    return items


# --- native /completion -------------------------------------------------------------------------------------

def native_final(task: Task, index: int, info: JobInfo, content: str, prompt_text: str, probs: list | None,
                 stream: bool) -> dict[str, Any]:
    p = info.params
    res: dict[str, Any] = {
        "index": index,
        "content": content,
        "tokens": list(task.generated) if (p.return_tokens and not stream) else [],
        "id_slot": task.slot_id,
        "stop": True,
        "model": info.model,
        "tokens_predicted": task.n_decoded,
        "tokens_evaluated": len(task.tokens),
        "generation_settings": generation_settings(p),
        "prompt": prompt_text,
        "has_new_line": "\n" in content,
        "truncated": task.truncated,
        "stop_type": task.stop_type,
        "stopping_word": task.stopping_word,
        "tokens_cached": task.n_tokens_cached,
        "timings": timings(task),
    }
    if not stream and probs:
        res["completion_probabilities"] = probs
    return select_fields(res, p.response_fields) if p.response_fields else res


def native_partial(task: Task, index: int, info: JobInfo, out: TokenOut, probs: list | None) -> dict[str, Any]:
    res: dict[str, Any] = {
        "index": index, "content": out.text, "tokens": [out.token], "stop": False, "id_slot": -1,
        "tokens_predicted": out.n_decoded, "tokens_evaluated": len(task.tokens),
    }
    if info.params.timings_per_token:
        res["timings"] = timings(task)
    if probs:
        res["completion_probabilities"] = probs
    return res


def progress_json(task: Task, processed: int, now_s: float) -> dict[str, Any]:
    t0 = task.t_start_s if task.t_start_s >= 0 else now_s
    return {"total": len(task.tokens), "cache": task.n_prompt_cached, "processed": processed,
            "time_ms": max(0.0, (now_s - t0) * 1e3)}


def select_fields(res: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """`json_get_nested_values`: keep the listed fields; "a/b" is looked up nested, stored under "a/b"."""
    out: dict[str, Any] = {}
    for path in fields:
        cur: Any = res
        ok = True
        for part in path.split("/"):
            if isinstance(cur, dict) and part in cur:
                cur = cur[part]
            else:
                ok = False
                break
        if ok:
            out[path] = cur
    return out


# --- OpenAI-compatible --------------------------------------------------------------------------------------

def finish_reason(task: Task) -> str:
    return "stop" if task.stop_type in (STOP_EOS, STOP_WORD) else "length"


def usage(tasks: list[Task]) -> dict[str, Any]:
    n_gen = sum(t.n_decoded for t in tasks)
    n_prompt = sum(len(t.tokens) for t in tasks)
    return {"completion_tokens": n_gen, "prompt_tokens": n_prompt, "total_tokens": n_gen + n_prompt,
            "prompt_tokens_details": {"cached_tokens": sum(t.n_prompt_cached for t in tasks)}}


def oai_cmpl_final(results: list[tuple[int, Task, str, list | None]], info: JobInfo) -> dict[str, Any]:
    """Non-stream /v1/completions; several results (n > 1, several prompts) merge their choices."""
    choices = [{"text": content, "index": idx,
                "logprobs": {"content": probs} if probs else None,
                "finish_reason": finish_reason(task)} for idx, task, content, probs in results]
    first = results[0][1]
    return {"choices": choices, "created": info.created, "model": info.model, "system_fingerprint": BUILD_INFO,
            "object": "text_completion", "usage": usage([r[1] for r in results]), "id": info.cmpl_id,
            "timings": timings(first)}


def oai_cmpl_chunk(index: int, info: JobInfo, text: str, probs: list | None, finish: str | None,
                   task: Task | None = None, with_usage: bool = False) -> dict[str, Any]:
    res: dict[str, Any] = {
        "choices": [{"text": text, "index": index, "logprobs": {"content": probs} if probs else None,
                     "finish_reason": finish}],
        "created": info.created, "model": info.model, "system_fingerprint": BUILD_INFO,
        "object": "text_completion",
    }
    if with_usage and task is not None:
        res["usage"] = usage([task])
    res["id"] = info.cmpl_id
    if task is not None and (finish is not None or info.params.timings_per_token):
        res["timings"] = timings(task)
    return res


def oai_chat_final(results: list[tuple[int, Task, str, list | None]], info: JobInfo) -> dict[str, Any]:
    choices = []
    for idx, task, content, probs in results:
        choice: dict[str, Any] = {"finish_reason": finish_reason(task), "index": idx,
                                  "message": {"role": "assistant", "content": content}}
        if probs:
            choice["logprobs"] = {"content": probs}
        choices.append(choice)
    first = results[0][1]
    return {"choices": choices, "created": info.created, "model": info.model, "system_fingerprint": BUILD_INFO,
            "object": "chat.completion", "usage": usage([r[1] for r in results]), "id": info.cmpl_id,
            "timings": timings(first)}


def _chat_chunk(index: int, info: JobInfo, delta: dict, finish: str | None) -> dict[str, Any]:
    return {"choices": [{"finish_reason": finish, "index": index, "delta": delta}], "created": info.created,
            "id": info.cmpl_id, "model": info.model, "system_fingerprint": BUILD_INFO,
            "object": "chat.completion.chunk"}


def oai_chat_partial(task: Task, index: int, info: JobInfo, out: TokenOut, probs: list | None,
                     progress: dict | None = None, first: bool = False) -> list[dict[str, Any]]:
    """One token's chunks: the first chunk of a choice also sends the role delta; empty text sends no
    content delta. (Upstream keys the role delta on n_decoded == 1, so it is lost when the first token ends
    inside a UTF-8 character; here it goes with the first chunk actually sent.)"""
    chunks = []
    if first or progress is not None:
        chunks.append(_chat_chunk(index, info, {"role": "assistant", "content": None}, None))
    if out.text:
        chunks.append(_chat_chunk(index, info, {"content": out.text}, None))
    if chunks:
        last = chunks[-1]
        if probs:
            last["choices"][0]["logprobs"] = {"content": probs}
        if info.params.timings_per_token:
            last["timings"] = timings(task)
        if progress is not None:
            last["prompt_progress"] = progress
    return chunks


def oai_chat_stream_final(task: Task, index: int, info: JobInfo) -> list[dict[str, Any]]:
    chunks = [_chat_chunk(index, info, {}, finish_reason(task))]
    if info.params.include_usage:
        chunks.append({"choices": [], "created": info.created, "id": info.cmpl_id, "model": info.model,
                       "system_fingerprint": BUILD_INFO, "object": "chat.completion.chunk",
                       "usage": usage([task])})
    chunks[-1]["timings"] = timings(task)
    return chunks
