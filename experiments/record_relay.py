"""`slotlab record`'s default proxy (`--proxy relay`): an HTTP-aware byte relay on uvloop with httptools'
parsers, the event loop and HTTP parser uvicorn itself runs on, without uvicorn's ASGI cycle on one side and
a client library's request objects on the other.

Why not the ASGI app alone (`--proxy asgi`, experiments/record.py): the recorder's budget is ≤ 1 ms added
per request at 16 concurrent clients. On a 2-core machine, with an upstream that spends 50 ms per request,
the ASGI proxy (uvicorn + an aiohttp pool) spends ~1.3 ms of CPU per request, its recording included, and
adds +0.8 to +1.5 ms at the median; this relay spends ~0.95 ms and adds +0.2 to +0.6 ms; a relay that copies
bytes and parses nothing adds +0.3 to +0.5 ms in the same rounds (benchmarks/bench_record_proxy.py
`--relay`; docs/cli.md, `slotlab record`, "Cost"). This proxy stays close to that floor: the bytes of an
answer go to the client as they come (head, framing and body, unchanged), and the parsers only watch
them, in C, to find where each message ends and to keep what the trace needs.

What it does per client connection:
- requests are parsed (httptools.HttpRequestParser), buffered whole (as the ASGI proxy does) and sent one at a
  time, in order (pipelined requests wait for the answer before them), on an upstream connection of the
  client connection's own (opened at its first request, reopened when the upstream closed it or it sat idle
  for `record.KEEPALIVE_S`, before cpp-httplib's 5 s keep-alive would close it under a request);
- the request head is rebuilt from the parsed one: method, target (raw, as sent), HTTP version and headers
  in the client's order, but the hop-by-hop ones (RFC 9110 §7.6.1) and `Expect`; `Host` names the upstream;
  `Content-Length` is the body's (a chunked request body goes on as one body of known length). An
  `Expect: 100-continue` is answered by the proxy (it needs the body before it can forward anything);
- the response goes back byte for byte as the upstream sent it, except the one change the recorder makes
  (experiments/record.py: a native non-stream `/completion` is sent with `return_tokens`; its answer is held
  until complete and sent with the ids blanked out and its `Content-Length` adjusted);
- the upstream down or closing without an answer: a 502 with llama-server's error JSON, the client
  connection kept; the upstream cutting a response: the client connection is closed (as the upstream's own
  would be); the client leaving: the upstream connection is closed, so the upstream stops the request;
- a response whose request asked to close (or an HTTP/1.0 request, or an upstream that closes) ends the
  client connection after it; a client that does not read is not buffered without bound: the upstream
  connection stops reading while the client's socket is full.

The trace lines are what the ASGI proxy writes (the same `Recorder` code, after the client has its answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
import time
from urllib.parse import urlsplit

import httptools

from engine.http.app import start_and_wait
from experiments.record import (AUTH_HEADERS, CONNECT_TIMEOUT_S, HOP_BY_HOP, INFLIGHT_WAIT_S, KEEPALIVE_S, Answer,
                                Pending, Recorder, SSETap, bad_gateway_body, blank_tokens, pending_of)

# what the proxy does not forward of a request's headers (it sets Host and Content-Length itself; it answers
# Expect itself)
DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect"}


class Request:
    __slots__ = ("method", "target", "version", "headers", "body", "keep_alive", "arrival_s")

    def __init__(self) -> None:
        self.target = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def method_path(self) -> tuple[str, str]:
        """The method and the target's path (its query left out), as text."""
        return self.method.decode("latin-1"), self.target.split(b"?", 1)[0].decode("latin-1")


class Exchange:
    """A request sent upstream and its answer on the way back."""

    __slots__ = ("req", "pending", "wire", "reused", "hold", "status", "headers", "head_seen", "body", "tap",
                 "forwarded", "got_bytes", "raw_held", "head_only")

    def __init__(self, req: Request, pending: Pending | None, wire: bytes) -> None:
        self.req = req
        self.pending = pending
        self.wire = wire                                         # the request as sent upstream
        self.reused = False                                      # sent on a connection that served another
        self.hold = pending is not None and pending.injected     # answer held whole: its ids are blanked
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_seen = False
        self.body: list[bytes] = []
        self.tap: SSETap | None = None
        self.forwarded = False                                   # a byte of the answer went to the client
        self.got_bytes = False                                   # a byte of the answer came in
        self.raw_held: list[bytes] = []
        self.head_only = req.method == b"HEAD"


