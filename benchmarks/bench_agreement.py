"""Top-1 agreement between numerics modes on SmolLM2, teacher-forced over `validate_llamacpp.LONG_TEXT`.

    .venv/bin/python benchmarks/bench_agreement.py [--modes f32,q,ggml,ggml-numpy] [--n-tokens 1000] [--threads 2]

Each mode runs the whole text as one chunk (logits of every position); prints, for every pair of modes, the
share of positions whose argmax agrees, the largest and mean |logit| difference, and the time of each
forward. "ggml" replays llama.cpp's CPU arithmetic (100% top-1 agreement with llama.cpp measured, see
docs/tokenizer_sampling.md), so agreement with it stands for agreement with llama.cpp; "ggml-numpy" is the same
arithmetic on its numpy reference code (minutes; "ggml" runs numba kernels that must give the same bits).
`--save DIR` / `--load DIR` keep a mode's logits' argmax and values between runs (ggml is slow).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.validate_llamacpp import LONG_TEXT  # noqa: E402
from engine.model import default_model_path, load  # noqa: E402
from engine.model.numerics import GGML_REFERENCE  # noqa: E402

# names of --modes: the NUMERICS names, and "ggml-numpy", the ggml arithmetic on its numpy reference code
SPECIAL = {"ggml-numpy": GGML_REFERENCE}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--modes", default="f32,q,ggml")
    ap.add_argument("--n-tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=0,
                    help="feed the text in chunks of this many tokens (1: every product takes the decode path, "
                         "one row at a time; default 0: one chunk)")
    ap.add_argument("--save", default=None, metavar="DIR", help="write each mode's logits to DIR/<mode>.npy")
    ap.add_argument("--load", default=None, metavar="DIR", help="reuse DIR/<mode>.npy instead of computing")
    args = ap.parse_args()
    if not args.model:
        raise SystemExit("model not found; pass --model")
    logits: dict[str, np.ndarray] = {}
    ids = None
    for mode in args.modes.split(","):
        cached = args.load and os.path.exists(os.path.join(args.load, f"{mode}.npy"))
        model = load(args.model, n_threads=args.threads, numerics=SPECIAL.get(mode, mode))
        ids = model.tokenize(LONG_TEXT)[: args.n_tokens]
        if cached:
            logits[mode] = np.load(os.path.join(args.load, f"{mode}.npy"))
            print(f"{mode}: loaded from {args.load}")
            continue
        t0 = time.perf_counter()
        if args.chunk > 0:
            kv = model.new_kv(1, len(ids))
            rows = [model.forward_batch(kv, [(0, ids[a:a + args.chunk], a, range(len(ids[a:a + args.chunk])))])[0]
                    for a in range(0, len(ids), args.chunk)]
            logits[mode] = np.concatenate(rows)
        else:
            logits[mode] = model.forward_logits(ids)
        print(f"{mode}: {len(ids)} tokens (chunks of {args.chunk or len(ids)}) in {time.perf_counter() - t0:.1f} s ({model.threads_desc}, "
              f"load average {os.getloadavg()[0]:.2f})", flush=True)
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            np.save(os.path.join(args.save, f"{mode}.npy"), logits[mode])
    print(f"\n{len(ids)} teacher-forced positions")
    print("| modes | top-1 agreement | max abs logit diff | mean abs logit diff | bit-identical |")
    print("|---|---|---|---|---|")
    for a, b in itertools.combinations(logits, 2):
        la, lb = logits[a], logits[b]
        agree = float((la.argmax(1) == lb.argmax(1)).mean())
        d = np.abs(la - lb)
        print(f"| {a} vs {b} | {agree * 100:.2f}% ({int((la.argmax(1) != lb.argmax(1)).sum())} differ) | "
              f"{d.max():.3g} | {d.mean():.3g} | {'yes' if np.array_equal(la, lb) else 'no'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
