"""Synthetic comparison records with known truth (speedups, divergence rates, acceptance)."""

from __future__ import annotations

import math
import random
from typing import Any


def leg(
    role: str,
    *,
    ttft: float,
    e2e: float,
    tokens: int,
    tpe: float | None,
    mal: float | None = None,
    status: int = 200,
    outcome: str = "completed",
    kv: float | None = None,
    rate: float = 10.0,
    parity: float | None = None,
) -> dict[str, Any]:
    """One leg; ``rate``: its backend's per-replica arrival rate at dispatch (load-matched legs
    share the primary's, so their ``parity`` is 1)."""
    events = max(1, round(tokens / tpe)) if tpe else tokens
    return {
        "role": role,
        "backend": f"{role}-backend",
        "status": status,
        "outcome": outcome,
        "error_type": None if status < 400 else "UpstreamStatusError",
        "ttft_s": ttft,
        "tpot_s": (e2e - ttft) / (tokens - 1),
        "e2e_s": e2e,
        "chunk_gap_p50_s": (e2e - ttft) / max(1, events - 1),
        "chunk_gap_p99_s": 2 * (e2e - ttft) / max(1, events - 1),
        "output_tokens": tokens,
        "tokens_source": "usage",
        "events": events,
        "tokens_per_event": tokens / events,
        "output_length_bucket": "<64" if tokens < 64 else "64-256",
        "concurrency_bucket": "1" if tokens % 2 else "2-4",
        "acceptance": {
            "mean_acceptance_length": mal,
            "draft_acceptance_rate": None if mal is None else (mal - 1) / 4,
            "source": "vllm_metrics" if mal else None,
            "coverage": None,
            "backend_window": {"kv_cache_usage_perc": kv} if kv is not None else None,
        },
        "output": {"sha256": "x", "chars": 10, "text": f"{role} text"},
        "share": None if role == "primary" else 1.0,
        "load": {"rate_rps": rate, "per_replica_rate_rps": rate, "in_flight": 2,
                 "per_replica_in_flight": 2.0, "replicas": 1, "window_s": 10.0, "scraped": None},
        "load_parity": parity if role != "primary" else None,
    }  # fmt: skip


def comparison(a: str, b: str, exact: bool) -> dict[str, Any]:
    return {
        "a": a, "b": b, "comparable": True, "greedy": True, "flag": not exact,
        "exact_match": exact, "first_divergence": None if exact else 7,
        "divergence_unit": None if exact else "chars", "similarity": 1.0 if exact else 0.8,
    }  # fmt: skip


def record(
    cat: str, i: int, legs: list[dict[str, Any]], comparisons: list[dict[str, Any]]
) -> dict[str, Any]:
    """The ``i``-th record of category ``cat`` (load-matched: parity 1)."""
    return {
        "schema": "specshadow.record/1",
        "exchange_id": f"{cat}-{i}",
        "request_id": f"req-{cat}-{i}",
        "category": cat,
        "started_unix_ns": 1_700_000_000_000_000_000 + i,
        "legs": legs,
        "load_parity": 1.0,
        "comparisons": comparisons,
    }


def records(
    *,
    speedups: dict[str, float],
    n: int = 60,
    noise: float = 0.08,
    candidate_divergence: dict[str, float] | None = None,
    baseline_divergence: float = 0.02,
    ttft_s: float = 0.05,
    seed: int = 1,
) -> list[dict[str, Any]]:
    """``n`` records per category; candidate e2e = primary e2e / speedup × lognormal(0, noise)."""
    rng = random.Random(seed)
    out = []
    for cat, true_speedup in speedups.items():
        div = (candidate_divergence or {}).get(cat, baseline_divergence)
        for i in range(n):
            tokens = rng.randint(20, 200)
            e2e = ttft_s + tokens * 0.01 * math.exp(rng.gauss(0, 0.2))
            cand_e2e = e2e / true_speedup * math.exp(rng.gauss(0, noise))
            base_e2e = e2e * math.exp(rng.gauss(0, noise))
            tpe = 1 + 1.6 * true_speedup / 1.5 if true_speedup > 1 else 1.05
            out.append(record(cat, i, [
                leg("primary", ttft=ttft_s, e2e=e2e, tokens=tokens, tpe=1.0, kv=0.3),
                leg("candidate", ttft=min(ttft_s, cand_e2e / 2), e2e=cand_e2e, tokens=tokens, tpe=tpe, mal=tpe + 0.8, kv=0.45, parity=1.0),
                leg("baseline", ttft=ttft_s, e2e=base_e2e, tokens=tokens, tpe=1.0, parity=1.0),
            ], [
                comparison("primary", "candidate", rng.random() >= div),
                comparison("primary", "baseline", rng.random() >= baseline_divergence),
            ]))  # fmt: skip
    return out


def several(
    candidates: dict[str, dict[str, Any]],
    *,
    categories: tuple[str, ...] = ("chat", "code"),
    n: int = 40,
    noise: float = 0.05,
    seed: int = 3,
) -> list[dict[str, Any]]:
    """Records mirrored to several candidates at once, with known truth per candidate:
    ``{backend: {"speedups": {category: x}, "divergence": {category: p}, "method": …, "k": …,
    "verification": …}}``. Each candidate's e2e is the primary's / its speed-up × its own
    lognormal(0, ``noise``); ``noise=0`` makes equal speed-ups exactly equal."""
    rng = random.Random(seed)
    out = []
    for cat in categories:
        for i in range(n):
            tokens = rng.randint(20, 200)
            e2e = 0.05 + tokens * 0.01 * math.exp(rng.gauss(0, 0.2))
            legs = [leg("primary", ttft=0.05, e2e=e2e, tokens=tokens, tpe=1.0, kv=0.3)]
            comparisons = []
            for backend, truth in candidates.items():
                speedup = truth["speedups"].get(cat, 1.0)
                cand_e2e = e2e / speedup * math.exp(rng.gauss(0, noise) if noise else 0.0)
                tpe = 1 + 1.6 * speedup / 1.5 if speedup > 1 else 1.05
                cand = leg("candidate", ttft=min(0.05, cand_e2e / 2), e2e=cand_e2e, tokens=tokens,
                           tpe=tpe, mal=tpe + 0.8, kv=0.45, parity=1.0)  # fmt: skip
                cand["backend"] = backend
                cand["speculative"] = {
                    "method": truth.get("method", "ngram"),
                    "num_speculative_tokens": truth.get("k", 4),
                    "label": truth.get("label"),
                    "verification": truth.get("verification", "lossless"),
                    "verification_source": "vllm_server_info",
                    "verification_detail": "rejection_sample_method=standard",
                    "mismatches": [],
                }
                legs.append(cand)
                exact = rng.random() >= truth.get("divergence", {}).get(cat, 0.0)
                comparisons.append(
                    {**comparison("primary", "candidate", exact), "b_backend": backend}
                )
            base = leg(
                "baseline",
                ttft=0.05,
                e2e=e2e * math.exp(rng.gauss(0, noise)),
                tokens=tokens,
                tpe=1.0,
                parity=1.0,
            )
            legs.append(base)
            comparisons.append(comparison("primary", "baseline", True))
            out.append(record(cat, i, legs, comparisons))
    return out
