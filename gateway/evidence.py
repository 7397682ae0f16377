"""Evidence → telemetry: what happens to a finished exchange off the event loop.

Two consumers, both run on worker threads (never on the request path):

- :func:`metrics_handler` — per exchange: classify the request (the same ``classify.categorize``
  the records use, so metric and record categories agree) and record every leg's histograms.
- :func:`record_log_hook` — per record: the record itself as an OTLP log record, for
  collectors that feed a shared store at scale (``OTEL_LOGS_EXPORTER`` / the OTLP endpoint).
- :func:`comparison_hook` — per record (``RecordSink`` hook): count match/diverge per role and
  category, and attach the comparison verdicts as ``gen_ai.evaluation.result`` events on a
  ``compare`` span in the request's trace (the request span has usually ended by then; the
  compare span is its child through the exchange's ``traceparent``).
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.classify import categorize
from gateway.compare import evaluations
from gateway.exchange import Exchange
from gateway.records.sink import RecordEvidence
from otel.record import EvaluationResult
from otel.telemetry import Telemetry

_PROPAGATOR = TraceContextTextMapPropagator()


def category_of(exchange: Exchange) -> str | None:
    """The exchange's category: the client's header, else the classifier's answer."""
    if exchange.category is not None:
        return exchange.category
    category, _source = categorize(None, exchange.request_json)
    return category


def metrics_handler(telemetry: Telemetry) -> Callable[[Exchange], None]:
    def handle(exchange: Exchange) -> None:
        telemetry.record_exchange_metrics(exchange, category=category_of(exchange))

    return handle


def record_log_hook(telemetry: Telemetry) -> Callable[[RecordEvidence], None]:
    """Each written record also leaves as an OTLP log record (when OTLP logs are configured)."""

    def hook(evidence: RecordEvidence) -> None:
        telemetry.emit_record(evidence.record, unix_ns=evidence.exchange.started_unix_ns)

    return hook


def comparison_hook(telemetry: Telemetry) -> Callable[[RecordEvidence], None]:
    def hook(evidence: RecordEvidence) -> None:
        if not evidence.comparisons:
            return
        for c in evidence.comparisons:
            if c.exact_match is not None:
                outcome = "match" if c.exact_match else "diverge"
                telemetry.count_comparison(outcome, role=c.b, category=evidence.category)
        carrier = {"traceparent": evidence.exchange.traceparent or ""}
        context = _PROPAGATOR.extract(carrier) if evidence.exchange.traceparent else None
        span = telemetry.tracer.start_span(
            "compare",
            context=context,
            attributes={"specshadow.exchange_id": evidence.exchange.exchange_id},
        )
        try:
            for c in evidence.comparisons:
                results = [
                    EvaluationResult(
                        name=name,
                        score_value=value,
                        score_label=label,
                        explanation=f"{c.b} vs {c.a}",
                    )
                    for name, value, label in evaluations(c)
                ]
                telemetry.add_evaluation_events(span, results)
        finally:
            span.end()

    return hook
