"""Peer benchmark clients through the gateway — AIPerf and GuideLLM — paired with its records.

Each peer runs from its own virtual environment (:mod:`tests.toolenv`), tokenizing client-side
with the local tiny model's tokenizer folder (never a hub id; see :func:`peer_environment`), via an
in-process gateway in front of a vLLM server that writes its records to a SQLite store. Its
per-request figures are then paired with the records of the same requests and compared, the way
``specshadow vllm agreement`` does for ``vllm bench serve`` (:mod:`specshadow.agreement`).

The three tools name the same quantities differently (docs/concepts.md has the crosswalk):

=====================  ==========================  ===================  ==================
specshadow record       definition                  AIPerf               GuideLLM
=====================  ==========================  ===================  ==================
``ttft_s``              t0 → first output event      TTFT                 TTFT
chunk gaps              gaps between output events   ICL                  —
``tpot_s``              (e2e − ttft) / (tokens − 1)  **ITL**              **ITL**
=====================  ==========================  ===================  ==================

Pairing: AIPerf sends a fresh ``X-Request-ID`` per request and exports it with the request's
figures (``profile_export.jsonl``); the gateway keeps a client's id as the record's
``request_id``. GuideLLM sends no id, so its requests are paired with the records by order of
sending at concurrency 1 (``synchronous``), and the pairing is checked by the generated text
being the record's primary output byte for byte.
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backends.server import SERVED_MODEL_NAME
from core import jsonx
from records.sqlite_store import query_records
from specshadow.agreement import BURST_S, MetricAgreement
from specshadow.inprocess import running_gateway, shadow_policy
from tests.toolenv import ToolEnv

RUN_TIMEOUT_S = 900.0
_MS = 1000.0


@dataclass(frozen=True, slots=True)
class PeerRequest:
    """One request as a peer client measured it (seconds; ``None`` where it reported nothing)."""

    request_id: str | None
    ttft_s: float
    tpot_s: float | None  # the peer's "ITL": (e2e − TTFT) / (its output token count − 1)
    gaps_s: tuple[float, ...]  # AIPerf's ICL; GuideLLM reports none
    output_tokens: int | None  # the peer's own count (its client-side tokenizer)
    acceptance: Mapping[str, float] | None  # AIPerf's per-request spec_decode_* figures
    text: str | None
    start_s: float  # the peer's clock, for ordering only


@dataclass(frozen=True, slots=True)
class PeerAgreement:
    peer: str
    requests: int  # the peer's successful requests
    paired: int  # of those, found in the records with ttft and tpot
    metrics: tuple[MetricAgreement, ...]  # ttft, tpot, and (AIPerf) icl ≙ the records' gaps
    ttft_offset_p50_ms: float  # per-request peer TTFT − record TTFT
    ttft_offset_max_ms: float
    tokens_equal: int  # the peer's output token count == the record's primary output_tokens
    texts_equal: int | None  # GuideLLM: the pairing check
    acceptance_compared: int = 0
    acceptance_mismatches: tuple[str, ...] = ()
    tpot_mean_ms: tuple[float, float] = (float("nan"), float("nan"))  # (peer, gateway)
    tpot_offset_p50_ms: float = float("nan")  # per request, the peer's TPOT − the record's
    gap_mean_ms: tuple[float, float] = (float("nan"), float("nan"))  # (peer, gateway), pooled
    # per request, the peer's mean gap − the gateway's, over the requests with gaps on both sides:
    # (p50, how many requests, how many of them read the same number of gaps on both sides)
    gap_mean_offset_p50_ms: float = float("nan")
    gap_requests: int = 0
    gap_counts_equal: int = 0
    # the share of gaps under BURST_S (peer, gateway): chunks a reader got in one read
    gap_burst_share: tuple[float, float] = (float("nan"), float("nan"))
    per_request: tuple[Mapping[str, Any], ...] = field(default=())

    def metric(self, name: str) -> MetricAgreement:
        return next(m for m in self.metrics if m.name == name)

    def format(self) -> str:
        lines = [
            f"{self.peer}: {self.paired}/{self.requests} requests paired; token counts equal "
            f"{self.tokens_equal}/{self.paired}"
            + (
                f"; texts equal {self.texts_equal}/{self.paired}"
                if self.texts_equal is not None
                else ""
            )
            + (
                f"; acceptance compared on {self.acceptance_compared}, mismatches "
                f"{len(self.acceptance_mismatches)}"
                if self.acceptance_compared
                else ""
            ),
            f"{'metric':<6} {'peer ms':>9} {'gateway ms':>11} {'offset ms':>10} {'offset %':>9}",
        ]
        lines += [
            f"{m.name:<6} {m.bench_median_ms:>9.3f} {m.gateway_median_ms:>11.3f} "
            f"{m.offset_ms:>10.3f} {m.relative * 100:>8.1f}%"
            for m in self.metrics
        ]
        lines.append(
            f"per-request TTFT offset p50 {self.ttft_offset_p50_ms:.3f} ms, "
            f"max {self.ttft_offset_max_ms:.3f} ms; mean TPOT peer {self.tpot_mean_ms[0]:.3f} / "
            f"gateway {self.tpot_mean_ms[1]:.3f} ms; mean gap peer {self.gap_mean_ms[0]:.3f} / "
            f"gateway {self.gap_mean_ms[1]:.3f} ms; per-request mean gap offset p50 "
            f"{self.gap_mean_offset_p50_ms:.3f} ms over {self.gap_requests} requests, gap counts "
            f"equal on {self.gap_counts_equal}; per-request TPOT offset p50 "
            f"{self.tpot_offset_p50_ms:.3f} ms"
        )
        return "\n".join(lines)


# --- AIPerf -------------------------------------------------------------------------------------


def aiperf_command(
    env: ToolEnv, url: str, tokenizer: Path, dataset: Path, out_dir: Path, *, requests: int
) -> list[str]:
    """``aiperf profile`` at concurrency 1, greedy, streaming, one request per dataset line.

    ``--use-server-token-count``: AIPerf's ITL divides by the output's token count, and by
    default that is the client-side tokenizer's count of the generated *text*. Re-tokenizing the
    tiny model's 48-token answers gave 24–29 tokens for 22 of 24 (it writes non-canonical token
    sequences), so its default ITL read about twice the engine's TPOT. With the server's usage
    it is the records' definition exactly; the prompt is still tokenized client-side.
    """
    return [
        str(env.bin("aiperf")), "profile",
        "--model", SERVED_MODEL_NAME,
        "--url", url,
        "--endpoint-type", "chat",
        "--streaming",
        "--tokenizer", str(tokenizer),
        "--input-file", str(dataset),
        "--custom-dataset-type", "single_turn",
        "--dataset-sampling-strategy", "sequential",
        "--request-count", str(requests),
        "--concurrency", "1",
        "--extra-inputs", "temperature:0",
        "--use-server-token-count",
        "--output-artifact-dir", str(out_dir),
        "--no-auto-plot",
    ]  # fmt: skip


def aiperf_dataset(prompts: Sequence[str], output_len: int) -> bytes:
    return b"".join(jsonx.dumps({"text": p, "output_length": output_len}) + b"\n" for p in prompts)


def _value(metrics: Mapping[str, Any], name: str) -> Any:
    entry = metrics.get(name)
    return entry.get("value") if isinstance(entry, Mapping) else None


def read_aiperf(out_dir: Path) -> list[PeerRequest]:
    """``profile_export.jsonl``: one line per request, its metrics in AIPerf's units (ms)."""
    out: list[PeerRequest] = []
    for line in (out_dir / "profile_export.jsonl").read_bytes().splitlines():
        if not line.strip():
            continue
        row = jsonx.loads(line)
        meta, metrics = row.get("metadata") or {}, row.get("metrics") or {}
        if row.get("error") or _value(metrics, "time_to_first_token") is None:
            continue
        itl = _value(metrics, "inter_token_latency")
        acceptance = {
            "num_draft_tokens": _value(metrics, "spec_decode_draft_tokens"),
            "num_accepted_tokens": _value(metrics, "spec_decode_accepted_draft_tokens"),
            "num_drafts": _value(metrics, "spec_decode_steps"),
            "mean_acceptance_length": _value(metrics, "spec_decode_acceptance_length"),
            "draft_acceptance_rate_pct": _value(metrics, "spec_decode_draft_acceptance_rate"),
        }
        out.append(
            PeerRequest(
                request_id=meta.get("x_request_id"),
                ttft_s=_value(metrics, "time_to_first_token") / _MS,
                tpot_s=itl / _MS if itl is not None else None,
                gaps_s=tuple(g / _MS for g in _value(metrics, "inter_chunk_latency") or ()),
                output_tokens=_value(metrics, "output_sequence_length"),
                acceptance=acceptance if acceptance["num_draft_tokens"] is not None else None,
                text=None,
                start_s=meta.get("request_start_ns", 0) / 1e9,
            )
        )
    return out


