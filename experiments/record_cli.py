"""`slotlab record`, the command: its flags, its run, and the recorder in a background thread for tests and
benchmarks, with either proxy (`--proxy relay`, experiments/record_relay.py, the default; `--proxy asgi`,
experiments/record.py)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import signal
import sys
from pathlib import Path
from typing import Any

import uvicorn

from engine.http.app import ThreadedUvicorn, uvicorn_config
from experiments.flags import RECORD, RECORD_PROXIES, add_flags
from experiments.record import MISSING, Recorder, server_options
from experiments.record import __doc__ as RECORD_DOC
from experiments.record_relay import BackgroundRelay, new_loop, serve


class BackgroundRecorder:
    """The recorder in a background thread (tests, benchmarks): `start()` returns once the socket listens.
    `proxy`: "relay" (the default, experiments/record_relay.py) or "asgi" (this module's ASGI app on uvicorn)."""

    def __init__(self, upstream: str, out: str | Path, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", proxy: str = RECORD_PROXIES[0]) -> None:
        if proxy not in RECORD_PROXIES:
            raise ValueError(f"proxy must be one of {RECORD_PROXIES}, got {proxy!r}")
        self.recorder = Recorder(upstream, out, log=lambda msg: None)
        if proxy == "relay":
            self._impl = BackgroundRelay(self.recorder, host, port)
        else:
            self._impl = ThreadedUvicorn(self.recorder.app, host, port, log_level, name="slotlab-record",
                                         shutdown_s=5.0, **server_options())

    def start(self, timeout_s: float = 30.0) -> "BackgroundRecorder":
        self._impl.start(timeout_s)
        return self

    @property
    def port(self) -> int:
        return self._impl.port

    @property
    def base_url(self) -> str:
        return self._impl.base_url

    def stop(self) -> None:
        self._impl.stop()


# --- command line ----------------------------------------------------------------------------------------

EPILOG = """examples:
  slotlab serve -m model.gguf --port 8080 &
  slotlab record --upstream http://127.0.0.1:8080 --out trace.jsonl --port 8081
      point clients at :8081; every request goes on to :8080, one trace line per completion
  slotlab validate --recorded trace.jsonl -np 4 --latency parametric:cal.json
      simulate the recorded requests (their own prompt and output tokens), compare with what :8080 measured
"""


def add_record_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        RECORD, help="record the traffic of a llama-server compatible server as a native trace",
        allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description=RECORD_DOC.split("\n\n")[0].replace("`slotlab record`: a", "A"))
    add_flags(p, RECORD)
    p.set_defaults(func=run_record)
    return p


def run_relay(rec: Recorder, host: str, port: int) -> None:
    """The relay proxy until SIGINT or SIGTERM; then the requests in flight end and their lines are written."""
    loop = new_loop()
    asyncio.set_event_loop(loop)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        loop.run_until_complete(serve(rec, host, port, stop))
    finally:
        loop.close()


def run_record(args: argparse.Namespace) -> int:
    if MISSING:
        print(f"slotlab record: error: {MISSING}", file=sys.stderr)
        return 2
    if not args.upstream.startswith(("http://", "https://")):
        print(f"slotlab record: error: --upstream must be an http(s) URL, got {args.upstream!r}", file=sys.stderr)
        return 2
    rec = Recorder(args.upstream, args.out)
    try:
        rec.open()
    except OSError as e:
        print(f"slotlab record: error: cannot write {args.out}: {e}", file=sys.stderr)
        return 2
    print(f"slotlab record: http://{args.host}:{args.port} -> {rec.upstream}, writing {args.out} "
          f"(proxy: {args.proxy})", file=sys.stderr)
    gc.freeze()         # the objects of the imported modules: out of every later full collection's walk
    try:
        if args.proxy == "relay":
            run_relay(rec, args.host, args.port)
        else:
            uvicorn.Server(uvicorn_config(rec.app, args.host, args.port, "warning", timeout_graceful_shutdown=5,
                                          **server_options())).run()
    except OSError as e:
        print(f"slotlab record: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    finally:
        rec.close()
        stats = ", ".join(f"{k} {v}" for k, v in sorted(rec.stats.items())) or "no completion requests"
        print(f"slotlab record: {stats} -> {args.out}", file=sys.stderr)
    return 0
