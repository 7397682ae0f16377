"""The report's executable checklist: rollout.yaml is a valid policy fragment whose guards carry
the measured thresholds, and the Argo / Flagger templates' PromQL parses (promtool) and answers
over a real Prometheus scraping a real gateway."""

from __future__ import annotations

import asyncio
import statistics
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from policies.compile import parse_policy
from policies.parse import read_yaml
from report import build_report
from report.rollout import guard_queries
from tests.gateway.test_shadow import CHAT, raw_stream
from tests.receivers.prometheus import PROMTOOL, requires_prometheus, requires_promtool
from tests.report.synthetic import several

POLICY_HEAD = (
    "version: 1\nbackends:\n  prod: {url: 'http://127.0.0.1:1', kind: vllm}\n"
    "  ngram: {url: 'http://127.0.0.1:2', kind: vllm}\n"
    "  eagle: {url: 'http://127.0.0.1:3', kind: vllm}\nprimary: prod\n"
)


def records() -> list[dict[str, Any]]:
    return several({"ngram": {"speedups": {"chat": 1.1, "code": 1.8}, "method": "ngram"},
                    "eagle": {"speedups": {"chat": 1.5, "code": 1.2}, "method": "eagle3"}})  # fmt: skip


def test_rollout_yaml_is_a_policy_fragment_with_the_measured_thresholds(tmp_path: Path) -> None:
    recs = records()
    paths = build_report(recs, None, tmp_path)
    text = paths.rollout["rollout.yaml"].read_text()
    policy = parse_policy(read_yaml((POLICY_HEAD + text).encode(), source="r"), source="r")
    by_name = {r.name: r for r in policy.rules}
    assert set(by_name) == {"rollout-chat-eagle", "rollout-code-ngram"}
    code = by_name["rollout-code-ngram"]
    assert code.rollout is not None and code.rollout.stage == "canary"
    assert code.rollout.candidate.backend.name == "ngram" and code.rollout.steps == (
        0.05,
        0.25,
        0.5,
        1.0,
    )
    # Independently: half the measured speculative gain of ngram's code legs.
    tpe = [leg["tokens_per_event"] for r in recs if r["category"] == "code"
           for leg in r["legs"] if leg.get("backend") == "ngram"]  # fmt: skip
    assert code.rollout.guards.tokens_per_event_min == round(1 + (statistics.fmean(tpe) - 1) / 2, 2)
    # The p99 ratio guard: 1.25 × measured, never above 1.5, never below 1.0.
    a = paths.analysis
    cand = a.latency[("candidate ngram", "code")]["e2e_s"][2]
    prim = a.latency[("primary", "code")]["e2e_s"][2]
    assert cand is not None and prim is not None
    assert code.rollout.guards.e2e_p99_ratio_max == round(min(1.5, max(1.0, 1.25 * cand / prim)), 2)
    # No recommendation, no files (and no stale ones).
    slow = several({"slow": {"speedups": {"chat": 0.8, "code": 0.8}}})
    again = build_report(slow, None, tmp_path)
    assert again.rollout == {} and not (tmp_path / "rollout.yaml").exists()


def test_argo_and_flagger_templates_have_their_shape(tmp_path: Path) -> None:
    paths = build_report(records(), None, tmp_path)
    argo = yaml.safe_load(paths.rollout["argo-analysis-template.yaml"].read_text())
    assert argo["kind"] == "AnalysisTemplate" and argo["apiVersion"] == "argoproj.io/v1alpha1"
    metrics = {m["name"]: m for m in argo["spec"]["metrics"]}
    assert set(metrics) >= {
        "e2e-p99-ratio",
        "tpot-p99-ratio",
        "error-rate-delta",
        "divergence-rate",
        "tokens-per-event",
    }
    assert "result[0] <= " in metrics["e2e-p99-ratio"]["successCondition"]
    assert "result[0] >= " in metrics["tokens-per-event"]["successCondition"]
    flagger = list(yaml.safe_load_all(paths.rollout["flagger-metric-templates.yaml"].read_text()))
    templates = [d for d in flagger if d["kind"] == "MetricTemplate"]
    (canary,) = [d for d in flagger if d["kind"] == "Canary"]
    refs = {m["templateRef"]["name"] for m in canary["spec"]["analysis"]["metrics"]}
    assert refs == {t["metadata"]["name"] for t in templates}


def _as_rules(queries: dict[str, str]) -> str:
    rules = "\n".join(
        f"  - record: specshadow:{name}\n    expr: |\n"
        + "\n".join(f"      {line}" for line in q.splitlines())
        for name, q in queries.items()
    )
    return f"groups:\n- name: specshadow-guards\n  rules:\n{rules}\n"


