"""The `slotlab` command line: the parser of every subcommand and `main`, which dispatches to them.

Each subcommand is a module (`simulate`, `compare`, `replay`, `generate`, `calibrate`, `validate`, `serve`,
`record_cli`, `study.command`) that registers its parser and runs the command; their flags come from the one
table in `experiments.flags` (`study` has its own few: it reads the rest from its spec).
See docs/cli.md and docs/http_api.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from experiments import calibrate, compare, generate, record_cli, replay, serve, simulate, upstream_flags, validate
from experiments.flags import UsageError
from experiments.study.command import add_study_parser, cmd_study


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (plus a pointer to --help) instead of the whole usage block."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n(see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="slotlab", allow_abbrev=False,
        description="slotlab: simulate llama-server slot scheduling, prompt caching and batching policies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    simulate.add_parser(sub)
    compare.add_parser(sub)
    replay.add_parser(sub)
    generate.add_parser(sub)
    calibrate.add_calibrate_parser(sub)
    validate.add_validate_parser(sub)
    serve.add_serve_parser(sub)
    add_study_parser(sub)
    record_cli.add_record_parser(sub)
    return parser


def cmd_delegated(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Commands whose parser set `func` (serve, calibrate, validate, record)."""
    return args.func(args)


COMMANDS = {"simulate": simulate.cmd_simulate, "compare": compare.cmd_compare, "replay": replay.cmd_replay,
            "generate": generate.cmd_generate, "serve": cmd_delegated, "calibrate": cmd_delegated,
            "validate": cmd_delegated, "study": cmd_study, "record": cmd_delegated}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `slotlab` console script; returns the exit code (2 = bad usage or input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:               # llama-server's LLAMA_ARG_* environment variables
        argv = ["serve", *upstream_flags.env_argv(argv[1:])]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:   # argparse has printed the usage error (or the help)
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return COMMANDS[args.command](args, argv)
    except UsageError as exc:
        print(f"slotlab {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"slotlab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
