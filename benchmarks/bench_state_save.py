"""Cost of saving and restoring one sequence's KV state (the host-RAM prompt cache's copy), this tree against
another checkout (`--base DIR`), interleaved in one process.

    .venv/bin/python benchmarks/bench_state_save.py [--base /path/to/other/tree] [--cells 512,2048,7000]
        [--rounds 4] [--repeat 5] [--kv-type f32|f16]

A `KVStore` with SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64; f32 cells, the engine's default
numerics, or `--kv-type f16`; 4 sequences in a
unified pool of 4 x 8192 cells, so that a sequence is a strided view of the pool as in the server) holds one
sequence of each `--cells` size. Each round times, per tree (the order alternates between rounds),
`--repeat` saves of each sequence (the previous blob released before the next save, as an evicted entry is)
and `--repeat` loads of the blob into another sequence. Prints the median and range per tree and size in ms
and in ns per byte of blob, and the ratio this tree / base. numpy copies on one thread (no BLAS call);
thread variables and load averages are printed with the figures.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(n_layer=30, n_head_kv=3, head_dim=64)      # SmolLM2-135M


class _NoRotation:
    def rerotate(self, k, delta):                        # never called: the benchmark shifts nothing
        raise AssertionError("no shift here")


def _kv_module(tree: str, name: str):
    path = os.path.join(tree, "engine", "model", "kv.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod                              # dataclasses look the module up by name
    spec.loader.exec_module(mod)
    return mod


def _store(mod, cells: list[int], dtype):
    kv = mod.KVStore(4, 8192, rotator=_NoRotation(), unified=True, dtype=dtype, **SHAPE)
    rng = np.random.default_rng(0)
    for seq, n in enumerate(cells):
        (s,) = kv.prepare_append([(seq, 0, n)])
        s.k[:, :, :n] = rng.standard_normal((SHAPE["n_layer"], SHAPE["n_head_kv"], n, SHAPE["head_dim"]))
        s.v[:, :, :n] = rng.standard_normal((SHAPE["n_layer"], SHAPE["n_head_kv"], n, SHAPE["head_dim"]))
        kv.commit_append(s, 0, n)
    return kv


def _time_tree(kv, seq: int, repeat: int) -> tuple[list[float], list[float], int]:
    saves, loads = [], []
    blob = None
    for _ in range(repeat):
        blob = None                                      # the previous blob released, as an evicted entry is
        gc.collect()
        t0 = time.perf_counter()
        blob = kv.state_save(seq)
        saves.append(time.perf_counter() - t0)
    for _ in range(repeat):
        t0 = time.perf_counter()
        kv.state_load(3, blob)
        loads.append(time.perf_counter() - t0)
    kv.seq_rm(3, -1, -1)
    return saves, loads, len(blob)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", help="another checkout of the project to compare with")
    ap.add_argument("--cells", default="512,2048,7000", help="sequence lengths, at most 3 (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--kv-type", choices=("f32", "f16"), default="f32", help="cell type (default %(default)s)")
    args = ap.parse_args()
    cells = [int(c) for c in args.cells.split(",")]
    if not 1 <= len(cells) <= 3 or min(cells) < 1 or max(cells) > 8192:
        ap.error("--cells: 1 to 3 lengths of 1..8192 cells")
    trees = {"this": _kv_module(HERE, "kv_this")}
    if args.base:
        trees = {"base": _kv_module(os.path.abspath(args.base), "kv_base"), **trees}
    dtype = np.float32 if args.kv_type == "f32" else np.float16
    stores = {name: _store(mod, cells, dtype) for name, mod in trees.items()}
    print(f"KV cells {args.kv_type}; threads: numpy copies on 1 thread; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}; load average before "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    res: dict = {}
    names = list(stores)
    for rnd in range(args.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            for seq, _n in enumerate(cells):
                saves, loads, size = _time_tree(stores[name], seq, args.repeat)
                r = res.setdefault((name, seq), {"save": [], "load": [], "bytes": size})
                r["save"] += saves
                r["load"] += loads
    print(f"load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| tree | cells | MB | save median (range) ms | save ns/B | load median (range) ms | load ns/B |")
    print("|---|---|---|---|---|---|---|")
    for (name, seq), r in res.items():
        mb = r["bytes"] / 1e6
        row = [name, str(cells[seq]), f"{mb:.1f}"]
        for op in ("save", "load"):
            xs = r[op]
            med = statistics.median(xs)
            row += [f"{med * 1e3:.1f} ({min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f})", f"{med * 1e9 / r['bytes']:.2f}"]
        print("| " + " | ".join(row) + " |")
    if args.base:
        print()
        for seq, n in enumerate(cells):
            ratios = [statistics.median(res[("this", seq)][op]) / statistics.median(res[("base", seq)][op])
                      for op in ("save", "load")]
            print(f"{n} cells: this / base  save {ratios[0]:.2f}x  load {ratios[1]:.2f}x")


if __name__ == "__main__":
    main()