@pytest.mark.prometheus
@requires_promtool
def test_every_guard_query_parses_in_promtool(tmp_path: Path) -> None:
    paths = build_report(records(), None, tmp_path)
    argo = yaml.safe_load(paths.rollout["argo-analysis-template.yaml"].read_text())
    argo_queries = {
        m["name"].replace("-", "_"): m["provider"]["prometheus"]["query"]
        for m in argo["spec"]["metrics"]
    }
    flagger = [
        d
        for d in yaml.safe_load_all(paths.rollout["flagger-metric-templates.yaml"].read_text())
        if d["kind"] == "MetricTemplate"
    ]
    flagger_queries = {
        d["metadata"]["name"].replace("-", "_"): d["spec"]["query"].replace("{{ interval }}", "5m")
        for d in flagger
    }
    for label, queries in (("argo", argo_queries), ("flagger", flagger_queries)):
        rules = tmp_path / f"{label}.rules.yml"
        rules.write_text(_as_rules(queries))
        assert PROMTOOL is not None
        proc = subprocess.run(
            [PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"SUCCESS: {len(queries)} rules found" in proc.stdout


@pytest.mark.prometheus
@requires_prometheus
async def test_the_guard_queries_answer_over_a_real_prometheus_scraping_the_gateway(
    sims, gateway, write_policy, prometheus_server
):
    # Steps of 10 ms: the candidate's answers (about a quarter of the steps) land two or more of
    # the duration histogram's doubling buckets below the primary's, so its p99 reads below the
    # primary's on a loaded machine too (2 ms steps put both in one bucket there: ratio 1.0).
    # Every draft accepted and every answer max_tokens long: each candidate stream carries the
    # same tokens per event (8 in 3 events), so the guard's mean over whichever legs its rate
    # window holds has one true value. (With acceptance 0.8 the window's few legs and the mean
    # over every leg differed by 22 % on a busy machine: two different samples.)
    primary = await sims(step_s=0.01)
    candidate = await sims(mode="speculative", acceptance=1.0, step_s=0.01)
    baseline = await sims(step_s=0.01)
    policy = (
        "version: 1\n"
        f"backends:\n  prim: {{url: '{primary.base_url}', kind: sim}}\n"
        f"  cand: {{url: '{candidate.base_url}', kind: sim}}\n"
        f"  base: {{url: '{baseline.base_url}', kind: sim}}\n"
        "primary: prim\n"
        "default: {ratio: 1.0, legs: [{backend: cand, role: candidate}, {backend: base, role: baseline}]}\n"
    )
    gw = await gateway(None, policy_path=write_policy(policy))
    server = prometheus_server([gw.url.removeprefix("http://")], interval_s=0.5)
    await server.wait_ready()
    queries = guard_queries("cand", "1m")
    answers: dict[str, float] = {}
    for i in range(300):
        body = {**CHAT, "messages": [{"role": "user", "content": f"guard {i}"}], "stream": True,
                "max_tokens": 8}  # fmt: skip
        status, _ = await raw_stream(gw.url, body)
        assert status == 200
        if i % 20 == 19:
            for name, q in queries.items():
                result = await server.query(q)
                if result:
                    answers[name] = float(result[0]["value"][1])
            if len(answers) == len(queries) and all(v == v for v in answers.values()):
                break
        await asyncio.sleep(0.01)
    assert set(answers) == set(queries), answers
    tpe = [leg.recording.timings.tokens_per_event for e in gw.sink.exchanges
           for leg in e.shadows if leg.role == "candidate" and leg.recording is not None]  # fmt: skip
    (truth,) = set(tpe)  # the simulator's: one value on every candidate leg
    assert truth is not None and truth > 1.0
    assert answers["tokens_per_event"] == pytest.approx(truth, rel=1e-9)
    assert answers["error_rate_delta"] == 0.0  # no leg failed
    assert answers["divergence_rate"] == 0.0  # lossless, greedy: nothing diverges
    # The p99 ratio is the two legs' p99 as Prometheus interpolates it in their buckets, computed
    # here from the raw bucket rates, with the selectors written out by hand; one query holds the
    # guard and both legs' buckets, so all three read one instant. Whether the candidate's p99
    # reads below the primary's is a wall-clock claim (the tail of a few hundred answers is the
    # machine's: one CI run read both in one bucket, ratio 1.0), so it is printed, not held.
    dur = "gen_ai_client_operation_duration_seconds_bucket"
    legs = {
        "candidate": 'specshadow_leg_role="candidate",specshadow_backend="cand"',
        "primary": 'specshadow_leg_role="primary"',
    }
    promql = f'label_replace({queries["e2e_p99_ratio"]}, "part", "guard", "", "")' + "".join(
        f'\nor label_replace(sum by (le) (rate({dur}{{{sel}}}[1m])), "part", "{leg}", "", "")'
        for leg, sel in legs.items()
    )
    rows = await server.query(promql)
    (guard,) = [float(r["value"][1]) for r in rows if r["metric"]["part"] == "guard"]
    p99 = {
        leg: bucket_quantile(
            0.99,
            [
                (float(r["metric"]["le"]), float(r["value"][1]))
                for r in rows
                if r["metric"]["part"] == leg
            ],
        )
        for leg in legs
    }
    print(f"\ne2e p99: candidate {p99['candidate']:.4f} s, primary {p99['primary']:.4f} s")
    assert 0 < p99["candidate"] < float("inf") and 0 < p99["primary"] < float("inf"), p99
    assert guard == pytest.approx(p99["candidate"] / p99["primary"], rel=1e-9)
    async with aiohttp.ClientSession() as s, s.get(f"{gw.url}/metrics") as r:
        assert r.status == 200


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's ``histogram_quantile`` on one series of cumulative buckets ``(le, count)``:
    the rank's bucket found, linear inside it (from 0 in the first), the highest finite bound
    where the rank falls in ``+Inf``."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for i, (le, cum) in enumerate(buckets):
        if cum >= rank:
            if le == float("inf"):
                return buckets[i - 1][0]
            return lower + (le - lower) * (rank - below) / (cum - below)
        lower, below = le, cum
    raise AssertionError(buckets)


def test_bucket_quantile_is_prometheus_interpolation() -> None:
    # 100 observations: 50 at or under 0.1, 40 more under 0.2, 10 more under 0.4.
    buckets = [(0.1, 50.0), (0.2, 90.0), (0.4, 100.0), (float("inf"), 100.0)]
    assert bucket_quantile(0.5, buckets) == pytest.approx(0.1)
    assert bucket_quantile(0.7, buckets) == pytest.approx(0.15)
    assert bucket_quantile(0.99, buckets) == pytest.approx(0.2 + 0.2 * 9 / 10)
    assert bucket_quantile(0.99, [(0.1, 0.0), (float("inf"), 4.0)]) == 0.1


def test_the_checklists_triggers_are_rollout_yamls_guards(tmp_path: Path) -> None:
    """Issue 36: one source. Every trigger the checklist states for a category is the guard
    rollout.yaml carries for it, and says its value in ms at today's primary p99."""
    paths = build_report(records(), None, tmp_path)
    a = paths.analysis
    rules = yaml.safe_load(paths.rollout["rollout.yaml"].read_text())["rules"]
    text = "\n".join(a.checklist)
    assert rules
    for rule in rules:
        (cat,) = rule["match"]["categories"]
        backend = rule["legs"][0]["backend"]
        guards = rule["rollout"]["guards"]
        for metric, key, what in (("tpot_s", "tpot_p99_ratio_max", "tpot"),
                                  ("e2e_s", "e2e_p99_ratio_max", "e2e")):  # fmt: skip
            prim = a.latency[("primary", cat)][metric][2]
            cand = a.latency[(f"candidate {backend}", cat)][metric][2]
            assert prim is not None and cand is not None
            ratio = guards[key]
            # Independently: 1.25 × the measured ratio, within [1.0, 1.5].
            assert ratio == round(min(1.5, max(1.0, 1.25 * cand / prim)), 2)
            want = (f"Roll back {cat} if candidate p99 {what} > {ratio}× the primary's p99 = "
                    f"{ratio * prim * 1e3:.1f} ms at today's primary p99 of {prim * 1e3:.1f} ms")  # fmt: skip
            assert want in text, (want, text)
        assert f"falls below {guards['tokens_per_event_min']:.2f}" in text
        assert f"by more than {guards['divergence_rate_max']:.1%}" in text
        assert f"by more than {guards['error_rate_delta_max']:.1%}" in text
    # The old checklist's own rule (1.2 × the candidate's p99, below the primary's) is gone.
    assert " ms (measured: candidate" not in text


def test_a_rule_for_sampled_traffic_without_a_baseline_carries_its_reference(
    tmp_path: Path,
) -> None:
    """Issue 36: the rules rollout.yaml writes have quality guards that work on the traffic
    measured. Sampled traffic: ``sampled_divergence`` on, and — no baseline leg in the rule — the
    primary as its reference: mirrored behind every canary answer (``ratio``) and, live, at
    ``reference_ratio`` > 0. ``specshadow policy check`` accepts the file."""
    import dataclasses

    from report.checklist import checklist, guards_for
    from report.rollout import rollout_yaml
    from specshadow.main import main

    a = build_report(records(), None, tmp_path).analysis
    greedy = yaml.safe_load(rollout_yaml(a) or "")["rules"]
    assert all("sampled_divergence_max" not in r["rollout"]["guards"] for r in greedy)
    sampled = {
        b: dataclasses.replace(
            c, equivalence={k: dataclasses.replace(e, n=120) for k, e in c.equivalence.items()}
        )
        for b, c in a.candidates.items()
    }
    s = dataclasses.replace(a, candidates=sampled)
    assert guards_for(s, sampled["ngram"], "code").sampled
    text = rollout_yaml(s)
    assert text is not None
    for rule in yaml.safe_load(text)["rules"]:
        assert [leg["role"] for leg in rule["legs"]] == ["candidate"]  # no baseline leg
        assert rule["rollout"]["guards"]["sampled_divergence_max"] == 0.0
        assert rule["ratio"] > 0 and rule["rollout"]["reference_ratio"] > 0
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY_HEAD + text)
    parsed = parse_policy(read_yaml(policy.read_bytes(), source="p"), source="p")
    assert all(r.rollout is not None and r.rollout.reference_ratio > 0 for r in parsed.rules)
    assert main(["policy", "check", str(policy)]) == 0
    lines = checklist(s, s.candidates, s.recommendations, s.resources)
    assert any("sampled outputs stop being exchangeable" in line for line in lines)
