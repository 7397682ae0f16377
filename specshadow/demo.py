"""``specshadow demo``: the whole story on one machine, with embedded defaults and no configuration.

Simulated (the default): :mod:`specshadow.story` — two candidates shadowed side by side, the
report's pick per category, a canary of each pick, a bad deploy rolled back by the guards on
their own, and the final report.

``--vllm`` (real vLLM CPU servers: plain, n-gram, plain, started with :mod:`backends` or
reused with ``--vllm-urls``) and ``--llamacpp`` (llama.cpp's own server: plain, draft model,
plain, started with :mod:`backends.llamacpp` or reused with ``--llamacpp-urls``): the shadow part
of the story —

1. Start the gateway in front of the primary with a policy that mirrors a share of traffic to the
   candidate and the baseline, writing comparison records to an embedded store.
2. Replay the bundled trace of real prompts through the gateway with the load generator (the
   official ``openai`` request shapes, streamed, category header set).
3. Print what the gateway measured per request and per role, build the adoption report, print
   where it is, and stop everything.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from core.exchange import Exchange, LegResult
from core.extras import require
from core.sinks import MemorySink
from core.stats import percentile
from gateway.settings import Settings
from policies.compile import parse_policy
from policies.compiled import BackendKind
from policies.store import PolicyStore
from records.reader import read
from records.sqlite_store import query_records
from specshadow.app import build_app

MODEL = "sim-model"
# --vllm: fewer, shorter requests (the tiny CPU model serves ~200 tokens/s per server on 2 cores),
# and prompts that fit its 1024-token context with room for the output.
VLLM_REQUESTS = 30
VLLM_MAX_TOKENS = 48
VLLM_CONCURRENCY = 4
VLLM_MAX_PROMPT_CHARS = 2000


@dataclass(frozen=True, slots=True)
class DemoBackends:
    """Where the three demo backends listen, what they are, and the model name they serve."""

    primary: str
    candidate: str
    baseline: str
    kind: BackendKind
    model: str
    description: str  # for the printout and the report's sources


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "demo", help="run the whole shadow-testing story on simulated backends"
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests in the shadow act (default 240: the bundled trace twice; --vllm 30)",
    )
    p.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight (default 8; --vllm 4)"
    )
    p.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="--vllm: share of requests mirrored (default 0.8); the simulated story mirrors at "
        "load parity",
    )
    p.add_argument("--trace", default=None, help="JSONL trace (default: the bundled one)")
    p.add_argument("--out", default="specshadow-out/demo", help="records, results and report")
    p.add_argument("--quiet", action="store_true", help="no per-request lines")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="real vLLM CPU servers (plain primary, n-gram candidate, plain baseline) instead of "
        "simulators; `specshadow vllm setup` builds them on first use",
    )
    p.add_argument(
        "--vllm-urls",
        metavar="PRIMARY,CANDIDATE,BASELINE",
        default=None,
        help="with --vllm: use these running vLLM servers (base URLs, e.g. from `specshadow vllm "
        "up`) instead of starting three",
    )
    p.add_argument(
        "--llamacpp",
        action="store_true",
        help="real llama.cpp servers (plain primary, draft-model candidate, plain baseline) instead "
        "of simulators; `specshadow llamacpp setup` builds them on first use",
    )
    p.add_argument(
        "--llamacpp-urls",
        metavar="PRIMARY,CANDIDATE,BASELINE",
        default=None,
        help="with --llamacpp: use these running llama.cpp servers (base URLs, e.g. from "
        "`specshadow llamacpp up`) instead of starting three",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"override max_tokens (default: the trace's; --vllm {VLLM_MAX_TOKENS})",
    )
    p.set_defaults(func=run_demo)


def demo_policy(
    primary: str, candidate: str, baseline: str, ratio: float, kind: BackendKind = "sim"
) -> PolicyStore:
    raw = {
        "version": 1,
        "backends": {
            "primary": {"url": primary, "kind": kind},
            "candidate": {"url": candidate, "kind": kind, "metrics_url": f"{candidate}/metrics"},
            "baseline": {"url": baseline, "kind": kind},
        },
        "primary": "primary",
        "default": {
            "ratio": ratio,
            "legs": [
                {"backend": "candidate", "role": "candidate"},
                {"backend": "baseline", "role": "baseline"},
            ],
        },
    }
    return PolicyStore(parse_policy(raw, source="demo (embedded)"))


def run_demo(args: argparse.Namespace) -> int:
    require("report", command="demo")
    from loadgen.results import summarize, write_results
    from loadgen.trace import bundled_trace, read_trace
    from report import build_report

    started = time.perf_counter()
    if getattr(args, "vllm", False) and getattr(args, "llamacpp", False):
        from core.faults import BadInput

        raise BadInput("--vllm and --llamacpp are two demos; give one")
    # A real engine (vLLM or llama.cpp): the same shadow story, sized for the tiny CPU models.
    vllm = bool(getattr(args, "vllm", False) or getattr(args, "llamacpp", False))
    _resolve_defaults(args, vllm)
    rows = read_trace(args.trace) if args.trace else bundled_trace()
    if vllm:
        rows = [r for r in rows if _prompt_chars(r.body) <= VLLM_MAX_PROMPT_CHARS]
    rows = (rows * (1 + args.requests // max(1, len(rows))))[: args.requests]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store_path = out / "records.sqlite"
    for stale in [*out.glob("records.sqlite*"), out / "rollout-state.json"]:
        stale.unlink(missing_ok=True)
    if not vllm:
        from specshadow.story import run_story

        return asyncio.run(run_story(args, rows, out))
    exchanges, results = asyncio.run(replay_through_gateway(args, rows, store_path))
    if not args.quiet:
        print_table(exchanges)
    print_summary(exchanges)
    print_vllm_evidence(exchanges, "llama.cpp" if getattr(args, "llamacpp", False) else "vLLM")
    write_results(out / "loadgen.jsonl", results)
    summary = summarize(results)
    print(
        f"\nclient side (loadgen): {summary.get('requests', len(results))} requests, "
        f"errors {summary.get('errors', 0)}"
    )
    records = list(query_records(store_path))
    result_rows = [r.to_json() for r in results]
    print_equivalence(records)
    source = (
        "demo (llama.cpp: plain, draft model, plain)"
        if getattr(args, "llamacpp", False)
        else "demo (vLLM CPU: plain, n-gram, plain)"
    )
    paths = build_report(records, result_rows, out / "report", sources=[source])
    print(f"\nrecords  {store_path}  ({len(records)} comparison records)")
    print(f"results  {out / 'loadgen.jsonl'}")
    print(f"report   {paths.html}")
    print(f"summary  {paths.markdown}")
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")
    return 0


def _resolve_defaults(args: argparse.Namespace, vllm: bool) -> None:
    """Fill the defaults that differ between simulated and real backends."""
    if args.requests is None:
        args.requests = VLLM_REQUESTS if vllm else 240
    if args.ratio is None:
        args.ratio = 0.8
    if args.concurrency is None:
        args.concurrency = VLLM_CONCURRENCY if vllm else 8
    if getattr(args, "max_tokens", None) is None:
        args.max_tokens = VLLM_MAX_TOKENS if vllm else None


def _prompt_chars(body: Mapping[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return len(str(body.get("prompt", "")))
    return sum(len(m.get("content") or "") for m in messages if isinstance(m, Mapping))


def parse_vllm_urls(text: str, *, flag: str = "--vllm-urls") -> tuple[str, str, str]:
    """``PRIMARY,CANDIDATE,BASELINE`` base URLs (a trailing ``/`` or ``/v1`` is dropped)."""
    urls = [u.strip().rstrip("/").removesuffix("/v1") for u in text.split(",")]
    if len(urls) != 3 or not all(urls):
        raise ValueError(f"{flag} needs PRIMARY,CANDIDATE,BASELINE, got {text!r}")
    return urls[0], urls[1], urls[2]


@asynccontextmanager
async def llamacpp_demo_backends(urls: str | None) -> AsyncIterator[DemoBackends]:
    """Running llama.cpp servers: the given ones, or plain / draft model / plain started (and
    stopped) here."""
    from backends.llamacpp import SERVED_MODEL_NAME

    label = "llama.cpp"
    if urls is not None:
        primary, candidate, baseline = parse_vllm_urls(urls, flag="--llamacpp-urls")
        yield DemoBackends(primary, candidate, baseline, "llamacpp", SERVED_MODEL_NAME, label)
        return
    from backends.llamacpp import LlamaServerSpec, setup, start_servers, stop_servers

    print("starting llama.cpp servers: plain, draft model, plain", flush=True)
    env = await asyncio.to_thread(setup)
    specs = [
        LlamaServerSpec("primary", "plain"),
        LlamaServerSpec("candidate", "draft"),
        LlamaServerSpec("baseline", "plain"),
    ]
    servers = await asyncio.to_thread(start_servers, specs, env)
    try:
        p, c, b = (s.base_url for s in servers)
        yield DemoBackends(p, c, b, "llamacpp", SERVED_MODEL_NAME, label)
    finally:
        await asyncio.to_thread(stop_servers, servers)


@asynccontextmanager
async def vllm_demo_backends(urls: str | None) -> AsyncIterator[DemoBackends]:
    """Running vLLM servers: the given ones, or plain / n-gram / plain started (and stopped) here."""
    from backends.server import SERVED_MODEL_NAME

    if urls is not None:
        primary, candidate, baseline = parse_vllm_urls(urls)
        yield DemoBackends(primary, candidate, baseline, "vllm", SERVED_MODEL_NAME, "vLLM")
        return
    from backends.server import VllmServerSpec, spread_cores, start_servers, stop_servers
    from backends.setup import setup

    print("starting vLLM CPU servers: plain, n-gram, plain (about 1–2 minutes)", flush=True)
    env = await asyncio.to_thread(setup)
    # The primary's engine on a core of its own, the two mirrored legs beside each other on the
    # next: vLLM's own default binds every server's engine to the first core, where a request's
    # legs take turns (docs/vllm.md, "Servers").
    primary_core, mirror_core = spread_cores(2)
    specs = [
        VllmServerSpec("primary", "plain", cores=primary_core),
        VllmServerSpec("candidate", "ngram", cores=mirror_core),
        VllmServerSpec("baseline", "plain", cores=mirror_core),
    ]
    servers = await asyncio.to_thread(start_servers, specs, env)
    try:
        p, c, b = (s.base_url for s in servers)
        yield DemoBackends(p, c, b, "vllm", SERVED_MODEL_NAME, "vLLM")
    finally:
        await asyncio.to_thread(stop_servers, servers)


async def replay_through_gateway(
    args: argparse.Namespace, rows: Sequence[Any], store_path: Path
) -> tuple[list[Exchange], list[Any]]:
    """Backends and gateway up, the trace replayed through it, everything down again."""
    from loadgen.runner import run_loadgen

    backends = (
        llamacpp_demo_backends(getattr(args, "llamacpp_urls", None))
        if getattr(args, "llamacpp", False)
        else vllm_demo_backends(getattr(args, "vllm_urls", None))
    )
    sink = MemorySink()
    async with backends as b:
        store = demo_policy(b.primary, b.candidate, b.baseline, args.ratio, kind=b.kind)
        settings = Settings(primary_url=None, store_path=str(store_path), scrape_interval_s=2.0)
        runner = web.AppRunner(
            build_app(settings, sinks=[sink], policy=store),
            handler_cancellation=True,
            access_log=None,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            gateway_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            kind = {"vllm": "n-gram", "llamacpp": "draft model"}.get(b.kind, "speculative")
            print(f"primary   (plain)        {b.primary}")
            print(f"candidate ({kind + ')':<14} {b.candidate}")
            print(f"baseline  (plain)        {b.baseline}")
            print(f"gateway                  {gateway_url}  (mirroring {args.ratio:.0%})\n")
            results = await run_loadgen(
                f"{gateway_url}/v1",
                rows,
                concurrency=args.concurrency,
                model=b.model,
                max_tokens=getattr(args, "max_tokens", None),
            )
            await _settle(sink, len(rows))
        finally:
            await runner.cleanup()  # drains shadow legs, flushes the records store
    return list(sink.exchanges), list(results)


async def _settle(sink: MemorySink, expected: int, timeout_s: float = 30.0) -> None:
    """Wait until every exchange (including its shadow legs) reached the sink."""
    deadline = time.perf_counter() + timeout_s
    while len(sink.exchanges) < expected and time.perf_counter() < deadline:  # noqa: ASYNC110 — bounded poll of a plain deque
        await asyncio.sleep(0.05)


def _ms(value: float | None) -> str:
    return f"{value * 1000:7.1f}" if value is not None else "      –"


def _tpe(leg: LegResult | None) -> str:
    if leg is None or leg.recording is None or leg.recording.timings.tokens_per_event is None:
        return "   –"
    return f"{leg.recording.timings.tokens_per_event:4.2f}"


def _role(exchange: Exchange, role: str) -> LegResult | None:
    return next((leg for leg in exchange.legs if leg.role == role), None)


def print_table(exchanges: Sequence[Exchange]) -> None:
    print(
        f"{'request':<12} {'category':<18} {'ttft ms':>7} {'tpot ms':>7} {'tok/ev':>6}   "
        f"{'cand ttft':>9} {'cand tpot':>9} {'cand tok/ev':>11}"
    )
    for ex in sorted(exchanges, key=lambda e: e.started_unix_ns):
        p = ex.primary.recording
        cand = _role(ex, "candidate")
        c = cand.recording if cand is not None else None
        print(
            f"{ex.request_id[:12]:<12} {ex.category or '-':<18} "
            f"{_ms(p.timings.ttft_s if p else None)} {_ms(p.timings.tpot_s if p else None)} "
            f"{_tpe(ex.primary):>6}   "
            f"{_ms(c.timings.ttft_s if c else None):>9} {_ms(c.timings.tpot_s if c else None):>9} "
            f"{_tpe(cand):>11}"
        )


def print_summary(exchanges: Sequence[Exchange]) -> None:
    print("\nper role (medians over the requests each role served)")
    print(f"{'role':<10} {'n':>4} {'ttft ms':>8} {'tpot ms':>8} {'e2e ms':>8} {'tok/ev':>7}")
    for role in ("primary", "candidate", "baseline"):
        recs = [
            leg.recording
            for ex in exchanges
            for leg in ex.legs
            if leg.role == role and leg.recording is not None
        ]

        def med(values: list[float | None]) -> float | None:
            return percentile([v for v in values if v is not None], 50)

        tpe = med([r.timings.tokens_per_event for r in recs])
        print(
            f"{role:<10} {len(recs):>4} {_ms(med([r.timings.ttft_s for r in recs])):>8} "
            f"{_ms(med([r.timings.tpot_s for r in recs])):>8} "
            f"{_ms(med([r.timings.e2e_s for r in recs])):>8} "
            f"{tpe if tpe is not None else float('nan'):>7.2f}"
        )
    mirrored = [ex for ex in exchanges if ex.shadows]
    print(f"\nmirrored {len(mirrored)} of {len(exchanges)} requests")


def print_vllm_evidence(exchanges: Sequence[Exchange], engine: str = "vLLM") -> None:
    """The candidate's acceptance, three ways (docs/concepts.md, "Acceptance, three ways"), pooled over the demo's requests."""
    from evidence.acceptance import leg_acceptance, summarize

    legs = [
        leg_acceptance(leg.recording)
        for ex in exchanges
        for leg in ex.shadows
        if leg.role == "candidate" and leg.recording is not None
    ]
    pooled = summarize(("candidate", acc) for acc in legs).get("candidate")
    if pooled is None:
        return
    rate = pooled.draft_acceptance_rate
    mal = pooled.mean_acceptance_length
    tpp = pooled.tokens_per_pass_mean
    print(
        f"\ncandidate acceptance ({engine} per-request metrics, pooled): "
        f"rate {rate if rate is not None else float('nan'):.2f}, "
        # llama.cpp reports no drafting steps per request, so no mean acceptance length.
        f"mean acceptance length {f'{mal:.2f}' if mal is not None else 'n/a'}; "
        f"stream shape: {tpp if tpp is not None else float('nan'):.2f} tokens per target pass"
    )


def print_equivalence(records: Sequence[Mapping[str, Any]]) -> None:
    """Greedy exact matches per shadow role, from the comparison records."""
    for role in ("candidate", "baseline"):
        verdicts = [
            c.exact_match
            for r in map(read, records)
            for c in r.comparisons
            if c.b == role and c.greedy and c.comparable
        ]
        print(
            f"greedy exact match, primary vs {role}: {sum(bool(v) for v in verdicts)}/{len(verdicts)}"
        )
