"""`slotlab simulate`: one server configuration on a workload, in the simulator; writes a results directory
(per-request and timeline tables, summary, plots) and prints the summary."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from experiments.flags import SIMULATE, add_command, option_values
from experiments.runs import (RunSpec, check_options, follow, format_summary, one_line_summary, out_dir,
                              run_context, run_one, saturation_warning, usage_errors)
from experiments.workloads import build_workload

SIMULATE_EPILOG = """examples:
  slotlab simulate
      built-in multi-turn chat workload (32 users), upstream defaults, results in results/simulate/<timestamp>/
  slotlab simulate --trace azure_conv.csv --rate 2 --max-requests 2000 -np 8 -c 32768 --evict lru --cache-hit copy
      replay a public trace at 2 requests/s on 8 slots with an LRU prompt cache
  slotlab simulate --workload poisson --rate 4 --requests 500 --prompt-tokens 200-2000 --latency constant:0.02
      open-loop Poisson arrivals with a constant 20 ms step time
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    return add_command(subparsers, SIMULATE, "simulate one server configuration on a workload",
                       "Simulate one llama-server configuration on a workload; write per-request\nresults, a "
                       "summary and plots. With no arguments: the built-in multi-turn chat workload.",
                       SIMULATE_EPILOG)


def cmd_simulate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    values = option_values(args)
    with usage_errors():   # everything is checked before the results directory is created
        workload, desc = build_workload(values)
        check_options(values)
        out = out_dir(args, SIMULATE)
    spec = RunSpec(values, str(out), csv=args.csv, plots=not args.no_plots, context=run_context(argv, desc))
    if args.quiet:
        summary = run_one(spec, workload)
        print(f"slotlab simulate: {one_line_summary(summary)} -> {out}")
        warning = saturation_warning(summary)
        if warning:
            print(warning)
        return 0
    with tqdm(total=desc.get("n_requests"), unit="req", desc="simulate", file=sys.stderr, leave=False) as bar:
        summary = run_one(spec, workload, follow(bar))
    print(format_summary(summary))
    warning = saturation_warning(summary)
    if warning:
        print(warning)
    print(f"results: {out}/")
    return 0
