"""``specshadow policy check FILE`` and ``specshadow policy schema [--out FILE]``.

``check`` is for SREs' own CI: exit 0 with a one-line summary, or exit 1 with every problem as
``FILE: path: message`` on stderr. ``schema`` prints the JSON Schema committed as
``policies/schema.json`` (editors use it through the examples' ``yaml-language-server`` line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from policies.compile import load_policy
from policies.errors import PolicyError
from policies.model import render_json_schema


def register(subparsers: Any) -> None:
    """Add ``policy`` with its ``check`` and ``schema`` subcommands."""
    parser = subparsers.add_parser("policy", help="validate policy files, print their schema")
    sub = parser.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="validate a policy file (exit 1 on any problem)")
    check.add_argument("file", type=Path)
    check.set_defaults(func=run_check)
    schema = sub.add_parser("schema", help="print the policy JSON Schema")
    schema.add_argument("--out", type=Path, default=None, help="write to this file instead")
    schema.set_defaults(func=run_schema)


def run_check(args: argparse.Namespace) -> int:
    path: Path = args.file
    try:
        policy = load_policy(path)
    except PolicyError as exc:
        for problem in exc.problems:
            print(f"{path}: {problem}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{path}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        return 1
    rules = len(policy.rules) + (policy.default_rule is not None)
    flags = " KILL SWITCH ON" if policy.kill_switch else ""
    print(
        f"{path}: ok — {rules} rule{'s' if rules != 1 else ''}"
        f"{' (with default)' if policy.default_rule else ''}, "
        f"{len(policy.backends)} backend{'s' if len(policy.backends) != 1 else ''}, "
        f"sha256 {policy.sha256[:12]}{flags}"
    )
    return 0


def run_schema(args: argparse.Namespace) -> int:
    data = render_json_schema()
    if args.out is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        args.out.write_bytes(data)
    return 0
