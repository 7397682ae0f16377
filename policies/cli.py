"""``specshadow policy check FILE``, ``specshadow policy schema [--out FILE]`` and
``specshadow plan`` (sizing a shadow for load parity, :mod:`policies.plan`).

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
    """Add ``policy`` (``check``, ``schema``) and ``plan``."""
    plan = subparsers.add_parser(
        "plan",
        help="size a shadow: candidate replicas for load parity, or the parity of a sizing",
        description=(
            "What must match production is the per-replica arrival rate: a share f of R "
            "requests/s over s candidate replicas gives each f*R/s against production's R/p."
        ),
    )
    plan.add_argument("--primary-replicas", type=int, required=True, metavar="P")
    plan.add_argument("--rate", type=float, required=True, metavar="RPS", help="today's requests/s")
    plan.add_argument(
        "--share", type=float, default=None, help="the share to mirror (cost); default: 1/P"
    )
    plan.add_argument(
        "--candidate-replicas",
        type=int,
        action="append",
        default=[],
        metavar="S",
        help="the candidate's current sizing (repeat for several candidates side by side)",
    )
    plan.set_defaults(func=run_plan)
    parser = subparsers.add_parser("policy", help="validate policy files, print their schema")
    sub = parser.add_subparsers(dest="policy_command", required=True, metavar="ACTION")
    check = sub.add_parser("check", help="validate a policy file (exit 1 on any problem)")
    check.add_argument("file", type=Path)
    check.set_defaults(func=run_check)
    schema = sub.add_parser("schema", help="print the policy JSON Schema")
    schema.add_argument("--out", type=Path, default=None, help="write to this file instead")
    schema.set_defaults(func=run_schema)


def run_plan(args: argparse.Namespace) -> int:
    from policies.plan import Plan, plan_many

    p = args.primary_replicas
    problems = []
    if p < 1:
        problems.append(f"--primary-replicas: must be at least 1, got {p}")
    if not args.rate > 0:
        problems.append(f"--rate: must be positive, got {args.rate}")
    share = args.share if args.share is not None else (1 / p if p >= 1 else 0.0)
    if not 0 < share <= 1:
        problems.append(f"--share: must be in (0, 1], got {share}")
    problems += [
        f"--candidate-replicas: must be at least 1, got {s}"
        for s in args.candidate_replicas
        if s < 1
    ]
    if problems:
        for problem in problems:
            print(f"specshadow plan: {problem}", file=sys.stderr)
        return 2
    sizings = args.candidate_replicas or [None]
    for s in sizings:
        print("\n".join(Plan(p, args.rate, share, s).lines()))
    if len(args.candidate_replicas) > 1:
        rows = plan_many(p, args.rate, args.candidate_replicas)
        total = sum(rps for _s, _f, rps in rows)
        print(
            f"\n{len(rows)} candidates, each load-matched: mirrored {total:.3g} requests/s in all"
        )
        for s, f, rps in rows:
            print(f"  {s} replica{'s' if s != 1 else ''}: share {f:.3g}, {rps:.3g} requests/s")
    return 0


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
    rollouts = [f"{r.name}: {r.rollout.stage}" for r in policy.all_rules if r.rollout is not None]
    if rollouts:  # the stage the file asks for; a gateway's state may say rolled back
        flags += f", rollout {', '.join(rollouts)}"
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
