"""`slotlab serve`: a llama-server compatible HTTP server on the numpy engine.

Its flags are llama-server's (names, aliases and defaults of llama.cpp `common/arg.cpp`), declared once in
`experiments.flags` with the simulator's commands; slotlab adds the policy choices. The API answers 503
"Loading model" while the model loads in the background, then serves. See docs/http_api.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import replace

from engine.core import ServerConfig
from engine.core.errors import ConfigError
from engine.model.heap import reserve
from engine.model.sampling import LLAMA_DEFAULT_SEED, SamplingParams
from experiments import upstream_flags as U
from experiments.flags import SERVE, add_flags, config_fields

GGUF_MAGIC = b"GGUF"
EPILOG = ("Every other llama-server flag is accepted too (with its LLAMA_ARG_* environment variable), so a\n"
          "llama-server command line starts: flags that only concern hardware or features this server does\n"
          "not have print one warning each (docs/http_api.md, 'Flags').")


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Register `serve` on the `slotlab` sub-command parser."""
    p = subparsers.add_parser(SERVE, help="serve the llama-server HTTP API on the numpy engine",
                              description=__doc__.split("\n\n")[0], allow_abbrev=False, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, SERVE)
    U.add_upstream_flags(p)
    p.set_defaults(func=run_serve)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="slotlab serve", description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, SERVE)
    U.add_upstream_flags(p)
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
    from engine.http.state import ServerOptions   # the HTTP stack (starlette) only when serving

    check_model_file(args.model)
    if args.slot_save_path and not os.path.isdir(args.slot_save_path):
        raise ServeError(f"--slot-save-path must be an existing directory: {args.slot_save_path}")
    if args.threads == 0 or args.threads < -1:
        raise ServeError(f"invalid value for --threads: {args.threads}")
    config = ServerConfig(**config_fields(vars(args)))
    try:
        # validate now (n_ctx 0 = "from the model": any n_ctx_train will do for the check)
        replace(config, n_ctx_train=config.n_ctx_train or 4096).resolve()
    except ConfigError as e:
        raise ServeError(str(e)) from None
    seed = LLAMA_DEFAULT_SEED if args.seed == -1 else args.seed & 0xFFFFFFFF
    dl = U.download_flag(args)
    if dl is not None:
        raise ServeError(f"{dl}: models cannot be downloaded here; pass a local GGUF file with -m FILE")
    sleep_s = _sleep_idle_seconds(U.value_of(args, "--sleep-idle-seconds"))
    template = U.value_of(args, "--chat-template") or ""
    template_file = U.value_of(args, "--chat-template-file")
    if template_file:
        try:
            with open(template_file, encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ServeError(f"--chat-template-file {template_file}: {e.strerror}") from None
    if template and "{%" not in template and "{{" not in template:
        raise ServeError(f"--chat-template {template!r}: llama.cpp's built-in template names are not available "
                         "here; pass the Jinja template itself (or --chat-template-file FILE)")
    return ServerOptions(
        model_path=args.model, config=config,
        n_threads=(os.cpu_count() or 1) if args.threads == -1 else args.threads,
        default_sampling=SamplingParams(temperature=max(0.0, args.temp), seed=seed),
        aliases=tuple(a.strip() for a in args.alias.split(",") if a.strip()),
        api_keys=_api_keys(args), cors_origins=args.cors_origins, cors_methods=args.cors_methods,
        cors_headers=args.cors_headers, cors_credentials=args.cors_credentials, endpoint_metrics=args.metrics,
        endpoint_slots=args.slots, endpoint_props=args.props,
        slot_save_path=args.slot_save_path, api_prefix=args.api_prefix.rstrip("/"), numerics=args.numerics,
        chat_template=template, verbose=bool(U.value_of(args, "--verbose")), sleep_idle_s=sleep_s,
        warmup=U.value_of(args, "--warmup") is not False)


def _sleep_idle_seconds(value: object) -> int:
    """--sleep-idle-seconds as upstream's common/arg.cpp takes it: an integer, -1 (the default) = never sleep."""
    if value is None:
        return -1
    try:
        n = int(str(value))
    except ValueError:
        raise ServeError(f"--sleep-idle-seconds: expected an integer number of seconds, got {value!r}") from None
    if n == 0 or n < -1:
        raise ServeError("--sleep-idle-seconds: invalid value: cannot be 0 or less than -1")
    return n


def upstream_warnings(args: argparse.Namespace) -> list[str]:
    """One line for every upstream flag on the command line that changes nothing here."""
    out = []
    for f, value in U.given(args):
        pick = f.names if value is not False or not f.negative else f.negative      # the spelling given
        if set(pick) & U.IMPLEMENTED - {"--no-jinja"}:
            continue
        name = next((n for n in pick if n.startswith("--")), pick[0])
        shown = name if value in (True, False) else f"{name} {' '.join(value) if isinstance(value, list) else value}"
        if name == "--no-jinja":
            out.append(f"{shown}: chat templates are always rendered with Jinja here")
        else:
            out.append(f"{shown}: accepted for compatibility, no effect: {U.reason(f.names)}")
    return out


def run_serve(args: argparse.Namespace) -> int:
    """Serve until interrupted; 1 on a bad model file, bad flags or a failed model load."""
    import uvicorn   # the HTTP stack (uvicorn, starlette) only when serving

    from engine.http.app import create_app, uvicorn_config
    from engine.http.state import ServerState

    level = "DEBUG" if U.value_of(args, "--verbose") else args.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_file = U.value_of(args, "--log-file")
    if log_file:
        handler = logging.FileHandler(str(log_file))
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger().addHandler(handler)
    for line in upstream_warnings(args):
        print(f"slotlab serve: warning: {line}", file=sys.stderr)
    try:
        options = options_from_args(args)
    except ServeError as e:
        print(f"slotlab serve: error: {e}", file=sys.stderr)
        return 1
    try:            # before any thread of the server allocates (engine/model/heap.py)
        reserved = reserve(args.mem_reserve)
    except (ValueError, MemoryError) as e:
        print(f"slotlab serve: error: {e}", file=sys.stderr)
        return 1
    note = reserved.note(args.mem_reserve)
    if note:
        print(f"slotlab serve: note: {note}", file=sys.stderr)
    state = ServerState(options)
    app = create_app(state, load_on_startup=False)
    server = uvicorn.Server(uvicorn_config(app, args.host, args.port, args.log_level, timeout_graceful_shutdown=3))
    failed: list[str] = []

    def on_error(message: str) -> None:
        failed.append(message)
        print(f"slotlab serve: error: failed to load the model: {message}", file=sys.stderr)
        server.should_exit = True

    state.start_loading(on_error)
    print(f"slotlab serve: listening on http://{args.host}:{args.port}{options.api_prefix} "
          f"(model loads in the background; 503 until ready), compute threads {options.n_threads}, "
          f"numerics {options.numerics}, heap reserve {reserved.mib} MiB",
          file=sys.stderr, flush=True)
    server.run()
    state.shutdown()
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(U.env_argv(sys.argv[1:] if argv is None else argv))
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
