"""The product assembled: the gateway, the evidence pipeline behind it, telemetry and records.

:func:`build_app` is what ``specshadow serve`` runs (and the demo, the in-process gateway and the
tests' gateway fixture): :func:`gateway.app.create_app` with one
:class:`~evidence.worker.EvidenceWorker` as its sink, whose consumers are the telemetry (metrics,
comparison counts, ``compare`` spans, records as OTLP logs when configured) and — with
``--store`` — the embedded record store — and the rollout controller's guards. The backends' ``/metrics`` are scraped whenever the
policy names a metrics URL, with or without a store, and every vLLM, SGLang or simulator backend
is asked what speculative decoding it runs (:mod:`evidence.serverinfo`). Both pollers follow
the policy the gateway started with; a reload that adds backends needs a restart for them.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

from core.evidence import EvidenceConsumer
from core.exchange import ExchangeSink
from evidence.counts import TOKENIZE_KINDS, CountPlan, CountTap, Tokenizer
from evidence.likelihood import SCORING_KINDS, LikelihoodPlan
from evidence.scrape import MetricsScraper
from evidence.serverinfo import INFO_PATHS, InfoTarget, ServerInfoProbe
from evidence.tokens import TokenEndpoint, TokenPlan, TokenTap
from evidence.worker import EvidenceWorker
from gateway.app import create_app, open_policy
from gateway.settings import Settings
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from otel.telemetry import Telemetry
from policies.compiled import CompiledPolicy
from policies.store import PolicyStore
from records.clickhouse import ClickHouseWriter
from records.stores import open_writer
from rollout.controller import RolloutController


def scrape_targets(policy: CompiledPolicy) -> dict[str, str]:
    """Backend name → its ``/metrics`` URL, for backends that expose one."""
    return {name: b.metrics_url for name, b in policy.backends.items() if b.metrics_url}


def info_targets(policy: CompiledPolicy) -> dict[str, InfoTarget]:
    """Backends that can say what they run (vLLM, SGLang, the simulator), and any whose engine the
    policy declares."""
    return {
        name: InfoTarget(b.url, b.kind, b.speculative, b.engine)
        for name, b in policy.backends.items()
        if b.kind in INFO_PATHS or b.engine
    }


def token_plan(policy: CompiledPolicy) -> TokenPlan | None:
    """The token tap's plan from the policy's ``counterfactual`` section (None: off)."""
    c = policy.counterfactual
    if c is None:
        return None
    return TokenPlan(
        tokenizer=TokenEndpoint(c.tokenizer.name, c.tokenizer.url, c.tokenizer.kind),
        share=c.share,
        drafters=tuple(TokenEndpoint(d.name, d.url) for d in c.drafters),
        max_in_flight=c.max_in_flight,
        timeout_s=c.timeout_s,
    )


def count_plan(policy: CompiledPolicy) -> CountPlan:
    """Who may count a leg's output tokens when its response carried no usage: every backend but
    the primary that serves ``/tokenize`` (the counterfactual tokenizer first, when named)."""
    primary = policy.primary.name if policy.primary is not None else None
    tokenizers = {
        name: Tokenizer(b.url, b.auth_header)
        for name, b in policy.backends.items()
        if b.kind in TOKENIZE_KINDS and name != primary
    }
    c = policy.counterfactual
    return CountPlan(tokenizers, preferred=c.tokenizer.name if c is not None else None)


def likelihood_plan(policy: CompiledPolicy) -> LikelihoodPlan | None:
    """The likelihood scorer's plan from the policy's ``quality.likelihood`` (None: off)."""
    lk = policy.quality.likelihood
    if lk is None:
        return None
    if lk.scorer is None:
        # Each exchange's own baseline scores it, where that backend can (vLLM's API).
        scorers = {
            name: b.url
            for name, b in policy.backends.items()
            if b.kind in SCORING_KINDS and (policy.primary is None or name != policy.primary.name)
        }
        return LikelihoodPlan(
            scorer_name=None,
            scorer_url=None,
            baseline_scorers=scorers,
            share=lk.share,
            max_in_flight=lk.max_in_flight,
            timeout_s=lk.timeout_s,
        )
    return LikelihoodPlan(
        scorer_name=lk.scorer.name,
        scorer_url=lk.scorer.url,
        share=lk.share,
        max_in_flight=lk.max_in_flight,
        timeout_s=lk.timeout_s,
    )


class _PlanOf:
    """The current policy's token plan, recomputed only when the policy generation changes."""

    def __init__(self, store: PolicyStore) -> None:
        self._store = store
        self._generation = -1
        self._plan: TokenPlan | None = None
        self._likelihood: LikelihoodPlan | None = None
        self._counts: CountPlan | None = None

    def _refresh(self) -> None:
        current = self._store.current
        if current.generation != self._generation:
            self._plan, self._likelihood = token_plan(current), likelihood_plan(current)
            self._counts = count_plan(current)
            self._generation = current.generation

    def counts(self) -> CountPlan | None:
        self._refresh()
        return self._counts

    def __call__(self) -> TokenPlan | None:
        self._refresh()
        return self._plan

    def likelihood(self) -> LikelihoodPlan | None:
        self._refresh()
        return self._likelihood


