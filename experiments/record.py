"""`slotlab record`: a reverse proxy in front of a llama-server compatible server that records its traffic as a
native trace (docs/traces.md §3, "Recorded traffic"), for `slotlab simulate --trace` and `slotlab validate
--recorded`.

Every request is forwarded as it came (method, path and query as sent, headers except hop-by-hop ones, body)
and every response is sent back as it came; streamed responses go through HTTP chunk by HTTP chunk, each as
soon as it is in. Two proxies: the default, an HTTP-aware byte relay (experiments/record_relay.py,
`--proxy relay`), and this module's plain ASGI app on uvicorn (httptools, uvloop) with one aiohttp keep-alive
pool to the upstream (`--proxy asgi`); both record through this module's `Recorder`. The CPU a proxy spends
per request is what it adds to each request's latency on a busy machine (benchmarks/bench_record_proxy.py
measures both, docs/cli.md "Cost"). The one change: a native
non-stream `/completion` that does not ask for `return_tokens` is sent with `"return_tokens": true` (and
without `Accept-Encoding`), and the token ids are blanked out of the answer again (`"tokens":[]`, exactly
what the client would have received), so the generated ids are recorded without the client seeing a difference.

For each completion request (`/completion`, `/completions`, `/v1/completions`, `/chat/completions`,
`/v1/chat/completions`) that the upstream answered with 200, one JSON line is written and flushed as the
request ends (lines are therefore in end order; the header says `"line_order": "end"`): the arrival time
(seconds since the recorder started), the prompt token ids (from the request when it gives ids; else from
the upstream's `/tokenize`, and for chat from `/apply-template` then `/tokenize`, both asked after the
client has its answer), the generated token ids when the response carries them (native endpoints), the
request's generation parameters, and what the upstream answered (`timings`, slot, cached tokens, stop type,
end time). A killed recorder loses at most the requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:                          # dependencies of the project; an environment installed before them still runs
    import aiohttp            # every other command, and `record` says what to install
    import yarl
except ImportError as _e:     # pragma: no cover - depends on the environment
    aiohttp = yarl = None
    MISSING = f"{_e.name} is not installed (pip install -e . installs the project's dependencies)"
else:
    MISSING = None


NATIVE, OAI_CMPL, OAI_CHAT = "native", "oai_cmpl", "oai_chat"
# RFC 9110 §7.6.1 hop-by-hop headers, plus the ones the client library sets itself
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                        b"trailer", b"trailers", b"transfer-encoding", b"upgrade", b"proxy-connection"})
DROP_REQUEST = HOP_BY_HOP | {b"host", b"content-length"}
DROP_RESPONSE = HOP_BY_HOP | {b"content-length"}
AUTH_HEADERS = ("authorization", "x-api-key")
# the headers aiohttp would add of its own; the client's (if any) are forwarded instead
NO_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
# the request fields that shape a generation (llama-server's params_from_json_cmpl), recorded as sent
SAMPLING_KEYS = frozenset({
    "n_predict", "max_tokens", "max_completion_tokens", "temperature", "dynatemp_range", "dynatemp_exponent",
    "top_k", "top_p", "min_p", "top_n_sigma", "typical_p", "xtc_probability", "xtc_threshold", "repeat_last_n",
    "repeat_penalty", "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base", "dry_allowed_length",
    "dry_penalty_last_n", "dry_sequence_breakers", "mirostat", "mirostat_tau", "mirostat_eta", "seed",
    "ignore_eos", "logit_bias", "stop", "n_probs", "logprobs", "top_logprobs", "min_keep", "samplers",
    "grammar", "json_schema", "response_format", "stream", "return_tokens", "cache_prompt", "id_slot", "n_keep",
    "n_discard", "n_cache_reuse", "n_cmpl", "n"})
# "tokens":[...] at a key position: a quote inside a JSON string is escaped, so an unescaped '"tokens":['
# only occurs as a key (the value of "tokens" is a list of integers). What `blank_tokens` empties, as one
# pattern; it searches for the literal key first (bytes.find), about 15x faster than this pattern's `sub`.
TOKENS_FIELD = re.compile(rb'((?<!\\)"tokens"\s*:\s*\[)[-0-9,\s]*(\])')
TOKENS_KEY = b'"tokens"'
TOKENS_REST = re.compile(rb'\s*:\s*\[([-0-9,\s]*)\]')
INFLIGHT_WAIT_S = 10.0
RECORDING_WORKERS = 1          # recordings in progress at once, while they keep up with the traffic ...
RECORDING_BACKLOG = 64         # ... and one more per this many waiting (up to RECORDING_WORKERS_MAX)
RECORDING_WORKERS_MAX = 8
CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_S = 4.0
UPSTREAM_ERRORS = (aiohttp.ClientError if aiohttp else OSError, asyncio.TimeoutError, OSError)
# what aiohttp raises when a kept-alive connection was closed under a request that had no answer yet
RESEND_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) if aiohttp else ()
NOT_RESENT = (aiohttp.ClientConnectorError,) if aiohttp else ()     # no connection at all: the upstream is down


class Answer:
    """An upstream answer's status and raw headers (as sent), as `Recorder.finish_later` reads them."""

    __slots__ = ("status_code", "headers")

    def __init__(self, status_code: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status_code = status_code
        self.headers = headers

    def header(self, name: bytes, default: str = "") -> str:
        """The first header called `name` (lower case), decoded."""
        return next((v.decode("latin-1") for k, v in self.headers if k.lower() == name), default)


class Upstream(Answer):
    """The ASGI proxy's upstream answer: an `Answer` and the aiohttp response for its body."""

    __slots__ = ("raw",)

    def __init__(self, raw: aiohttp.ClientResponse) -> None:
        super().__init__(raw.status, raw.raw_headers)
        self.raw = raw


def endpoint_kind(method: str, path: str) -> str | None:
    """Which completion endpoint a request path is (any --api-prefix in front), or None (forwarded only)."""
    if method != "POST":
        return None
    if path.endswith("/v1/chat/completions") or path.endswith("/chat/completions"):
        return OAI_CHAT
    if path.endswith("/v1/completions"):
        return OAI_CMPL
    if path.endswith("/completion") or path.endswith("/completions"):
        return NATIVE
    return None


def split_prompts(prompt: Any) -> list[Any]:
    """A `prompt` field as upstream's `tokenize_input_prompts` reads it: a string, a list of ids or a mixed
    list of ids and strings is one prompt; any other list is a list of prompts."""
    if isinstance(prompt, list) and prompt and not any(isinstance(p, (int, float)) and not isinstance(p, bool)
                                                       for p in prompt):
        return list(prompt)
    return [prompt]


def all_ints(xs: list) -> bool:
    """Every item is an int (not a bool): one C-level pass (map, set) instead of a Python-level loop."""
    return set(map(type, xs)) <= {int}


def prompt_ids(prompt: Any) -> list[int] | None:
    """The ids of a prompt given as token ids, else None (it needs the upstream's tokenizer)."""
    if isinstance(prompt, list) and all_ints(prompt):
        return list(prompt)
    return None


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k in SAMPLING_KEYS}
    for alias in ("max_tokens", "max_completion_tokens"):
        if "n_predict" not in out and isinstance(out.get(alias), int) and not isinstance(out[alias], bool):
            out["n_predict"] = out[alias]
    if type(out.get("n_predict")) is not int:
        out.pop("n_predict", None)
    return out


