"""Per-kernel speed of the "ggml" numerics' products (`engine.model.gkernels`), one thread, this tree against
another checkout's kernels (`--base`), interleaved in one process.

    .venv/bin/python benchmarks/bench_ggml_kernels.py [--base /path/to/other/tree] [--rows 1,2,4,16,64]
        [--reps 5]

Shapes are SmolLM2-135M's: the 30 layers' Q4_1 matrices (qkv 576 -> 960, o 576 -> 576, gate/up 576 -> 3072,
down 1536 -> 576; 80 MB of quants, d and m) called one after the other as a decode step does (each matrix once
per pass: the weights come from memory, not from the core's caches), and the Q8_0 output head 576 -> 49152
(28 MB of int8 quants + 3.5 MB of d; before this kernel existed the head was a float32 BLAS product over
113 MB, measured here through the f32 `Linear` with numpy's matmul on 1 BLAS thread). Random weights and
activations; every result is compared with the other kernel set's (bit for bit where both replay ggml).
Prints per row count: median CPU time of the thread over `--reps` passes, GB/s of weights streamed, GMAC/s.
Each kernel set gets the weight layout and activation type it reads: the packed layout (`ggml.pack_blocks`) and
int8 quants for kernels that have `_dot_packed`, `quant.QPart`'s transposed layout and float32 quants for older
ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.model import ggml as G  # noqa: E402
from engine.model import gkernels as K  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def load_other(tree: str):
    """The other tree's gkernels.py as a module of its own, from a copy in a fresh directory: numba's cache of
    a module loaded this way is not found again by a later process (it compiles, ~10-20 s)."""
    path = os.path.join(tempfile.mkdtemp(prefix="gkernels_base_"), "gkernels_base.py")
    shutil.copyfile(os.path.join(tree, "engine", "model", "gkernels.py"), path)
    spec = importlib.util.spec_from_file_location("gkernels_base", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                 # numba's cache finds the module of a cached function by name
    spec.loader.exec_module(mod)
    return mod


def packed(mod) -> bool:
    """Whether a kernel module reads the packed layout (`ggml.pack_blocks`) and int8 activation quants."""
    return hasattr(mod, "_dot_packed")


def layout(mod, q, d, m):
    """(q, d, m) as kernel module `mod` reads them (m None: Q8_0, d again), in its group width (8 before the
    groups of 16)."""
    if packed(mod):
        return G.pack_blocks(q, d, m, getattr(mod, "GROUP", 8))
    return q, d, (d if m is None else m)


def activations(mod, xs):
    """{n_in: (qx, dx, sx)} with qx as `mod` reads it."""
    return {n: ((qx if packed(mod) else qx.astype(np.float32)), dx, sx) for n, (qx, dx, sx) in xs.items()}


def median_time(fn, reps: int) -> float:
    """Median CPU time of this thread over `reps` calls (one thread: not counting the time another process holds
    the core, which the wall time on this shared machine does)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="another tree whose gkernels to compare with")
    ap.add_argument("--rows", default="1,2,4,16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    base = load_other(args.base) if args.base else None
    rng = np.random.default_rng(0)
    mats = []
    for _ in range(args.layers):
        for n_out, n_in in LAYER_SHAPES:
            nb = n_in // 32
            q = rng.integers(0, 256, (nb, 16, n_out), dtype=np.uint8)
            d = (rng.random((nb, n_out)) * 0.01).astype(np.float16).astype(np.float32)
            m = (-rng.random((nb, n_out)) * 0.05).astype(np.float16).astype(np.float32)
            mats.append((q, d, m, n_out, n_in))
    layer_bytes = sum(q.nbytes + d.nbytes + m.nbytes for q, d, m, _, _ in mats)
    layer_macs = sum(n_out * n_in for _, _, _, n_out, n_in in mats)
    n_vocab, n_embd = 49152, 576
    hq = rng.integers(-127, 128, (n_embd // 32, 32, n_vocab)).astype(np.int8)
    hd = (rng.random((n_embd // 32, n_vocab)) * 0.01).astype(np.float16).astype(np.float32)
    head_bytes = hq.nbytes + hd.nbytes
    wf = np.ascontiguousarray((hq.astype(np.float32) * hd[:, None, :]).reshape(n_embd, n_vocab))  # [K, N] f32
    print(f"1 thread (BLAS limited to 1); load average {os.getloadavg()}; layers: {len(mats)} matrices, "
          f"{layer_bytes / 1e6:.1f} MB; head {head_bytes / 1e6:.1f} MB quantized, {wf.nbytes / 1e6:.1f} MB f32")
    print("| kernel | rows | base | new | new / base |")
    print("|---|---|---|---|---|")
    mods = [("new", K)] + ([("base", base)] if base is not None else [])
    weights = {name: [layout(mod, q, d, m) for q, d, m, _, _ in mats] for name, mod in mods}
    heads = {name: layout(mod, hq, hd, None)[:2] for name, mod in mods}
    with threadpool_limits(limits=1, user_api="blas"):
        for rows in [int(r) for r in args.rows.split(",")]:
            xs = {n: G.quantize_q8_compiled(rng.normal(0, 1, (rows, n)).astype(np.float32)) for n in (576, 1536)}
            ys = {name: [np.empty((rows, n_out), np.float32) for *_, n_out, _ in mats] for name, _ in mods}
            yh = {name: np.empty((rows, n_vocab), np.float32) for name, _ in mods}

            def layers(name, mod):
                acts = activations(mod, xs)
                for (q, d, m), (*_, n_out, n_in), y in zip(weights[name], mats, ys[name]):
                    qx, dx, sx = acts[n_in]
                    mod.dot_nib(q, d, m, qx, dx, sx, y, 0, n_out)

            def head(name, mod):
                qx, dx, _ = activations(mod, xs)[576]
                q, d = heads[name]
                mod.dot_q8_0(q, d, qx, dx, yh[name], 0, n_vocab)
            figs = {name: median_time(lambda: layers(name, mod), args.reps) for name, mod in mods}
            hfigs = {name: median_time(lambda: head(name, mod), args.reps) for name, mod in mods}
            same = base is None or all(np.array_equal(a, b) for a, b in zip(ys["new"], ys["base"]))
            hsame = base is None or np.array_equal(yh["new"], yh["base"])

            def fig(t, nbytes, macs):
                return f"{t * 1e3:.2f} ms ({nbytes / t / 1e9:.1f} GB/s, {macs * rows / t / 1e9:.1f} GMAC/s)"
            b = fig(figs["base"], layer_bytes, layer_macs) if "base" in figs else "-"
            r = f"{figs['new'] / figs['base']:.3f}" if "base" in figs else "-"
            print(f"| dot_nib, 120 Q4_1 layer matrices{'' if same else ' (RESULTS DIFFER)'} | {rows} | {b} | "
                  f"{fig(figs['new'], layer_bytes, layer_macs)} | {r} |", flush=True)
            b = fig(hfigs["base"], head_bytes, n_vocab * n_embd) if "base" in hfigs else "-"
            r = f"{hfigs['new'] / hfigs['base']:.3f}" if "base" in hfigs else "-"
            print(f"| dot_q8_0, head 49152 x 576{'' if hsame else ' (RESULTS DIFFER)'} | {rows} | {b} | "
                  f"{fig(hfigs['new'], head_bytes, n_vocab * n_embd)} | {r} |", flush=True)
            qx, dx, _ = xs[576]
            xq = np.empty(qx.shape, np.float32)
            K.q8_values(qx, dx, xq)
            t_blas = median_time(lambda: xq @ wf, args.reps)
            # a check that it is the same product: the exact lane chains vs BLAS, within float32 rounding
            ref = xq.astype(np.float64) @ wf.astype(np.float64)
            bound = 30 * 2.0 ** -24 * (np.abs(xq).astype(np.float64) @ np.abs(wf).astype(np.float64))
            ok = bool(np.all(np.abs(yh["new"] - ref) <= bound))
            print(f"| head 49152 x 576: f32 BLAS (base) vs dot_q8_0 (new){'' if ok else ' (WRONG PRODUCT)'} | "
                  f"{rows} | {fig(t_blas, wf.nbytes, n_vocab * n_embd)} | "
                  f"{fig(hfigs['new'], head_bytes, n_vocab * n_embd)} | {hfigs['new'] / t_blas:.3f} |", flush=True)
    print(f"load average after {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
