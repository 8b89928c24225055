"""What `slotlab record` adds per request: C concurrent closed-loop clients against a stand-in llama-server,
directly and through the recorder, in interleaved rounds (direct, [relay], recorders, [baseline], direct, ...)
so that load drift hits every path alike; per-request latency P50/P90 of each path, the difference, and the
CPU seconds per request of the recorder and of the upstream processes.

Processes: the stand-in upstream (this script, `--serve-upstream`), one recorder per `--proxy` (default: both,
`relay` and `asgi`) as `slotlab record` in its own process (as it runs in front of a server), with
`--baseline DIR` one more recorder from another source tree (e.g. `git archive REV | tar -x -C DIR`; its
default proxy) measured in the same rounds, with `--relay` a byte relay that parses nothing (this script,
`--serve-relay`: the floor of what any proxy process adds), and the clients (aiohttp) in this process.
Upstream, recorders and clients share the machine's cores, so on a small machine the latency difference also
measures CPU contention; the recorder's CPU per request (from /proc, including its
/tokenize and /apply-template calls and the trace line, read once every line of the round is on disk) is
the figure that does not depend on what else runs.

The stand-in upstream answers at once (or after `--delay-ms`, spread over the tokens of a stream), with
llama-server's bodies (tools/server/server-task.cpp, `to_json_non_oaicompat`, `to_json_oaicompat_chat`,
`to_json_oaicompat_chat_stream`): native `/completion` (stream and not, `return_tokens`), `/v1/chat/completions`
(stream and not), `/tokenize`, `/apply-template`. Clients cycle through the four kinds of request in `--mix`.

    python benchmarks/bench_record_proxy.py                           # 16 clients, 3 rounds x 20 requests each
    python benchmarks/bench_record_proxy.py --baseline /tmp/before    # + the recorder of another tree
    python benchmarks/bench_record_proxy.py --delay-ms 50 --relay --rounds 9    # docs/cli.md "Cost, now"
    python benchmarks/bench_record_proxy.py --delay-ms 50 --mix native
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("native", "native-stream", "chat", "chat-stream")
PROMPT = ("You are a helpful assistant. Summarize the following text in two sentences: The quick brown fox "
          "jumps over the lazy dog while the farmer watches from the porch, wondering whether the fence will "
          "hold through the winter storms that the radio promised for the coming week. ") * 2
TIMINGS_BASE = {"cache_n": 0, "prompt_ms": 12.5, "prompt_per_token_ms": 0.16, "prompt_per_second": 6100.0,
                "predicted_per_token_ms": 6.1, "predicted_per_second": 163.9}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the stand-in upstream --------------------------------------------------------------------------------

def upstream_app(delay_s: float):
    """A raw ASGI app (cheap, so that its own CPU disturbs the measurement little)."""
    settings = {"seed": 4294967295, "temperature": 0.8, "dynatemp_range": 0.0, "dynatemp_exponent": 1.0,
                "top_k": 40, "top_p": 0.95, "min_p": 0.05, "top_n_sigma": -1.0, "xtc_probability": 0.0,
                "xtc_threshold": 0.1, "typical_p": 1.0, "repeat_last_n": 64, "repeat_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75,
                "dry_allowed_length": 2, "dry_penalty_last_n": 4096, "dry_sequence_breakers": ["\n", ":", "\"", "*"],
                "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "stop": [], "max_tokens": 16,
                "n_predict": 16, "n_keep": 0, "n_discard": 0, "ignore_eos": False, "stream": False,
                "logit_bias": [], "n_probs": 0, "min_keep": 0, "grammar": "", "grammar_lazy": False,
                "grammar_triggers": [], "preserved_tokens": [], "chat_format": "Content-only",
                "reasoning_format": "auto", "reasoning_in_content": False, "generation_prompt": "",
                "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                             "temperature"], "speculative.types": ["none"], "timings_per_token": False,
                "post_sampling_probs": False, "backend_sampling": False, "lora": []}
    oai = {"created": 1767225600, "model": "stand-in.gguf", "system_fingerprint": "b7000-0123abcd",
           "id": "chatcmpl-0123456789abcdef0123456789abcdef"}

    def n_prompt_of(text: str) -> int:
        return len(text) // 4 + 1

    def timings(n_prompt: int, n: int) -> dict:
        return {**TIMINGS_BASE, "prompt_n": n_prompt, "predicted_n": n, "predicted_ms": 6.1 * n}

    def chat_text(body: dict) -> str:
        return "".join(f"<|im_start|>{m.get('role')}\n{m.get('content')}<|im_end|>\n"
                       for m in body.get("messages", [])) + "<|im_start|>assistant\n"

    def native_final(body: dict, n_prompt: int, n: int, stream: bool) -> dict:
        return {"index": 0, "content": "" if stream else " word" * n,
                "tokens": list(range(1000, 1000 + n)) if body.get("return_tokens") and not stream else [],
                "id_slot": 0, "stop": True, "model": oai["model"], "tokens_predicted": n, "tokens_evaluated": n_prompt,
                "generation_settings": {**settings, "n_predict": n, "max_tokens": n, "stream": stream},
                "prompt": "<s>" + str(body.get("prompt")), "has_new_line": False, "truncated": False,
                "stop_type": "limit", "stopping_word": "", "tokens_cached": n_prompt + n - 1,
                "timings": timings(n_prompt, n)}

    def chunk(choices: list, **extra) -> dict:
        return {"choices": choices, "created": oai["created"], "id": oai["id"], "model": oai["model"],
                "system_fingerprint": oai["system_fingerprint"], "object": "chat.completion.chunk", **extra}

    def sse(obj) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def events(path: str, body: dict, n_prompt: int, n: int):
        if path == "/completion":
            for i in range(n):
                yield sse({"index": 0, "content": " word", "tokens": [1000 + i], "stop": False, "id_slot": -1,
                           "tokens_predicted": i + 1, "tokens_evaluated": n_prompt})
            yield sse(native_final(body, n_prompt, n, True))
            return
        yield sse(chunk([{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}]))
        for _ in range(n):
            yield sse(chunk([{"finish_reason": None, "index": 0, "delta": {"content": " word"}}]))
        yield sse(chunk([{"finish_reason": "length", "index": 0, "delta": {}}], timings=timings(n_prompt, n)))
        yield b"data: [DONE]\n\n"

    def answer(path: str, body: dict) -> tuple[int, bytes]:
        if path == "/tokenize":
            return 200, json.dumps({"tokens": list(range(1, n_prompt_of(str(body.get("content"))) + 1))}).encode()
        if path == "/apply-template":
            return 200, json.dumps({"prompt": chat_text(body)}).encode()
        n = body.get("n_predict", body.get("max_tokens", 16))
        if path == "/completion":
            return 200, json.dumps(native_final(body, n_prompt_of(str(body.get("prompt"))), n, False),
                                   separators=(",", ":")).encode()
        if path == "/v1/chat/completions":
            n_prompt = n_prompt_of(chat_text(body))
            return 200, json.dumps({
                "choices": [{"finish_reason": "length", "index": 0,
                             "message": {"role": "assistant", "content": " word" * n}}],
                "created": oai["created"], "model": oai["model"], "system_fingerprint": oai["system_fingerprint"],
                "object": "chat.completion", "usage": {"completion_tokens": n, "prompt_tokens": n_prompt,
                                                       "total_tokens": n + n_prompt,
                                                       "prompt_tokens_details": {"cached_tokens": 0}},
                "id": oai["id"], "timings": timings(n_prompt, n)}, separators=(",", ":")).encode()
        return 404, b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        raw = b""
        more = True
        while more:
            msg = await receive()
            raw += msg.get("body", b"")
            more = msg.get("more_body", False)
        body = json.loads(raw) if raw else {}
        path = scope["path"]
        if body.get("stream") and path in ("/completion", "/v1/chat/completions"):
            n = body.get("n_predict", body.get("max_tokens", 16))
            n_prompt = n_prompt_of(str(body.get("prompt")) if path == "/completion" else chat_text(body))
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"server", b"llama.cpp")]})
            for ev in events(path, body, n_prompt, n):
                if delay_s:
                    await asyncio.sleep(delay_s / (n + 1))
                await send({"type": "http.response.body", "body": ev, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if delay_s and path != "/tokenize" and path != "/apply-template":
            await asyncio.sleep(delay_s)
        status, out = answer(path, body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json; charset=utf-8"), (b"server", b"llama.cpp"),
                                (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    return app


def serve_upstream(port: int, delay_s: float) -> None:
    import uvicorn

    from experiments.record import server_options
    uvicorn.run(upstream_app(delay_s), host="127.0.0.1", port=port, log_level="warning", access_log=False,
                lifespan="on", server_header=False, date_header=False, ws="none", **server_options())


# --- a byte relay: the floor of any proxy ------------------------------------------------------------------

def serve_relay(port: int, upstream_port: int) -> None:
    """A TCP relay that copies bytes both ways and parses nothing: one more process hop with the least work
    a proxy can do per request (one accept per client connection, one upstream connection each, no HTTP).
    What it adds is what the hop itself costs on this machine (wake-ups, loopback copies, a core to run on);
    a recorder cannot add less."""
    import uvloop

    from experiments.record_relay import nodelay

    class Up(asyncio.Protocol):
        def __init__(self, down: asyncio.Transport) -> None:
            self.down = down

        def connection_made(self, t) -> None:
            nodelay(t)

        def data_received(self, data: bytes) -> None:
            self.down.write(data)

        def connection_lost(self, exc) -> None:
            self.down.close()

    class Down(asyncio.Protocol):
        def connection_made(self, t) -> None:
            self.t, self.up, self.early = t, None, []
            nodelay(t)
            asyncio.get_running_loop().create_task(self.connect())

        async def connect(self) -> None:
            self.up, _ = await asyncio.get_running_loop().create_connection(
                lambda: Up(self.t), "127.0.0.1", upstream_port)
            if self.t.is_closing():                     # the client left while the upstream connection opened
                self.up.close()
            for data in self.early:                     # what the client sent before the upstream was open
                self.up.write(data)

        def data_received(self, data: bytes) -> None:
            if self.up is None:
                self.early.append(data)
            else:
                self.up.write(data)

        def connection_lost(self, exc) -> None:
            if self.up is not None:
                self.up.close()

    async def run() -> None:
        server = await asyncio.get_running_loop().create_server(Down, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(run())


# --- clients ----------------------------------------------------------------------------------------------

def request_of(kind: str, n_predict: int) -> tuple[str, dict]:
    stream = kind.endswith("-stream")
    if kind.startswith("native"):
        return "/completion", {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0.8, "stream": stream}
    return "/v1/chat/completions", {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                                                 {"role": "user", "content": PROMPT}],
                                    "max_tokens": n_predict, "temperature": 0.8, "stream": stream}


async def one_round(base_url: str, clients: int, per_client: int, kinds: tuple[str, ...],
                    n_predict: int) -> list[tuple[str, float]]:
    """Each request's kind and latency (seconds from sending it to its answer's last byte)."""
    import aiohttp

    lat: list[tuple[str, float]] = []
    reqs = [request_of(k, n_predict) for k in kinds]

    async def client(s: aiohttp.ClientSession, c: int) -> None:
        for i in range(per_client):
            k = (c + i) % len(reqs)
            path, body = reqs[k]
            t0 = time.perf_counter()
            try:
                async with s.post(base_url + path, json=body) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{base_url}{path} answered {r.status}: {(await r.read())[:200]!r}")
                    async for _chunk in r.content.iter_any():
                        pass
            except aiohttp.ClientError as e:
                raise RuntimeError(f"{base_url}{path}: {type(e).__name__}: {e}") from e
            lat.append((kinds[k], time.perf_counter() - t0))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        await asyncio.gather(*(client(s, c) for c in range(clients)))
    return lat


# --- processes --------------------------------------------------------------------------------------------

def cpu_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process so far (Linux /proc/PID/stat, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def since(pid: int, t0: tuple[float, float]) -> tuple[float, float]:
    t1 = cpu_s(pid)
    return t1[0] - t0[0], t1[1] - t0[1]


def threads_of(pid: int) -> int:
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("Threads:"))


def runtime_of(pid: int) -> str:
    """Which event loop and HTTP parser a process has loaded (uvicorn picks them at start)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return ("uvloop" if "/uvloop/" in maps else "asyncio") + "+" + ("httptools" if "/httptools/" in maps else "h11")


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end and proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} (process exited with {proc.poll()})")


