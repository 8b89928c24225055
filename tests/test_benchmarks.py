"""The benchmark and validation scripts still import and parse their arguments (they are run by hand, with
the reference tools, so nothing else would notice a broken import), and bench_engine's summary is right."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


def test_every_script_is_covered():
    assert {"bench_engine.py", "bench_sim.py", "validate_llamacpp.py"} <= set(SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help(script):
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("usage:")


def test_bench_engine_summary_prints_each_figure_per_run_and_its_median(capsys):
    spec = importlib.util.spec_from_file_location("bench_engine", BENCHMARKS / "bench_engine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.print_summary([{"prefill tok/s": 500.0, "16 seq / llama.cpp 1 seq (best)": 1.9},
                       {"prefill tok/s": 600.0, "16 seq / llama.cpp 1 seq (best)": 2.3},
                       {"prefill tok/s": 550.0}])
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "summary of 3 runs (each row: run 1 .. run 3 | median over runs)"
    prefill = next(line for line in out if "prefill tok/s" in line).split()
    assert prefill[2:] == ["500.00", "600.00", "550.00", "|", "550.00"]
    ratio = next(line for line in out if "16 seq" in line).split()
    assert ratio[-4:] == ["1.90", "2.30", "|", "2.10"]
