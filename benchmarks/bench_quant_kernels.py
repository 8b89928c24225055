"""Per-kernel speed of numerics "q" on synthetic matrices, one type against another, and the load cost.

    .venv/bin/python benchmarks/bench_quant_kernels.py [--types Q4_1,Q4_K,Q5_1,Q5_K,Q8_0,Q6_K] [--rows 1,4,16,64]
        [--n-out 576] [--n-in 1536] [--rounds 5] [--threads 1] [--load-model]

Each type gets a matrix W [n_out, n_in] of random blocks (K-quants: random bytes with an fp16 d, dmin of
1e-3; the others, F16 and BF16 too: `gguf.quants.quantize` of normal values), decoded and repacked as the engine does at load
(`quant.QPart.from_tensor`; its time is printed as ns per weight), plus the float32 `Linear` of the same W. In
each round every (type, rows) product runs in turn, interleaved, for ~20 ms of repetitions; the medians over
the rounds are printed with the bytes a product streams (`QPart.nbytes`: q, d and m where used) per second and
the multiply-adds per second. The default shape is SmolLM2's ffn_down (576 outputs, 1536 inputs: the one
SmolLM2 matrix whose rows are a multiple of 256, so the only one a K-quant file can hold; the 576-column ones
fall back to Q5_0 / Q5_1 / Q8_0 in llama-quantize). The weights stay in cache (1.1 MB at most): these are
kernel figures, not DRAM ones.

`--load-model` also writes a synthetic model of SmolLM2's depth (30 layers) and FFN (1536) with n_embd 768
(a multiple of 256; 576 is not) for each K type and F16 and times `load` and single-sequence decode steps
(after a 64-token prefill, median) in f32 and q numerics, interleaved.
Prints the thread settings and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants
from threadpoolctl import threadpool_info, threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.model import BatchChunk, load, quant  # noqa: E402
from engine.model.matmul import Matmul  # noqa: E402
from engine.model.tiny import write_tiny_gguf  # noqa: E402
from engine.model.types import Linear  # noqa: E402

T = GGMLQuantizationType
K_SCALES = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def raw_matrix(qtype: GGMLQuantizationType, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    if qtype in K_SCALES:
        size = GGML_QUANT_SIZES[qtype][1]
        blk = rng.integers(0, 256, (n_out, n_in // 256, size), dtype=np.uint8)
        for off in K_SCALES[qtype]:
            blk[..., off:off + 2] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)
        return blk.reshape(n_out, -1)
    return gguf_quants.quantize(rng.standard_normal((n_out, n_in)).astype(np.float32), qtype)


def timed(fn, target_s: float = 0.02) -> float:
    """Seconds per call: enough calls for ~target_s."""
    fn()
    n, t0 = 1, time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(target_s / one))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def rows_max(part) -> int:
    """Rows up to which `QuantMatmul` runs the part's fused kernel."""
    if isinstance(part, quant.HalfPart):
        return quant.HALF_ROWS_MAX
    return quant.NIB_ROWS_MAX if part.nib else quant.BYTE_ROWS_MAX


