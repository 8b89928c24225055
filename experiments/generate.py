"""`slotlab generate`: tokenize a prompt, generate tokens with the numpy engine through the serving core, print
the text (a quick check of a model file)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from engine.backend import NumpyBackend
from engine.core import ServerConfig, ServerCore, Task, run_until_idle
from engine.model import load
from engine.model.chat import apply_chat_template
from engine.model.sampling import SamplingParams
from engine.model.tokenizer import read_gguf_metadata
from experiments.flags import GENERATE, UsageError, add_flags
from experiments.runs import resolve_model, usage_errors
from policies import make_policies


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(GENERATE, help="generate text with the numpy engine (a quick model check)",
                              allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
                              description="Tokenize a prompt, generate N tokens with the numpy engine, print the "
                              "text.")
    add_flags(p, GENERATE)
    return p


def cmd_generate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    with usage_errors():
        if args.n_predict < 0 or args.threads < 1:
            raise UsageError("-n must be >= 0 and --threads >= 1")
        path = resolve_model(args.model)
        model = load(path, n_threads=args.threads, numerics=args.numerics)
    warm_s = model.warm_up()        # compiles (first run on a machine) or loads the kernels: not in the timing
    tok = model.tokenizer
    text = args.prompt
    if args.chat:
        template = str(read_gguf_metadata(path).get("tokenizer.chat_template") or "")
        if not template:
            raise UsageError(f"{path} has no chat template (tokenizer.chat_template)")
        text = apply_chat_template(template, [{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.tokenize(text, add_special=True, parse_special=True)
    n_ctx = max(256, len(ids) + args.n_predict + 1)
    backend = NumpyBackend(model, 1, ((n_ctx + 255) // 256) * 256,
                           default_sampling=SamplingParams(temperature=args.temp, seed=args.seed & 0xFFFFFFFF))
    cfg = ServerConfig(n_parallel=1, n_ctx=n_ctx, cache_ram_mib=0, **model.config_facts())
    core = ServerCore(cfg, make_policies(cfg.policies))
    task = core.submit(Task(id=-1, tokens=ids, n_predict=args.n_predict), 0.0)
    t0 = time.perf_counter()
    run_until_idle(core, backend)
    wall = time.perf_counter() - t0
    print(tok.detokenize(task.generated, special=False))
    print(f"[{len(ids)} prompt tokens, {task.n_decoded} generated in {wall:.2f} s, stop: {task.stop_type}, "
          f"{model.threads_desc}, numerics {model.numerics}; warm-up {warm_s:.2f} s]", file=sys.stderr)
    return 0
