"""`slotlab record`: the reverse proxy forwards unchanged and writes one native-trace line per completion."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.http.app import ThreadedUvicorn, uvicorn_config
from experiments.record import TOKENS_FIELD, SSETap, blank_tokens, inject_return_tokens, split_prompts
from experiments.record_cli import BackgroundRecorder
from traces import read_trace


@pytest.fixture(scope="module")
def upstream(start_server):
    return start_server(n_parallel=2, n_ctx=2048, api_keys=())


PROXIES = ("relay", "asgi")          # the two proxies of `slotlab record --proxy`: each test runs with each


@pytest.fixture(params=PROXIES)
def proxy(request) -> str:
    return request.param


@pytest.fixture()
def recorder(upstream, tmp_path, proxy):
    rec = BackgroundRecorder(upstream.base_url, tmp_path / "trace.jsonl", proxy=proxy).start()
    yield rec
    rec.stop()


def lines(path) -> list[dict]:
    return [json.loads(x) for x in open(path, encoding="utf-8") if x.strip()]


def wait_lines(path, n: int, timeout_s: float = 10.0) -> list[dict]:
    t_end = time.monotonic() + timeout_s
    while True:
        got = lines(path)
        if len(got) >= n or time.monotonic() > t_end:
            return got
        time.sleep(0.02)


GREEDY = {"n_predict": 6, "temperature": 0, "seed": 3}


def test_native_answer_is_what_the_client_would_get_and_the_ids_are_recorded(upstream, recorder, tmp_path):
    body = {"prompt": "Hello world, the", **GREEDY}
    with httpx.Client(base_url=recorder.base_url, timeout=60) as c, \
            httpx.Client(base_url=upstream.base_url, timeout=60) as d:
        via = c.post("/completion", json=body)
        direct = d.post("/completion", json=body)
        asked = c.post("/completion", json={**body, "return_tokens": True}).json()
    assert via.status_code == 200 and via.headers["server"] == "llama.cpp"
    a, b = via.json(), direct.json()
    assert list(a) == list(b) and a["tokens"] == [] == b["tokens"]       # the recorder's return_tokens is blanked
    assert a["content"] == b["content"] and a["generation_settings"] == b["generation_settings"]
    assert len(asked["tokens"]) == 6                                    # a client that asks gets them
    got = wait_lines(tmp_path / "trace.jsonl", 3)
    assert got[0]["slotlab_native"] == 1 and got[0]["line_order"] == "end"
    # written as each recording ends (the first's may wait for its /tokenize behind the second's generation)
    first, second = sorted(got[1:], key=lambda line: line["arrival_s"])
    assert first["output_tokens"] == asked["tokens"] == second["output_tokens"]
    assert first["prompt_tokens"] == upstream_tokenize(upstream, "Hello world, the")
    assert first["sampling"] == GREEDY and second["sampling"]["return_tokens"] is True
    r = first["recorded"]
    assert r["endpoint"] == "/completion" and r["stop_type"] == "limit" and r["tokens_source"] == "tokenize"
    assert r["timings"]["predicted_n"] == 6 and r["n_prompt_server"] == len(first["prompt_tokens"])
    assert 0 <= first["arrival_s"] <= r["end_s"] <= second["arrival_s"]
    assert r["id_slot"] == a["id_slot"] and r["n_cached"] == a["timings"]["cache_n"]
    trace = read_trace(tmp_path / "trace.jsonl")                          # a valid native trace
    assert [t.output_tokens for t in trace] == [tuple(asked["tokens"])] * 2


def upstream_tokenize(upstream, text: str) -> list[int]:
    return httpx.post(upstream.base_url + "/tokenize", json={"content": text, "add_special": True}).json()["tokens"]


def test_stream_goes_through_chunk_by_chunk_and_its_tokens_are_recorded(upstream, recorder, tmp_path):
    ids = upstream_tokenize(upstream, "Hello world, the")        # a prompt whose greedy tokens are whole text
    body = {"prompt": ids, "stream": True, **GREEDY}
    with httpx.Client(base_url=recorder.base_url, timeout=60) as c:
        with c.stream("POST", "/completion", json=body) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            chunks = list(s.iter_raw())
    events = [json.loads(e[6:]) for e in b"".join(chunks).split(b"\n\n") if e.startswith(b"data: ")]
    assert len(chunks) > 1 and events[-1]["stop"] is True
    streamed = [t for e in events[:-1] for t in e["tokens"]]
    line = wait_lines(tmp_path / "trace.jsonl", 2)[1]
    assert line["prompt_tokens"] == ids and line["recorded"]["tokens_source"] == "request"
    assert line["recorded"]["stream"] is True and line["recorded"]["first_byte_s"] >= line["arrival_s"]
    if len(streamed) == events[-1]["tokens_predicted"]:
        assert line["output_tokens"] == streamed
    else:                            # a token ending inside a UTF-8 character is not streamed: length only
        assert "output_tokens" not in line and line["n_output"] == events[-1]["tokens_predicted"]


def test_chat_prompt_tokens_come_from_apply_template_and_tokenize(recorder, tmp_path):
    body = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=recorder.base_url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=body).json()
        oai = c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3}).json()
    # lines are written as each request's recording ends (line_order "end"): the chat's waits for its template
    # and tokenize calls, so the completion's line may come first
    by_endpoint = {line["recorded"]["endpoint"]: line for line in wait_lines(tmp_path / "trace.jsonl", 3)[1:]}
    chat, cmpl = by_endpoint["/v1/chat/completions"], by_endpoint["/v1/completions"]
    assert len(chat["prompt_tokens"]) == r["usage"]["prompt_tokens"]
    assert chat["recorded"]["tokens_source"] == "apply-template+tokenize"
    assert chat["n_output"] == r["usage"]["completion_tokens"] and "output_tokens" not in chat
    assert chat["sampling"]["n_predict"] == 4
    assert len(cmpl["prompt_tokens"]) == oai["usage"]["prompt_tokens"]


def test_other_routes_and_errors_are_forwarded_as_they_are(upstream, recorder, tmp_path):
    with httpx.Client(base_url=recorder.base_url, timeout=60) as c, \
            httpx.Client(base_url=upstream.base_url, timeout=60) as d:
        for method, path, body in (("GET", "/health", None), ("POST", "/tokenize", {"content": "ab"}),
                                   ("GET", "/nope", None), ("POST", "/completion", {"n_predict": 1}),
                                   ("POST", "/completion", {"prompt": "x", "n_predict": -5})):
            a = c.request(method, path, json=body)
            b = d.request(method, path, json=body)
            assert (a.status_code, a.content) == (b.status_code, b.content), path
        bad = c.post("/completion", content=b"{not json")
        assert bad.status_code == 500 and "parse_error" in bad.json()["error"]["message"]
        assert c.get("/slots").json()[0]["id"] == 0
    time.sleep(0.2)
    assert len(lines(tmp_path / "trace.jsonl")) == 1          # only the header: nothing was answered with 200


def test_upstream_down_is_a_502_with_a_clear_message(tmp_path, proxy):
    rec = BackgroundRecorder("http://127.0.0.1:9", tmp_path / "t.jsonl", proxy=proxy).start()
    try:
        r = httpx.post(rec.base_url + "/completion", json={"prompt": "x"}, timeout=30)
    finally:
        rec.stop()
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["type"] == "unavailable_error" and "http://127.0.0.1:9 did not answer POST /completion" in err["message"]


def test_a_line_is_on_disk_as_soon_as_its_request_ended(recorder, tmp_path):
    with httpx.Client(base_url=recorder.base_url, timeout=60) as c:
        c.post("/completion", json={"prompt": [1, 2, 3], "n_predict": 2})
        got = wait_lines(tmp_path / "trace.jsonl", 2)             # read while the recorder still runs
    assert len(got) == 2 and got[1]["prompt_tokens"] == [1, 2, 3]


def test_a_killed_recorder_process_keeps_every_line_of_the_requests_that_ended(upstream, tmp_path, proxy):
    port = free_port()
    out = tmp_path / "killed.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "experiments.cli", "record", "--upstream", upstream.base_url,
                             "--out", str(out), "--port", str(port), "--proxy", proxy], stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            t_end = time.monotonic() + 120
            while True:                                  # until it listens
                try:
                    c.get("/health")
                    break
                except httpx.TransportError:
                    assert proc.poll() is None and time.monotonic() < t_end
                    time.sleep(0.1)
            for i in range(3):
                assert c.post("/completion", json={"prompt": [1, 2, 3 + i], "n_predict": 2}).status_code == 200
        got = wait_lines(out, 4)
    finally:
        proc.kill()                                       # SIGKILL: no shutdown, no final flush
        proc.wait(10)
    assert lines(out) == got and [x["prompt_tokens"] for x in got[1:]] == [[1, 2, 3], [1, 2, 4], [1, 2, 5]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_request_body_edits_keep_the_client_bytes():
    raw = b'{ "prompt" : "a",\n "n_predict": 1e0}'
    assert inject_return_tokens(raw, json.loads(raw)) == b'{"return_tokens":true, "prompt" : "a",\n "n_predict": 1e0}'
    assert inject_return_tokens(b"{}", {}) == b'{"return_tokens":true}'
    assert json.loads(inject_return_tokens(b'{"return_tokens":false}', {"return_tokens": False})) == \
        {"return_tokens": True}


def test_blank_tokens_touches_only_the_tokens_key():
    raw = (b'[{"index":0,"content":"say \\"tokens\\":[1,2]","tokens":[5, 6,-1],"x":{"tokens":[]}},'
           b'{"tokens":[7]}]')
    assert blank_tokens(raw) == (b'[{"index":0,"content":"say \\"tokens\\":[1,2]","tokens":[],"x":{"tokens":[]}},'
                                 b'{"tokens":[]}]')


FRAGMENTS = [b'"tokens"', b'"tokens":[', b'"tokens": [1, -2]', b'"tokens":[3]', b'\\"tokens":[4]', b'\\"tokens\\"',
             b"\\", b":", b" ", b"\n", b"[", b"]", b"[]", b"1", b"-2", b",", b'"', b"{", b"}", b"x", b"tokens"]


@given(st.lists(st.sampled_from(FRAGMENTS), max_size=40))
def test_blank_tokens_does_what_its_pattern_says(parts):
    raw = b"".join(parts)
    assert blank_tokens(raw) == TOKENS_FIELD.sub(rb"\1\2", raw)


def test_prompt_lists_are_split_as_upstream_reads_them():
    assert split_prompts("a") == ["a"]
    assert split_prompts([1, 2]) == [[1, 2]]
    assert split_prompts([1, "a"]) == [[1, "a"]]
    assert split_prompts(["a", "b"]) == ["a", "b"]
    assert split_prompts([[1], [2, 3]]) == [[1], [2, 3]]


EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(8)]
HUNG_UP = threading.Event()


async def echo_app(scope, receive, send):
    """An upstream that answers every request with what it received: method, raw path, query, headers, body."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body, more = b"", True
    while more:
        msg = await receive()
        body, more = body + msg.get("body", b""), msg.get("more_body", False)
    if scope["path"] == "/completion" and b'"stream"' in body:     # one event, then wait for the client to go
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": EVENTS[0], "more_body": True})
        if (await receive())["type"] == "http.disconnect":
            HUNG_UP.set()
        return
    if scope["path"] == "/events":                  # EVENTS, one HTTP chunk each, sent back to back
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for ev in EVENTS:
            await send({"type": "http.response.body", "body": ev, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    out = json.dumps({"method": scope["method"], "raw_path": scope["raw_path"].decode(),
                      "query": scope["query_string"].decode(), "body": body.decode(),
                      "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"x-upstream", b"a"), (b"x-upstream", b"b")]})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture()
def echo(tmp_path, proxy):
    """An echo upstream that closes idle connections after 1 s, and a recorder in front of it."""
    up = ThreadedUvicorn(echo_app, timeout_keep_alive=1).start()
    rec = BackgroundRecorder(up.base_url, tmp_path / "echo.jsonl", proxy=proxy).start()
    yield up, rec
    rec.stop()
    up.stop()


def test_the_upstream_gets_the_request_as_the_client_sent_it(echo):
    up, rec = echo
    raw = b'{"anything": [1, 2]}'
    headers = {"X-Custom": "v1", "Authorization": "Bearer k", "Content-Type": "text/plain"}
    with httpx.Client(timeout=30) as c:
        via = c.put(rec.base_url + "/some%20where/x%2Fy?a=1&b=%C3%A9", content=raw, headers=headers)
        direct = c.put(up.base_url + "/some%20where/x%2Fy?a=1&b=%C3%A9", content=raw, headers=headers)
    assert via.status_code == 200 and via.headers.get_list("x-upstream") == ["a", "b"]
    a, b = via.json(), direct.json()
    assert a["method"] == "PUT" and a["raw_path"] == "/some%20where/x%2Fy" and a["query"] == "a=1&b=%C3%A9"
    assert a["body"] == raw.decode()
    host = up.base_url.split("://")[1]
    # the same headers in the same order but the hop-by-hop `Connection`; Host names the upstream (as for a
    # direct client); nothing added (no User-Agent or Accept of the proxy's own)
    assert a["headers"] == [[k, host if k == "host" else v] for k, v in b["headers"] if k != "connection"]


def test_a_stream_keeps_the_upstream_chunks_even_when_they_come_in_together(echo):
    up, rec = echo
    with httpx.Client(timeout=30) as c, c.stream("GET", rec.base_url + "/events") as s:
        got = list(s.iter_raw())
    ends = {sum(map(len, got[:i + 1])) for i in range(len(got))}
    assert b"".join(got) == b"".join(EVENTS)
    assert {sum(map(len, EVENTS[:i + 1])) for i in range(len(EVENTS))} <= ends   # each event ends a chunk


def test_a_client_that_hangs_up_mid_stream_ends_the_upstream_request(echo, tmp_path):
    up, rec = echo
    HUNG_UP.clear()
    with httpx.Client(timeout=30) as c, c.stream("POST", rec.base_url + "/completion", json={"stream": True}) as s:
        assert next(s.iter_raw()) == EVENTS[0]
    assert HUNG_UP.wait(10)                       # the proxy closed its upstream connection
    assert rec.recorder.stats["not_recorded_interrupted"] == 1
    assert len(lines(tmp_path / "echo.jsonl")) == 1                # the header only


def test_a_connection_the_upstream_closed_while_idle_is_not_reused(echo):
    up, rec = echo
    with httpx.Client(base_url=rec.base_url, timeout=30) as c:
        assert c.post("/completion", content=b"{}").status_code == 200
        time.sleep(1.5)                           # the upstream closes the idle keep-alive connection
        assert c.post("/completion", content=b"{}").status_code == 200


def test_the_stream_tap_parses_complete_events_however_the_chunks_cut_them():
    stream = (b'data: {"a": 1}\n\n: comment\ndata: {"b": 2}\r\n\r\ndata: [DONE]\n\n'
              b'data: not json\n\ndata: {"c": 3}\n\ndata: {"d": 4}')      # the last event is not complete
    whole = SSETap()
    whole.feed(stream)
    assert whole.events() == [{"a": 1}, {"b": 2}, {"c": 3}]
    for cut in range(1, len(stream)):
        tap = SSETap()
        tap.feed(stream[:cut])
        tap.feed(stream[cut:])
        assert tap.events() == whole.events(), cut


def test_serve_keeps_h11_and_asyncio_whatever_is_installed():
    config = uvicorn_config(echo_app, "127.0.0.1", 0, "warning")
    assert (config.http, config.loop) == ("h11", "asyncio")


def raw_exchange(base_url: str, data: bytes, n_responses: int, heads: tuple[int, ...] = ()) -> tuple[list, bool]:
    """Send raw bytes to the proxy, read what comes back until the connection closes or stays quiet for 0.5 s
    after `n_responses` answers; parse the answers (status, headers, body; those at indexes `heads` answer a
    HEAD: no body) and say whether the proxy closed the connection."""
    host, port = base_url.split("://")[1].split(":")
    buf, closed = b"", False
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        t_end = time.monotonic() + 20
        while time.monotonic() < t_end:
            s.settimeout(0.5 if buf.count(b"HTTP/1.") >= n_responses else 10)
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                closed = True
                break
            buf += chunk
    out = []
    while buf and len(out) < n_responses + 1:
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
        body = b""
        if len(out) in heads or 100 <= status < 200:
            pass
        elif headers.get("transfer-encoding") == "chunked":
            while True:
                size, _, buf = buf.partition(b"\r\n")
                n = int(size, 16)
                body, buf = body + buf[:n], buf[n + 2:]
                if n == 0:
                    break
        elif "content-length" in headers:
            n = int(headers["content-length"])
            body, buf = buf[:n], buf[n:]
        else:                                             # ended by the close
            body, buf = buf, b""
        out.append((status, headers, body))
    return out, closed


def req(method: str, target: str, body: bytes = b"", extra: str = "", version: str = "1.1") -> bytes:
    head = f"{method} {target} HTTP/{version}\r\nHost: x\r\n{extra}"
    if body or method == "POST":
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def echoed(body: bytes) -> dict:
    return json.loads(body)


def test_pipelined_requests_are_answered_in_order_on_one_connection(echo):
    up, rec = echo
    got, closed = raw_exchange(rec.base_url, req("POST", "/a", b"1") + req("POST", "/b", b"22") + req("GET", "/c"), 3)
    assert [(s, echoed(b)["raw_path"], echoed(b)["body"]) for s, _, b in got] == \
        [(200, "/a", "1"), (200, "/b", "22"), (200, "/c", "")]
    assert not closed                                     # keep-alive: the connection stays open


def test_a_client_that_asks_to_close_gets_its_answer_then_the_close(echo):
    up, rec = echo
    got, closed = raw_exchange(rec.base_url, req("POST", "/a", b"{}", "Connection: close\r\n"), 1)
    assert got[0][0] == 200 and closed
    got, closed = raw_exchange(rec.base_url, req("GET", "/old", version="1.0"), 1)
    assert got[0][0] == 200 and echoed(got[0][2])["raw_path"] == "/old" and closed


def test_expect_100_continue_is_answered_and_the_body_goes_on(echo):
    up, rec = echo
    got, _ = raw_exchange(rec.base_url, req("POST", "/e", b'{"k": 1}', "Expect: 100-continue\r\n"), 2)
    assert got[0][0] == 100 and got[1][0] == 200
    assert echoed(got[1][2])["body"] == '{"k": 1}'       # (the relay answers the 100 itself: it needs the body)


def test_a_chunked_request_body_reaches_the_upstream_whole(echo):
    up, rec = echo
    body = b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    got, _ = raw_exchange(rec.base_url, req("POST", "/c", extra="Transfer-Encoding: chunked\r\n")[:-2]
                          .replace(b"Content-Length: 0\r\n", b"") + b"\r\n" + body, 1)
    sent = echoed(got[0][2])
    assert sent["body"] == "hello world" and dict(sent["headers"])["content-length"] == "11"


def test_a_head_request_keeps_the_connection_usable(echo):
    up, rec = echo
    got, closed = raw_exchange(rec.base_url, req("HEAD", "/h") + req("GET", "/after"), 2, heads=(0,))
    assert [s for s, _, _ in got] == [200, 200] and got[0][2] == b""
    assert echoed(got[1][2])["raw_path"] == "/after" and not closed


def test_a_request_that_is_not_http_is_a_400(echo):
    up, rec = echo
    got, closed = raw_exchange(rec.base_url, b"NOT HTTP AT ALL\r\n\r\n", 1)
    assert got[0][0] == 400 and closed


class ClosingUpstream:
    """An upstream that announces keep-alive but closes a connection, unanswered, when a second request comes
    on it (the race of a server that closes each connection after its answer): a thread of its own. It
    answers `/tokenize` with three ids and anything else with a native completion."""

    TOKENIZED = b'{"tokens": [1, 2, 3]}'
    ANSWER = json.dumps({"index": 0, "content": "ab", "tokens": [5, 6], "id_slot": 0, "stop": True,
                         "tokens_predicted": 2, "tokens_evaluated": 3, "stop_type": "limit",
                         "timings": {"cache_n": 0, "prompt_n": 3, "predicted_n": 2}}).encode()

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    @staticmethod
    def handle(conn: socket.socket) -> None:
        with conn:
            buf, answered = b"", 0
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                buf += data
                if b"\r\n\r\n" not in buf:
                    continue
                if answered:
                    return                                    # the second request: closed unanswered
                body = ClosingUpstream.TOKENIZED if buf.startswith(b"POST /tokenize ") else ClosingUpstream.ANSWER
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nKeep-Alive: timeout=5, max=100\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                buf, answered = b"", 1


def test_a_request_on_a_connection_the_upstream_closes_unanswered_is_sent_again(tmp_path, proxy):
    up = ClosingUpstream()
    rec = BackgroundRecorder(up.base_url, tmp_path / "t.jsonl", proxy=proxy).start()
    try:
        with httpx.Client(base_url=rec.base_url, timeout=30) as c:
            got = [c.post(f"/r{i}", content=b"{}").status_code for i in range(4)]    # POST: not idempotent
    finally:
        rec.stop()
        up.sock.close()
    assert got == [200] * 4 and up.connections == 4
    assert rec.recorder.stats["upstream_resent"] == 3             # each reuse raced the close once


def test_the_recording_calls_to_tokenize_are_sent_again_too(tmp_path, proxy):
    up = ClosingUpstream()
    rec = BackgroundRecorder(up.base_url, tmp_path / "t.jsonl", proxy=proxy).start()
    try:
        with httpx.Client(base_url=rec.base_url, timeout=30) as c:
            for _ in range(4):
                assert c.post("/completion", json={"prompt": "a text prompt", "n_predict": 2}).status_code == 200
            got = wait_lines(tmp_path / "t.jsonl", 5)
    finally:
        rec.stop()
        up.sock.close()
    assert [x["prompt_tokens"] for x in got[1:]] == [[1, 2, 3]] * 4
    assert [x["output_tokens"] for x in got[1:]] == [[5, 6]] * 4
    assert rec.recorder.stats["upstream_resent_recording"] >= 1 and rec.recorder.stats["recorded"] == 4
