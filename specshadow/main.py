"""The ``specshadow`` command: one console script, one subcommand per job.

Each subcommand lives next to the code it drives and registers itself with a ``register``
function; this module imports them all (it is the top of the package graph, the one place that
may), assembles the parser, sets up logging and dispatches. Registering imports no heavy library:
each command imports what it needs (numpy, matplotlib, the openai SDK) when it runs, and says which
extra to install when that is missing.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from backends import cli as vllm_cli
from core.extras import MissingExtra
from counterfactual import cli as counterfactual_cli
from evidence import cli as records_cli
from gateway import cli as rollout_cli
from loadgen import cli as loadgen_cli
from policies import cli as policy_cli
from report import cli as report_cli
from simulator import cli as simulator_cli
from specshadow import agreement, demo, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specshadow",
        description="Shadow-test speculative decoding on live OpenAI-compatible traffic.",
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.register(sub)
    demo.register(sub)
    agreement.register(vllm_cli.register(sub))
    simulator_cli.register(sub)
    policy_cli.register(sub)
    records_cli.register(sub)
    loadgen_cli.register(sub)
    report_cli.register(sub)
    counterfactual_cli.register(sub)
    rollout_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        result: int = args.func(args)
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    return result