def n_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f) - 1
    except FileNotFoundError:
        return 0


def wait_lines(path: Path, n: int, timeout_s: float = 30.0) -> int:
    t_end = time.monotonic() + timeout_s
    while (got := n_lines(path)) < n and time.monotonic() < t_end:
        time.sleep(0.01)
    return got


def content_of(path: Path) -> list[str]:
    """The trace's lines without the times that differ from run to run (arrival, end, first byte), sorted."""
    out = []
    with open(path, encoding="utf-8") as f:
        next(f)
        for line in f:
            d = json.loads(line)
            d.pop("arrival_s", None)
            for k in ("end_s", "first_byte_s"):
                d.get("recorded", {}).pop(k, None)
            out.append(json.dumps(d, sort_keys=True))
    return sorted(out)


class Path_:
    """One way to the upstream: direct, or through a recorder process."""

    def __init__(self, name: str, url: str, proc: subprocess.Popen | None = None, trace: Path | None = None):
        self.name, self.url, self.proc, self.trace = name, url, proc, trace
        self.lat: list[tuple[str, float]] = []
        self.cpu = [0.0, 0.0]           # user, system seconds over the path's rounds
        self.up_cpu = [0.0, 0.0]
        self.missing = 0


def uptime() -> str:
    exe = shutil.which("uptime")
    if exe:
        return subprocess.run([exe], capture_output=True, text=True).stdout.strip()
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=20, help="requests per client per round (default: 20)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per path, interleaved (default: 3)")
    ap.add_argument("--mix", default=",".join(KINDS),
                    help=f"request kinds the clients cycle through, comma-separated (default: {','.join(KINDS)})")
    ap.add_argument("--n-predict", type=int, default=16, help="tokens per answer (default: 16)")
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="stand-in upstream's time per request (default: 0, it answers at once)")
    ap.add_argument("--baseline", metavar="DIR", type=Path,
                    help="also measure the recorder of this source tree, in the same rounds")
    ap.add_argument("--baseline-pythonpath", metavar="PATHS", default="",
                    help="PYTHONPATH entries after the baseline tree (default: none; this tree's processes keep "
                         "the caller's PYTHONPATH)")
    ap.add_argument("--upstream", help="measure against this running server instead of the stand-in")
    ap.add_argument("--proxy", default="relay,asgi",
                    help="the recorder's proxies to measure (slotlab record --proxy), comma-separated "
                         "(default: relay,asgi)")
    ap.add_argument("--relay", action="store_true",
                    help="also measure a byte relay (a process that copies bytes both ways and parses no HTTP): "
                         "the floor of what any proxy process adds on this machine")
    ap.add_argument("--serve-upstream", type=int, metavar="PORT", help=argparse.SUPPRESS)
    ap.add_argument("--serve-relay", type=int, nargs=2, metavar=("PORT", "UPSTREAM_PORT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_relay:
        serve_relay(*args.serve_relay)
        return 0
    if args.serve_upstream:
        serve_upstream(args.serve_upstream, args.delay_ms / 1e3)
        return 0
    kinds = tuple(args.mix.split(","))
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--mix takes kinds out of {', '.join(KINDS)}, got {args.mix!r}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_record_"))
    procs: list[subprocess.Popen] = []

    def start(cmd: list[str], tree: Path, port: int) -> subprocess.Popen:
        # this tree's processes keep the caller's PYTHONPATH after the tree; a baseline tree has its own
        extra = [os.environ.get("PYTHONPATH", "") if tree == ROOT else args.baseline_pythonpath]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), *extra]))}
        p = subprocess.Popen(cmd, env=env, cwd=tmp)
        procs.append(p)
        wait_listening(port, p)
        return p

    try:
        up_proc = None
        if args.upstream:
            upstream = args.upstream.rstrip("/")
        else:
            port = free_port()
            up_proc = start([sys.executable, str(Path(__file__).resolve()), "--serve-upstream", str(port),
                             "--delay-ms", str(args.delay_ms)], ROOT, port)
            upstream = f"http://127.0.0.1:{port}"
        paths = [Path_("direct", upstream)]
        if args.relay:
            rport = free_port()
            relay = start([sys.executable, str(Path(__file__).resolve()), "--serve-relay", str(rport),
                           str(port_of(upstream))], ROOT, rport)
            paths.append(Path_("relay", f"http://127.0.0.1:{rport}", relay))
        recorders = [(f"rec-{proxy}", ROOT, ["--proxy", proxy]) for proxy in args.proxy.split(",")]
        if args.baseline:
            recorders.append(("baseline", args.baseline, []))
        for name, tree, extra in recorders:
            rport, trace = free_port(), tmp / f"{name}.jsonl"
            rec = start([sys.executable, "-m", "experiments.cli", "record", "--upstream", upstream, "--out",
                         str(trace), "--port", str(rport), *extra], tree.resolve(), rport)
            paths.append(Path_(name, f"http://127.0.0.1:{rport}", rec, trace))
        for p in paths:                                              # warm-up: connections, imports, caches
            asyncio.run(one_round(p.url, args.clients, 1, kinds, args.n_predict))
            if p.trace:
                wait_lines(p.trace, args.clients)
        up_before = uptime()
        for r in range(args.rounds):
            for p in paths[r % len(paths):] + paths[:r % len(paths)]:     # the order turns each round
                c0 = cpu_s(p.proc.pid) if p.proc else (0.0, 0.0)
                u0 = cpu_s(up_proc.pid) if up_proc else (0.0, 0.0)
                want = n_lines(p.trace) + args.clients * args.requests if p.trace else 0
                p.lat += asyncio.run(one_round(p.url, args.clients, args.requests, kinds, args.n_predict))
                if p.trace:
                    p.missing += want - wait_lines(p.trace, want)    # every line of the round is on disk
                if p.proc:
                    p.cpu = [a + b for a, b in zip(p.cpu, since(p.proc.pid, c0))]
                if up_proc:
                    p.up_cpu = [a + b for a, b in zip(p.up_cpu, since(up_proc.pid, u0))]
        up_after = uptime()
        info = {p.name: (threads_of(p.proc.pid), runtime_of(p.proc.pid)) for p in paths if p.proc}
        if up_proc:
            info["upstream"] = (threads_of(up_proc.pid), runtime_of(up_proc.pid))
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)

    def q(v: list[tuple[str, float]], kind: str | None = None) -> tuple[float, float, float]:
        v = [t for k, t in v if kind is None or k == kind]
        dec = statistics.quantiles(v, n=10)
        return statistics.median(v) * 1e3, dec[8] * 1e3, statistics.fmean(v) * 1e3

    n = args.clients * args.requests * args.rounds
    print(f"{args.clients} clients, {n} requests per path in {args.rounds} interleaved rounds, mix {','.join(kinds)}, "
          f"{args.n_predict} tokens per answer, upstream {upstream}"
          + (f" (stand-in, {args.delay_ms:g} ms per request)" if not args.upstream else ""))
    print(f"load before: {up_before}\nload after:  {up_after}\n{os.cpu_count()} CPUs; processes (OS threads, "
          f"loop+parser): " + ", ".join(f"{k} {t} threads {rt}" for k, (t, rt) in info.items())
          + f"; clients in this process ({threading_count()} threads, aiohttp on asyncio)")
    d = q(paths[0].lat)
    def per_req(c: list[float]) -> str:
        return f"{sum(c) / n * 1e3:.3f} ({c[0] / n * 1e3:.2f}+{c[1] / n * 1e3:.2f})"

    print(f"{'path':10}{'P50 ms':>9}{'P90 ms':>9}{'mean ms':>9}{'+P50':>9}{'+P90':>9}{'+mean':>9}"
          f"{'CPU ms/req (usr+sys)':>23}{'upstream CPU ms/req':>23}")
    for p in paths:
        x = q(p.lat)
        cpu = f"{per_req(p.cpu):>23}" if p.proc else f"{'':23}"
        upc = f"{per_req(p.up_cpu):>23}" if up_proc else f"{'':23}"
        print(f"{p.name:10}{x[0]:9.2f}{x[1]:9.2f}{x[2]:9.2f}{x[0] - d[0]:+9.2f}{x[1] - d[1]:+9.2f}{x[2] - d[2]:+9.2f}"
              f"{cpu}{upc}")
    if len(kinds) > 1:
        print("by kind, P50 / P90 ms: " + "; ".join(
            f"{k}: " + ", ".join(f"{p.name} {q(p.lat, k)[0]:.1f} / {q(p.lat, k)[1]:.1f}" for p in paths)
            for k in kinds))
    traced = [p for p in paths if p.trace]
    for p in traced:
        print(f"{p.name}: {n_lines(p.trace)} trace lines" + (f", {p.missing} missing" if p.missing else ""))
    for p in traced[1:]:
        same = content_of(traced[0].trace) == content_of(p.trace)
        print(f"trace content (times aside) of {traced[0].name} and {p.name}: {'identical' if same else 'DIFFERENT'}")
    print(f"CPU per request: user + system seconds of the process over its rounds / {n} requests "
          f"(clock tick {1e3 / os.sysconf('SC_CLK_TCK'):g} ms)")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


def port_of(url: str) -> int:
    from urllib.parse import urlsplit
    port = urlsplit(url).port
    if port is None:
        raise SystemExit(f"--relay needs an upstream URL with a port, got {url}")
    return port


def threading_count() -> int:
    import threading
    return threading.active_count()


if __name__ == "__main__":
    sys.exit(main())
