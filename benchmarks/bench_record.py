"""Latency `slotlab record` adds per request: C concurrent closed-loop clients against an upstream, directly
and through the recorder, in interleaved rounds (direct, proxied, direct, ...) so load drift hits both alike.

The upstream is, by default, a stand-in llama-server (a separate process) that answers native `/completion`
after a fixed delay (`--delay-ms`, an LLM request's duration) with a body of llama-server's shape and size,
and `/tokenize` at once; `--upstream URL` measures against a running server instead (`slotlab serve`, a real
llama-server). The recorder runs as `slotlab record` in its own process, as it would in front of a server.

    python benchmarks/bench_record.py                      # 16 clients, 50 ms upstream, 4 rounds x 25 requests
    python benchmarks/bench_record.py --stream --delay-ms 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the stand-in upstream --------------------------------------------------------------------------------

def serve_mock(port: int, delay_s: float) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    def final(body: dict) -> dict:
        n = int(body.get("n_predict", 16))
        return {"index": 0, "content": "x" * 4 * n, "tokens": list(range(100, 100 + n)) if body.get("return_tokens")
                else [], "id_slot": 0, "stop": True, "model": "mock", "tokens_predicted": n, "tokens_evaluated": 32,
                "generation_settings": {f"setting_{i}": 0.5 for i in range(40)}, "prompt": "p" * 120,
                "has_new_line": False, "truncated": False, "stop_type": "limit", "stopping_word": "",
                "tokens_cached": 31 + n, "timings": {"cache_n": 0, "prompt_n": 32, "prompt_ms": 5.0,
                                                     "prompt_per_token_ms": 0.15, "prompt_per_second": 6000.0,
                                                     "predicted_n": n, "predicted_ms": delay_s * 1e3,
                                                     "predicted_per_token_ms": 3.0, "predicted_per_second": 330.0}}

    async def completion(request):
        body = json.loads(await request.body())
        if body.get("stream"):
            n = int(body.get("n_predict", 16))

            async def events():
                for i in range(n):
                    await asyncio.sleep(delay_s / n)
                    yield b"data: " + json.dumps({"index": 0, "content": "xxxx", "tokens": [100 + i], "stop": False,
                                                  "id_slot": -1, "tokens_predicted": i + 1,
                                                  "tokens_evaluated": 32}).encode() + b"\n\n"
                yield b"data: " + json.dumps({**final(body), "tokens": []}).encode() + b"\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        await asyncio.sleep(delay_s)
        return Response(json.dumps(final(body), separators=(",", ":")).encode(), media_type="application/json")

    async def tokenize(request):
        body = json.loads(await request.body())
        return Response(json.dumps({"tokens": list(range(len(str(body.get("content", ""))) // 4 + 1))}),
                        media_type="application/json")

    app = Starlette(routes=[Route("/completion", completion, methods=["POST"]),
                            Route("/tokenize", tokenize, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# --- clients ----------------------------------------------------------------------------------------------

async def one_round(base_url: str, clients: int, per_client: int, stream: bool) -> list[float]:
    import httpx

    lat: list[float] = []
    body = {"prompt": "Once upon a time " * 8, "n_predict": 16, "stream": stream}

    async def client(c: httpx.AsyncClient) -> None:
        for _ in range(per_client):
            t0 = time.perf_counter()
            if stream:
                async with c.stream("POST", "/completion", json=body) as r:
                    async for _chunk in r.aiter_raw():
                        pass
            else:
                r = await c.post("/completion", json=body)
                r.raise_for_status()
            lat.append(time.perf_counter() - t0)

    async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                 limits=httpx.Limits(max_connections=clients + 4)) as c:
        await client_warmup(c, body)
        await asyncio.gather(*(client(c) for _ in range(clients)))
    return lat


async def client_warmup(c, body) -> None:
    r = await c.post("/completion", json={**body, "stream": False})
    r.raise_for_status()


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_listening(port: int, timeout_s: float = 30.0) -> None:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=25, help="requests per client per round (default: 25)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per path, interleaved (default: 4)")
    ap.add_argument("--delay-ms", type=float, default=50.0, help="stand-in upstream's time per request (default: 50)")
    ap.add_argument("--stream", action="store_true", help="streamed requests (SSE)")
    ap.add_argument("--upstream", help="measure against this running server instead of the stand-in")
    ap.add_argument("--serve-mock", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_mock:
        serve_mock(args.serve_mock, args.delay_ms / 1e3)
        return 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = []
    try:
        if args.upstream:
            upstream = args.upstream.rstrip("/")
        else:
            port = free_port()
            procs.append(subprocess.Popen([sys.executable, __file__, "--serve-mock", str(port),
                                           "--delay-ms", str(args.delay_ms)], env=env))
            wait_listening(port)
            upstream = f"http://127.0.0.1:{port}"
        rport = free_port()
        trace = Path(tempfile.mkdtemp()) / "bench_trace.jsonl"
        procs.append(subprocess.Popen([sys.executable, "-m", "experiments.cli", "record", "--upstream", upstream,
                                       "--out", str(trace), "--port", str(rport)], env=env, stderr=subprocess.DEVNULL))
        wait_listening(rport)
        proxied = f"http://127.0.0.1:{rport}"
        load0 = os.getloadavg()
        direct_lat, proxy_lat = [], []
        rec_pid = procs[-1].pid
        cpu = up_cpu = 0.0
        for _ in range(args.rounds):
            u0 = cpu_s(procs[0].pid) if not args.upstream else 0.0
            direct_lat += asyncio.run(one_round(upstream, args.clients, args.requests, args.stream))
            up_cpu += (cpu_s(procs[0].pid) - u0) if not args.upstream else 0.0
            c0 = cpu_s(rec_pid)
            proxy_lat += asyncio.run(one_round(proxied, args.clients, args.requests, args.stream))
            time.sleep(0.3)                      # the last lines' /tokenize calls
            cpu += cpu_s(rec_pid) - c0
        load1 = os.getloadavg()
        n_lines = sum(1 for _ in open(trace)) - 1
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)

    def stats(v: list[float]) -> tuple[float, float, float]:
        q = statistics.quantiles(v, n=10)
        return statistics.median(v) * 1e3, statistics.fmean(v) * 1e3, q[8] * 1e3

    d, p = stats(direct_lat), stats(proxy_lat)
    print(f"{args.clients} clients, {len(direct_lat)} requests per path, upstream {upstream}"
          f"{' (stand-in, %.0f ms per request)' % args.delay_ms if not args.upstream else ''}"
          f"{', streamed' if args.stream else ''}")
    print(f"{'':10}{'median ms':>11}{'mean ms':>10}{'p90 ms':>9}")
    print(f"{'direct':10}{d[0]:>11.2f}{d[1]:>10.2f}{d[2]:>9.2f}")
    print(f"{'recorded':10}{p[0]:>11.2f}{p[1]:>10.2f}{p[2]:>9.2f}")
    print(f"{'added':10}{p[0] - d[0]:>+11.2f}{p[1] - d[1]:>+10.2f}{p[2] - d[2]:>+9.2f}")
    print(f"recorder CPU per request: {cpu / (len(proxy_lat) + args.rounds) * 1e3:.2f} ms (user + system, "
          f"forwarding and recording)"
          + (f"; the stand-in upstream's: {up_cpu / (len(direct_lat) + args.rounds) * 1e3:.2f} ms" if not args.upstream
             else ""))
    print(f"trace lines written: {n_lines}; load average {load0[0]:.2f} -> {load1[0]:.2f} "
          f"({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
