"""The ``specshadow`` command: one console script, one subcommand per job.

Each subcommand lives next to the code it drives and registers itself through a
``register(subparsers)`` function in the module named in :data:`SUBCOMMAND_MODULES`; this module only
assembles the parser, sets up logging and dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# Modules that expose ``register(subparsers) -> None``. Each registered subparser sets
# ``func=callable(args) -> int``.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "gateway.serve",
    "gateway.demo",
    "loadgen.vllm.cli",
    "simulator.cli",
    "policies.cli",
    "gateway.records.cli",
    "loadgen.cli",
    "loadgen.report.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specshadow",
        description="Shadow-test speculative decoding on live OpenAI-compatible traffic.",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    result: int = args.func(args)
    return result