class Relay:
    """The listening side and what all connections share: the recorder, the upstream's address."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        u = urlsplit(rec.upstream)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/").encode()
        self.host_header = u.netloc.rsplit("@", 1)[-1].encode()
        self.ssl = ssl.create_default_context() if u.scheme == "https" else None
        self.connections: set[ClientConn] = set()

    async def open_upstream(self, conn: "ClientConn") -> "UpstreamConn":
        loop = asyncio.get_running_loop()
        _, proto = await asyncio.wait_for(
            loop.create_connection(lambda: UpstreamConn(conn), self.host, self.port, ssl=self.ssl,
                                   server_hostname=self.host if self.ssl else None), CONNECT_TIMEOUT_S)
        return proto


def nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class UpstreamConn(asyncio.Protocol):
    """One connection to the upstream, owned by one client connection."""

    def __init__(self, owner: "ClientConn") -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = time.monotonic()

    # transport callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        nodelay(transport)

    def data_received(self, data: bytes) -> None:
        ex = self.owner.exchange
        if ex is None:                       # nothing asked: an upstream that talks out of turn is closed
            self.transport.close()
            return
        ex.got_bytes = True
        if not ex.hold:
            self.owner.transport.write(data)
            ex.forwarded = True
        else:
            ex.raw_held.append(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.owner.upstream_broke("answered with something that is not HTTP")
            return
        if ex.head_only and ex.head_seen and self.owner.exchange is ex:
            self.parser = httptools.HttpResponseParser(self)     # a HEAD answer has no body: it ends here
            self.owner.answered(ex, keep_alive=True)

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.owner.up is self:
            self.owner.up = None
        ex = self.owner.exchange
        if ex is not None and ex.req is not None and self.owner.up_of_exchange is self:
            self.owner.upstream_broke("closed the connection" + (f" ({exc})" if exc else ""))

    # parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.owner.exchange.headers.append((name, value))

    def on_headers_complete(self) -> None:
        ex = self.owner.exchange
        ex.status = self.parser.get_status_code()
        if 100 <= ex.status < 200:           # an interim answer (not asked for: Expect is not forwarded)
            ex.headers = []
            return
        ex.head_seen = True
        if ex.pending is not None and ex.status == 200:
            ctype = next((v for k, v in ex.headers if k.lower() == b"content-type"), b"")
            if ctype.startswith(b"text/event-stream"):
                ex.tap = SSETap()

    def on_body(self, body: bytes) -> None:
        ex = self.owner.exchange
        if ex.pending is None or ex.status != 200:
            return
        if ex.tap is not None:
            if ex.pending.first_byte_s is None:
                ex.pending.first_byte_s = self.owner.rec.now()
            ex.tap.feed(body)
        else:
            ex.body.append(body)

    def on_message_complete(self) -> None:
        ex = self.owner.exchange
        if not ex.head_seen:                 # the end of an interim (1xx) answer
            return
        self.owner.answered(ex, keep_alive=self.parser.should_keep_alive())


class ClientConn(asyncio.Protocol):
    """One client connection: its requests in order, each on this connection's upstream connection."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.rec = relay.rec
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.req: Request | None = None
        self.queue: list[Request] = []
        self.exchange: Exchange | None = None
        self.up: UpstreamConn | None = None
        self.up_of_exchange: UpstreamConn | None = None
        self.sending = False                 # between taking a request off the queue and its answer's start
        self.task: asyncio.Task | None = None
        self.closing = False

    # transport callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        nodelay(transport)
        self.relay.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.bad_request(b"slotlab record: protocol upgrades are not forwarded")
        except httptools.HttpParserError as e:
            self.bad_request(f"slotlab record: invalid HTTP request ({e})".encode())

    def connection_lost(self, exc) -> None:
        self.relay.connections.discard(self)
        self.closing = True
        self.queue.clear()
        ex = self.exchange
        if ex is not None and ex.pending is not None:
            self.rec.stats["not_recorded_interrupted"] += 1
            ex.pending = None
        self.exchange = None
        self.up_of_exchange = None
        if self.up is not None and not self.up.closed:
            self.up.transport.close()        # the upstream sees its client go and stops the request
        self.up = None

    def pause_writing(self) -> None:         # the client does not read: stop reading its answer upstream
        if self.up is not None and self.up.transport is not None:
            self.up.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None and self.up.transport is not None and not self.up.closed:
            self.up.transport.resume_reading()

    # request parser callbacks
    def on_message_begin(self) -> None:
        self.req = Request()
        self.req.arrival_s = self.rec.now()

    def on_url(self, url: bytes) -> None:
        self.req.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.req.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if any(k.lower() == b"expect" and v.lower() == b"100-continue" for k, v in self.req.headers):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self.req.body.append(body)

    def on_message_complete(self) -> None:
        req = self.req
        req.method = self.parser.get_method()
        req.version = self.parser.get_http_version().encode()
        req.keep_alive = self.parser.should_keep_alive()
        self.req = None
        self.queue.append(req)
        if self.exchange is None and not self.sending:
            self.next()

    # the exchanges
    def next(self) -> None:
        if self.closing or not self.queue:
            return
        self.sending = True
        # kept: the event loop holds only a weak reference to a task
        self.task = asyncio.get_running_loop().create_task(self.send(self.queue.pop(0)))

    async def send(self, req: Request) -> None:
        raw = b"".join(req.body)
        method, path = req.method_path()
        pending, raw = pending_of(method, path, raw, req.arrival_s, lambda: [
            (k.decode("latin-1"), v.decode("latin-1")) for k, v in req.headers
            if k.lower().decode("latin-1") in AUTH_HEADERS])
        drop_encoding = pending is not None and pending.injected
        head = [req.method, b" ", self.relay.prefix, req.target, b" HTTP/", req.version, b"\r\n"]
        has_host = has_length = False
        for k, v in req.headers:
            lk = k.lower()
            if lk == b"host":
                head += [k, b": ", self.relay.host_header, b"\r\n"]
                has_host = True
            elif lk == b"content-length":
                if not has_length:
                    head += [k, b": ", str(len(raw)).encode(), b"\r\n"]
                    has_length = True
            elif lk in DROP or (drop_encoding and lk == b"accept-encoding"):
                continue
            else:
                head += [k, b": ", v, b"\r\n"]
        if not has_host:
            head += [b"Host: ", self.relay.host_header, b"\r\n"]
        if not has_length and (raw or req.method in (b"POST", b"PUT", b"PATCH")):
            head += [b"Content-Length: ", str(len(raw)).encode(), b"\r\n"]
        head.append(b"\r\n")
        await self.transmit(Exchange(req, pending, b"".join(head) + raw))

    async def transmit(self, ex: Exchange) -> None:
        """Send `ex` on this connection's upstream connection, opened first if there is none (or it closed, or
        sat idle past KEEPALIVE_S)."""
        up = self.up
        if up is not None and (up.closed or time.monotonic() - up.idle_since > KEEPALIVE_S):
            if not up.closed:
                up.transport.close()
            up = self.up = None
        ex.reused = up is not None
        if up is None:
            try:
                up = await self.relay.open_upstream(self)
            except (OSError, asyncio.TimeoutError) as e:
                self.sending = False
                if self.closing:
                    return
                self.bad_gateway(ex.req, f"{type(e).__name__}: {e or 'no details'}")
                self.then(ex.req.keep_alive)
                return
            if self.closing:                 # the client left while the connection opened
                up.transport.close()
                return
            self.up = up
        self.exchange = ex
        self.up_of_exchange = up
        self.sending = False
        up.transport.write(ex.wire)

    def answered(self, ex: Exchange, keep_alive: bool) -> None:
        """The upstream's answer to `ex` is complete."""
        end_s = self.rec.now()
        up = self.up_of_exchange
        self.exchange = None
        self.up_of_exchange = None
        original = b"".join(ex.body) if ex.pending is not None and ex.tap is None else None
        if ex.hold:
            if ex.status == 200 and original is not None:
                self.transport.write(self.rewritten(ex, blank_tokens(original)))
            else:
                self.transport.write(b"".join(ex.raw_held))
        if ex.pending is not None:
            answer = Answer(ex.status, ex.headers)
            self.rec.finish_later(ex.pending, answer, ex.tap, original, end_s)
        if up is not None:
            if keep_alive:
                up.idle_since = time.monotonic()
            else:
                up.transport.close()
                if self.up is up:
                    self.up = None
        self.then(ex.req.keep_alive and keep_alive)

    def then(self, keep_alive: bool) -> None:
        """After an exchange: the next request on the connection, or (`keep_alive` false) its end."""
        if keep_alive:
            self.next()
        else:
            self.closing = True
            self.transport.close()

    @staticmethod
    def rewritten(ex: Exchange, body: bytes) -> bytes:
        """A held 200 answer with its new body: headers as sent, framing by Content-Length."""
        out = [b"HTTP/1.1 200 OK\r\n"]
        for k, v in ex.headers:
            lk = k.lower()
            if lk in (b"content-length", b"transfer-encoding"):
                continue
            out += [k, b": ", v, b"\r\n"]
        out += [b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body]
        return b"".join(out)

    def upstream_broke(self, what: str) -> None:
        """The upstream connection failed during an exchange."""
        ex = self.exchange
        up = self.up_of_exchange
        self.exchange = None
        self.up_of_exchange = None
        if up is not None and not up.closed:
            up.transport.close()
        if self.up is up:
            self.up = None
        if ex.reused and not ex.got_bytes and not self.closing:
            # A kept-alive connection the upstream closed as the request went out, before any answer: sent
            # again once, on a new connection. Some servers close every connection after its answer while
            # announcing keep-alive (llama-server 0c1e57098: "Keep-Alive: timeout=5, max=100", then the
            # close), and the next request races the close. A server that closes without answering has not
            # answered it: what a client would do on that connection's failure too.
            self.rec.stats["upstream_resent"] += 1
            self.sending = True
            fresh = Exchange(ex.req, ex.pending, ex.wire)
            self.task = asyncio.get_running_loop().create_task(self.transmit(fresh))
            return
        if ex.pending is not None:
            self.rec.stats["not_recorded_interrupted"] += 1
        if ex.forwarded or self.closing:     # part of the answer is with the client: its connection ends too
            self.closing = True
            self.transport.close()
            return
        self.bad_gateway(ex.req, what)
        self.then(ex.req.keep_alive)

    def bad_gateway(self, req: Request, what: str) -> None:
        self.rec.stats["upstream_errors"] += 1
        body = bad_gateway_body(self.rec.upstream, *req.method_path(), what)
        self.transport.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json; charset=utf-8\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def bad_request(self, text: bytes) -> None:
        """A 400 with `text`, and the connection closed (its bytes can no longer be parsed)."""
        self.closing = True
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text))
        self.transport.close()