def inject_return_tokens(raw: bytes, body: dict[str, Any]) -> bytes:
    """The request body with `"return_tokens": true`; byte-for-byte the client's otherwise when the field was
    absent (inserted after the opening brace), re-serialized only when the client sent it false."""
    if "return_tokens" in body:
        return json.dumps({**body, "return_tokens": True}, ensure_ascii=False).encode("utf-8")
    i = raw.index(b"{") + 1
    rest = raw[i:]
    sep = b"" if rest.lstrip().startswith(b"}") else b","
    return raw[:i] + b'"return_tokens":true' + sep + rest


def pending_of(method: str, path: str, raw: bytes, arrival_s: float,
               auth: Callable[[], list[tuple[str, str]]]) -> tuple[Pending | None, bytes]:
    """What both proxies decide for a request: its recording (None when it is not a completion request with a
    JSON object body) and the body to forward, with `"return_tokens": true` injected (`Pending.injected`; the
    proxy then drops `Accept-Encoding` and blanks the ids of the answer) for a native non-stream `/completion`
    that does not ask for the ids itself. `auth()`: the request's `Authorization` / `X-Api-Key` headers."""
    kind = endpoint_kind(method, path)
    if kind is None:
        return None, raw
    try:
        body = json.loads(raw)
    except ValueError:
        return None, raw
    if not isinstance(body, dict):
        return None, raw
    pending = Pending(kind, path, body, arrival_s, auth())
    if (kind == NATIVE and not pending.stream and body.get("return_tokens") is not True
            and not body.get("response_fields")):
        raw = inject_return_tokens(raw, body)
        pending.injected = True
    return pending, raw