# --- GuideLLM -----------------------------------------------------------------------------------


def guidellm_command(
    env: ToolEnv, url: str, tokenizer: Path, dataset: Path, out_file: Path, *, requests: int
) -> list[str]:
    """``guidellm run`` synchronous (one request at a time), streaming, one request per line.

    ``validate_backend=false``: its check asks ``/health``, which the gateway does not serve
    (``/healthz``). It sends ``ignore_eos`` and asks for usage on every chunk itself.
    """
    return [
        str(env.bin("guidellm")), "run",
        "--backend", f"kind=openai_http,target={url},model={SERVED_MODEL_NAME},"
                     "validate_backend=false",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={requests}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--data", f"kind=json_file,path={dataset}",
        "--output", f"kind=json,path={out_file}",
        "--disable-console-interactive",
    ]  # fmt: skip


def guidellm_dataset(prompts: Sequence[str], output_len: int) -> bytes:
    return b"".join(
        jsonx.dumps({"prompt": p, "output_tokens_count": output_len}) + b"\n" for p in prompts
    )


def read_guidellm(out_file: Path) -> list[PeerRequest]:
    """The JSON report's successful requests (its own figures: ms, its token count)."""
    report = jsonx.loads(out_file.read_bytes())
    out: list[PeerRequest] = []
    for bench in report["benchmarks"]:
        for req in bench["requests"]["successful"]:
            if req.get("time_to_first_token_ms") is None:
                continue
            itl = req.get("inter_token_latency_ms")
            spec = (req.get("response_metrics") or {}).get("speculative_decoding")
            acceptance = None
            if isinstance(spec, Mapping):
                acceptance = {
                    "num_draft_tokens": spec.get("num_draft_tokens"),
                    "num_accepted_tokens": spec.get("num_accepted_draft_tokens"),
                    "num_drafts": spec.get("num_spec_steps"),
                    "mean_acceptance_length": spec.get("mean_acceptance_length"),
                    "draft_acceptance_rate_pct": 100 * spec["draft_acceptance_rate"],
                }
            out.append(
                PeerRequest(
                    request_id=None,  # GuideLLM's own id never leaves it
                    ttft_s=req["time_to_first_token_ms"] / _MS,
                    tpot_s=itl / _MS if itl is not None else None,
                    gaps_s=(),
                    output_tokens=req.get("output_tokens"),
                    acceptance=acceptance,
                    text=req.get("output"),
                    start_s=req["info"]["timings"]["request_start"],
                )
            )
    return out