def kernels(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    n_out, n_in = args.n_out, args.n_in
    parts: dict[str, object] = {}
    print(f"W [{n_out} outputs, {n_in} inputs]; decode + repack at load (ns per weight):")
    for name in args.types:
        qtype = T[name]
        data = raw_matrix(qtype, n_out, n_in, rng)
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            kind = quant.HalfPart if qtype in quant.HALF_TYPES else quant.QPart
            part = kind.from_tensor(data, qtype, (n_out, n_in))
            ts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        gguf_quants.dequantize(data, qtype)
        t_ref = time.perf_counter() - t0
        parts[name] = quant.quant_linear([(None, qtype, part)])
        print(f"  {name}: {min(ts) / (n_out * n_in) * 1e9:.2f} ns  (gguf.quants.dequantize to float32: "
              f"{t_ref / (n_out * n_in) * 1e9:.2f} ns); streamed {part.nbytes / 1e6:.3f} MB = "
              f"{part.nbytes * 8 / (n_out * n_in):.2f} bits/weight, held {part.resident_bytes * 8 / (n_out * n_in):.2f}")
    w = parts[args.types[0]].weight
    parts["f32"] = Linear.from_weight(np.ascontiguousarray(w))
    mm = quant.QuantMatmul(args.threads)
    f32mm = Matmul(args.threads)
    xs = {m: rng.standard_normal((m, n_in)).astype(np.float32) for m in args.rows}
    res: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for m in args.rows:
            for name, lin in parts.items():
                f = (lambda: f32mm(lin, xs[m])) if name == "f32" else (lambda: mm(lin, xs[m]))
                res.setdefault((name, m), []).append(timed(f))
    print(f"\nproducts, --threads {args.threads}, median of {args.rounds} interleaved rounds "
          f"(fused kernel up to {quant.NIB_ROWS_MAX} rows for nibble parts, {quant.BYTE_ROWS_MAX} for byte parts, "
          f"{quant.HALF_ROWS_MAX} for F16 / BF16, then dequantized tile + BLAS):")
    print("| type | " + " | ".join(f"{m} row{'s' if m > 1 else ''}" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name, lin in parts.items():
        nbytes = lin.stream_bytes
        cells = []
        for m in args.rows:
            t = statistics.median(res[(name, m)])
            path = "" if name == "f32" else (" f" if m <= rows_max(lin.parts[0]) else " t")
            cells.append(f"{t * 1e3:.3f} ms{path}, {nbytes / t / 1e9:.1f} GB/s, {m * n_in * n_out / t / 1e9:.1f} GMAC/s")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("(f = fused kernel, t = tile + BLAS; GB/s = bytes of the weights a product reads / time)")


def decode_steps(model, n_prompt: int = 64, n_steps: int = 10) -> list[float]:
    """Seconds of each single-sequence decode step after an n_prompt-token prefill (first two dropped)."""
    ids = [3 + (7 * i) % (model.hparams.n_vocab - 3) for i in range(n_prompt + n_steps)]
    kv = model.new_kv(1, n_prompt + n_steps + 1)
    model.forward_batch(kv, [BatchChunk(0, ids[:n_prompt], 0, True)])
    out = []
    for i in range(n_steps):
        t0 = time.perf_counter()
        model.forward_batch(kv, [BatchChunk(0, [ids[n_prompt + i]], n_prompt + i, True)])
        out.append(time.perf_counter() - t0)
    return out[2:]


def load_times(args: argparse.Namespace) -> None:
    d = tempfile.mkdtemp(prefix="kq-bench-")
    print("\nload of a synthetic model: 30 layers, n_embd 768, n_ff 1536, 12 heads (4 KV), tiny vocabulary")
    paths = {}
    for name in ("Q4_K", "Q5_K", "Q6_K", "F16"):
        paths[name] = write_tiny_gguf(os.path.join(d, f"{name}.gguf"), n_layer=30, n_embd=768, n_ff=1536,
                                      n_head=12, n_head_kv=4, tensor_type=name)
    for name, path in paths.items():
        times: dict[str, list[float]] = {"f32": [], "q": []}
        steps: dict[str, list[float]] = {"f32": [], "q": []}
        held = {}
        for _ in range(2):
            for mode in ("f32", "q"):
                t0 = time.perf_counter()
                model = load(path, n_threads=args.threads, numerics=mode)
                times[mode].append(time.perf_counter() - t0)
                held[mode] = (model.weights.n_resident_bytes, model.weights.n_stream_bytes)
                steps[mode] += decode_steps(model)
                del model
        print(f"  {name} file {os.path.getsize(path) / 1e6:.0f} MB: " + "; ".join(
            f"{mode} load {min(ts):.2f} s, held {held[mode][0] / 1e6:.0f} MB, streamed per step "
            f"{held[mode][1] / 1e6:.0f} MB, decode step {statistics.median(steps[mode]) * 1e3:.1f} ms"
            for mode, ts in times.items()))
        os.unlink(path)
    os.rmdir(d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_1,Q4_K,Q5_1,Q5_K,Q8_0,Q6_K,F16,BF16", type=lambda s: s.split(","))
    ap.add_argument("--rows", default="1,4,16,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--n-out", type=int, default=576)
    ap.add_argument("--n-in", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--load-model", action="store_true")
    args = ap.parse_args()
    if not quant.available():
        sys.exit("numba cannot be loaded: numerics 'q' is not available")
    print(f"load average before: {os.getloadavg()}")
    with threadpool_limits(limits=1, user_api="blas"):
        print("BLAS:", [(i.get("internal_api"), i.get("num_threads"), i.get("architecture")) for i in threadpool_info()
                        if i.get("user_api") == "blas"], f"engine --threads {args.threads}")
        kernels(args)
        if args.load_model:
            load_times(args)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
