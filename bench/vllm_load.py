"""Load-true verdicts on real vLLM: plain vs n-gram through the gateway, at a low and a high
arrival rate, mirrored load-matched and at 10 % — against a direct A/B at the same rate.

``python -m bench.vllm_load [--urls PLAIN,NGRAM] [--rates R,…] [--duration S] [--json F]``

- **The truth** at each rate: the same open-loop schedule (gamma arrivals, shape 4) and prompts
  sent straight to the plain server and to the n-gram server at the same time — as a full
  mirror runs them, since on one machine they share its cores — paired request by request: the
  geometric mean of plain ÷ n-gram e2e; measured before and again after the two mirrored runs,
  so drift of a shared machine shows as two truths that disagree.
- **What specshadow says**: the schedule sent through an in-process gateway with the plain server
  as primary and the n-gram server as candidate, mirrored at ``ratio: load_matched`` (one replica
  each: every request) and at ``ratio: 0.1``; the report's overall verdict, its e2e speed-up at
  production load and the load parity it measured.

Prints one table (the one in docs/vllm.md). Starts the two servers, each bound to its own core,
unless ``--urls`` is given (``specshadow vllm up --pin`` serves them so; unpinned, vLLM binds
every server's worker to the same core and the mirror's two legs take turns on it); takes about
ten minutes on two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backends.server import SERVED_MODEL_NAME
from bench.tables import render_table, write_json
from loadgen.runner import run_loadgen
from loadgen.speedup import paired_speedup
from loadgen.trace import TraceRecord, bundled_trace
from policies.compile import parse_policy
from policies.store import PolicyStore
from records.sqlite_store import query_records
from report.analysis import ALL, analyze
from specshadow.inprocess import running_gateway

MAX_TOKENS = 48
BURSTINESS = 4.0


def prompts() -> list[TraceRecord]:
    """Chat rows short enough for the tiny model's 1,024-token context."""
    out = []
    for r in bundled_trace():
        messages = r.body.get("messages") or []
        if r.category == "chat" and sum(len(str(m.get("content") or "")) for m in messages) < 1500:
            out.append(r)
    return out


async def open_loop(url: str, rate: float, duration_s: float, seed: int) -> list[Any]:
    results = await run_loadgen(
        f"{url}/v1", prompts(), rate_rps=rate, burstiness=BURSTINESS, duration_s=duration_s,
        model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS, seed=seed, request_timeout_s=300.0,
    )  # fmt: skip
    return [r for r in results if not r.warmup]


def paired(plain: Sequence[Any], spec: Sequence[Any], skip: float = 0.2) -> float | None:
    """Geometric mean of plain ÷ n-gram e2e over the same requests, the first ``skip`` of them
    (JIT and cache warm-up) left out — the report's own paired estimator."""
    by_index = {r.index: r for r in spec if r.error is None}
    pairs = [(p.e2e_s, by_index[p.index].e2e_s) for p in plain
             if p.error is None and p.index in by_index]  # fmt: skip
    s = paired_speedup(pairs[int(len(pairs) * skip) :])
    return s.point if s is not None else None


def policy(plain: str, ngram: str, ratio: str) -> PolicyStore:
    raw = {
        "version": 1,
        "backends": {
            "plain": {"url": plain, "kind": "vllm", "replicas": 1},
            "ngram": {"url": ngram, "kind": "vllm", "replicas": 1},
        },
        "primary": "plain",
        "default": {
            "ratio": ratio if ratio == "load_matched" else float(ratio),
            "legs": [{"backend": "ngram", "role": "candidate"}],
        },
    }
    return PolicyStore(parse_policy(raw, source="bench.vllm_load"))


