"""32 concurrent clients, mixed streaming and non-streaming, some disconnecting mid-stream.

Accounting rule checked here: llama-server's /metrics totals count every task's prompt tokens once its first
token is sampled and its generated tokens when its slot is released, whether or not the client is still
there. So the totals equal the sums of `timings.prompt_n` / `timings.predicted_n` over the responses clients
received in full, plus what the abandoned requests had cost when they were cancelled, which slotlab reports in
`slotlab:cancelled_prompt_tokens_total` / `slotlab:cancelled_tokens_predicted_total`.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

N_CLIENTS = 32


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


async def native_stream(c: httpx.AsyncClient, i: int, disconnect_after: int | None) -> dict | None:
    body = {"prompt": f"client {i} says the cat is on the house", "stream": True, "ignore_eos": True,
            "n_predict": 5000 if disconnect_after else 24 + i % 9}
    async with c.stream("POST", "/completion", json=body) as r:
        assert r.status_code < 500
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            n += 1
            if disconnect_after and n >= disconnect_after:
                return None                            # leaving the block closes the connection mid-stream
            if ev.get("stop"):
                return {"status": r.status_code, "timings": ev["timings"]}
    raise AssertionError("stream ended without a final event")


async def chat_stream(c: httpx.AsyncClient, i: int) -> dict:
    body = {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 16 + i % 5, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    timings = None
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code < 500
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                timings = ev.get("timings", timings)
    return {"status": r.status_code, "timings": timings}


async def plain(c: httpx.AsyncClient, i: int) -> dict:
    r = await c.post("/completion", json={"prompt": f"plain {i} of the world", "n_predict": 20 + i % 7,
                                          "ignore_eos": True})
    assert r.status_code < 500
    return {"status": r.status_code, "timings": r.json()["timings"]}


async def run_clients(base_url: str) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=N_CLIENTS + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as c:
        jobs = []
        for i in range(N_CLIENTS):
            kind = i % 4
            if kind == 0:
                jobs.append(native_stream(c, i, disconnect_after=3))
            elif kind == 1:
                jobs.append(plain(c, i))
            elif kind == 2:
                jobs.append(chat_stream(c, i))
            else:
                jobs.append(native_stream(c, i, disconnect_after=None))
        t0 = time.perf_counter()
        results = await asyncio.gather(*jobs)
        return results, time.perf_counter() - t0


@pytest.mark.slow
def test_32_mixed_clients_end_idle_without_5xx_and_metrics_add_up(start_server):
    srv = start_server(n_parallel=8, n_ctx=8192, endpoint_metrics=True)
    results, elapsed_s = asyncio.run(run_clients(srv.base_url))
    done = [r for r in results if r is not None]
    assert len(done) == N_CLIENTS - N_CLIENTS // 4
    assert all(r["status"] == 200 for r in done)
    with httpx.Client(base_url=srv.base_url, timeout=30) as c:
        t_end = time.monotonic() + 30        # a deadline, not a speed target (a shared machine may be slow)
        while any(s["is_processing"] for s in c.get("/slots").json()):
            assert time.monotonic() < t_end, "slots still busy after the clients left"
            time.sleep(0.05)
        text = c.get("/metrics").text
    assert metric(text, "llamacpp:requests_processing") == 0
    assert metric(text, "llamacpp:requests_deferred") == 0
    prompt_sum = sum(r["timings"]["prompt_n"] for r in done)
    predicted_sum = sum(r["timings"]["predicted_n"] for r in done)
    cancelled_prompt = metric(text, "slotlab:cancelled_prompt_tokens_total")
    cancelled_predicted = metric(text, "slotlab:cancelled_tokens_predicted_total")
    assert cancelled_predicted >= 3 * (N_CLIENTS // 4)          # each abandoned stream had sent 3 tokens
    assert metric(text, "llamacpp:prompt_tokens_total") == prompt_sum + cancelled_prompt
    assert metric(text, "llamacpp:tokens_predicted_total") == predicted_sum + cancelled_predicted
    total = metric(text, "llamacpp:tokens_predicted_total")
    print(f"\n[concurrency] {N_CLIENTS} clients ({len(done)} completed, {N_CLIENTS - len(done)} disconnected) "
          f"in {elapsed_s:.2f} s; generated {total:.0f} tokens = {total / elapsed_s:.0f} tok/s "
          f"(completed: {predicted_sum}); n_decode {metric(text, 'llamacpp:n_decode_total'):.0f}, "
          f"busy slots/decode {metric(text, 'llamacpp:n_busy_slots_per_decode'):.2f}; tiny model, 1 BLAS thread")