def resendable(e: BaseException) -> bool:
    """An aiohttp error of a kept-alive connection the upstream closed under a request that had no answer yet
    (not a connection that could not be opened: the upstream is down)."""
    return isinstance(e, RESEND_ERRORS) and not isinstance(e, NOT_RESENT)


def bad_gateway_body(upstream: str, method: str, path: str, what: str) -> bytes:
    """The 502 answer's body (llama-server's error JSON) when the upstream did not answer."""
    return json.dumps({"error": {
        "code": 502, "type": "unavailable_error",
        "message": f"slotlab record: the upstream {upstream} did not answer {method} {path} ({what})"}}).encode()


def blank_tokens(raw: bytes) -> bytes:
    """A native response with every `"tokens":[ids]` emptied (`TOKENS_FIELD.sub(rb"\1\2", raw)`): what the
    client gets without return_tokens."""
    out = []
    done = 0                                         # raw[:done] is in out
    at = raw.find(TOKENS_KEY)
    while at >= 0:
        m = TOKENS_REST.match(raw, at + len(TOKENS_KEY)) if at == 0 or raw[at - 1] != 0x5C else None   # '\\'
        if m is None:
            at = raw.find(TOKENS_KEY, at + 1)
            continue
        out.append(raw[done:m.start(1)])
        done = m.end(1)
        at = raw.find(TOKENS_KEY, m.end())
    if not out:
        return raw
    out.append(raw[done:])
    return b"".join(out)


class SSETap:
    """Keeps the chunks of a server-sent-event stream as they pass through (a list append per chunk), and parses
    them once, after the stream ended (`events`): the JSON value of every `data:` line of every complete
    event (one that a blank line ended; chunks may cut events anywhere; LF or CRLF line ends)."""

    __slots__ = ("chunks",)

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def feed(self, chunk: bytes) -> None:
        self.chunks.append(chunk)

    def events(self) -> list[Any]:
        buf = b"".join(self.chunks).replace(b"\r\n", b"\n")
        out: list[Any] = []
        for line in buf[:max(0, buf.rfind(b"\n\n"))].split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data and data != b"[DONE]":
                    try:
                        out.append(json.loads(data))
                    except ValueError:
                        pass
        return out


class Pending:
    """One completion request on its way: what the recorder needs when it ends."""

    __slots__ = ("kind", "path", "body", "arrival_s", "stream", "injected", "auth", "first_byte_s")

    def __init__(self, kind: str, path: str, body: dict[str, Any], arrival_s: float, auth: list) -> None:
        self.kind = kind
        self.path = path
        self.body = body
        self.arrival_s = arrival_s
        self.stream = bool(body.get("stream"))
        self.injected = False
        self.auth = auth
        self.first_byte_s: float | None = None