def evidence_worker(
    settings: Settings,
    policy: PolicyStore,
    telemetry: Telemetry,
    *,
    consumers: Sequence[EvidenceConsumer] = (),
) -> EvidenceWorker:
    """The evidence pipeline for ``settings``: telemetry, the store (``--store``), ``consumers``."""
    first: list[EvidenceConsumer] = []
    if settings.store_path:
        writer = open_writer(settings.store_path)  # opened now: a bad store fails fast
        if isinstance(writer, ClickHouseWriter):  # drops and failed inserts are telemetry
            writer.on_loss = lambda reason, n: telemetry.count_telemetry_dropped(
                "records", reason, n
            )
        first.append(writer)
    targets = scrape_targets(policy.current)
    keepalive_s = settings.upstream.keepalive_s
    scraper = (
        MetricsScraper(targets, settings.scrape_interval_s, keepalive_s=keepalive_s)
        if targets
        else None
    )
    info = info_targets(policy.current)
    return EvidenceWorker(
        [*first, telemetry, *consumers],
        capture_default=policy.current.capture,
        scraper=scraper,
        # Asked every ten scrapes (10 s by default): an engine upgrade re-qualifies the evidence
        # within seconds, for a few small GETs per backend.
        probe=ServerInfoProbe(
            info, refresh_s=min(60.0, 10 * settings.scrape_interval_s), keepalive_s=keepalive_s
        )
        if info
        else None,
        # Visible as specshadow.telemetry.dropped{signal=metrics, reason=queue_full}.
        on_drop=lambda: telemetry.count_telemetry_dropped("metrics", "queue_full", 1),
    )


def build_app(
    settings: Settings,
    *,
    sinks: Sequence[ExchangeSink] = (),
    policy: PolicyStore | None = None,
    telemetry: Telemetry | None = None,
    consumers: Sequence[EvidenceConsumer] = (),
) -> web.Application:
    """The gateway with its evidence pipeline; ``sinks`` also get every raw exchange.

    Raises PolicyError, ValueError or OSError (e.g. an unusable ``--store`` path) at once.
    """
    store = policy if policy is not None else open_policy(settings)
    tel = telemetry if telemetry is not None else build_telemetry(TelemetrySettings.from_env({}))
    # The rollout guards are an evidence consumer like any other: they see every exchange with
    # its comparisons, off the event loop, with or without a record store.
    rollout = RolloutController(settings.state_path, telemetry=tel)
    worker = evidence_worker(settings, store, tel, consumers=[rollout, *consumers])
    if worker.scraper is not None:
        rollout.kv_recent = worker.scraper.recent_kv
        rollout.acceptance_recent = worker.scraper.recent_acceptance
    # The token tap hands every exchange on to the worker (a sampled share after tokenizing,
    # another after scoring the shadow legs' likelihoods under the target).
    plans = _PlanOf(store)
    tap = TokenTap(
        worker,
        plans,
        # Visible as specshadow.telemetry.dropped{signal=tokens, reason=budget|error}.
        on_drop=lambda reason: tel.count_telemetry_dropped("tokens", reason, 1),
        likelihood=plans.likelihood,
        # Visible as specshadow.telemetry.dropped{signal=likelihood, reason=budget|error}.
        on_likelihood_drop=lambda reason: tel.count_telemetry_dropped("likelihood", reason, 1),
        keepalive_s=settings.upstream.keepalive_s,
        # A hung tokenizer or scorer holds shutdown no longer than the gateway's own drain.
        drain_s=settings.shutdown_timeout_s,
    )
    # In front of both: a mirrored exchange whose primary streamed without usage (the SDK's
    # default) has its legs' outputs counted by a shadow backend's tokenizer (evidence.counts).
    counts = CountTap(
        tap,
        plans.counts,
        # Visible as specshadow.telemetry.dropped{signal=counts, reason=budget|error}.
        on_drop=lambda reason: tel.count_telemetry_dropped("counts", reason, 1),
        keepalive_s=settings.upstream.keepalive_s,
        # A hung tokenizer or scorer holds shutdown no longer than the gateway's own drain.
        drain_s=settings.shutdown_timeout_s,
    )
    return create_app(
        settings, sinks=[counts, *sinks], policy=store, telemetry=tel, rollout=rollout
    )
