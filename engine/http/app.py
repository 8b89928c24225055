"""The llama-server compatible HTTP application (Starlette, served by uvicorn).

Middleware order follows `server_http_context::init` (tools/server/server-http.cpp): CORS headers, OPTIONS
answered with 200, 503 "Loading model" while the model loads, API key check (/health, /models exempt), then
routing with a JSON 404 for unknown routes. Every response carries `Server: llama.cpp`. CORS follows
the `--cors-origins/-methods/-headers/-credentials` options with upstream's defaults (`common_params`,
common/common.h).

Header names go out in upstream's spelling (`Access-Control-Allow-Origin`, `Content-Type`,
`Process-Start-Time-Unix`, ...): cpp-httplib sends them as the server code writes them, while Starlette
lower-cases every name. Clients that read headers into a plain dict see the same keys as with llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.routing import Route

from engine.core.errors import ErrorType
from engine.http import routes
from engine.http.jsonutil import HTTPError, JSONResponse, dumps, error_body, error_response
from engine.http.state import ServerOptions, ServerState

log = logging.getLogger("slotlab.http")

# upstream's `get_public_endpoints` and `frontend_paths` (server-http.cpp), compared with the request path as
# it is (an --api-prefix is not stripped, as upstream); "/" is the UI's path, which this server does not serve
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/"})
FRONTEND_PATHS = frozenset({"/"})
# GET endpoints that answer while the server sleeps, without waking it or resetting its idle timer
# (upstream's `create_response(true)` handlers: server_routes::init_routes)
SLEEP_READS = frozenset({"/health", "/v1/health", "/props", "/models", "/v1/models", "/metrics"})
_LOCAL_ORIGIN_HOSTS = ("localhost", "127.0.0.1", "::1")


def origin_is_localhost(origin: str) -> bool:
    """Upstream's `origin_is_localhost` (server-http.cpp) over `common_http_parse_url` (common/http.h):
    an http(s) URL whose host, without user info, port or IPv6 brackets, is localhost, 127.0.0.1 or ::1."""
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme not in ("http", "https"):
        return False
    # user info is cut from the authority only; upstream looks for '@' anywhere in the URL, so it would read
    # "http://evil.example/@localhost" as local: a deliberate difference (an Origin carries no path anyway)
    rest = rest.rpartition("@")[2] if "@" in rest.partition("/")[0] else rest
    host = rest.partition("/")[0]
    port = ""
    if host.startswith("["):
        close = host.find("]")
        if close < 0:
            return False
        after = host[close + 1:]
        port = after[1:] if after.startswith(":") else ""
        host = host[1:close]
    elif ":" in host:
        host, _, port = host.partition(":")
    if port and not port.lstrip("+-").isdigit():        # std::stoi throws: not an origin upstream accepts
        return False
    return host in _LOCAL_ORIGIN_HOSTS


def cors_origin(origins: str, credentials: bool, origin: str | None) -> str | None:
    """The Access-Control-Allow-Origin value upstream sends, or None for no header: with credentials and
    `*` (the defaults) the request's Origin is echoed (empty when it has none); `localhost` reflects only a
    local origin; anything else is sent as it is."""
    if credentials and origins == "*":
        return origin or ""
    if origins == "localhost":
        return origin if origin and origin_is_localhost(origin) else None
    return origins


def header_name(name: bytes) -> bytes:
    """A header name in the spelling cpp-httplib sends: each dash-separated word capitalized."""
    return b"-".join(w[:1].upper() + w[1:].lower() for w in name.split(b"-"))


class FrontMiddleware:
    """Pure ASGI middleware (streaming-safe) for the steps upstream runs before routing."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        opts = self.state.options
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        allow = cors_origin(opts.cors_origins, opts.cors_credentials, headers.get("origin"))
        extra = [(b"server", b"llama.cpp")]
        if allow is not None:
            extra.append((b"access-control-allow-origin", allow.encode("latin-1")))

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in extra}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in names]
                message = {**message, "headers": [(header_name(k), v) for k, v in kept + extra]}
            await send(message)

        if scope["method"] == "OPTIONS":
            await _respond(send_with_headers, 200, b"", "text/html", [
                (b"access-control-allow-credentials", b"true" if opts.cors_credentials else b"false"),
                (b"access-control-allow-methods", opts.cors_methods.encode("latin-1")),
                (b"access-control-allow-headers", opts.cors_headers.encode("latin-1"))])
            return
        path = scope["path"]
        if not self.state.ready and path not in FRONTEND_PATHS:
            await _respond_json(send_with_headers, 503, error_body(ErrorType.UNAVAILABLE, "Loading model"))
            return
        keys = opts.api_keys
        if keys and path not in PUBLIC_PATHS:
            key = headers.get("authorization") or headers.get("x-api-key") or ""
            if key.startswith("Bearer "):
                key = key[len("Bearer "):]
            if key not in keys:
                await _respond_json(send_with_headers, 401,
                                    error_body(ErrorType.AUTHENTICATION, "Invalid API Key"))
                return
        state = self.state
        if state.options.sleep_idle_s < 0 or path in FRONTEND_PATHS or (
                scope["method"] in ("GET", "HEAD") and path[len(opts.api_prefix):] in SLEEP_READS):
            await self.app(scope, receive, send_with_headers)
            return
        # a request that needs the model: it keeps the model loaded while open and wakes it if asleep
        with state.lock:
            state.n_busy += 1
            asleep = state.sleeping
        try:
            if asleep:
                try:
                    await asyncio.to_thread(state.wake)
                except Exception as e:  # noqa: BLE001 - the request gets upstream's error JSON, the server stays up
                    log.exception("failed to reload the model after sleeping")
                    await _respond_json(send_with_headers, 500, error_body(
                        ErrorType.SERVER, f"failed to reload the model after sleeping: {type(e).__name__}: {e}"))
                    return
            await self.app(scope, receive, send_with_headers)
        finally:
            with state.lock:
                state.n_busy -= 1


