"""HTTP handlers with llama-server's routes, shapes and error rules (`server.cpp` routes, `server_routes` in
server-context.cpp, `handle_completions_impl`, `handle_slots_*`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from engine.core import Task
from engine.core.errors import ErrorType
from engine.core.types import STOP_WORD
from engine.http import responses as R
from engine.http import slot_files
from engine.http.engine_thread import Job, JobEvent, SlotRestoreError, TextHook
from engine.http.jsonutil import HTTPError, JSONResponse, bad_request, error_body, error_response
from engine.http.metrics_text import CONTENT_TYPE as METRICS_CONTENT_TYPE
from engine.http.metrics_text import MetricsSnapshot, render
from engine.http.oai_chat import chat_to_completion, render_messages
from engine.http.params import CompletionParams, parse_completion_params, tokenize_prompts
from engine.http.sse import DONE, PING, SSE_HEADERS, SSE_MEDIA_TYPE, sse
from engine.http.state import ServerState
from engine.model.textstream import TextStream

NATIVE, OAI_CMPL, OAI_CHAT = "native", "oai_cmpl", "oai_chat"
POLL_S = 1.0               # how often a waiting handler checks for a closed connection (HTTP_POLLING_SECONDS)
SSE_PING_INTERVAL_S = 30.0


def server_of(request: Request) -> ServerState:
    return request.app.state.server


# --- request bodies -----------------------------------------------------------------------------------------

def _not_supported(what: str, flag: str) -> JSONResponse:
    """llama-server's 501 for a feature the server was not started with."""
    return error_response(ErrorType.NOT_SUPPORTED, f"This server does not support {what}. Start it with `{flag}`")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid literal '{name}'")


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number overflow parsing '{text}'")
    return value


async def read_json(request: Request) -> Any:
    """Parse the body as strict JSON; a malformed body is a 500, as upstream (`json::parse` throws)."""
    raw = await request.body()
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant, parse_float=_float)
    except (ValueError, UnicodeDecodeError) as e:
        raise HTTPError(ErrorType.SERVER, f"[json.exception.parse_error.101] parse error: {e}") from None


class ClientGone(Exception):
    """The client closed the connection while its request was waiting."""


class Waiter:
    """Takes events off a job's queue without losing one to a timeout; notices closed connections."""

    def __init__(self, job: Job, request: Request | None) -> None:
        self.job = job
        self.request = request
        self._get: asyncio.Future | None = None

    async def next(self, timeout_s: float | None = None) -> JobEvent | None:
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self._get is None:
                self._get = asyncio.ensure_future(self.job.queue.get())
            wait = POLL_S if t_end is None else max(0.0, min(POLL_S, t_end - time.monotonic()))
            done, _ = await asyncio.wait({self._get}, timeout=wait)
            if done:
                ev, self._get = self._get.result(), None
                return ev
            if self.request is not None and await self.request.is_disconnected():
                raise ClientGone()
            if t_end is not None and time.monotonic() >= t_end:
                return None

    def close(self) -> None:
        if self._get is not None:
            self._get.cancel()
            self._get = None