async def mirrored(
    plain: str, ngram: str, rate: float, ratio: str, duration_s: float, work: Path
) -> dict[str, Any]:
    store = work / f"{rate}-{ratio}.sqlite"
    async with running_gateway(
        policy(plain, ngram, ratio), store_path=store, scrape_interval_s=1.0
    ) as gw:
        await open_loop(gw.url, rate, duration_s, seed=11)
        await asyncio.sleep(2.0)
    a = analyze(list(query_records(store)))
    main = a.main
    v = next((v for v in main.verdicts if v.category == ALL), None) if main is not None else None
    at = v.at_load if v is not None else None
    e2e = at.e2e if at is not None else None
    return {
        "verdict": v.decision if v is not None else None,
        "speedup": None
        if e2e is None
        else {"estimate": e2e.estimate, "low": e2e.low, "high": e2e.high},
        "raw": v.e2e.point if v is not None and v.e2e is not None else None,
        "parity_p50": at.parity_p50 if at is not None else None,
        "pairs": at.mirrored_pairs if at is not None else 0,
    }


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.urls:
        plain, ngram = (u.rstrip("/").removesuffix("/v1") for u in args.urls.split(","))
        return await run_all(plain, ngram, args)
    from backends.server import VllmServerSpec, spread_cores, start_servers, stop_servers
    from backends.setup import setup

    env = await asyncio.to_thread(setup)
    plain_cores, ngram_cores = spread_cores(2)  # a core each, as two GPUs would be
    specs = [
        VllmServerSpec("plain", "plain", cores=plain_cores),
        VllmServerSpec("ngram", "ngram", cores=ngram_cores),
    ]
    servers = await asyncio.to_thread(start_servers, specs, env)
    try:
        return await run_all(servers[0].base_url, servers[1].base_url, args)
    finally:
        await asyncio.to_thread(stop_servers, servers)


async def direct(plain: str, ngram: str, rate: float, duration_s: float) -> float | None:
    # Both servers at once, as the mirror runs them: they share the machine, so one after the
    # other would measure each on a quieter machine, not at the same load.
    a, b = await asyncio.gather(
        open_loop(plain, rate, duration_s, seed=11), open_loop(ngram, rate, duration_s, seed=11)
    )
    return paired(a, b)


async def run_all(plain: str, ngram: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per rate: direct A/B, both mirrors, direct A/B again — the truth bracketed in time, so a
    machine that drifted between phases shows as two truths that disagree."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rate in args.rates:
            before = await direct(plain, ngram, rate, args.duration)
            got = [
                await mirrored(plain, ngram, rate, ratio, args.duration, Path(tmp))
                for ratio in ("load_matched", "0.1")
            ]
            after = await direct(plain, ngram, rate, args.duration)
            for ratio, g in zip(("load_matched", "0.1"), got, strict=True):
                rows.append(
                    {"rate_rps": rate, "mirror": ratio, "truth": before, "truth_after": after, **g}
                )
    return rows


def parse_rates(text: str) -> list[float]:
    """``--rates 1,2.5``: positive requests/s, comma-separated."""
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of numbers: {text!r}"
        ) from None
    if any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"every rate must be above 0 requests/s: {text!r}")
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--urls", default=None, metavar="PLAIN,NGRAM")
    p.add_argument(
        "--rates", type=parse_rates, default=[0.5, 4.0], metavar="R,…",
        help="the arrival rates to measure, requests/s, comma-separated (default 0.5,4)",
    )  # fmt: skip
    p.add_argument("--duration", type=float, default=90.0, help="seconds per phase")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = asyncio.run(measure(args))

    def ab(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}×"

    def sp(r: dict[str, Any]) -> str:
        s = r["speedup"]
        return "—" if s is None else f"{s['estimate']:.2f}× [{s['low']:.2f}, {s['high']:.2f}]"

    header = ["rate (req/s)", "mirror", "pairs", "load parity p50", "report verdict",
              "e2e at production load", "raw (at its own load)", "direct A/B before, after"]  # fmt: skip
    table = [
        [f"{r['rate_rps']:g}", r["mirror"], str(r["pairs"]),
         "—" if r["parity_p50"] is None else f"{r['parity_p50']:.2f}",
         str(r["verdict"]), sp(r), "—" if r["raw"] is None else f"{r['raw']:.2f}×",
         f"{ab(r['truth'])}, {ab(r['truth_after'])}"]
        for r in rows
    ]  # fmt: skip
    print(render_table("plain vs n-gram on vLLM's CPU build, through the gateway", header, table))
    if args.json:
        write_json(args.json, rows)


if __name__ == "__main__":
    main()
