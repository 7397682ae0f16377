"""The simulated demo's story: shadow two candidates → pick one per category → canary → a bad
deploy → the guards roll it back on their own.

Backends (simulators with known ground truth, on loopback): a plain **primary**, a plain
**baseline** (the noise floor), and two speculative candidates that win on different traffic —
**ngram-k4**, vLLM's n-gram proposer (really: its drafts are the lookup over the request's own
token ids), which shines when the answer repeats the conversation (multi-turn) and finds
nothing to copy in fresh chat, and **eagle3-k3**, a draft-model proposer that is stronger on
free chat and structured output. Each candidate is reached through a :class:`~simulator.switch.Switch`, so
act 3 can swap a deploy under the gateway's feet.

1. **Shadow.** First a 10 % mirror: the candidates see a tenth of production's per-replica
   arrival rate, and the report refuses to conclude (``not_load_matched``, with the fix). Then the
   policy is rewritten to ``ratio: load_matched`` (one replica each: every request) and the
   gateway mirrors every request to both candidates and the baseline at load parity, writing
   comparison records.
2. **Evidence.** The report judges each candidate per category at production's load, compares
   them head to head on the same requests and names the configuration to ship per category.
   The counterfactual matrix scores every n-gram depth and lookup window on production's own
   outputs (token ids from the baseline, no server per configuration), names the best per
   category, and checks its prediction for ngram-k4 against what that candidate reported.
3. **Canary.** The policy file is rewritten — the gateway hot-reloads it — with one rule per
   pick: a canary answering 30 % of that category from its candidate, guards on. Then eagle3
   gets a bad deploy (10× slower steps). Its rule's guard fires and rolls it back to shadow on
   its own; no client sees an error; the other rule stays in canary.
4. **Report.** The final report over everything, with the rollout timeline.

The guard window and minimum sample are smaller than a production default so the story fits in
about a minute and a half; everything else is what ``specshadow serve`` runs.

Size: one script, read top to bottom — the backends, the acts and what each act prints; split,
the story would no longer read in order.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from core.exchange import Exchange
from core.sinks import MemorySink
from gateway.settings import Settings
from gateway.state import GATEWAY
from policies.emit import policy_yaml
from policies.store import PolicyStore
from records.reader import read
from rollout.controller import RolloutController
from simulator.app import run_simulator
from simulator.config import SimConfig
from simulator.switch import Switch
from specshadow.app import build_app

MODEL = "sim-model"
CANARY_SHARE = 0.3
MISMATCHED = 0.1  # act 1's first policy: a 10 % mirror
LOAD_WINDOW_S = 5.0  # the gateway's dispatch-rate window (long enough at the demo's ~15 req/s)
GUARDS = {"window": 60, "min_samples": 20}
STEP_S, PREFILL_S = 0.008, 0.03
# The "model": its answers in a conversation repeat what was said before (every server runs the
# same model, so all answer the same text — the lossless property).
MODEL_TEXT: dict[str, Any] = {"category_copy": {"multi_turn": 0.8}}
# A real n-gram proposer: its drafts are vLLM's n-gram lookup over the request's own token ids,
# so the counterfactual replay of act 2 has an exact answer to match.
NGRAM = SimConfig(
    model=MODEL, prefill_base_s=PREFILL_S, step_s=STEP_S, mode="speculative", proposer="ngram", num_speculative_tokens=4,
    drafting="replay", prompt_lookup_min=2, prompt_lookup_max=4, spec_step_overhead_s=0.0005, **MODEL_TEXT,
)  # fmt: skip
EAGLE = SimConfig(
    model=MODEL, prefill_base_s=PREFILL_S, step_s=STEP_S, mode="speculative", proposer="eagle3", num_speculative_tokens=3, acceptance=0.8,
    category_acceptance={"chat": 0.85, "multi_turn": 0.45, "structured_output": 0.7},
    spec_step_overhead_s=0.002, **MODEL_TEXT,
)  # fmt: skip
# The bad deploy: the same model and proposer, steps ten times slower.
EAGLE_SLOW = SimConfig(model=MODEL, prefill_base_s=PREFILL_S, step_s=10 * STEP_S,
                       mode="speculative", proposer="eagle3", num_speculative_tokens=3,
                       acceptance=0.8, **MODEL_TEXT)  # fmt: skip
PLAIN = SimConfig(model=MODEL, prefill_base_s=PREFILL_S, step_s=STEP_S, **MODEL_TEXT)


@dataclass
class Stage:
    """Everything running: the backends, the switches, the gateway."""

    gateway_url: str
    policy_path: Path
    sink: MemorySink
    rollout: RolloutController
    switches: dict[str, Switch]
    urls: dict[str, str]  # backend name → URL the gateway uses
    policy: PolicyStore

    async def apply(self, text: str, timeout_s: float = 10.0) -> None:
        """Rewrite the policy file and wait until the gateway's hot reload took it."""
        generation = self.policy.generation
        self.policy_path.write_text(text)
        deadline = time.perf_counter() + timeout_s
        while self.policy.generation == generation:
            if time.perf_counter() > deadline:
                raise RuntimeError("the gateway did not reload the policy")
            await asyncio.sleep(0.05)


