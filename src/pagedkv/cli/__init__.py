"""`pagedkv` command line: one entry point, a subcommand per job.

Every command lives in this package, one module each (`register(subparsers)`), on top of
the layers it drives; a module imports its heavy dependencies only inside the handler, so
`pagedkv plan --help` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# The command modules, in the order `--help` lists them.
_COMMAND_MODULES = (
    "pagedkv.cli.serve",  # serve, generate
    "pagedkv.cli.demo",  # demo
    "pagedkv.cli.chat",  # chat
    "pagedkv.cli.convert",  # convert
    "pagedkv.cli.simulate",  # plan, simulate
    "pagedkv.cli.tune",  # tune
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv", description="A paged KV cache and LLM inference engine."
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        # Bad input or a missing optional dependency is a one-line error and a non-zero
        # exit, never a traceback.
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