# --- comparison ---------------------------------------------------------------------------------


def _median_ms(values: Sequence[float]) -> float:
    return statistics.median(values) * _MS if values else float("nan")


def _mean_ms(values: Sequence[float]) -> float:
    return statistics.fmean(values) * _MS if values else float("nan")


def _burst_share(gaps: Sequence[float]) -> float:
    return sum(g < BURST_S for g in gaps) / len(gaps) if gaps else float("nan")


# AIPerf rounds the two ratios it exports: the rate (a percentage) and the length to 6 digits.
RATE_PCT_TOL = 1e-3
LENGTH_TOL = 1e-6


def acceptance_mismatch(peer: Mapping[str, float], record: Mapping[str, Any]) -> str | None:
    """Where AIPerf's per-request acceptance differs from the record's primary leg, or None."""
    for name in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"):
        if peer[name] != record.get(name):
            return f"{name}: aiperf {peer[name]} record {record.get(name)}"
    rate = record.get("draft_acceptance_rate")
    if rate is None or abs(peer["draft_acceptance_rate_pct"] - 100 * rate) > RATE_PCT_TOL:
        return f"rate: aiperf {peer['draft_acceptance_rate_pct']} % record {rate}"
    length = record.get("mean_acceptance_length")
    if length is None or abs(peer["mean_acceptance_length"] - length) > LENGTH_TOL:
        return f"length: aiperf {peer['mean_acceptance_length']} record {length}"
    return None


