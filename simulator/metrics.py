"""The simulator's ``/metrics``: vLLM's Prometheus names, labels and buckets, per app.

Uses ``prometheus_client`` (what vLLM itself uses) with one ``CollectorRegistry`` per app, so the
exposition — ``_total``/``_created`` samples, histogram ``_bucket``/``_sum``/``_count``, label
escaping — is byte-for-byte the library's, not a hand-written imitation, and two simulators in one
process never share counters. Labels are vLLM's: ``model_name`` (the first served name) and
``engine="0"``. Counters advance per engine step as the step is emitted, so a scrape mid-stream sees
what a real server would, and at rest they add up exactly to the per-request ground truth.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from simulator.acceptance import Step
from simulator.config import SimConfig

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's default buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                             50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

_LABELS = ("model_name", "engine")


class SimMetrics:
    """Counters, gauges and histograms of one simulated engine."""

    def __init__(self, config: SimConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        values = (config.model, "0")
        self._capacity = config.kv_cache_capacity_tokens
        # A speculative request's drafter holds KV of its own (kv_overhead_fraction per token).
        self._kv_scale = 1.0 + (config.kv_overhead_fraction if config.speculative else 0.0)
        self._tokens_in_use = 0

        self.running = Gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            _LABELS,
            registry=reg,
        ).labels(*values)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            _LABELS,
            registry=reg,
        ).labels(*values)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            _LABELS,
            registry=reg,
        ).labels(*values)
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", _LABELS, registry=reg
        ).labels(*values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            _LABELS,
            registry=reg,
        ).labels(*values)
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*_LABELS, "finished_reason"),
            registry=reg,
        )
        self._success_values = values
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _LABELS,
            buckets=TTFT_BUCKETS_S,
            registry=reg,
        ).labels(*values)
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _LABELS,
            buckets=ITL_BUCKETS_S,
            registry=reg,
        ).labels(*values)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            _LABELS,
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=reg,
        ).labels(*values)
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            _LABELS,
            buckets=REQUEST_LATENCY_BUCKETS_S,
            registry=reg,
        ).labels(*values)

        # vLLM registers the spec-decode family only when a speculative config exists.
        self.speculative = config.speculative
        if self.speculative:
            self.num_drafts = Counter(
                "vllm:spec_decode_num_drafts",
                "Number of spec decoding drafts.",
                _LABELS,
                registry=reg,
            ).labels(*values)
            self.num_draft_tokens = Counter(
                "vllm:spec_decode_num_draft_tokens",
                "Number of draft tokens.",
                _LABELS,
                registry=reg,
            ).labels(*values)
            self.num_accepted_tokens = Counter(
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                _LABELS,
                registry=reg,
            ).labels(*values)
            per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                (*_LABELS, "position"),
                registry=reg,
            )
            self.per_pos = tuple(
                per_pos.labels(*values, str(i)) for i in range(config.num_speculative_tokens)
            )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def queued(self) -> None:
        self.waiting.inc()

    def started(self, queue_s: float, prompt_tokens: int) -> None:
        self.waiting.dec()
        self.running.inc()
        self.queue.observe(queue_s)
        self.prompt_tokens.inc(prompt_tokens)
        self._use_kv(prompt_tokens)

    def step(self, step: Step, *, first: bool, elapsed_s: float) -> None:
        """One engine step emitted ``step.emitted`` tokens, ``elapsed_s`` after the previous
        one (TTFT after arrival for the first)."""
        self.generation_tokens.inc(step.emitted)
        self._use_kv(step.emitted)
        if first:
            self.ttft.observe(elapsed_s)
        else:
            self.itl.observe(elapsed_s)
        if self.speculative and step.drafted:
            self.num_drafts.inc()
            self.num_draft_tokens.inc(step.drafted)
            self.num_accepted_tokens.inc(step.accepted)
            for pos in range(step.accepted):
                self.per_pos[pos].inc()

    def finished(self, *, kv_tokens: int, finish_reason: str | None, e2e_s: float | None) -> None:
        """The request left the engine; ``finish_reason`` None means aborted (no success count)."""
        self.running.dec()
        self._use_kv(-kv_tokens)
        if finish_reason is not None and e2e_s is not None:
            self._success.labels(*self._success_values, finish_reason).inc()
            self.e2e.observe(e2e_s)

    def _use_kv(self, tokens: int) -> None:
        self._tokens_in_use += tokens
        used = self._tokens_in_use * self._kv_scale
        self.kv_usage.set(min(1.0, max(0.0, used / self._capacity)))
