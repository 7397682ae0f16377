"""``specshadow rollout status|promote|rollback``: the operator's side of a progressive rollout.

Talks to a running gateway's admin API (``GET /admin/rollout``, ``POST
/admin/rollout/{rule}/promote|rollback``) with the standard library only. Changes need the admin
token: ``--token`` or ``SPECSHADOW_ADMIN_TOKEN``. Exit status: 0 done, 1 the gateway refused
(the reason is printed), 2 it could not be reached.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from core import jsonx

DEFAULT_GATEWAY = "http://127.0.0.1:8080"


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "rollout", help="show, promote or roll back a gateway's progressive rollouts"
    )
    sub = p.add_subparsers(dest="rollout_command", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--gateway", default=os.environ.get("SPECSHADOW_GATEWAY", DEFAULT_GATEWAY),
                        help=f"the gateway's base URL (default {DEFAULT_GATEWAY})")  # fmt: skip
    common.add_argument("--token", default=None,
                        help="admin bearer token (default: $SPECSHADOW_ADMIN_TOKEN)")  # fmt: skip
    status = sub.add_parser("status", parents=[common], help="every rule's stage and guards")
    status.add_argument("--json", action="store_true", help="the raw JSON")
    status.set_defaults(func=run_status)
    promote = sub.add_parser("promote", parents=[common], help="one step up, or to --stage")
    promote.add_argument("rule", help="the policy rule whose rollout moves")
    promote.add_argument(
        "--stage",
        choices=["canary", "live"],
        default=None,
        help="the stage to move to (default: the next one)",
    )
    promote.add_argument(
        "--serve-ratio", type=float, default=None, help="canary share, 0–1 (default: the policy's)"
    )
    promote.set_defaults(func=run_promote)
    rollback = sub.add_parser("rollback", parents=[common], help="back to shadow, sticky")
    rollback.add_argument("rule", help="the policy rule whose rollout goes back to shadow")
    rollback.add_argument(
        "--reason", default="operator rollback", help="recorded with the transition"
    )
    rollback.set_defaults(func=run_rollback)


def _call(
    args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None
) -> tuple[int, Any]:
    url = args.gateway.rstrip("/") + path
    data = jsonx.dumps(body) if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("content-type", "application/json")
    token = args.token or os.environ.get("SPECSHADOW_ADMIN_TOKEN")
    if token:
        request.add_header("authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, jsonx.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, jsonx.loads(exc.read())
        except ValueError:
            return exc.code, {"error": {"message": str(exc)}}


def _done(status: int, body: Any) -> int:
    if status >= 400:
        message = (body.get("error") or {}).get("message") if isinstance(body, dict) else body
        print(f"specshadow rollout: {status}: {message}", file=sys.stderr)
        return 1
    return 0


def _reachable(fn: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            result: int = fn(args)
        except BrokenPipeError:  # `rollout status --json | head`: the reader left, not the gateway
            raise
        except (urllib.error.URLError, OSError) as exc:
            print(f"specshadow rollout: cannot reach {args.gateway}: {exc}", file=sys.stderr)
            return 2
        return result

    return run


@_reachable
def run_status(args: argparse.Namespace) -> int:
    status, body = _call(args, "GET", "/admin/rollout")
    if status >= 400:
        return _done(status, body)
    if args.json:
        print(jsonx.dumps(body, indent=True).decode())
        return 0
    rules = body.get("rules", {})
    if not rules:
        print("no rule has a rollout")
    for name, r in rules.items():
        back = " (rolled back)" if r.get("rolled_back") else ""
        print(
            f"{name}: {r['stage']}{back}, serve ratio {r['serve_ratio']:.2f}, candidate {r['candidate']}"
        )
        for g in r.get("guards", ()):
            value = "—" if g["value"] is None else f"{g['value']:.3g}"
            print(
                f"  {g['guard']:<18} {g['status']:<11} {value:>8}  threshold {g['threshold']:g}  n={g['samples']}"
            )
        if r.get("waiting"):
            print(f"  waiting: {r['waiting']}")
        if r.get("acceptance_reference"):
            levels = ", ".join(
                f"{k or 'all traffic'} {v:.2f}"
                for k, v in sorted(r["acceptance_reference"].items())
            )
            print(f"  acceptance reference: {levels}")
        last = r.get("last_transition")
        if last:
            print(
                f"  last: {last['from_stage']} → {last['to_stage']} by {last['by']}: {last['reason']}"
            )
    for b in body.get("drift_breaches", ())[-5:]:
        print(f"drift: {b['rule']} {b['guard']} ({b['action']}): {b['detail']}")
    return 0


@_reachable
def run_promote(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {}
    if args.stage is not None:
        body["stage"] = args.stage
    if args.serve_ratio is not None:
        body["serve_ratio"] = args.serve_ratio
    status, out = _call(args, "POST", f"/admin/rollout/{args.rule}/promote", body or None)
    if status < 400:
        print(
            f"{args.rule}: {out['from_stage']} → {out['to_stage']} (serve ratio {out['serve_ratio']:.2f})"
        )
    return _done(status, out)


@_reachable
def run_rollback(args: argparse.Namespace) -> int:
    status, out = _call(
        args, "POST", f"/admin/rollout/{args.rule}/rollback", {"reason": args.reason}
    )
    if status < 400:
        print(f"{args.rule}: {out['from_stage']} → {out['to_stage']}: {out['reason']}")
    return _done(status, out)