def compare(
    peer: str,
    requests: Sequence[PeerRequest],
    records: Sequence[Mapping[str, Any]],
    primary: Mapping[str, tuple[tuple[float, ...], str]],
    *,
    by_order: bool = False,
) -> PeerAgreement:
    """Pair ``requests`` with ``records`` (by request id, or ``by_order`` of sending) and
    compare medians. ``primary``: request id → the gateway's chunk gaps and text of the
    primary leg (from its exchange: records keep neither)."""
    if by_order:
        ordered = sorted(records, key=lambda r: r["started_unix_ns"])
        pairs = list(zip(sorted(requests, key=lambda r: r.start_s), ordered, strict=False))
    else:
        by_id = {r["request_id"]: r for r in records}
        pairs = [(q, by_id[q.request_id]) for q in requests if q.request_id in by_id]
    p_ttft: list[float] = []
    p_tpot: list[float] = []
    p_gaps: list[float] = []
    g_ttft: list[float] = []
    g_tpot: list[float] = []
    g_gaps: list[float] = []
    offsets: list[float] = []
    gap_offsets: list[float] = []
    gap_counts_equal = 0
    tokens_equal = texts_equal = compared = 0
    mismatches: list[str] = []
    rows: list[Mapping[str, Any]] = []
    paired = 0
    for q, record in pairs:
        leg = record["legs"][0]
        assert leg["role"] == "primary", leg["role"]
        if leg["ttft_s"] is None or leg["tpot_s"] is None or q.tpot_s is None:
            continue
        paired += 1
        p_ttft.append(q.ttft_s)
        g_ttft.append(leg["ttft_s"])
        offsets.append(q.ttft_s - leg["ttft_s"])
        p_tpot.append(q.tpot_s)
        g_tpot.append(leg["tpot_s"])
        p_gaps.extend(q.gaps_s)
        gaps, text = primary.get(record["request_id"], ((), None))
        g_gaps.extend(gaps)
        if q.gaps_s and gaps:
            gap_offsets.append(statistics.fmean(q.gaps_s) - statistics.fmean(gaps))
            gap_counts_equal += int(len(q.gaps_s) == len(gaps))
        tokens_equal += int(q.output_tokens == leg["output_tokens"])
        if q.text is not None:
            texts_equal += int(q.text == text)
        if q.acceptance is not None:
            compared += 1
            wrong = acceptance_mismatch(q.acceptance, leg["acceptance"])
            if wrong is not None:
                mismatches.append(f"{record['request_id']}: {wrong}")
        rows.append(
            {"request_id": record["request_id"], "peer_ttft_s": q.ttft_s,
             "record_ttft_s": leg["ttft_s"], "peer_tpot_s": q.tpot_s,
             "record_tpot_s": leg["tpot_s"], "peer_tokens": q.output_tokens,
             "record_tokens": leg["output_tokens"], "peer_acceptance": q.acceptance,
             "record_acceptance": leg["acceptance"]}
        )  # fmt: skip
    metrics = [
        MetricAgreement("ttft", _median_ms(p_ttft), _median_ms(g_ttft)),
        MetricAgreement("tpot", _median_ms(p_tpot), _median_ms(g_tpot)),
    ]
    if p_gaps:
        metrics.append(MetricAgreement("icl", _median_ms(p_gaps), _median_ms(g_gaps)))
    return PeerAgreement(
        peer=peer,
        requests=len(requests),
        paired=paired,
        metrics=tuple(metrics),
        ttft_offset_p50_ms=_median_ms(offsets),
        ttft_offset_max_ms=max(offsets) * _MS if offsets else float("nan"),
        tokens_equal=tokens_equal,
        texts_equal=texts_equal if any(q.text is not None for q in requests) else None,
        acceptance_compared=compared,
        acceptance_mismatches=tuple(mismatches),
        tpot_mean_ms=(_mean_ms(p_tpot), _mean_ms(g_tpot)),
        tpot_offset_p50_ms=_median_ms([p - g for p, g in zip(p_tpot, g_tpot, strict=True)]),
        gap_mean_ms=(_mean_ms(p_gaps), _mean_ms(g_gaps)),
        gap_mean_offset_p50_ms=_median_ms(gap_offsets),
        gap_requests=len(gap_offsets),
        gap_counts_equal=gap_counts_equal,
        gap_burst_share=(_burst_share(p_gaps), _burst_share(g_gaps)),
        per_request=tuple(rows),
    )