class Recorder:
    """The proxy (an ASGI app) and the trace writer. All its work runs on the event loop."""

    def __init__(self, upstream: str, out: str | Path, *, log=None) -> None:
        if MISSING:
            raise RuntimeError(f"slotlab record: {MISSING}")
        self.upstream = upstream.rstrip("/")
        self.out_path = Path(out)
        self.t0 = time.monotonic()
        self.started_unix = time.time()
        self.stats: Counter[str] = Counter()
        self.log = log or (lambda msg: print(f"slotlab record: {msg}", file=sys.stderr))
        self._warned: set[str] = set()
        self._queue: asyncio.Queue | None = None          # recordings waiting for a worker
        self._workers: list[asyncio.Task] = []
        self._file = None
        self.client: aiohttp.ClientSession | None = None
        self.app = self

    # --- lifecycle ------------------------------------------------------------------------------------------
    def open(self) -> None:
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.out_path, "w", encoding="utf-8")
        self._write({"slotlab_native": 1, "origin_format": "recorded", "origin_source": self.upstream,
                     "line_order": "end", "recorder": "slotlab record", "started_unix": self.started_unix})

    async def start_client(self) -> None:
        """The client for the upstream (the ASGI proxy's forwards; every proxy's /tokenize and /apply-template
        calls), and the trace file if not open yet."""
        # aiohttp's client: a C HTTP parser and a keep-alive pool that does not poll every pooled socket
        # per request; about a third of httpcore's CPU per exchange (benchmarks/bench_record_proxy.py).
        # The pool has no size limit (as many upstream connections as requests in flight), gives idle
        # connections back before cpp-httplib's 5 s keep-alive would close them under a request, sends
        # only the client's headers (no User-Agent, Accept, ... of its own), keeps no cookies and follows
        # no redirect.
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S), auto_decompress=False,
            skip_auto_headers=NO_AUTO_HEADERS, cookie_jar=aiohttp.DummyCookieJar(), trust_env=False,
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S))
        if self._file is None:
            self.open()
        self._queue = asyncio.Queue()
        self._workers = [asyncio.get_running_loop().create_task(self._worker()) for _ in range(RECORDING_WORKERS)]

    async def stop_client(self) -> None:
        """Let the recordings in progress end (up to INFLIGHT_WAIT_S), then close the client."""
        if self._queue is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._queue.join(), INFLIGHT_WAIT_S)
            left = self._queue.qsize()
            if left:
                self.stats["not_recorded_shutdown"] += left
        for w in self._workers:
            w.cancel()
        if self._workers:
            await asyncio.gather(*self._workers, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    async def _worker(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                await self._finish(*item)
            finally:
                self._queue.task_done()

    async def _lifespan(self, receive, send) -> None:
        await receive()                                            # lifespan.startup
        try:
            await self.start_client()
        except Exception as e:  # noqa: BLE001 - uvicorn reports it and exits
            await send({"type": "lifespan.startup.failed", "message": f"{type(e).__name__}: {e}"})
            return
        await send({"type": "lifespan.startup.complete"})
        await receive()                                            # lifespan.shutdown
        await self.stop_client()
        self.close()
        await send({"type": "lifespan.shutdown.complete"})

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()

    def warn_once(self, key: str, msg: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log(f"warning: {msg}")

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- the proxy ------------------------------------------------------------------------------------------
    async def __call__(self, scope, receive, send) -> None:
        """The ASGI app (`app` is the recorder itself). A plain one, no framework: a proxy has one route, and
        every layer would cost CPU on every request and every streamed chunk."""
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self._lifespan(receive, send)
            return
        arrival = self.now()
        parts = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return                                             # the client left before its body ended
            parts.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        raw = b"".join(parts)
        method, path = scope["method"], scope["path"]
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                   if k.lower() not in DROP_REQUEST]
        pending, raw = pending_of(method, path, raw, arrival,
                                  lambda: [(k, v) for k, v in headers if k.lower() in AUTH_HEADERS])
        if pending is not None and pending.injected:
            headers = [(k, v) for k, v in headers if k.lower() != "accept-encoding"]
        # the path and query as the client sent them (still percent-encoded)
        target = scope.get("raw_path") or path.encode()
        query = scope["query_string"]
        url = yarl.URL(self.upstream + target.decode("latin-1") + ("?" + query.decode("latin-1") if query else ""),
                       encoded=True)
        for attempt in (1, 2):
            try:
                up = Upstream(await self.client.request(method, url, data=raw or None, headers=headers,
                                                        allow_redirects=False))
                break
            except UPSTREAM_ERRORS as e:
                if attempt == 1 and resendable(e):
                    # a pooled connection the upstream closed as the request went out, before any answer:
                    # sent once more (on a new connection; the failed one left the pool), as the relay does
                    # (experiments/record_relay.py, `ClientConn.upstream_broke`)
                    self.stats["upstream_resent"] += 1
                    continue
                return await self._bad_gateway(send, method, path, e)
        out_headers = [(k, v) for k, v in up.headers if k.lower() not in DROP_RESPONSE]
        if up.header(b"content-type").startswith("text/event-stream"):
            return await self._stream(up, out_headers, pending, receive, send)
        try:
            original = await up.raw.read()                  # as sent (auto_decompress off: any encoding kept)
        except UPSTREAM_ERRORS as e:
            up.raw.close()
            return await self._bad_gateway(send, method, path, e)
        content = original
        if pending is not None and pending.injected and up.status_code == 200:
            content = blank_tokens(original)
        await send({"type": "http.response.start", "status": up.status_code,
                    "headers": out_headers + [(b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})
        if pending is not None:
            self.finish_later(pending, up, None, original, self.now())

    async def _bad_gateway(self, send, method: str, path: str, e: BaseException) -> None:
        self.stats["upstream_errors"] += 1
        body = bad_gateway_body(self.upstream, method, path, f"{type(e).__name__}: {e or 'no details'}")
        await send({"type": "http.response.start", "status": 502,
                    "headers": [(b"content-type", b"application/json; charset=utf-8"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, up: "Upstream", out_headers: list, pending: Pending | None, receive, send) -> None:
        """Relay an event stream chunk by chunk; a client that hangs up ends it at once (the upstream
        connection is closed, as upstream's handler stops a task whose client is gone)."""
        await send({"type": "http.response.start", "status": up.status_code, "headers": out_headers})
        relay = asyncio.ensure_future(self._relay(up, pending, send))
        gone = asyncio.ensure_future(receive())                  # http.disconnect: the client hung up
        try:
            await asyncio.wait((relay, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not relay.done():
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay
        if not relay.cancelled():
            relay.result()                                       # an upstream error mid-stream: raised

    async def _relay(self, up: "Upstream", pending: Pending | None, send) -> None:
        tap = SSETap() if pending is not None else None
        complete = False
        try:
            # the upstream's HTTP chunks one by one, each as soon as it is in (several that came in one read
            # are not merged: each streamed event reaches the client as the upstream framed it)
            async for chunk, _ in up.raw.content.iter_chunks():
                if not chunk:
                    continue
                if tap is not None:
                    if pending.first_byte_s is None:
                        pending.first_byte_s = self.now()
                    tap.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            complete = True
        finally:
            if complete:
                up.raw.release()                 # the connection goes back to the pool
            else:
                up.raw.close()                   # cut mid-body: the connection is not reused
            if pending is not None:
                if complete:
                    self.finish_later(pending, up, tap, None, self.now())
                else:
                    self.stats["not_recorded_interrupted"] += 1
        await send({"type": "http.response.body", "body": b""})

    # --- recording (after the client has its answer) ----------------------------------------------------------
    def finish_later(self, pending: Pending, up: Answer, tap: SSETap | None, content: bytes | None,
                      end_s: float) -> None:
        """Queue the request's recording: its parsing, /tokenize calls and line run after the client has its
        answer, one request after the other (the line is written and flushed when they are done). One worker,
        not a task per request: the 16 recordings of 16 answers that came in together would otherwise all be
        ready at once, and the next requests (which their clients send at once) would wait behind all of them
        in the event loop; with one, behind at most one step of recording work. Measured at 16 clients
        (benchmarks/bench_record_proxy.py, docs/cli.md "Cost"): a task per request +2.8 ms, four workers
        +2.4 ms, one +0.8 ms. More workers join when the backlog grows (the upstream's /tokenize is slow)."""
        if up.status_code != 200:
            self.stats[f"not_recorded_status_{up.status_code}"] += 1
            return
        if up.header(b"content-encoding", "identity") != "identity" and tap is None:
            self.stats["not_recorded_encoded"] += 1
            return
        self._queue.put_nowait((pending, tap, content, end_s))
        waiting = self._queue.qsize()
        if waiting > RECORDING_BACKLOG * len(self._workers) and len(self._workers) < RECORDING_WORKERS_MAX:
            self._workers.append(asyncio.get_running_loop().create_task(self._worker()))
            self.warn_once("backlog", f"{waiting} requests wait for their recording (/tokenize calls to the "
                                      f"upstream): {len(self._workers)} recording workers now; their lines are "
                                      "written late, and a killed recorder would lose them")

    async def _finish(self, p: Pending, tap: SSETap | None, content: bytes | None, end_s: float) -> None:
        try:
            results = self._results(p, tap.events() if tap is not None else None, content)
            if not results:
                self.stats["not_recorded_no_result"] += 1
                return
            prompts = await self._prompt_tokens(p)
            n_cmpl = p.body.get("n_cmpl", p.body.get("n", 1))
            n_cmpl = n_cmpl if type(n_cmpl) is int and n_cmpl > 0 else 1
            sampling = sampling_of(p.body)
            for res in results:
                idx = res["index"]
                ids = prompts[idx // n_cmpl] if prompts is not None and idx // n_cmpl < len(prompts) else None
                if ids is None:
                    self.stats["not_recorded_no_prompt"] += 1
                    continue
                self._write(self._line(p, res, ids, sampling, end_s, len(results)))
                self.stats["recorded"] += 1
        except Exception as e:  # noqa: BLE001 - a recording problem must never take the proxy down
            self.stats["not_recorded_failed"] += 1
            self.warn_once(f"fail:{type(e).__name__}", f"a request was not recorded ({type(e).__name__}: {e})")

    def _line(self, p: Pending, res: dict[str, Any], ids: list[int], sampling: dict[str, Any], end_s: float,
              n_results: int) -> dict[str, Any]:
        line: dict[str, Any] = {"arrival_s": p.arrival_s, "prompt_tokens": ids}
        out = res.get("tokens")
        n_out = res.get("n_output")
        if out is not None and (n_out is None or len(out) == n_out):
            line["output_tokens"] = out
        else:
            if out is not None:
                self.stats["output_ids_incomplete"] += 1
                self.warn_once("incomplete", "a streamed response did not carry every generated token id (tokens "
                                             "that end inside a UTF-8 character are not streamed): only its "
                                             "length is recorded")
            line["n_output"] = n_out if n_out is not None else 0
        if sampling:
            line["sampling"] = sampling
        timings = res.get("timings")
        rec: dict[str, Any] = {"endpoint": p.path, "stream": p.stream, "status": 200, "end_s": max(end_s, p.arrival_s),
                               "first_byte_s": p.first_byte_s, "id_slot": res.get("id_slot"),
                               "n_cached": timings.get("cache_n") if isinstance(timings, dict) else None,
                               "n_prompt_server": res.get("n_prompt_server"), "stop_type": res.get("stop_type"),
                               "timings": timings if isinstance(timings, dict) else None,
                               "tokens_source": "request" if prompt_ids(self._prompt_field(p)) else
                               ("apply-template+tokenize" if p.kind == OAI_CHAT else "tokenize")}
        if n_results > 1:
            rec.update(n_results=n_results, result_index=res["index"])
        if rec["n_prompt_server"] is not None and rec["n_prompt_server"] != len(ids):
            self.stats["prompt_length_differs"] += 1
            self.warn_once("plen", f"the prompt tokenized by the upstream's /tokenize has {len(ids)} tokens, the "
                                   f"server evaluated {rec['n_prompt_server']} ({p.path})")
        line["recorded"] = {k: v for k, v in rec.items() if v is not None or k in ("first_byte_s",)}
        return line

    @staticmethod
    def _prompt_field(p: Pending) -> Any:
        return p.body.get("prompt")

    def _results(self, p: Pending, events: list | None, content: bytes | None) -> list[dict[str, Any]]:
        """One dict per result: index, tokens (ids or None), n_output, id_slot, stop_type, timings,
        n_prompt_server."""
        if events is None:
            data = json.loads(content)
            if p.kind == NATIVE:
                objs = data if isinstance(data, list) else [data]
                return [self._native(o, o.get("tokens")) for o in objs if isinstance(o, dict) and "timings" in o]
            choices = data.get("choices") or []
            if len(choices) != 1:
                self.stats["not_recorded_several_choices"] += 1
                return []
            usage = data.get("usage") or {}
            return [{"index": 0, "tokens": None, "n_output": self._n_out(data.get("timings"), usage),
                     "timings": data.get("timings"), "n_prompt_server": usage.get("prompt_tokens"),
                     "stop_type": choices[0].get("finish_reason")}]
        if any(isinstance(e, dict) and "error" in e for e in events):
            self.stats["not_recorded_stream_error"] += 1
            return []
        if p.kind == NATIVE:
            toks: dict[int, list[int]] = {}
            finals = []
            for e in events:
                if not isinstance(e, dict):
                    continue
                if e.get("stop"):
                    finals.append(e)
                elif isinstance(e.get("tokens"), list):
                    toks.setdefault(e.get("index", 0), []).extend(e["tokens"])
            return [self._native(f, toks.get(f.get("index", 0), [])) for f in finals]
        timings = usage = finish = None
        for e in events:
            if isinstance(e, dict):
                timings = e.get("timings", timings)
                usage = e.get("usage", usage)
                for c in e.get("choices") or []:
                    if c.get("index", 0) != 0:
                        self.stats["not_recorded_several_choices"] += 1
                        return []
                    finish = c.get("finish_reason") or finish
        if timings is None:
            return []
        return [{"index": 0, "tokens": None, "n_output": self._n_out(timings, usage or {}), "timings": timings,
                 "n_prompt_server": (usage or {}).get("prompt_tokens"), "stop_type": finish}]

    @staticmethod
    def _n_out(timings: Any, usage: dict) -> int | None:
        if isinstance(timings, dict) and type(timings.get("predicted_n")) is int:
            return timings["predicted_n"]
        n = usage.get("completion_tokens")
        return n if type(n) is int else None

    @staticmethod
    def _native(o: dict[str, Any], tokens: Any) -> dict[str, Any]:
        n_out = o.get("tokens_predicted")
        return {"index": o.get("index", 0), "tokens": tokens if isinstance(tokens, list) else None,
                "n_output": n_out if type(n_out) is int else None, "id_slot": o.get("id_slot"),
                "stop_type": o.get("stop_type"), "timings": o.get("timings"),
                "n_prompt_server": o.get("tokens_evaluated")}

    async def _prompt_tokens(self, p: Pending) -> list[list[int]] | None:
        """Each prompt's token ids: as given, or from the upstream (/tokenize; chat: /apply-template first)."""
        if p.kind == OAI_CHAT:
            r = await self._upstream_json("/apply-template", p.body, p)
            text = r.get("prompt") if isinstance(r, dict) else None
            if not isinstance(text, str):
                return None
            return [await self._tokenize(text, p)]
        prompt = p.body.get("prompt")
        out = []
        for item in split_prompts(prompt):
            ids = prompt_ids(item)
            out.append(ids if ids is not None else await self._tokenize(item, p))
        return out

    async def _tokenize(self, content: Any, p: Pending) -> list[int]:
        # as the completion handlers tokenize a prompt: special tokens added (BOS) and parsed
        r = await self._upstream_json("/tokenize", {"content": content, "add_special": True, "parse_special": True}, p)
        toks = r.get("tokens") if isinstance(r, dict) else None
        if not isinstance(toks, list) or not all_ints(toks):
            raise ValueError(f"/tokenize answered {str(r)[:80]!r}")
        return toks

    async def _upstream_json(self, route: str, body: Any, p: Pending) -> Any:
        prefix = p.path[:len(p.path) - len(_ENDPOINT_SUFFIX[p.kind](p.path))]
        data = json.dumps(body).encode()
        for attempt in (1, 2, 3):
            try:
                async with self.client.post(self.upstream + prefix + route, data=data, allow_redirects=False,
                                            headers=[("Content-Type", "application/json"), *p.auth]) as r:
                    content = await r.read()
                    if r.status != 200:
                        raise ValueError(f"{route} answered {r.status}")
                return json.loads(content)
            except RESEND_ERRORS as e:
                # a pooled connection closed under the call (see `__call__`); /tokenize and /apply-template
                # change nothing upstream, so they are asked again
                if attempt == 3 or not resendable(e):
                    raise
                self.stats["upstream_resent_recording"] += 1


def _suffix(path: str, options: tuple[str, ...]) -> str:
    return next(s for s in options if path.endswith(s))


_ENDPOINT_SUFFIX = {
    OAI_CHAT: lambda path: _suffix(path, ("/v1/chat/completions", "/chat/completions")),
    OAI_CMPL: lambda path: "/v1/completions",
    NATIVE: lambda path: _suffix(path, ("/completions", "/completion")),
}


def server_options() -> dict[str, str]:
    """uvicorn's fast protocol and loop (httptools, uvloop: dependencies of the project) where importable, else
    its pure-Python h11 and asyncio: about half the CPU of an incoming exchange."""
    return {"http": "httptools" if importlib.util.find_spec("httptools") else "h11",
            "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"}
