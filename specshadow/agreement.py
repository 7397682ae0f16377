"""Agreement with vLLM's own benchmark client: ``vllm bench serve`` through the gateway.

``vllm bench serve`` (run from vLLM's environment) sends its requests to an in-process gateway in
front of a vLLM primary; afterwards its per-request TTFT / ITL / TPOT (``--save-detailed``) are
paired, by ``x-request-id`` (the bench sends ``<prefix><i>``, the gateway keeps the client's id),
with what the gateway recorded for the primary leg of the same requests, and the medians compared.

Both sides use the same definitions but different clocks and vantage points:

- the bench's clock starts before it sends the request and stops when it has parsed the chunk;
  the gateway's starts when it sends the request upstream and stops when it reads the chunk. The
  bench's TTFT therefore exceeds the gateway's by the gateway's own path (request in → upstream
  out, chunk in → chunk out: the ``overhead`` it records) plus loopback and the bench client's
  own processing — a systematic offset, a few milliseconds at most on loopback;
- ITL: both take gaps between chunks; the bench also counts the gap between vLLM's role-only first
  chunk and the first token (≈ 0; one per request), the gateway only gaps between output-bearing
  events;
- TPOT: both (e2e − TTFT) / (output tokens − 1) with ``usage.completion_tokens``, so the
  constant offsets cancel;
- ITL's median is ill-posed when about half the gaps are ≈ 0: where events arrive in bursts the
  gaps are two modes (≈ 0 inside a burst, about one engine step between bursts) and the median
  falls between them (one CI run: 1.18 ms read by the bench and 4.89 ms by the gateway for the
  same requests, with 49 % and 47 % of gaps ≈ 0). ``itl_step`` is therefore also reported: the
  median of the gaps of at least ``BURST_S``, about one engine step on both sides while most
  gaps are steps.

Pure core: :func:`bench_command`, :func:`dataset_prompts`, :func:`compare_runs`. Shell:
:func:`run_agreement` (gateway + subprocess), :func:`main` (``specshadow vllm agreement``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.cli import add_common
from backends.server import (
    SERVED_MODEL_NAME,
    VllmServerSpec,
    running_servers,
    server_environment,
)
from backends.setup import VllmEnv, setup
from core import jsonx
from core.exchange import Exchange
from loadgen.trace import bundled_trace
from specshadow.inprocess import running_gateway, shadow_policy

REQUEST_ID_PREFIX = "specshadow-agreement-"
MAX_PROMPT_CHARS = 2000  # the tiny model's context is 1024 tokens
BENCH_TIMEOUT_S = 600.0
_MS = 1000.0
BURST_S = 0.0005  # a gap under half a millisecond: two chunks the reader got in one read


@dataclass(frozen=True, slots=True)
class MetricAgreement:
    """One metric's medians (milliseconds) from each side; ``offset_ms`` = bench − gateway."""

    name: str  # ttft, tpot, itl
    bench_median_ms: float
    gateway_median_ms: float

    @property
    def offset_ms(self) -> float:
        return self.bench_median_ms - self.gateway_median_ms

    @property
    def relative(self) -> float:
        """offset / gateway median (0 when the gateway median is 0)."""
        return self.offset_ms / self.gateway_median_ms if self.gateway_median_ms else 0.0


