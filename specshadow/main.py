"""The ``specshadow`` command: one console script, one subcommand per job.

Each subcommand lives next to the code it drives and registers itself with a ``register``
function; this module imports them all (it is the top of the package graph, the one place that
may), assembles the parser, sets up logging and dispatches. Registering imports no heavy library:
each command imports what it needs (numpy, matplotlib, the openai SDK) when it runs, and says which
extra to install when that is missing.

The help is finished here for every command at once (:func:`finish_help`): each subcommand's
description is its one-line help where it gives none, and every option shows its default
(:class:`HelpFormatter`). ``specshadow --version`` prints the installed version.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tomllib
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from backends import cli as vllm_cli
from core.extras import MissingExtra
from core.faults import Fault
from counterfactual import cli as counterfactual_cli, labels as export_labels
from gateway import cli as rollout_cli
from loadgen import cli as loadgen_cli
from policies import cli as policy_cli
from records import cli as records_cli
from report import cli as report_cli
from rollout.store import read_transitions
from simulator import cli as simulator_cli
from specshadow import agreement, demo, serve


def version() -> str:
    """The installed distribution's version, else the source tree's ``pyproject.toml``."""
    try:
        return metadata.version("specshadow")
    except metadata.PackageNotFoundError:
        pass
    try:
        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            found = tomllib.load(f).get("project", {}).get("version")
    except (OSError, tomllib.TOMLDecodeError):
        found = None
    return str(found) if found else "unknown"


class _Version(argparse.Action):
    """``--version``, looked up only when asked (the metadata scan costs a few milliseconds)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
        print(f"{parser.prog} {version()}")
        parser.exit()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``, where there is one to show: not for flags that
    default to nothing (None, False, an empty list) and not twice where the help names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is False
            or default is argparse.SUPPRESS
            or (isinstance(default, list | tuple) and not default)
            or "default" in text.lower()
        ):
            return text
        return super()._get_help_string(action)


def finish_help(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every subcommand under it :class:`HelpFormatter`, a description (the
    subcommand's help where it has none) and, for an option with a default but no help, a help
    that shows the default."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if (
            action.help is None
            and action.option_strings
            and HelpFormatter._get_help_string(HelpFormatter(parser.prog), action)
        ):
            action.help = "(default: %(default)s)"
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, child in action.choices.items():
                if child.description is None and helps.get(name):
                    text = str(helps[name])
                    child.description = text[:1].upper() + text[1:] + "."
                finish_help(child)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specshadow",
        description="Shadow-test speculative decoding on live OpenAI-compatible traffic.",
    )
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="how much the log says",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.register(sub)
    demo.register(sub)
    agreement.register(vllm_cli.register(sub))
    vllm_cli.register_llamacpp(sub)
    simulator_cli.register(sub)
    policy_cli.register(sub)
    records_cli.register(sub, labels=export_labels.labeller)  # rows labelled by a replay
    loadgen_cli.register(sub)
    report_cli.register(sub, read_state=read_transitions)  # every kind serve --state writes
    counterfactual_cli.register(sub)
    rollout_cli.register(sub)
    finish_help(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    """Run the parsed command: the one place where a known fault becomes one line on stderr
    and its exit status, for every subcommand alike (no traceback reaches the user).

    - :class:`core.faults.Fault` (a bad store, path or URL: 2; 0 records to work on: 1): its
      message, which names the thing and what to do;
    - a missing extra: which one to install (2);
    - a file the command was pointed at that cannot be opened (missing, a folder, no
      permission): the path and why (2);
    - a closed pipe (``specshadow records … | head``): normal use, status 0; stdout is pointed
      at /dev/null so the interpreter's last flush cannot fail again (as the Python docs on
      SIGPIPE advise).

    Anything else is a bug, and keeps its traceback.
    """
    name = f"specshadow {args.command}" + (f" {a}" if (a := getattr(args, "action", None)) else "")
    try:
        result: int = args.func(args)
        sys.stdout.flush()  # inside: a pipe closed on the last lines is caught here
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except MissingExtra as exc:
        print(exc, file=sys.stderr)
        return 2
    except Fault as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return exc.status
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        if exc.filename is None:
            raise
        print(f"{name}: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    return result


def _quiet_stdout() -> None:
    """Point stdout at /dev/null: the reader is gone, and what is left unflushed goes nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no real file (a test's capture): nothing to do
        pass
    finally:
        os.close(devnull)