def shadow_policy(urls: dict[str, str], ratio: float | str = "load_matched") -> str:
    return policy_yaml(_shadow(urls, ratio))


def _shadow(urls: dict[str, str], ratio: float | str = "load_matched") -> dict[str, Any]:
    legs = [{"backend": "ngram-k4", "role": "candidate"}, {"backend": "eagle3-k3", "role": "candidate"},
            {"backend": "baseline", "role": "baseline"}]  # fmt: skip
    return {
        "version": 1,
        "backends": {name: {"url": url, "kind": "sim"} for name, url in urls.items()},
        "primary": "primary",
        "default": {"ratio": ratio, "legs": legs},
        # Token ids of every exchange (the baseline tokenizes: never the primary), for act 2's
        # counterfactual matrix.
        "counterfactual": {"tokenizer": "baseline", "share": 0.5},
    }


def canary_policy(urls: dict[str, str], picks: dict[str, list[str]]) -> str:
    """The shadow policy plus one canary rule per picked candidate, for its categories."""
    rules = [
        {
            "name": backend,
            "match": {"categories": categories},
            "ratio": 1.0,
            "legs": [{"backend": backend, "role": "candidate"}, {"backend": "baseline", "role": "baseline"}],
            "rollout": {"stage": "canary", "serve_ratio": CANARY_SHARE, "guards": GUARDS},
        }
        for backend, categories in picks.items()
    ]  # fmt: skip
    return policy_yaml({**_shadow(urls), "rules": rules})


@asynccontextmanager
async def running(out: Path) -> AsyncIterator[Stage]:
    async with AsyncExitStack() as stack:
        sims = {}
        for name, config in (("primary", PLAIN), ("baseline", PLAIN), ("ngram", NGRAM),
                             ("eagle", EAGLE), ("eagle-slow", EAGLE_SLOW)):  # fmt: skip
            sims[name] = await stack.enter_async_context(run_simulator(config))
        switches = {
            "ngram-k4": Switch({"good": sims["ngram"].base_url}, "good"),
            "eagle3-k3": Switch({"good": sims["eagle"].base_url, "slow": sims["eagle-slow"].base_url}, "good"),
        }  # fmt: skip
        urls = {"primary": sims["primary"].base_url, "baseline": sims["baseline"].base_url}
        for name, switch in switches.items():
            urls[name] = await _serve(stack, switch.app())
        policy_path = out / "policy.yaml"
        policy_path.write_text(shadow_policy(urls, ratio=MISMATCHED))
        sink = MemorySink()
        settings = Settings(
            policy_path=str(policy_path),
            store_path=str(out / "records.sqlite"),
            state_path=str(out / "rollout-state.json"),
            policy_poll_s=0.2,
            scrape_interval_s=0.5,
            shutdown_timeout_s=5.0,
            load_window_s=LOAD_WINDOW_S,
        )
        app = build_app(settings, sinks=[sink])
        gateway_url = await _serve(stack, app)
        controller = app[GATEWAY].rollout
        assert controller is not None
        yield Stage(gateway_url, policy_path, sink, controller, switches, urls, app[GATEWAY].policy)


async def _serve(stack: AsyncExitStack, app: web.Application) -> str:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _settle(sink: MemorySink, expected: int, timeout_s: float = 30.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while len(sink.exchanges) < expected and time.perf_counter() < deadline:  # noqa: ASYNC110 — bounded poll of a plain deque
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)  # the evidence worker (guards, records) wakes every 50 ms


def _served(exchanges: Sequence[Exchange]) -> Counter[tuple[str, str]]:
    """(rule, who answered) over exchanges decided by a rolling-out rule."""
    return Counter(
        (e.policy_rule or "-", e.served_by) for e in exchanges if e.rollout_stage is not None
    )