class SSEResponse(StreamingResponse):
    """A stream that always watches for the client going away (whatever ASGI spec version the server speaks),
    so an abandoned request is cancelled within about a second instead of at the next write."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


def _task_error(task: Task) -> JSONResponse:
    e = task.error
    return error_response(e.type, e.message, e.extra)


# --- completions --------------------------------------------------------------------------------------------

def _build_job(state: ServerState, data: Any, kind: str) -> tuple[Job, R.JobInfo, int]:
    if not isinstance(data, dict):
        raise bad_request("[json.exception.type_error.304] cannot use at() with " + type(data).__name__)
    if "prompt" not in data:
        raise bad_request("[json.exception.out_of_range.403] key 'prompt' not found")
    tok = state.tokenizer
    params = parse_completion_params(
        data, state.defaults, n_vocab=tok.n_vocab, eog_ids=tok.eog_ids,
        tokenize=lambda s: state.tokenize(s, add_special=False, parse_special=False),
        tokenize_special=lambda s: state.tokenize(s, add_special=False, parse_special=True))
    prompts = tokenize_prompts(data["prompt"], lambda s, first: state.tokenize(s, add_special=first),
                               tok.n_vocab)
    model = data.get("model") if kind != NATIVE and isinstance(data.get("model"), str) else None
    info = R.JobInfo(params, model or state.options.model_name)
    stop = tuple(params.stop)
    preserved = frozenset(params.sampling.preserved_tokens)

    def make_hook() -> TextHook:
        return TextHook(TextStream(tok, stop=stop, preserved_tokens=preserved))

    job = Job(asyncio.get_running_loop(), [], make_hook, n_cmpl=params.n_cmpl,
              return_progress=params.stream and params.return_progress,
              want_tokens=params.stream or params.n_probs > 0, params=params)
    for i, ids in enumerate(prompts):
        job.tasks.append(Task(
            id=-1, tokens=ids, n_predict=params.n_predict, id_slot=params.id_slot, cache_prompt=params.cache_prompt,
            n_keep=params.n_keep, n_discard=params.n_discard, n_cache_reuse=params.n_cache_reuse,
            ignore_eos=params.ignore_eos, n_cmpl=params.n_cmpl, sampling=params.sampling, text_hook=make_hook(),
            user=(job, i * params.n_cmpl)))
    return job, info, len(prompts) * params.n_cmpl


def _content(task: Task) -> str:
    hook = task.text_hook
    return hook.stream.generated_text if isinstance(hook, TextHook) else ""


def _probs(state: ServerState, task: Task, outs: list[R.TokenOut], info: R.JobInfo) -> list | None:
    if info.params.n_probs <= 0:
        return None
    items = R.probs_json(outs, state.tokenizer, info.params.post_sampling_probs)
    if task.stop_type == STOP_WORD and task.stopping_word:
        # upstream drops the probabilities of the stop word's tokens (non-stream)
        n = min(len(items), len(state.tokenize(task.stopping_word, parse_special=False)))
        items = items[:len(items) - n]
    return items


async def completion_endpoint(request: Request, kind: str) -> Response:
    state = server_of(request)
    body = await read_json(request)
    if kind == OAI_CHAT:
        tok = state.tokenizer
        body = chat_to_completion(body, state.chat_template, state.token_text(tok.bos_id), state.token_text(tok.eos_id))
    job, info, n_expected = _build_job(state, body, kind)
    state.engine.submit(job)
    waiter = Waiter(job, request)
    if info.params.stream:
        return await _stream(state, job, info, kind, n_expected, waiter)
    finals: dict[int, Task] = {}
    outs: dict[int, list[R.TokenOut]] = defaultdict(list)
    try:
        while len(finals) < n_expected:
            ev = await waiter.next()
            what, idx, task, payload = ev.kind, ev.index, ev.task, ev.data
            if what == "token":
                outs[idx].append(payload)
            elif what == "final":
                if task.error is not None:
                    state.engine.cancel(job)
                    return _task_error(task)
                finals[idx] = task
    except ClientGone:
        state.engine.cancel(job)
        return Response(b"", status_code=400)
    finally:
        waiter.close()
    results = [(idx, finals[idx], _content(finals[idx]), _probs(state, finals[idx], outs[idx], info))
               for idx in sorted(finals)]
    if kind == NATIVE:
        objs = [R.native_final(t, idx, info, content, state.tokenizer.detokenize(t.tokens, special=True), probs,
                               stream=False) for idx, t, content, probs in results]
        return JSONResponse(objs[0] if len(objs) == 1 else objs)
    out = R.oai_cmpl_final(results, info) if kind == OAI_CMPL else R.oai_chat_final(results, info)
    if info.params.verbose:
        # upstream's debug field: the result in the native shape (`to_json_non_oaicompat`, server-task.cpp)
        idx, t, content, probs = results[0]
        out["__verbose"] = R.native_final(t, idx, info, content, state.tokenizer.detokenize(t.tokens, special=True),
                                          probs, stream=False)
    return JSONResponse(out)


def _render(state: ServerState, ev: JobEvent, info: R.JobInfo, kind: str, role_sent: set[int]) -> list[bytes]:
    what, idx, task, payload = ev.kind, ev.index, ev.task, ev.data
    if what == "token":
        out: R.TokenOut = payload
        if not out.sendable:
            return []
        probs = R.probs_json([out], state.tokenizer, info.params.post_sampling_probs) if out.probs else None
        if kind == NATIVE:
            return [sse(R.native_partial(task, idx, info, out, probs))]
        if kind == OAI_CMPL:
            return [sse(R.oai_cmpl_chunk(idx, info, out.text, probs, None, task))]
        first = idx not in role_sent
        role_sent.add(idx)
        return [sse(c) for c in R.oai_chat_partial(task, idx, info, out, probs, first=first)]
    if what == "progress":
        if kind == NATIVE:
            res = {"index": idx, "content": "", "tokens": [], "stop": False, "id_slot": -1,
                   "tokens_predicted": 0, "tokens_evaluated": len(task.tokens)}
            if info.params.timings_per_token:       # upstream: stats on every partial with timings_per_token
                res["timings"] = R.timings(task, prompt_n=payload["processed"] - payload["cache"])
            return [sse({**res, "prompt_progress": payload})]
        if kind == OAI_CMPL:
            chunk = R.oai_cmpl_chunk(idx, info, "", None, None)
            chunk["prompt_progress"] = payload
            return [sse(chunk)]
        role_sent.add(idx)
        return [sse(c) for c in R.oai_chat_partial(task, idx, info, R.TokenOut(-1, "", 0), None, progress=payload)]
    # final
    if task.error is not None:
        e = task.error
        return [sse(error_body(e.type, e.message, e.extra))]
    if kind == NATIVE:
        return [sse(R.native_final(task, idx, info, "", state.tokenizer.detokenize(task.tokens, special=True), None,
                                   stream=True))]
    if kind == OAI_CMPL:
        return [sse(R.oai_cmpl_chunk(idx, info, "", None, R.finish_reason(task), task, with_usage=True))]
    return [sse(c) for c in R.oai_chat_stream_final(task, idx, info)]


async def _stream(state: ServerState, job: Job, info: R.JobInfo, kind: str, n_expected: int,
                  waiter: Waiter) -> Response:
    """The first event decides the status: an error before any data is a plain JSON error."""
    try:
        first = await waiter.next()
        while first.kind == "token" and not first.data.sendable:     # nothing to send yet
            first = await waiter.next()
    except ClientGone:
        waiter.close()
        state.engine.cancel(job)
        return Response(b"", status_code=400)
    if first.kind == "final" and first.task.error is not None:
        waiter.close()
        state.engine.cancel(job)
        return _task_error(first.task)
    waiter.request = None          # from here on SSEResponse watches the connection

    async def events():
        finished = False
        n_final = 0
        role_sent: set[int] = set()
        try:
            ev = first
            while True:
                if ev is None:
                    yield PING
                else:
                    for chunk in _render(state, ev, info, kind, role_sent):
                        yield chunk
                    if ev.kind == "final":
                        if ev.task.error is not None:
                            break
                        n_final += 1
                        if n_final == n_expected:
                            if kind != NATIVE:
                                yield DONE
                            finished = True
                            break
                ev = await waiter.next(SSE_PING_INTERVAL_S)
        finally:
            waiter.close()
            if not finished:
                state.engine.cancel(job)

    return SSEResponse(events(), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)


async def completion(request: Request) -> Response:
    return await completion_endpoint(request, NATIVE)


async def oai_completions(request: Request) -> Response:
    return await completion_endpoint(request, OAI_CMPL)


async def chat_completions(request: Request) -> Response:
    return await completion_endpoint(request, OAI_CHAT)


# --- simple endpoints ---------------------------------------------------------------------------------------

async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def tokenize(request: Request) -> Response:
    state = server_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    add_special = bool(body.get("add_special", False))
    parse_special = bool(body.get("parse_special", True))
    with_pieces = bool(body.get("with_pieces", False))
    content = body.get("content")
    ids: list[int] = []
    if isinstance(content, str):
        ids = state.tokenize(content, add_special=add_special, parse_special=parse_special)
    elif isinstance(content, list):
        for i, item in enumerate(content):
            if isinstance(item, str):
                ids += state.tokenize(item, add_special=add_special and i == 0, parse_special=parse_special)
            elif isinstance(item, int) and not isinstance(item, bool):
                ids.append(item)
            else:
                raise bad_request("content must be a string or an array of strings and token ids")
    elif content is not None:
        raise bad_request("content must be a string or an array of strings and token ids")
    if not with_pieces:
        return JSONResponse({"tokens": ids})
    tok = state.tokenizer
    out = []
    for t in ids:
        piece = tok.token_to_piece(t, True) if 0 <= t < tok.n_vocab else b""
        try:
            p: Any = piece.decode("utf-8")
        except UnicodeDecodeError:
            p = list(piece)
        out.append({"id": t, "piece": p})
    return JSONResponse({"tokens": out})


async def detokenize(request: Request) -> Response:
    state = server_of(request)
    body = await read_json(request)
    tokens = body.get("tokens", []) if isinstance(body, dict) else []
    if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        raise bad_request("tokens must be an array of token ids")
    tok = state.tokenizer
    if any(t < 0 or t >= tok.n_vocab for t in tokens):
        raise bad_request("tokens contain ids outside the vocabulary")
    return JSONResponse({"content": tok.detokenize(tokens, special=True)})


async def chat_input_tokens(request: Request) -> Response:
    """`/chat/completions/input_tokens`: the prompt-token count of a chat request, without running it
    (upstream's `handle_count_tokens`: the chat rendered as for a completion, then tokenized with special
    tokens)."""
    state = server_of(request)
    body = await read_json(request)
    tok = state.tokenizer
    data = chat_to_completion(body, state.chat_template, state.token_text(tok.bos_id), state.token_text(tok.eos_id))
    n = len(state.tokenize(data["prompt"], add_special=True))
    return JSONResponse({"input_tokens": n, "object": "response.input_tokens"})


async def apply_template(request: Request) -> Response:
    state = server_of(request)
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    tok = state.tokenizer
    prompt = render_messages(body, state.chat_template, state.token_text(tok.bos_id), state.token_text(tok.eos_id))
    return JSONResponse({"prompt": prompt})


def _model_meta(state: ServerState) -> dict[str, Any]:
    m = state.model
    hp = m.hparams
    return {"vocab_type": 2 if state.tokenizer.model == "gpt2" else 1, "n_vocab": hp.n_vocab,
            "n_ctx": state.core.cfg.n_ctx_slot, "n_ctx_train": hp.n_ctx_train, "n_embd": hp.n_embd,
            "n_params": m.summary.n_params, "size": m.summary.n_tensor_bytes, "ftype": m.summary.ftype_name}


def _models_json(state: ServerState) -> dict[str, Any]:
    name = state.options.model_name
    aliases = sorted(state.options.aliases)
    return {
        "models": [{"name": name, "model": name, "modified_at": "", "size": "", "digest": "", "type": "model",
                    "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                    "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                "parameter_size": "", "quantization_level": ""}}],
        "object": "list",
        "data": [{"id": name, "aliases": aliases, "tags": [], "object": "model", "created": int(time.time()),
                  "owned_by": "llamacpp", "meta": _model_meta(state)}],
    }


async def models(request: Request) -> Response:
    state = server_of(request)
    with state.lock:          # answers while asleep, from the response cached when the server fell asleep
        body = state.sleep_cache["models"] if state.sleeping else _models_json(state)
    return JSONResponse(body)


def _default_params(state: ServerState) -> CompletionParams:
    d = state.defaults
    return CompletionParams(n_predict=-1, n_keep=d.n_keep, n_cache_reuse=d.n_cache_reuse,
                            cache_prompt=d.cache_prompt, sampling=d.sampling)


async def props(request: Request) -> Response:
    state = server_of(request)
    opts = state.options
    if request.method == "POST":
        if not opts.endpoint_props:
            return _not_supported("changing global properties", "--props")
        await read_json(request)
        return JSONResponse({"success": True})
    with state.lock:          # answers while asleep, from the response cached when the server fell asleep
        data = state.sleep_cache["props"] if state.sleeping else _props_json(state)
    return JSONResponse(data)


def _props_json(state: ServerState, is_sleeping: bool = False) -> dict[str, Any]:
    opts = state.options
    tok = state.tokenizer
    return {
        "default_generation_settings": {"params": R.generation_settings(_default_params(state), only_metrics=True),
                                        "n_ctx": state.core.cfg.n_ctx_slot},
        "total_slots": state.core.cfg.n_slots,
        "model_alias": opts.model_name,
        "model_ftype": state.model.summary.ftype_name,
        "model_path": opts.model_path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": "<__media__>",
        "endpoint_slots": opts.endpoint_slots,
        "endpoint_props": opts.endpoint_props,
        "endpoint_metrics": opts.endpoint_metrics,
        "ui": False,
        "ui_settings": {},
        "chat_template": state.chat_template_source,
        "chat_template_caps": {},
        "bos_token": state.token_text(tok.bos_id),
        "eos_token": state.token_text(tok.eos_id),
        "build_info": R.BUILD_INFO,
        "is_sleeping": is_sleeping,
        "cors_proxy_enabled": False,
    }


# --- /slots -------------------------------------------------------------------------------------------------

def _slot_json(state: ServerState, slot, task: Task | None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": slot.id, "n_ctx": slot.n_ctx, "speculative": False,
                           "is_processing": slot.is_processing}
    if task is None:
        return out
    job = task.user[0] if isinstance(task.user, tuple) else None
    params = job.params if job is not None and job.params is not None else _default_params(state)
    n_predict = params.n_predict if params.n_predict != -1 else state.defaults.n_predict
    busy = slot.is_processing
    out.update({
        "id_task": task.id, "n_prompt_tokens": len(task.tokens),
        "n_prompt_tokens_processed": task.n_prompt_processed, "n_prompt_tokens_cache": task.n_prompt_cached,
        "params": R.generation_settings(params, only_metrics=True),
        "next_token": [{"has_next_token": busy, "has_new_line": busy and "\n" in _content(task),
                        "n_remain": (n_predict - task.n_decoded if n_predict != -1 else -1) if busy else -1,
                        "n_decoded": task.n_decoded if busy else 0}],
    })
    return out


async def slots(request: Request) -> Response:
    state = server_of(request)
    if not state.options.endpoint_slots:
        return _not_supported("slots endpoint", "--slots")
    core, engine = state.core, state.engine

    def snapshot():
        return [_slot_json(state, s, s.task or engine.last_task[s.id]) for s in core.slots]

    data = await asyncio.wrap_future(engine.call(snapshot))
    fail = request.query_params.get("fail_on_no_slot", "")
    if fail not in ("", "0", "false") and not any(not s["is_processing"] for s in data):
        return error_response(ErrorType.UNAVAILABLE, "no slot available")
    return JSONResponse(data)


async def slot_action(request: Request) -> Response:
    state = server_of(request)
    opts = state.options
    if not opts.slot_save_path:
        return _not_supported("slots action", "--slot-save-path")
    raw_id = request.path_params["id_slot"]
    try:
        id_slot = int(raw_id)
    except ValueError:
        raise bad_request("Invalid slot ID") from None
    if id_slot < 0:
        raise bad_request("Invalid slot ID")
    core, engine = state.core, state.engine
    sid = id_slot % len(core.slots)       # upstream's get_slot_by_id wraps around
    action = request.query_params.get("action", "")
    if action == "erase":
        n = await asyncio.wrap_future(engine.erase_slot(sid))
        return JSONResponse({"id_slot": sid, "n_erased": n})
    if action not in ("save", "restore"):
        raise bad_request("Invalid action")
    body = await read_json(request)
    if not isinstance(body, dict) or "filename" not in body:
        raise HTTPError(ErrorType.SERVER, "[json.exception.out_of_range.403] key 'filename' not found")
    filename = body["filename"]
    if not slot_files.validate_filename(filename):
        raise bad_request("Invalid filename")
    path = os.path.join(opts.slot_save_path, filename)
    t0 = time.perf_counter()
    if action == "save":
        tokens, kv_state = await asyncio.wrap_future(engine.save_slot(sid))
        data = slot_files.encode(tokens, kv_state)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return JSONResponse({"id_slot": sid, "filename": filename, "n_saved": len(tokens), "n_written": len(data),
                             "timings": {"save_ms": (time.perf_counter() - t0) * 1e3}})
    try:
        with open(path, "rb") as f:
            raw = f.read()
        sf = slot_files.decode(raw)
        n_vocab = state.tokenizer.n_vocab
        if any(t < 0 or t >= n_vocab for t in sf.tokens):
            raise slot_files.SlotFileError("the file holds token ids outside the vocabulary")
        if len(sf.tokens) > core.slots[sid].n_ctx:
            raise slot_files.SlotFileError("Restored prompt does not fit in the slot context")
        n = await asyncio.wrap_future(engine.restore_slot(sid, sf.tokens, sf.state))
    except (OSError, ValueError) as e:     # SlotFileError and SlotRestoreError are ValueErrors
        if not isinstance(e, SlotRestoreError):
            await asyncio.wrap_future(engine.erase_slot(sid))   # upstream: prompt_clear() on any error
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise bad_request(f"Unable to restore slot: {reason}") from None
    return JSONResponse({"id_slot": sid, "filename": filename, "n_restored": n, "n_read": sf.n_read,
                         "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3}})


# --- /metrics -----------------------------------------------------------------------------------------------

def _metrics_snapshot(state: ServerState, reset_bucket: bool = True) -> MetricsSnapshot:
    """The core's metrics (engine thread only). Each scrape resets the rate buckets, as upstream."""
    core, engine = state.core, state.engine
    m = core.metrics
    snap = MetricsSnapshot(
        m.n_prompt_tokens_processed_total, m.n_prompt_tokens_cached_total, m.t_prompt_processing_total_s,
        m.n_tokens_predicted_total, m.t_tokens_generation_total_s, m.n_decode_total, m.n_tokens_max,
        m.n_prompt_tokens_processed, m.t_prompt_processing_s, m.n_tokens_predicted, m.t_tokens_generation_s,
        core.n_processing, len(core.deferred), m.n_busy_slots_per_decode,
        engine.n_cancelled_prompt_tokens, engine.n_cancelled_predicted_tokens, state.n_sleeps, 0)
    if reset_bucket:
        m.reset_bucket()
    return snap