@dataclass(frozen=True, slots=True)
class Agreement:
    """The outcome of one bench run compared with the gateway's records of the same requests."""

    requests: int  # the bench's successful requests
    paired: int  # of those, found in the gateway's exchanges with timings (≥ 2 output tokens)
    texts_equal: int  # bench's generated text == the gateway's recorded primary text
    metrics: tuple[MetricAgreement, ...]
    ttft_offset_p50_ms: float  # per-request bench TTFT − gateway TTFT
    ttft_offset_max_ms: float
    gateway_overhead_p50_ms: float | None  # median over requests of the gateway's per-chunk p50
    gateway_pre_upstream_p50_ms: float  # request received → primary request sent (wall clock)
    bench_result: Mapping[str, Any]
    # ITL's mean gap (bench, gateway): a burst read at once moves the median, not the mean — the
    # gaps of a request add up to its decode time however a reader splits them.
    itl_mean_ms: tuple[float, float] = (float("nan"), float("nan"))
    # the share of gaps under BURST_S (bench, gateway): chunks that reached the reader together
    itl_burst_share: tuple[float, float] = (float("nan"), float("nan"))

    def metric(self, name: str) -> MetricAgreement:
        return next(m for m in self.metrics if m.name == name)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "paired": self.paired,
            "texts_equal": self.texts_equal,
            "metrics": {
                m.name: {
                    "bench_median_ms": m.bench_median_ms,
                    "gateway_median_ms": m.gateway_median_ms,
                    "offset_ms": m.offset_ms,
                    "relative": m.relative,
                }
                for m in self.metrics
            },
            "ttft_offset_p50_ms": self.ttft_offset_p50_ms,
            "ttft_offset_max_ms": self.ttft_offset_max_ms,
            "gateway_overhead_p50_ms": self.gateway_overhead_p50_ms,
            "gateway_pre_upstream_p50_ms": self.gateway_pre_upstream_p50_ms,
            "itl_mean_ms": {"bench": self.itl_mean_ms[0], "gateway": self.itl_mean_ms[1]},
            "itl_burst_share": {
                "bench": self.itl_burst_share[0],
                "gateway": self.itl_burst_share[1],
            },
        }