async def run_story(args: argparse.Namespace, rows: Sequence[Any], out: Path) -> int:
    from loadgen.results import write_results
    from loadgen.runner import run_loadgen
    from report import build_report

    started = time.perf_counter()
    results: list[Any] = []
    async with running(out) as st:

        async def replay(batch: Sequence[Any]) -> None:
            before = len(st.sink.exchanges)
            results.extend(await run_loadgen(f"{st.gateway_url}/v1", batch, concurrency=args.concurrency,
                                             model=MODEL, max_tokens=args.max_tokens))  # fmt: skip
            await _settle(st.sink, before + len(batch))

        print("act 1 — shadow")
        for name, url in st.urls.items():
            print(f"  {name:<10} {url}")
        print(
            f"  gateway    {st.gateway_url}  mirroring 10 % to both candidates and the baseline\n"
        )
        await replay(rows)
        mismatched_done = time.perf_counter()
        mismatched = build_report(
            _records(out), None, out / "mismatched-report", sources=["demo: 10 % mirror"]
        )
        print_mismatch(mismatched.analysis)
        await st.apply(shadow_policy(st.urls))
        matched_from = st.policy.generation
        # Dispatch rates are counted over the gateway's load window: until the 10 % phase has
        # left it, the candidates' rates still read low and those pairs fall outside the parity
        # band. An SRE changing the share waits the same window out.
        await asyncio.sleep(max(0.0, LOAD_WINDOW_S - (time.perf_counter() - mismatched_done)))
        print(
            "\n  the policy now says ratio: load_matched (one replica each: every request is mirrored)\n"
        )
        before = len(st.sink.exchanges)
        await replay(rows)
        print_roles(list(st.sink.exchanges)[before:])

        print("\nact 2 — evidence")
        records = [r for r in _records(out) if _generation(r) >= matched_from]
        # Token texts classify where the counterfactual matrix's drafts were rejected. The demo's
        # servers are simulators in this process, so their tokenizer's pieces are at hand (a
        # deployment asks the tokenizer's /detokenize: `specshadow report` does).
        from records.reader import read
        from simulator.tokens import decode_piece

        texts = {
            t: decode_piece(t) or ""
            for r in map(read, records)
            if r.tokens is not None
            for t in r.tokens.output or ()
        }
        paths = build_report(
            records,
            [r.to_json() for r in results],
            out / "shadow-report",
            sources=["demo: shadow"],
            token_texts=texts,
        )
        a = paths.analysis
        print_picks(a)
        print_counterfactual(records, out / "shadow-report", texts)
        picks: dict[str, list[str]] = {}
        for cat, r in a.recommendations.items():
            if r.backend is not None and cat != "all":
                picks.setdefault(r.backend, []).append(cat)
        if not picks:
            print("  nothing to roll out: no candidate passed for any category")
        else:
            print(
                f"\nact 3 — canary: each pick answers {CANARY_SHARE:.0%} of its categories, guards on"
            )
            await st.apply(canary_policy(st.urls, picks))
            await _wait_for_rules(st.rollout, set(picks))
            canary_from = len(st.sink.exchanges)
            await replay(rows[:120])
            served = _served(list(st.sink.exchanges)[canary_from:])
            for rule in picks:
                print(
                    f"  {rule:<10} answered {served[(rule, 'candidate')]}, primary {served[(rule, 'primary')]}"
                )
            victim = "eagle3-k3" if "eagle3-k3" in picks else next(iter(picks))
            await _regression(st, victim, rows, replay)
        for r in results:
            if r.error is not None:
                print(f"  client error: {r.error}")
        print(
            f"\nclient side (loadgen): {len(results)} requests, errors {sum(1 for r in results if r.error)}"
        )
    records = _records(out)
    write_results(out / "loadgen.jsonl", results)
    final = build_report(
        records, [r.to_json() for r in results], out / "report", sources=["demo (simulated)"],
        rollout_state=out / "rollout-state.json",  # who rolled back, on which reading
    )  # fmt: skip
    print(
        "\nact 4 — report (the whole run: shadow, canary, the rollback; act 2's report is in shadow-report/)"
    )
    print(f"  {'records':<30} {out / 'records.sqlite'}  ({len(records)} comparison records)")
    print(f"  {'report':<30} {final.html}")
    print(f"  {'summary':<30} {final.markdown}")
    for name, path in final.rollout.items():
        print(f"  {name:<30} {path}")
    print(f"\ndemo finished in {time.perf_counter() - started:.1f} s")
    return 0