def sleep_snapshot(state: ServerState) -> dict[str, Any]:
    """What the read-only endpoints answer while the server sleeps (`update_cached_responses`): taken in the
    engine thread as the server falls asleep."""
    return {"props": _props_json(state, is_sleeping=True), "models": _models_json(state),
            "metrics": _metrics_snapshot(state, reset_bucket=False)}


async def metrics(request: Request) -> Response:
    state = server_of(request)
    if not state.options.endpoint_metrics:
        return _not_supported("metrics endpoint", "--metrics")
    with state.lock:
        if state.sleeping:
            # the metrics cached at sleep; a scrape empties their buckets (and the core's, on waking)
            snap = replace(state.sleep_cache["metrics"], n_sleeps=state.n_sleeps, is_sleeping=1)
            state.sleep_cache["metrics"] = replace(snap, n_prompt_tokens_processed=0, t_prompt_processing_s=0.0,
                                                   n_tokens_predicted=0, t_tokens_generation_s=0.0)
            state.reset_bucket_on_wake = True
            fut = None
        else:       # posted under the lock: the engine cannot fall asleep with the read waiting
            fut = state.engine.call(lambda: _metrics_snapshot(state), resets_idle=False)
    if fut is not None:
        snap = await asyncio.wrap_future(fut)
    return Response(render(snap), media_type=METRICS_CONTENT_TYPE,
                    headers={"Process-Start-Time-Unix": str(int(state.t_start_s))})


async def not_supported_embeddings(request: Request) -> Response:
    return _not_supported("embeddings", "--embeddings")


async def not_supported_rerank(request: Request) -> Response:
    return _not_supported("reranking", "--reranking")