def dataset_prompts(rows: Iterable[Mapping[str, Any]], count: int) -> list[str]:
    """User prompts for the bench's ``custom`` dataset (one string each: it sends a single user
    message): rows whose only user message fits the tiny model; a system message is dropped."""
    out: list[str] = []
    for body in rows:
        messages = body.get("messages")
        if not isinstance(messages, list):
            continue
        users = [m for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
        if len(users) != 1 or not isinstance(users[0].get("content"), str):
            continue
        prompt: str = users[0]["content"]
        if 0 < len(prompt) <= MAX_PROMPT_CHARS:
            out.append(prompt)
        if len(out) == count:
            break
    return out


def bench_command(
    env: VllmEnv,
    base_url: str,
    dataset: Path,
    result_dir: Path,
    *,
    num_prompts: int,
    output_len: int,
) -> list[str]:
    """``vllm bench serve`` at concurrency 1, greedy, saving per-request detail."""
    return [
        str(env.vllm_script), "bench", "serve",
        "--backend", "openai-chat",
        "--base-url", base_url,
        "--endpoint", "/v1/chat/completions",
        "--model", SERVED_MODEL_NAME,
        "--tokenizer", str(env.target_dir),
        "--dataset-name", "custom",
        "--dataset-path", str(dataset),
        "--skip-chat-template",  # the server applies it; the bench would wrap the prompt twice
        "--disable-shuffle",
        "--custom-output-len", str(output_len),
        "--num-prompts", str(num_prompts),
        "--max-concurrency", "1",
        "--temperature", "0",
        "--request-id-prefix", REQUEST_ID_PREFIX,
        "--disable-tqdm",
        "--save-result", "--save-detailed",
        "--result-dir", str(result_dir),
        "--result-filename", "bench.json",
    ]  # fmt: skip


def _median_ms(values: Sequence[float]) -> float:
    return statistics.median(values) * _MS if values else float("nan")


def _mean_ms(values: Sequence[float]) -> float:
    return statistics.fmean(values) * _MS if values else float("nan")


def _step_gaps(gaps: Sequence[float]) -> list[float]:
    return [g for g in gaps if g >= BURST_S]


def _burst_share(gaps: Sequence[float]) -> float:
    return sum(g < BURST_S for g in gaps) / len(gaps) if gaps else float("nan")


def _primary_text(exchange: Exchange) -> str | None:
    rec = exchange.primary.recording
    return None if rec is None else "".join(c.text for c in rec.choices)


def compare_runs(bench: Mapping[str, Any], exchanges: Iterable[Exchange]) -> Agreement:
    """Pair the bench's detailed result with the gateway's exchanges and compare medians.

    Only requests that succeeded on both sides and have ≥ 2 output tokens are compared; medians
    are over those pairs (ITL: over all gaps of those requests, as the bench pools them).
    """
    by_id: dict[str, Exchange] = {str(ex.request_id): ex for ex in exchanges}
    ttfts, itls = bench.get("ttfts") or [], bench.get("itls") or []
    latencies, lens = bench.get("latencies") or [], bench.get("output_lens") or []
    texts, errors = bench.get("generated_texts") or [], bench.get("errors") or []
    b_ttft: list[float] = []
    b_tpot: list[float] = []
    b_itl: list[float] = []
    g_ttft: list[float] = []
    g_tpot: list[float] = []
    g_itl: list[float] = []
    offsets: list[float] = []
    overheads: list[float] = []
    pre_upstream: list[float] = []
    requests = paired = equal = 0
    for i, ttft in enumerate(ttfts):
        if (errors and errors[i]) or not ttft:
            continue
        requests += 1
        ex = by_id.get(f"{REQUEST_ID_PREFIX}{i}")
        rec = ex.primary.recording if ex is not None else None
        if ex is None or rec is None or lens[i] < 2:
            continue
        t = rec.timings
        if t.ttft_s is None or t.tpot_s is None:
            continue
        paired += 1
        equal += int(texts[i] == _primary_text(ex))
        b_ttft.append(ttft)
        b_tpot.append((latencies[i] - ttft) / (lens[i] - 1))
        b_itl.extend(itls[i])
        g_ttft.append(t.ttft_s)
        g_tpot.append(t.tpot_s)
        g_itl.extend(t.chunk_gaps_s)
        offsets.append(ttft - t.ttft_s)
        if t.overhead_p50_s is not None:
            overheads.append(t.overhead_p50_s)
        pre_upstream.append((ex.primary.started_unix_ns - ex.started_unix_ns) / 1e9)
    metrics = (
        MetricAgreement("ttft", _median_ms(b_ttft), _median_ms(g_ttft)),
        MetricAgreement("tpot", _median_ms(b_tpot), _median_ms(g_tpot)),
        MetricAgreement("itl", _median_ms(b_itl), _median_ms(g_itl)),
        MetricAgreement("itl_step", _median_ms(_step_gaps(b_itl)), _median_ms(_step_gaps(g_itl))),
    )
    return Agreement(
        requests=requests,
        paired=paired,
        texts_equal=equal,
        metrics=metrics,
        ttft_offset_p50_ms=_median_ms(offsets),
        ttft_offset_max_ms=max(offsets) * _MS if offsets else float("nan"),
        gateway_overhead_p50_ms=_median_ms(overheads) if overheads else None,
        gateway_pre_upstream_p50_ms=_median_ms(pre_upstream),
        bench_result=bench,
        itl_mean_ms=(_mean_ms(b_itl), _mean_ms(g_itl)),
        itl_burst_share=(_burst_share(b_itl), _burst_share(g_itl)),
    )


async def run_agreement(
    env: VllmEnv,
    primary_url: str,
    work_dir: Path,
    *,
    prompts: Sequence[str],
    output_len: int = 48,
    candidate_url: str | None = None,
) -> Agreement:
    """Gateway in front of ``primary_url`` (mirroring everything to ``candidate_url`` if given),
    ``vllm bench serve`` through it, then :func:`compare_runs`."""
    dataset = await asyncio.to_thread(write_dataset, work_dir, prompts)
    policy = shadow_policy(primary_url, candidate_url=candidate_url)
    async with running_gateway(policy) as gw:
        cmd = bench_command(
            env, gw.url, dataset, work_dir, num_prompts=len(prompts), output_len=output_len
        )
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=server_environment(os.environ, env, work_dir),
            cwd=work_dir,
        )
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), BENCH_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = output.decode(errors="replace")[-3000:]
            raise RuntimeError(f"vllm bench serve exited with {proc.returncode}:\n{tail}")
        ids = {f"{REQUEST_ID_PREFIX}{i}" for i in range(len(prompts))}
        for rid in sorted(ids):  # the exchange is assembled just after the response ends
            await gw.sink.wait_for(_has_id(rid), timeout_s=60)
        exchanges = [ex for ex in gw.sink.exchanges if ex.request_id in ids]
    bench = await asyncio.to_thread(read_bench_result, work_dir)
    return compare_runs(bench, exchanges)