async def _regression(st: Stage, victim: str, rows: Sequence[Any], replay: Any) -> None:
    if "slow" not in st.switches[victim].targets:
        return
    print(f"\n  a bad deploy: {victim}'s steps are now 10× slower")
    st.switches[victim].current = "slow"
    since = len(st.sink.exchanges)
    for i in range(0, len(rows), 30):
        await replay(rows[i : i + 30])
        if st.rollout.stage_of(victim) == "shadow":
            break
    status = st.rollout.status()["rules"].get(victim, {})
    last = status.get("last_transition") or {}
    if status.get("stage") != "shadow":
        print(f"  {victim} still {status.get('stage')}: the guards did not fire")
        return
    ids = [e.exchange_id for e in list(st.sink.exchanges)[since:]]
    n = ids.index(last["exchange_id"]) + 1 if last.get("exchange_id") in ids else len(ids)
    print(f"  rolled back on its own, {n} exchanges after the deploy: {last.get('reason')}")
    print(
        "  (the guard reads the candidate's TPOT p99 over the primary's on the same requests: "
        "steps 10× slower on a candidate speculation had made faster read as less than 10; the "
        "e-value is the evidence against 'the candidate is no worse', valid however often it "
        "is looked at — the guard fires once it passes the threshold its α sets)"
    )
    after = len(st.sink.exchanges)
    await replay(rows[:60])
    served = _served(list(st.sink.exchanges)[after:])
    print(f"  since then: {victim} rule answered by the primary {served[(victim, 'primary')]}, "
          f"by the candidate {served[(victim, 'candidate')]}")  # fmt: skip
    for rule, stage in ((r, st.rollout.stage_of(r)) for r in st.rollout.status()["rules"]):
        if rule != victim:
            print(f"  {rule} is still in {stage}")


async def _wait_for_rules(
    controller: RolloutController, rules: set[str], timeout_s: float = 10.0
) -> None:
    deadline = time.perf_counter() + timeout_s
    while set(controller.status()["rules"]) < rules:
        if time.perf_counter() > deadline:
            raise RuntimeError("the gateway did not pick up the canary policy")
        await asyncio.sleep(0.1)


def _generation(record: Mapping[str, Any]) -> int:
    """The policy generation that decided the exchange (0: unknown)."""
    policy = read(record).policy
    return (policy.generation if policy is not None else None) or 0


def _records(out: Path) -> list[dict[str, Any]]:
    from records.sqlite_store import query_records

    return list(query_records(out / "records.sqlite"))


def print_roles(exchanges: Sequence[Exchange]) -> None:
    from core.stats import percentile

    by: dict[str, list[Any]] = {}
    for e in exchanges:
        for leg in e.legs:
            if leg.recording is not None:
                label = leg.role if leg.role != "candidate" else leg.backend
                by.setdefault(label, []).append(leg.recording)
    print(f"  {'leg':<10} {'n':>4} {'ttft ms':>8} {'tpot ms':>8} {'e2e ms':>8} {'tok/ev':>7}")
    for label, recs in by.items():

        def med(values: list[float | None]) -> str:
            p = percentile([v for v in values if v is not None], 50)
            return "–" if p is None else f"{p * 1000:.1f}"

        tpe = percentile(
            [r.timings.tokens_per_event for r in recs if r.timings.tokens_per_event], 50
        )
        print(f"  {label:<10} {len(recs):>4} {med([r.timings.ttft_s for r in recs]):>8} "
              f"{med([r.timings.tpot_s for r in recs]):>8} {med([r.timings.e2e_s for r in recs]):>8} "
              f"{(tpe or float('nan')):>7.2f}")  # fmt: skip