async def _respond(send, status: int, body: bytes, content_type: str, headers: list | None = None) -> None:
    hdrs = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": body})


async def _respond_json(send, status: int, obj) -> None:
    await _respond(send, status, dumps(obj).encode("utf-8"), "application/json; charset=utf-8")


async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _not_found(request: Request, exc: Exception) -> JSONResponse:
    return error_response(ErrorType.NOT_FOUND, "File Not Found")


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(ErrorType.SERVER, f"{type(exc).__name__}: {exc}")


async def _starlette_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code in (404, 405):   # upstream has no such route for that method: "File Not Found"
        return error_response(ErrorType.NOT_FOUND, "File Not Found")
    return error_response(ErrorType.INVALID_REQUEST, str(exc.detail), status=exc.status_code)


def _routes(prefix: str) -> list[Route]:
    r = routes
    table = [
        ("/health", r.health, ["GET"]), ("/v1/health", r.health, ["GET"]),
        ("/metrics", r.metrics, ["GET"]),
        ("/props", r.props, ["GET", "POST"]),
        ("/models", r.models, ["GET"]), ("/v1/models", r.models, ["GET"]),
        ("/slots", r.slots, ["GET"]), ("/slots/{id_slot}", r.slot_action, ["POST"]),
        ("/completion", r.completion, ["POST"]),
        ("/completions", r.completion, ["POST"]),            # native, as upstream (only /v1/ speaks OpenAI)
        ("/v1/completions", r.oai_completions, ["POST"]),
        ("/chat/completions", r.chat_completions, ["POST"]), ("/v1/chat/completions", r.chat_completions, ["POST"]),
        ("/chat/completions/input_tokens", r.chat_input_tokens, ["POST"]),
        ("/v1/chat/completions/input_tokens", r.chat_input_tokens, ["POST"]),
        ("/tokenize", r.tokenize, ["POST"]), ("/detokenize", r.detokenize, ["POST"]),
        ("/apply-template", r.apply_template, ["POST"]),
        ("/embedding", r.not_supported_embeddings, ["POST"]), ("/embeddings", r.not_supported_embeddings, ["POST"]),
        ("/v1/embeddings", r.not_supported_embeddings, ["POST"]),
        ("/rerank", r.not_supported_rerank, ["POST"]), ("/reranking", r.not_supported_rerank, ["POST"]),
        ("/v1/rerank", r.not_supported_rerank, ["POST"]), ("/v1/reranking", r.not_supported_rerank, ["POST"]),
    ]
    return [Route(prefix + path, fn, methods=methods) for path, fn, methods in table]