# --- running it -------------------------------------------------------------------------------------------

async def serve(rec: Recorder, host: str, port: int, stop: asyncio.Event, started=None) -> None:
    """Listen on host:port until `stop` is set, then let the requests in flight end (up to
    `record.INFLIGHT_WAIT_S`) and their lines be written. `started(server)` is called once it listens."""
    await rec.start_client()
    relay = Relay(rec)
    server = await asyncio.get_running_loop().create_server(lambda: ClientConn(relay), host, port, backlog=2048)
    try:
        if started is not None:
            started(server)
        await stop.wait()
    finally:
        server.close()
        t_end = time.monotonic() + INFLIGHT_WAIT_S
        while any(c.exchange is not None or c.sending for c in relay.connections) and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        for c in list(relay.connections):
            c.transport.close()
        await rec.stop_client()


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:                  # pragma: no cover - uvloop is a dependency of the project
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class BackgroundRelay:
    """The relay in a background thread (tests, benchmarks): `start()` returns once the socket listens."""

    def __init__(self, recorder: Recorder, host: str = "127.0.0.1", port: int = 0) -> None:
        self.recorder = recorder
        self.host, self._port = host, port
        self.loop = new_loop()
        self._stop: asyncio.Event | None = None
        self._server = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="slotlab-record", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            await serve(self.recorder, self.host, self._port, self._stop, started=self._started)

        try:
            self.loop.run_until_complete(main())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
        finally:
            self.recorder.close()

    def _started(self, server) -> None:
        self._server = server

    def start(self, timeout_s: float = 30.0):
        start_and_wait(self.thread, lambda: self._server is not None, timeout_s, cause=lambda: self._error)
        return self

    @property
    def port(self) -> int:
        return self._server.sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._stop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(INFLIGHT_WAIT_S + 5.0)
