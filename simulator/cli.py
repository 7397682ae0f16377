"""``specshadow simulate``: serve a simulated vLLM (plain or speculative) with known ground truth."""

from __future__ import annotations

import argparse
import asyncio
import errno
import signal
from collections.abc import Callable
from typing import Any, Literal

from core.faults import BadInput
from simulator.app import run_simulator
from simulator.config import SAMPLING_DEFECTS, Acceptance, SimConfig, parse_faults


def _acceptance(text: str) -> Acceptance:
    """``0.7`` (every position) or ``0.8,0.6,0.4,0.2`` (one value per position)."""
    parts = [float(p) for p in text.split(",") if p.strip()]
    return parts[0] if len(parts) == 1 else tuple(parts)


def _category_pairs(items: list[str], convert: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected CATEGORY=VALUE, got {item!r}")
        out[name] = convert(value)
    return out


def _setting(text: str) -> object:
    """An engine setting's value: true/false, none, an integer, else text."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        return text


DEFAULT_ACCEPTANCE = "0.7"
# The flags that describe drawn (probabilistic) drafting: given, they choose it under auto.
DRAWN = ("acceptance", "category_acceptance", "coverage", "category_coverage")


def drafting_of(args: argparse.Namespace) -> Literal["probabilistic", "replay"]:
    """``--drafting``; ``auto`` (the default): ``replay`` — vLLM's n-gram rule (or a drafter)
    over the real token ids, so what the candidate measures is what the counterfactual's replay
    of the same outputs predicts, and the live check can check it — unless a flag of drawn
    drafting (``--acceptance``, ``--coverage``, per category) or a proposer the replay does not
    run asks for ``probabilistic``."""
    if args.drafting != "auto":
        return "replay" if args.drafting == "replay" else "probabilistic"
    drawn = any(getattr(args, name) not in (None, []) for name in DRAWN)
    return "replay" if not drawn and args.proposer in ("ngram", "draft_model") else "probabilistic"


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        aliases=tuple(args.alias),
        mode=args.mode,
        num_speculative_tokens=args.k,
        acceptance=_acceptance(args.acceptance or DEFAULT_ACCEPTANCE),
        category_acceptance=_category_pairs(args.category_acceptance, _acceptance),
        coverage=1.0 if args.coverage is None else args.coverage,
        category_coverage=_category_pairs(args.category_coverage, float),
        seed=args.seed,
        divergence_at=args.divergence_at,
        proposer=args.proposer,
        drafting=drafting_of(args),
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        drafter_match=args.drafter_match,
        category_drafter_match=_category_pairs(args.category_drafter_match, float),
        max_model_len=args.max_model_len,
        copy=args.copy,
        category_copy=_category_pairs(args.category_copy, float),
        rejection_sample_method=args.rejection_sample_method,
        min_output_tokens=args.min_output_tokens,
        max_output_tokens=args.max_output_tokens,
        prefill_base_s=args.prefill_ms / 1e3,
        prefill_per_token_s=args.prefill_per_token_ms / 1e3,
        step_s=args.step_ms / 1e3,
        spec_step_overhead_s=args.spec_overhead_ms / 1e3,
        max_num_seqs=args.max_num_seqs,
        batching=args.batching,
        step_slot_s=args.slot_ms / 1e3,
        draft_s=args.draft_ms / 1e3,
        kv_overhead_fraction=args.kv_overhead,
        kv_cache_capacity_tokens=args.kv_capacity_tokens,
        always_metrics=args.always_metrics,
        stamp_events=not args.no_stamps,
        faults=parse_faults(args.fault),
        sampling=args.sampling,
        sampling_defect=args.sampling_defect,
        logit_noise_sigma=args.logit_noise_sigma,
        model_salt=args.model_salt,
        defect_strength=args.defect_strength,
        draft_logit_sigma=args.draft_logit_sigma,
        engine=_category_pairs(args.engine, _setting),
    )


async def _serve(config: SimConfig, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with run_simulator(config, host, port, shutdown_timeout_s=2.0) as server:
        # The real URL (``--port 0`` picks a free port): scripts and tests read this line.
        print(
            f"specshadow simulator ({config.mode}, model {config.model}) on {server.base_url}",
            flush=True,
        )
        await stop.wait()


def _run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:  # uvloop is a runtime dependency except on Windows
        factory = asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        try:
            runner.run(_serve(config, args.host, args.port))
        except OSError as exc:
            if exc.errno not in _LISTEN_ERRORS:
                raise
            where = f"{args.host}:{args.port}"
            raise BadInput(f"cannot listen on {where}: {_LISTEN_ERRORS[exc.errno]}") from None
    return 0


# The bind faults a user can fix, worded as ``specshadow serve`` words them.
_LISTEN_ERRORS = {
    errno.EADDRINUSE: "the port is already in use (another server?): give --port another one, "
    "or 0 for a free one",
    errno.EADDRNOTAVAIL: "the host is not an address of this machine",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
}


def register(subparsers: Any) -> None:
    """Add ``simulate`` to the ``specshadow`` parser."""
    p = subparsers.add_parser(
        "simulate",
        help="serve a simulated vLLM OpenAI server with known ground truth",
        description=(
            "Serve an OpenAI-compatible simulated vLLM (plain or speculative). Per-request ground "
            "truth at GET /sim/requests?id=<x-request-id>; faults per request via the x-sim-fault "
            "header; category via x-specshadow-category."
        ),
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001)
    p.add_argument("--mode", choices=["plain", "speculative"], default="plain")
    p.add_argument("--model", default="sim-model", help="served model name")
    p.add_argument("--alias", action="append", default=[], help="extra served name (repeatable)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument(
        "--acceptance",
        default=None,
        help=f"p, or p0,p1,...,p(k-1): drawn drafting (default {DEFAULT_ACCEPTANCE})",
    )
    p.add_argument(
        "--category-acceptance",
        action="append",
        default=[],
        metavar="CATEGORY=P",
        help="per-category acceptance, e.g. code=0.8 or json=0.9,0.8,0.7,0.6 (repeatable)",
    )
    p.add_argument(
        "--coverage",
        type=float,
        default=None,
        help="drawn drafting: P(proposer drafts on a step) (default 1.0)",
    )
    p.add_argument("--category-coverage", action="append", default=[], metavar="CATEGORY=C")
    p.add_argument("--prefill-ms", type=float, default=20.0)
    p.add_argument("--prefill-per-token-ms", type=float, default=0.0)
    p.add_argument("--step-ms", type=float, default=5.0, help="one target forward pass")
    p.add_argument("--spec-overhead-ms", type=float, default=0.0, help="proposer cost per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--divergence-at", type=int, default=None)
    p.add_argument("--proposer", default="ngram", help="method named by /server_info")
    p.add_argument(
        "--drafting",
        choices=["auto", "probabilistic", "replay"],
        default="auto",
        help="replay: drafts from a real proposer over the token ids (ngram: vLLM's rule; "
        "draft_model), which the counterfactual's replay can check; probabilistic: steps drawn "
        "from --acceptance and --coverage; auto: probabilistic when one of those is given, "
        "else replay",
    )
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: shortest n-gram")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: longest n-gram")
    p.add_argument(
        "--drafter-match",
        type=float,
        default=0.7,
        help="replay draft_model: P(the drafter predicts the actual token)",
    )
    p.add_argument("--category-drafter-match", action="append", default=[], metavar="CATEGORY=P")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument(
        "--copy", type=float, default=0.0, help="P(a text segment copies a span of the context)"
    )
    p.add_argument("--category-copy", action="append", default=[], metavar="CATEGORY=P")
    p.add_argument(
        "--rejection-sample-method",
        choices=["standard", "block", "synthetic"],
        default="standard",
        help="what /server_info reports (synthetic: a lossy verification)",
    )
    p.add_argument("--min-output-tokens", type=int, default=16)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--batching",
        choices=["independent", "continuous"],
        default="independent",
        help="continuous: one engine steps all running requests; a step's time grows with the batch",
    )
    p.add_argument(
        "--slot-ms", type=float, default=0.0, help="continuous: cost per verification slot"
    )
    p.add_argument(
        "--draft-ms",
        type=float,
        default=0.0,
        help="continuous: draft model cost per drafting request",
    )
    p.add_argument(
        "--kv-overhead", type=float, default=0.0, help="speculative: extra KV per token (drafter)"
    )
    p.add_argument("--kv-capacity-tokens", type=int, default=65_536, help="KV cache size in tokens")
    p.add_argument("--always-metrics", action="store_true", help="per-request metrics always")
    p.add_argument("--no-stamps", action="store_true", help="omit ': sent_ns=' SSE comments")
    p.add_argument(
        "--fault", default="", help="default faults, e.g. 'status=503' (x-sim-fault syntax)"
    )
    p.add_argument(
        "--sampling",
        action="store_true",
        help="draw text answers from a known per-prompt model (temperature, top_p, seed apply)",
    )
    p.add_argument(
        "--sampling-defect",
        choices=SAMPLING_DEFECTS,
        default="none",
        help="a lossy sampling mode reproducing a speculative-decoding bug (needs --sampling)",
    )
    p.add_argument(
        "--logit-noise-sigma",
        type=float,
        default=0.0,
        help="logit_noise: std of the Gaussian noise added to every logit",
    )
    p.add_argument(
        "--model-salt", default="target", help="names the sampling model (another: another model)"
    )
    p.add_argument(
        "--defect-strength",
        type=float,
        default=1.0,
        help="different_model: weight of the other model's logits, 0 < w <= 1",
    )
    p.add_argument(
        "--draft-logit-sigma",
        type=float,
        default=0.7,
        help="speculative sampling: std of the drafter's fixed logit perturbation (0: exact)",
    )
    p.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="what /server_info, /version and /metrics say the engine runs (repeatable): "
        "version, dtype, quantization, kv_cache_dtype, enable_prefix_caching, … "
        "(change it mid-run with POST /sim/engine)",
    )
    p.set_defaults(func=_run)