def create_app(state: ServerState, load_on_startup: bool = True) -> Starlette:
    """The ASGI app. With `load_on_startup`, model loading starts in the background when the server starts."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if load_on_startup and not state.ready and state._thread is None:
            state.start_loading()
        yield
        state.shutdown()

    app = Starlette(routes=_routes(state.options.api_prefix), lifespan=lifespan,
                    exception_handlers={HTTPError: _http_error, 404: _not_found,
                                        StarletteHTTPException: _starlette_error, Exception: _server_error})
    app.state.server = state
    state.sleep_snapshot = routes.sleep_snapshot
    app.add_middleware(FrontMiddleware, state=state)
    return app


def uvicorn_config(app, host: str, port: int, log_level: str, **kw) -> uvicorn.Config:
    """uvicorn as llama-server answers: no `server` or `date` header of its own (cpp-httplib sends neither;
    `Server: llama.cpp` comes from the middleware), lifespan on, no websockets. The HTTP protocol and event
    loop are h11 and asyncio unless `kw` names others (uvicorn's "auto" would switch to httptools and uvloop
    whenever they are installed, which `slotlab record` installs for itself)."""
    kw = {"http": "h11", "loop": "asyncio", **kw}
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, server_header=False, date_header=False,
                          lifespan="on", ws="none", **kw)


def start_and_wait(thread: threading.Thread, ready: Callable[[], bool], timeout_s: float,
                   cause: Callable[[], object] = lambda: None) -> None:
    """Start a server's thread and return once `ready()`; RuntimeError (with `cause()`, when it has one) if the
    thread ends first or `timeout_s` passes."""
    thread.start()
    t_end = time.monotonic() + timeout_s
    while not ready():
        if not thread.is_alive() or time.monotonic() > t_end:
            why = cause()
            raise RuntimeError(f"{thread.name} did not start" + (f" ({why})" if why is not None else ""))
        time.sleep(0.01)


class ThreadedUvicorn:
    """uvicorn serving `app` in a background thread (tests, notebooks, benchmarks): `start()` returns once
    the socket listens; `stop()` asks it to exit and waits."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", *,
                 name: str = "slotlab-http", shutdown_s: float = 2.0, **config) -> None:
        self.app = app
        self.server = uvicorn.Server(uvicorn_config(app, host, port, log_level, timeout_graceful_shutdown=shutdown_s,
                                                    **config))
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)
        self._join_s = shutdown_s + 8.0

    def start(self, timeout_s: float = 30.0):
        start_and_wait(self.thread, lambda: self.server.started, timeout_s)
        return self

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.server.config.host}:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(self._join_s)


class BackgroundServer(ThreadedUvicorn):
    """`slotlab serve`'s app in a background thread; `base_url` includes the --api-prefix."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.state = state
        super().__init__(create_app(state), host, port, log_level, name="slotlab-http", shutdown_s=2.0)

    @property
    def base_url(self) -> str:
        return super().base_url + self.state.options.api_prefix

    def stop(self) -> None:
        super().stop()
        self.state.shutdown()


__all__ = ["BackgroundServer", "ServerOptions", "ServerState", "ThreadedUvicorn", "create_app"]