def print_counterfactual(
    records: Sequence[dict[str, Any]], out: Path, texts: dict[int, str] | None = None
) -> None:
    """Every n-gram depth and window, and the dynamic lookahead rules, scored on production's
    own outputs; where drafts were rejected; and the live check."""
    from counterfactual.cli import write_outputs
    from counterfactual.matrix import build_matrix

    m = build_matrix(lambda: iter(records), pieces=texts)
    if not m.scored:
        return
    write_outputs(m, out)
    print(
        f"\n  every proposer × depth on production's own outputs ({m.scored} exchanges, "
        f"{len(m.configs)} configurations, no server for any):"
    )
    print(f"  {'category':<18}{'best configuration':<26}{'MAL':<10}predicted TPOT speed-up")
    print("  (MAL: mean acceptance length, the tokens one target step emits: accepted drafts + 1)")
    for cat, pick in sorted(m.picks.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        if pick["config"] is None:
            print(f"  {cat:<18}none: {pick['reason']}")
            continue
        mal = pick["mean_acceptance_length"]["estimate"]
        s = (pick["predicted_tpot_speedup"] or {}).get("estimate")
        speed = "–" if s is None else f"{s:.2f}×"
        print(f"  {cat:<18}{pick['config']['label']:<26} {mal:<9.2f}{speed}")
    overall = [r for r in m.rows if r["category"] == "all" and r["output_length_bucket"] == "all"]
    ranked = sorted(
        (r for r in overall if r["predicted_tpot_speedup"] is not None),
        key=lambda r: -r["predicted_tpot_speedup"],
    )
    best_fixed = next((r for r in ranked if r["rule"] is None), None)
    best_rule = next((r for r in ranked if r["rule"] is not None), None)
    if best_fixed is not None and best_rule is not None:
        print(
            f"  dynamic lookahead: {best_rule['label']} ({best_rule['replay_class']}) "
            f"{best_rule['predicted_tpot_speedup']:.2f}× predicted, against the best fixed k "
            f"({best_fixed['label']}) {best_fixed['predicted_tpot_speedup']:.2f}×"
        )
    for cat, pick in sorted(m.picks.items()):
        label = pick["config"]["label"] if pick["config"] else None
        row = next((r for r in m.rows if r["category"] == cat and r["label"] == label
                    and r["output_length_bucket"] == "all"), None)  # fmt: skip
        rejected = (row or {}).get("rejections") or {}
        top = max(rejected.items(), key=lambda kv: kv[1]["rejections"], default=None)
        if top is not None and top[1]["rejections"]:
            cls, v = top
            print(
                f"  {cat:<18}drafts rejected most at {cls}: {v['rejection_share']:.0%} of "
                f"rejections, {v['output_share']:.0%} of output tokens"
            )
    for live in m.live:
        p, me = live["predicted_mean_acceptance_length"], live["measured_mean_acceptance_length"]
        print(
            f"  live {live['backend']} ({live['label']}): predicted {p['estimate']:.2f}, "
            f"its engine reported {me['estimate']:.2f} — {'⚠ ' if live['flag'] else ''}{live['note']}"
        )
    for backend, why in sorted(m.live_skipped.items()):
        print(f"  live {backend}: not checked against the prediction — {why}")
    print(f"  {'matrix':<18}{out / 'counterfactual.json'}")


def print_mismatch(a: Any) -> None:
    """What the report said about the 10 % mirror: not load-matched, and how to fix it."""
    for c in a.candidates.values():
        overall = next((v for v in c.verdicts if v.category == "all"), None)
        at = overall.at_load if overall is not None else None
        if overall is None:
            continue
        parity = f"{at.parity_p50:.2f}" if at is not None and at.parity_p50 is not None else "?"
        raw = (
            f", raw speed-up {overall.e2e.point:.2f}× at that load"
            if overall.e2e is not None
            else ""
        )
        print(f"  {c.label:<11} {overall.label}: load parity {parity}{raw}")
    fix = next((v.fix for c in a.candidates.values() for v in c.verdicts if v.fix), None)
    if fix:
        print(f"  to measure it at production's load: {fix}")


def print_picks(a: Any) -> None:
    labels = {b: c.label for b, c in a.candidates.items()}
    cats = [*a.categories, "all"]
    head = f"  {'category':<18}" + "".join(f"{labels[b]:<26}" for b in labels) + "ship"
    print(head)
    for cat in cats:
        cells = []
        for c in a.candidates.values():
            v = next((v for v in c.verdicts if v.category == cat), None)
            at = v.at_load.e2e if v is not None and v.at_load is not None else None
            text = (
                "—" if v is None else v.label + (f" {at.estimate:.2f}×" if at is not None else "")
            )
            cells.append(f"{text:<26}")
        pick = a.recommendations.get(cat)
        ship = labels.get(pick.backend, "none") if pick is not None and pick.backend else "none"
        print(f"  {cat:<18}" + "".join(cells) + ship)
    main = a.main
    if main is not None:
        at = main.load.get("all")
        if at is not None and at.parity_p50 is not None:
            print(
                f"  load parity p50 {at.parity_p50:.2f}: the candidates ran at production's per-replica rate"
            )