def write_dataset(work_dir: Path, prompts: Sequence[str]) -> Path:
    """The ``custom`` dataset (``{"prompt": ...}`` lines) and the folders vLLM's env points at."""
    work_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("vllm-cache", "inductor", "rpc", "tmp", "hf"):
        (work_dir / sub).mkdir(exist_ok=True)
    dataset = work_dir / "prompts.jsonl"
    dataset.write_bytes(b"".join(jsonx.dumps({"prompt": p}) + b"\n" for p in prompts))
    return dataset


def read_bench_result(work_dir: Path) -> dict[str, Any]:
    result: dict[str, Any] = jsonx.loads((work_dir / "bench.json").read_bytes())
    return result


def _has_id(request_id: str) -> Any:
    return lambda ex: ex.request_id == request_id


def format_agreement(result: Agreement, label: str) -> str:
    lines = [
        f"{label}: {result.paired}/{result.requests} requests paired, "
        f"{result.texts_equal} identical texts",
        f"{'metric':<8} {'bench ms':>9} {'gateway ms':>11} {'offset ms':>10} {'offset %':>9}",
    ]
    lines += [
        f"{m.name:<8} {m.bench_median_ms:>9.2f} {m.gateway_median_ms:>11.2f} "
        f"{m.offset_ms:>10.3f} {m.relative * 100:>8.1f}%"
        for m in result.metrics
    ]
    overhead = result.gateway_overhead_p50_ms
    (b_mean, g_mean), (b_burst, g_burst) = result.itl_mean_ms, result.itl_burst_share
    lines.append(
        f"ITL mean gap: bench {b_mean:.2f} / gateway {g_mean:.2f} ms; gaps under "
        f"{BURST_S * _MS:g} ms: bench {b_burst:.0%} / gateway {g_burst:.0%}"
    )
    lines.append(
        f"per-request TTFT offset: p50 {result.ttft_offset_p50_ms:.3f} ms, "
        f"max {result.ttft_offset_max_ms:.3f} ms",
    )
    lines.append(
        f"gateway's own share: request in → upstream out p50 "
        f"{result.gateway_pre_upstream_p50_ms:.3f} ms, chunk in → out p50 "
        + (f"{overhead:.3f} ms" if overhead is not None else "n/a")
    )
    return "\n".join(lines)


def register(vllm: argparse._SubParsersAction[Any]) -> None:
    """Add ``agreement`` to the ``specshadow vllm`` actions."""
    p_agree = vllm.add_parser(
        "agreement", help="run `vllm bench serve` through the gateway and compare medians"
    )
    p_agree.add_argument(
        "--primary-url", help="a running vLLM server (default: start one of --config)"
    )
    p_agree.add_argument(
        "--candidate-url", help="also mirror every request to this server (shadow load)"
    )
    p_agree.add_argument("--config", choices=["plain", "ngram", "draft"], default="plain")
    p_agree.add_argument("--requests", type=int, default=30)
    p_agree.add_argument("--max-tokens", type=int, default=48)
    p_agree.add_argument("--out", type=Path, default=Path("specshadow-out/agreement"))
    add_common(p_agree)
    p_agree.set_defaults(func=_cmd_agreement)


def _cmd_agreement(args: argparse.Namespace) -> int:
    env = setup(args.cache)
    prompts = dataset_prompts([row.body for row in bundled_trace()], args.requests)
    with contextlib.ExitStack() as stack:
        primary = args.primary_url
        if primary is None:
            spec = VllmServerSpec(
                name=args.config, config=args.config,
                num_speculative_tokens=args.num_speculative_tokens, enforce_eager=not args.compile,
            )  # fmt: skip
            (server,) = stack.enter_context(running_servers([spec], env))
            primary = server.base_url
        result = asyncio.run(
            run_agreement(
                env,
                primary.rstrip("/").removesuffix("/v1"),
                args.out,
                prompts=prompts,
                output_len=args.max_tokens,
                candidate_url=args.candidate_url,
            )
        )
    (args.out / "agreement.json").write_bytes(jsonx.dumps(result.to_json()))
    print(format_agreement(result, f"vllm bench serve via the gateway → {primary}"))
    print(f"bench result: {args.out / 'bench.json'}\nagreement:    {args.out / 'agreement.json'}")
    return 0
