"""benchmarks/llamacpp_tools.py against stand-in executables that print what llama.cpp's llama-bench (`-o json`)
and llama-batched-bench (`--output-format jsonl`) print: the arguments passed, the figures parsed, and clear
errors for a missing tool, a failing one and output that is not the documented format."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load


@pytest.fixture(scope="module")
def tools():
    return load("llamacpp_tools")


def fake(dir_: Path, name: str, body: str) -> Path:
    """An executable Python script standing in for a llama.cpp tool; it logs its argv to <name>.argv."""
    path = dir_ / name
    path.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(path) + '.argv'!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


LLAMA_BENCH = r"""
a = sys.argv[1:]
p, n = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1])
print("load_backend: loaded CPU backend", file=sys.stderr)
test = {"build_commit": "0c1e57098", "n_threads": int(a[a.index("-t") + 1]), "n_prompt": p, "n_gen": n,
        "avg_ts": 174.5 if p else 97.6, "stddev_ts": 1.0, "samples_ts": [174.5] if p else [97.6]}
print(json.dumps([test], indent=2))
"""

BATCHED = r"""
a = sys.argv[1:]
print("main: n_kv_max = 1472, n_batch = 2048")
for pl in a[a.index("-npl") + 1].split(","):
    print(json.dumps({"pp": int(a[a.index("-npp") + 1]), "tg": int(a[a.index("-ntg") + 1]), "pl": int(pl),
                      "speed_pp": 150.0, "speed_tg": 8.0 * int(pl), "speed": 1.0}))
"""


def test_llama_bench_runs_pp_and_tg_separately_and_parses_both(tools, tmp_path):
    fake(tmp_path, "llama-bench", LLAMA_BENCH)
    out = tools.llama_bench(tmp_path, "m.gguf", 2, 512, 24, 3, n_depth=64)
    assert out["pp"]["avg_ts"] == 174.5 and out["pp"]["n_prompt"] == 512 and out["pp"]["n_threads"] == 2
    assert out["tg"]["avg_ts"] == 97.6 and out["tg"]["n_gen"] == 24
    calls = [json.loads(line) for line in (tmp_path / "llama-bench.argv").read_text().splitlines()]
    assert len(calls) == 2
    pp_call, tg_call = calls
    assert pp_call[pp_call.index("-p") + 1] == "512" and pp_call[pp_call.index("-n") + 1] == "0"
    assert "-d" not in pp_call                                      # the prompt goes into an empty context
    assert tg_call[tg_call.index("-d") + 1] == "64" and tg_call[tg_call.index("-p") + 1] == "0"
    for call in calls:
        assert call[call.index("-t") + 1] == "2" and call[call.index("-r") + 1] == "3"
        assert call[call.index("-o") + 1] == "json" and call[call.index("-m") + 1] == "m.gguf"


SAMPLED = r"""
a = sys.argv[1:]
p, n, r = int(a[a.index("-p") + 1]), int(a[a.index("-n") + 1]), int(a[a.index("-r") + 1])
ns = [2_000_000 + 1000 * i for i in range(r)]
print(json.dumps([{"n_prompt": p, "n_gen": n, "n_threads": 2, "avg_ts": 1.0, "stddev_ts": 0.0,
                   "samples_ns": ns if "short" not in a[a.index("-m") + 1] else ns[:-1]}]))
"""


def test_llama_bench_samples_are_each_repetition_in_seconds_in_order(tools, tmp_path):
    fake(tmp_path, "llama-bench", SAMPLED)
    assert tools.llama_bench_samples(tmp_path, "m.gguf", 2, 0, 1, 3, n_depth=256) == [0.002, 0.002001, 0.002002]
    (call,) = [json.loads(line) for line in (tmp_path / "llama-bench.argv").read_text().splitlines()]
    assert [call[call.index(f) + 1] for f in ("-p", "-n", "-d", "-r", "-t")] == ["0", "1", "256", "3", "2"]
    assert len(tools.llama_bench_samples(tmp_path, "m.gguf", 2, 256, 0, 2)) == 2


def test_llama_bench_samples_want_one_per_repetition(tools, tmp_path):
    fake(tmp_path, "llama-bench", SAMPLED)
    with pytest.raises(tools.ToolError, match="without 3 positive samples_ns"):
        tools.llama_bench_samples(tmp_path, "short.gguf", 2, 0, 1, 3)
    with pytest.raises(ValueError, match="one of n_prompt and n_gen"):
        tools.llama_bench_samples(tmp_path, "m.gguf", 2, 64, 1, 3)


def test_batched_bench_rows_by_sequence_count_and_context_large_enough(tools, tmp_path):
    fake(tmp_path, "llama-batched-bench", BATCHED)
    rows = tools.batched_bench(tmp_path, "m.gguf", 2, 64, 24, [1, 4, 16])
    assert sorted(rows) == [1, 4, 16]
    assert rows[16]["speed_tg"] == 128.0 and rows[1]["speed_tg"] == 8.0
    (call,) = [json.loads(line) for line in (tmp_path / "llama-batched-bench.argv").read_text().splitlines()]
    assert call[call.index("-npl") + 1] == "1,4,16"
    assert int(call[call.index("-c") + 1]) >= 16 * (64 + 24)      # every sequence's prompt and steps fit
    assert call[call.index("-t") + 1] == call[call.index("-tb") + 1] == "2"
    assert call[call.index("--output-format") + 1] == "jsonl"


def test_missing_tool_names_the_path(tools, tmp_path):
    with pytest.raises(tools.ToolError, match="no executable llama-bench"):
        tools.llama_bench(tmp_path, "m.gguf", 2, 512, 24, 1)


def test_failing_tool_reports_exit_code_and_stderr(tools, tmp_path):
    fake(tmp_path, "llama-batched-bench", "print('error: failed to load model', file=sys.stderr); sys.exit(1)")
    with pytest.raises(tools.ToolError, match=r"exited with 1:\nerror: failed to load model"):
        tools.batched_bench(tmp_path, "m.gguf", 2, 64, 24, [1])


@pytest.mark.parametrize("text, message", [
    ("no json here", "no JSON array"),
    ('[{"n_prompt": 512, "n_gen": 0}]', "without avg_ts"),
])
def test_llama_bench_output_not_in_its_format(tools, text, message):
    with pytest.raises(tools.ToolError, match=message):
        tools.parse_llama_bench(text)


@pytest.mark.parametrize("text, message", [
    ("only a log line\n", "no JSON rows"),
    ('{"pl": 1, "speed_tg": 8.0\n', "not JSON"),
    ('{"pp": 64, "tg": 24}\n', "without pl / speed_tg"),
])
def test_batched_bench_output_not_in_its_format(tools, text, message):
    with pytest.raises(tools.ToolError, match=message):
        tools.parse_batched_bench(text)
