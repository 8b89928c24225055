"""`slotlab serve` (experiments/serve.py) as a process: bad model files exit 1; a good one serves."""

from __future__ import annotations

import os
import platform
import socket
import subprocess
import sys
import time

import httpx
import pytest

from experiments.serve import build_parser, options_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def serve(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-m", "experiments.serve", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("content", [None, b"not a gguf at all", b"GGUF\x03\x00\x00\x00garbage"])
def test_missing_or_invalid_model_exits_1_with_a_clear_error(tmp_path, content):
    path = tmp_path / "m.gguf"
    if content is not None:
        path.write_bytes(content)
    p = serve("-m", str(path), "--port", str(free_port()))
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "error" in err and str(path) in err or "failed to load" in err


def test_defaults_are_llama_servers(tiny_path):
    opts = options_from_args(build_parser().parse_args(["-m", tiny_path]))
    c = opts.config
    assert (c.n_parallel, c.n_ctx, c.n_batch, c.n_ubatch, c.cache_ram_mib) == (-1, 0, 2048, 512, 8192)
    assert (c.slot_prompt_similarity, c.n_cache_reuse, c.ctx_shift, c.n_keep, c.kv_unified) == (0.10, 0, False, 0, None)
    assert c.cache_idle_slots and c.cache_prompt and c.n_predict == -1
    assert opts.endpoint_slots and not opts.endpoint_metrics and not opts.endpoint_props
    assert opts.default_sampling.temperature == 0.8 and opts.default_sampling.seed == 0xFFFFFFFF
    assert opts.model_name == "tiny.gguf"


def test_alias_and_api_key_file(tiny_path, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk1\n\nk2\n")
    args = build_parser().parse_args(["-m", tiny_path, "--alias", "tinyllama-2,fim,code", "--api-key", "k0",
                                      "--api-key-file", str(keys)])
    opts = options_from_args(args)
    assert opts.model_name == "code" and opts.api_keys == ("k0", "k1", "k2")


def test_serve_process_answers_then_stops(tiny_path, tmp_path):
    port = free_port()
    p = serve("-m", tiny_path, "--port", str(port), "-np", "2", "-c", "1024", "--metrics", "-t", "1",
              "--slot-save-path", str(tmp_path), "--log-level", "warning", "--mem-reserve", "32")
    try:
        url = f"http://127.0.0.1:{port}"
        t_end = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert p.poll() is None and time.monotonic() < t_end, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.1)
        r = httpx.post(url + "/completion", json={"prompt": "Hello", "n_predict": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 3
        assert httpx.get(url + "/props").json()["total_slots"] == 2
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    # the heap reserved before the server's threads started (engine/model/heap.py; glibc only)
    glibc = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
    assert ("heap reserve 32 MiB" if glibc else "heap reserve 0 MiB") in err


def test_a_negative_heap_reserve_exits_1_before_serving(tiny_path):
    p = serve("-m", tiny_path, "--port", str(free_port()), "--mem-reserve", "-5")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "--mem-reserve: expected a size in MiB >= 0, got -5" in err
