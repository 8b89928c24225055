"""`slotlab serve`: a llama-server compatible HTTP server on the numpy engine.

Flags keep llama-server's names and defaults (`common/arg.cpp`); slotlab adds the policy choices. The API
answers 503 "Loading model" while the model loads in the background, then serves. See docs/http_api.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from engine.core import PolicyNames, ServerConfig
from engine.core.errors import ConfigError
from engine.model.sampling import LLAMA_DEFAULT_SEED, SamplingParams
from policies import BATCH_BUILDERS, CONTEXT_SHIFTS, EVICTIONS, QUEUE_ORDERS, SLOT_SELECTORS

GGUF_MAGIC = b"GGUF"


def _policy(registry: dict, kind: str):
    def convert(text: str) -> str:
        if text.partition(":")[0] not in registry:
            raise argparse.ArgumentTypeError(f"unknown {kind} policy {text!r}; choose one of: {', '.join(registry)}")
        return text
    return convert


def _switch(parser: argparse.ArgumentParser, on: list[str], off: list[str], dest: str, default: bool,
            help_text: str) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(*on, dest=dest, action="store_true", default=default,
                       help=f"{help_text} (default: {'enabled' if default else 'disabled'})")
    group.add_argument(*off, dest=dest, action="store_false", help=argparse.SUPPRESS)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and network")
    g.add_argument("-m", "--model", required=True, metavar="FNAME", help="GGUF model file")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080)")
    g.add_argument("--api-prefix", default="", metavar="PREFIX", help="prefix of every route (default: none)")
    g.add_argument("-t", "--threads", type=int, default=-1, metavar="N",
                   help="compute threads for the forward pass (default: -1 = number of CPUs; matmuls split "
                        "over N threads, BLAS itself held at 1)")
    g.add_argument("-a", "--alias", default="", metavar="NAMES", help="model name(s) in responses, comma separated")
    g.add_argument("--numerics", choices=("f32", "ggml"), default="f32",
                   help="engine arithmetic: f32 (default) or ggml (llama.cpp's CPU arithmetic, f16 KV; much slower)")
    g = p.add_argument_group("server (llama-server flags and defaults)")
    g.add_argument("-c", "--ctx-size", type=int, default=0, metavar="N",
                   help="total context size (default: 0 = from the model)")
    g.add_argument("-np", "--parallel", type=int, default=-1, metavar="N",
                   help="number of slots (default: -1 = auto: 4 slots with a unified KV cache)")
    g.add_argument("-b", "--batch-size", type=int, default=2048, metavar="N", help="logical batch size (default: 2048)")
    g.add_argument("-ub", "--ubatch-size", type=int, default=512, metavar="N",
                   help="physical batch size (default: 512)")
    g.add_argument("-cram", "--cache-ram", type=int, default=8192, metavar="MiB",
                   help="host-RAM prompt cache limit in MiB (default: 8192; -1 = no limit, 0 = off)")
    g.add_argument("-sps", "--slot-prompt-similarity", type=float, default=0.10, metavar="F",
                   help="prompt similarity needed to reuse a slot (default: 0.10; 0 = off)")
    g.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                   help="min chunk size to reuse from the cache via KV shifting (default: 0 = off)")
    _switch(p, ["--context-shift"], ["--no-context-shift"], "context_shift", False, "context shift on full context")
    g.add_argument("--keep", type=int, default=0, metavar="N",
                   help="prompt tokens kept on a context shift (default: 0; -1 = all)")
    kvu = p.add_mutually_exclusive_group()
    kvu.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_const", const=True, default=None,
                     help="one KV buffer shared by all slots (default: enabled if the number of slots is auto)")
    kvu.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_const", const=False,
                     help=argparse.SUPPRESS)
    _switch(p, ["--cache-idle-slots"], ["--no-cache-idle-slots"], "cache_idle_slots", True,
            "save idle slots to the prompt cache")
    _switch(p, ["--cache-prompt"], ["--no-cache-prompt"], "cache_prompt", True, "reuse the KV of earlier prompts")
    _switch(p, ["-cb", "--cont-batching"], ["-nocb", "--no-cont-batching"], "cont_batching", True,
            "continuous batching")
    g.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=int, default=-1, metavar="N",
                   help="default tokens to predict per request (default: -1 = unlimited)")
    g.add_argument("--temp", type=float, default=0.8, metavar="T", help="default temperature (default: 0.8)")
    g.add_argument("-s", "--seed", type=int, default=-1, metavar="SEED", help="default RNG seed (default: -1 = random)")
    g = p.add_argument_group("endpoints and access")
    g.add_argument("--api-key", default="", metavar="KEYS", help="API keys, comma separated (default: none)")
    g.add_argument("--api-key-file", default="", metavar="FNAME", help="file with one API key per line")
    g.add_argument("--cors-origins", default="*", metavar="ORIGINS",
                   help="Access-Control-Allow-Origin: * = echo the Origin, 'localhost', or a literal value")
    g.add_argument("--metrics", action="store_true", help="enable /metrics (default: disabled)")
    _switch(p, ["--slots"], ["--no-slots"], "slots", True, "expose GET /slots")
    g.add_argument("--props", action="store_true", help="enable POST /props (default: disabled)")
    g.add_argument("--slot-save-path", default="", metavar="PATH",
                   help="directory for slot save/restore files (default: disabled)")
    g = p.add_argument_group("slotlab policies (defaults are llama-server's behaviour)")
    g.add_argument("--select", default="lcp_lru", type=_policy(SLOT_SELECTORS, "slot selection"),
                   help=f"slot selection: {', '.join(SLOT_SELECTORS)}")
    g.add_argument("--queue", default="fifo", type=_policy(QUEUE_ORDERS, "queue order"),
                   help=f"deferred queue order: {', '.join(QUEUE_ORDERS)}")
    g.add_argument("--batch", default="decode_first", type=_policy(BATCH_BUILDERS, "batch building"),
                   help=f"batch building: {', '.join(BATCH_BUILDERS)}")
    g.add_argument("--shift", default="half", type=_policy(CONTEXT_SHIFTS, "context shift"),
                   help=f"context shift: {', '.join(CONTEXT_SHIFTS)}")
    g.add_argument("--evict", default="fifo", type=_policy(EVICTIONS, "cache eviction"),
                   help=f"prompt-cache eviction: {', '.join(EVICTIONS)}")
    g.add_argument("--cache-hit", default="move", choices=("move", "copy"),
                   help="prompt-cache hit: move the entry out (upstream) or copy it")
    g.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                   help="log level (default: info)")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on the `slotlab` sub-command parser."""
    p = subparsers.add_parser("serve", help="serve the llama-server HTTP API on the numpy engine",
                              description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotlab serve", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add_serve_arguments(p)
    return p


class ServeError(Exception):
    """A problem with the command line or the model file (printed, exit code 1)."""


def check_model_file(path: str) -> None:
    if not os.path.exists(path):
        raise ServeError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise ServeError(f"model path is not a file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ServeError(f"cannot read model file {path}: {e.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ServeError(f"not a GGUF file (bad magic {magic!r}): {path}")


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = [k.strip() for k in args.api_key.split(",") if k.strip()]
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                for line in f:
                    line = line.strip()
                    if line and not line.startswith("#"):
                        keys.append(line)
        except OSError as e:
            raise ServeError(f"cannot read API key file {args.api_key_file}: {e.strerror}") from None
    return tuple(keys)


def options_from_args(args: argparse.Namespace):
    """ServerOptions for the parsed flags (validated: a bad value raises ServeError)."""
    from engine.http.state import ServerOptions

    check_model_file(args.model)
    if args.slot_save_path and not os.path.isdir(args.slot_save_path):
        raise ServeError(f"--slot-save-path must be an existing directory: {args.slot_save_path}")
    if args.threads == 0 or args.threads < -1:
        raise ServeError(f"invalid value for --threads: {args.threads}")
    config = ServerConfig(
        n_parallel=args.parallel, n_ctx=args.ctx_size, n_batch=args.batch_size, n_ubatch=args.ubatch_size,
        cache_ram_mib=args.cache_ram, slot_prompt_similarity=args.slot_prompt_similarity,
        n_cache_reuse=args.cache_reuse, cache_prompt=args.cache_prompt, cont_batching=args.cont_batching,
        ctx_shift=args.context_shift, n_keep=args.keep, cache_idle_slots=args.cache_idle_slots,
        kv_unified=args.kv_unified, n_predict=args.n_predict,
        policies=PolicyNames(slot_selection=args.select, queue_order=args.queue, batch_building=args.batch,
                             context_shift=args.shift, eviction=args.evict),
        cache_hit=args.cache_hit)
    try:
        # validate now (n_ctx 0 = "from the model": any n_ctx_train will do for the check)
        replace(config, n_ctx_train=config.n_ctx_train or 4096).resolve()
    except ConfigError as e:
        raise ServeError(str(e)) from None
    seed = LLAMA_DEFAULT_SEED if args.seed == -1 else args.seed & 0xFFFFFFFF
    return ServerOptions(
        model_path=args.model, config=config,
        n_threads=(os.cpu_count() or 1) if args.threads == -1 else args.threads,
        default_sampling=SamplingParams(temperature=max(0.0, args.temp), seed=seed),
        aliases=tuple(a.strip() for a in args.alias.split(",") if a.strip()),
        api_keys=_api_keys(args), cors_origins=args.cors_origins, endpoint_metrics=args.metrics,
        endpoint_slots=args.slots, endpoint_props=args.props,
        slot_save_path=args.slot_save_path, api_prefix=args.api_prefix.rstrip("/"), numerics=args.numerics)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; 1 on a bad model file, bad flags or a failed model load."""
    import uvicorn

    from engine.http.app import create_app
    from engine.http.state import ServerState

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = options_from_args(args)
    except ServeError as e:
        print(f"slotlab serve: error: {e}", file=sys.stderr)
        return 1
    state = ServerState(options)
    app = create_app(state, load_on_startup=False)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, server_header=False,
                            lifespan="on", timeout_graceful_shutdown=3, ws="none")
    server = uvicorn.Server(config)
    failed: list[str] = []

    def on_error(message: str) -> None:
        failed.append(message)
        print(f"slotlab serve: error: failed to load the model: {message}", file=sys.stderr)
        server.should_exit = True

    state.start_loading(on_error)
    print(f"slotlab serve: listening on http://{args.host}:{args.port}{options.api_prefix} "
          f"(model loads in the background; 503 until ready), compute threads {options.n_threads}, "
          f"numerics {options.numerics}",
          file=sys.stderr, flush=True)
    server.run()
    state.shutdown()
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