# --- running ------------------------------------------------------------------------------------


def peer_environment(work_dir: Path) -> dict[str, str]:
    """The tokenizer is a local folder, and a hub request could only reach a closed loopback port.

    Not ``HF_HUB_OFFLINE``: AIPerf 0.13.0 then takes every tokenizer name for a hub id and looks
    it up in the hub's cache (a local folder fails there); online it loads an absolute path as a
    folder without asking the hub. ``HF_ENDPOINT`` makes sure any call that slips through stays
    on this machine.
    """
    home = work_dir / "home"
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


async def run_peer(
    argv: Sequence[str], primary_url: str, work_dir: Path, *, requests: int
) -> tuple[list[dict[str, Any]], dict[str, tuple[tuple[float, ...], str]], str]:
    """A gateway (records to ``work_dir/records.sqlite``) in front of ``primary_url``; ``argv``
    with ``{gateway}`` replaced by the gateway's URL, run to completion; then every record, each
    request's primary chunk gaps (request id → gaps) and the peer's output. ``requests``: how
    many exchanges the run makes (the records are read once that many were assembled)."""
    store = work_dir / "records.sqlite"
    async with running_gateway(shadow_policy(primary_url), store_path=store) as gw:
        cmd = [a.replace("{gateway}", gw.url) for a in argv]
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=peer_environment(work_dir),
            cwd=work_dir,
        )
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        text = output.decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{text[-4000:]}")
        deadline = asyncio.get_running_loop().time() + 60
        while len(gw.sink.exchanges) < requests:  # assembled just after each response ends
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"{len(gw.sink.exchanges)} of {requests} exchanges recorded")
            await asyncio.sleep(0.05)
        primary = {
            str(ex.request_id): (
                tuple(rec.timings.chunk_gaps_s),
                "".join(c.text for c in rec.choices),
            )
            for ex in gw.sink.exchanges
            if (rec := ex.primary.recording) is not None
        }
    records = await asyncio.to_thread(lambda: list(query_records(store)))
    return records, primary, text
