"""llama-server's whole flag set for `slotlab serve`, so that any llama-server command line starts.

`data/llama_server_flags.json` lists every flag llama-server accepts (names, negative names, whether it
takes a value, its environment variable), read from llama.cpp's `common/arg.cpp` by
`benchmarks/llama_server_flags.py`. `slotlab serve` declares its own flags in `experiments.flags`; this
module adds the rest with the right arity, so that argparse consumes their values:

- aliases upstream has for a flag slotlab implements (`--temperature` for `--temp`) set the same option;
- a few upstream flags are implemented here: `-v/--verbose/--log-verbose`, `--log-file`, `--chat-template`
  (a Jinja template), `--chat-template-file`, `--jinja/--no-jinja`, `--sleep-idle-seconds` (sleeping on idle),
  `--warmup/--no-warmup` (a warm-up run at load);
- flags that only concern hardware, memory placement or the build (GPU layers, flash attention, KV cache
  types, NUMA, CPU masks, mmap, ...) are accepted with one warning each: the numpy engine has no such knob;
- features this server does not have (embeddings, reranking, LoRA, speculative decoding, multimodal, tools,
  the web UI, ...) are accepted with one warning each; their endpoints answer as upstream does when the
  feature is off (501 or 404);
- model downloads (`-hf`, `-mu`, `-dr`, ...) are refused with a clear error: nothing can be fetched here,
  and a server started on another model than the one asked for would mislead.

Environment variables (`LLAMA_ARG_*`, as `common_params_parse` reads them) give a flag's value when the
command line does not name it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).with_name("data") / "llama_server_flags.json"
DEST_PREFIX = "upstream__"

# flags that act instead of configuring (handled by argparse itself or meaningless for a server here)
ACTIONS = {"-h", "--help", "--usage", "--version", "--list-devices", "-cl", "--cache-list", "--completion-bash"}
# model sources that need a download
DOWNLOADS = {"-mu", "--model-url", "-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-hfv", "-hfrv",
             "--hf-repo-v", "-hffv", "--hf-file-v", "-dr", "--docker-repo", "-hft", "--hf-token",
             "--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"}
IMPLEMENTED = {"-v", "--verbose", "--log-verbose", "--log-file", "--chat-template", "--chat-template-file",
               "--jinja", "--no-jinja", "--sleep-idle-seconds", "--warmup", "--no-warmup"}

# why a flag has no effect here, by a word its names contain (first match wins); the rest: "has no
# effect on this server"
_REASONS = (
    (("gpu", "-ngl", "--device", "-dev", "split-mode", "-sm", "tensor-split", "-ts", "main-gpu", "-mg",
      "--rpc", "override-tensor", "-ot", "cpu-moe", "-cmoe", "-ncmoe", "fit", "repack", "op-offload",
      "kv-offload", "-nkvo", "host", "direct-io"), "GPU and device placement: the numpy engine runs on the CPU"),
    (("flash-attn", "-fa"), "flash attention is a ggml kernel choice; the numpy engine has its own attention"),
    (("cache-type", "-ctk", "-ctv", "-ctkd", "-ctvd"), "KV cache types: the engine's KV dtype follows --numerics"),
    (("numa", "cpu-mask", "cpu-range", "cpu-strict", "-C", "-Cr", "-Cb", "-Crb", "prio", "poll",
      "threads-batch", "-tb", "threads-http"), "thread placement and priority: only --threads applies"),
    (("mmap", "mlock", "load-mode", "check-tensors", "no-perf", "perf"),
     "model loading and profiling switches of llama.cpp"),
    (("embedding", "pooling"), "embeddings are not served: the embeddings endpoints answer 501 as upstream "
     "without --embeddings"),
    (("rerank",), "reranking is not served: the rerank endpoints answer 501 as upstream without --reranking"),
    (("lora", "control-vector"), "adapters and control vectors are not supported"),
    (("draft", "spec", "-md", "lookup", "-lcs", "-lcd"), "speculative decoding is not implemented"),
    (("mmproj", "media", "image", "audio", "video"), "multimodal input is not supported"),
    (("tools", "mcp", "agent", "cors-proxy"), "server tools are not implemented"),
    (("ui", "webui", "static", "path", "public"), "the web UI is not served"),
    (("rope", "yarn", "swa", "override-kv", "defrag", "kv-unified-per-slot"),
     "model and KV options of llama.cpp that the numpy engine does not take"),
)


@dataclass(frozen=True, slots=True)
class UpstreamFlag:
    names: tuple[str, ...]
    negative: tuple[str, ...]
    kind: str               # switch | bool | value | value2
    env: str | None

    @property
    def dest(self) -> str:
        return DEST_PREFIX + max(self.names, key=len).lstrip("-").replace("-", "_")


def load_table(path: Path = DATA) -> list[UpstreamFlag]:
    data = json.loads(path.read_text())
    return [UpstreamFlag(tuple(f["names"]), tuple(f["negative"]), f["kind"], f["env"]) for f in data["flags"]]


TABLE = load_table()


def reason(names: Sequence[str]) -> str:
    """Why an accepted flag changes nothing here."""
    for words, why in _REASONS:
        for n in names:
            if any(n == w or (len(w) > 3 and w.lstrip("-") in n) for w in words):
                return why
    return "has no effect on this server"


def add_upstream_flags(parser: argparse.ArgumentParser) -> None:
    """Add every upstream flag the parser does not know yet (help hidden; docs/http_api.md lists them)."""
    known = parser._option_string_actions     # argparse keeps no public map from option strings to actions
    for f in TABLE:
        names = [n for n in f.names if n not in ACTIONS]
        if not names:
            continue
        have = [known[n] for n in (*names, *f.negative) if n in known]
        missing = [n for n in names if n not in known]
        missing_neg = [n for n in f.negative if n not in known]
        if have:
            # upstream aliases of an option slotlab implements: the same destination and conversion
            pos = [known[n] for n in f.names if n in known]
            act = pos[0] if pos else have[0]
            if missing and act.nargs == 0:
                parser.add_argument(*missing, dest=act.dest, action="store_const", const=act.const,
                                    help=argparse.SUPPRESS)
            elif missing:
                parser.add_argument(*missing, dest=act.dest, type=act.type, help=argparse.SUPPRESS)
            if missing_neg:
                parser.add_argument(*missing_neg, dest=act.dest, action="store_const", const=False,
                                    help=argparse.SUPPRESS)
            continue
        if f.kind == "value":
            parser.add_argument(*names, dest=f.dest, default=None, help=argparse.SUPPRESS)
        elif f.kind == "value2":
            parser.add_argument(*names, dest=f.dest, nargs=2, default=None, help=argparse.SUPPRESS)
        elif f.kind == "bool":
            parser.add_argument(*names, dest=f.dest, action="store_const", const=True, default=None,
                                help=argparse.SUPPRESS)
            if f.negative:
                parser.add_argument(*f.negative, dest=f.dest, action="store_const", const=False,
                                    help=argparse.SUPPRESS)
        else:
            parser.add_argument(*names, dest=f.dest, action="store_const", const=True, default=None,
                                help=argparse.SUPPRESS)


def given(args: argparse.Namespace) -> list[tuple[UpstreamFlag, object]]:
    """The upstream-only flags set on this command line (or by their environment variable)."""
    out = []
    for f in TABLE:
        v = getattr(args, f.dest, None)
        if v is not None:
            out.append((f, v))
    return out


_TRUE = ("on", "enabled", "true", "1")
_FALSE = ("off", "disabled", "false", "0")


def env_argv(argv: Sequence[str], environ: dict[str, str] | None = None) -> list[str]:
    """`argv` with the flags that upstream's environment variables set put in front of it, for every flag
    the command line does not name (the command line wins, as upstream)."""
    environ = os.environ if environ is None else environ
    named = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    front: list[str] = []
    for f in TABLE:
        if not f.env or f.env not in environ or named & {*f.names, *f.negative}:
            continue
        value = environ[f.env]
        name = next((n for n in f.names if n.startswith("--")), f.names[0])
        if f.kind in ("value", "value2"):
            front += [name, value] if f.kind == "value" else [name, *value.split(",", 1)]
        elif value.lower() in _TRUE:
            front.append(name)
        elif value.lower() in _FALSE and f.negative:
            front.append(next((n for n in f.negative if n.startswith("--")), f.negative[0]))
    return front + list(argv)


def value_of(args: argparse.Namespace, name: str) -> object:
    """The value of an upstream-only flag by any of its names (None when not given)."""
    f = next(f for f in TABLE if name in f.names or name in f.negative)
    return getattr(args, f.dest, None)


def download_flag(args: argparse.Namespace) -> str | None:
    """The first model-download flag given, if any."""
    for f, _ in given(args):
        if set(f.names) & DOWNLOADS:
            return max(f.names, key=len)
    return None
