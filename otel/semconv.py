"""Names: every span, event, attribute and metric name specshadow emits, in one place.

Pure constants, no imports from the SDK. Each name is marked **spec** (OpenTelemetry semantic
conventions; the GenAI ones are *development* status and still moving, which is why they are
pinned here rather than imported from ``opentelemetry.semconv._incubating``) or **local** (the
project's own ``specshadow.*`` namespace, used where no convention exists — OpenLLMetry's habit of
commenting which is which).

Metric attributes are low-cardinality only: role, model, backend, route, outcome, category,
error.type. Request ids, exchange ids and text never go on a metric (span attributes only).
"""

from __future__ import annotations

from typing import Final, Literal

# --- Instrumentation scope -------------------------------------------------------------------
SCOPE_NAME: Final = "specshadow"  # local: tracer/meter name
DEFAULT_SERVICE_NAME: Final = "specshadow"  # local: service.name when OTEL_SERVICE_NAME is unset

# --- Span names --------------------------------------------------------------------------------
# spec (HTTP server): "{http.request.method} {http.route}", built in record.request_span_name.
# spec (GenAI client): "{gen_ai.operation.name} {gen_ai.request.model}", built in leg_span_name.
EVENT_EVALUATION_RESULT: Final = "gen_ai.evaluation.result"  # spec: one event per evaluation
EVENT_CHUNK: Final = "specshadow.chunk"  # local: one bounded event per output-bearing SSE event

# --- GenAI attributes (spec) ----------------------------------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"  # spec: chat | text_completion
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"  # spec
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"  # spec: model sent upstream
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"  # spec: model the upstream reported
GEN_AI_REQUEST_STREAM: Final = "gen_ai.request.stream"  # spec
GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: Final = "gen_ai.response.time_to_first_chunk"  # spec (s)
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"  # spec
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"  # spec
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"  # spec: string[]
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"  # spec
GEN_AI_TOKEN_TYPE: Final = "gen_ai.token.type"  # spec: metric attribute, input | output
GEN_AI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"  # spec (opt-in content capture)
GEN_AI_INPUT_MESSAGES: Final = "gen_ai.input.messages"  # spec (opt-in content capture)
GEN_AI_EVALUATION_NAME: Final = "gen_ai.evaluation.name"  # spec (event attribute)
GEN_AI_EVALUATION_SCORE_VALUE: Final = "gen_ai.evaluation.score.value"  # spec
GEN_AI_EVALUATION_SCORE_LABEL: Final = "gen_ai.evaluation.score.label"  # spec
GEN_AI_EVALUATION_EXPLANATION: Final = "gen_ai.evaluation.explanation"  # spec

TOKEN_TYPE_INPUT: Final = "input"  # spec value
TOKEN_TYPE_OUTPUT: Final = "output"  # spec value
PROVIDER_OPENAI: Final = "openai"  # spec value: the API specshadow speaks to every upstream

# --- General / HTTP attributes (spec, stable) -----------------------------------------------------
SERVER_ADDRESS: Final = "server.address"
SERVER_PORT: Final = "server.port"
ERROR_TYPE: Final = "error.type"
HTTP_ROUTE: Final = "http.route"
HTTP_REQUEST_METHOD: Final = "http.request.method"
HTTP_RESPONSE_STATUS_CODE: Final = "http.response.status_code"
SERVICE_NAME: Final = "service.name"  # spec (resource)
SERVICE_VERSION: Final = "service.version"  # spec (resource)

# --- Project attributes (local) -------------------------------------------------------------------
LEG_ROLE: Final = "specshadow.leg.role"  # primary | candidate | baseline
BACKEND: Final = "specshadow.backend"  # backend name from the policy
REQUEST_ID: Final = "specshadow.request_id"  # spans only
EXCHANGE_ID: Final = "specshadow.exchange_id"  # spans only
# The compare span: each leg's engine configuration fingerprint, by role (``….primary``,
# ``….candidate``, ``….baseline``), whole and without the speculative block (docs/confounds.md).
ENGINE_FINGERPRINT: Final = "specshadow.engine.fingerprint"  # spans only
ENGINE_BASE_FINGERPRINT: Final = "specshadow.engine.base_fingerprint"  # spans only
CATEGORY: Final = "specshadow.category"  # prompt category from the trace/policy
TIMING_TTFT_S: Final = "specshadow.timing.ttft_s"
TIMING_TPOT_S: Final = "specshadow.timing.tpot_s"
TIMING_E2E_S: Final = "specshadow.timing.e2e_s"
TIMING_CHUNK_GAP_P50_S: Final = "specshadow.timing.chunk_gap.p50_s"
TIMING_CHUNK_GAP_P99_S: Final = "specshadow.timing.chunk_gap.p99_s"
TIMING_TOKENS_PER_EVENT: Final = "specshadow.timing.tokens_per_event"
TIMING_OUTPUT_EVENTS: Final = "specshadow.timing.output_events"
TIMING_OVERHEAD_P50_S: Final = "specshadow.timing.overhead.p50_s"
TIMING_OVERHEAD_P99_S: Final = "specshadow.timing.overhead.p99_s"
TOKENS_SOURCE: Final = "specshadow.tokens.source"  # usage | continuous_usage | logprobs | estimated
ACCEPTANCE_MEAN_LENGTH: Final = "specshadow.acceptance.mean_acceptance_length"
ACCEPTANCE_DRAFT_RATE: Final = "specshadow.acceptance.draft_acceptance_rate"
ACCEPTANCE_SOURCE: Final = "specshadow.acceptance.source"
POLICY_GENERATION: Final = "specshadow.policy.generation"
POLICY_RULE: Final = "specshadow.policy.rule"
SHADOW_SAMPLED: Final = "specshadow.shadow.sampled"
SHADOW_DROP_REASON: Final = "specshadow.shadow.drop_reason"
STREAM_OUTCOME: Final = "specshadow.stream.outcome"
CHUNK_INDEX: Final = "specshadow.chunk.index"  # chunk event attribute
CHUNK_TOKENS: Final = "specshadow.chunk.tokens"  # chunk event attribute
# Metric-only attributes (local)
OUTCOME: Final = "specshadow.outcome"  # shadow.requests / compare.results outcome
REASON: Final = "specshadow.reason"  # why a shadow was dropped / failed
ACTION: Final = "specshadow.rollout.action"  # drift breaches: what rollout.on_drift did
RESULT: Final = "specshadow.result"  # policy reload: ok | error
SIGNAL: Final = "specshadow.signal"  # telemetry.dropped: spans | metrics
RULE: Final = "specshadow.rule"  # rollout metrics: the policy rule
GUARD: Final = "specshadow.guard"  # rollout metrics and events: e2e_p99_ratio, …
SERVED_BY: Final = "specshadow.served_by"  # primary | candidate (also a span attribute)
STAGE_FROM: Final = "specshadow.rollout.from_stage"  # transition event
STAGE_TO: Final = "specshadow.rollout.to_stage"  # transition event
ACTOR: Final = "specshadow.rollout.by"  # guard | operator | schedule | policy
EVENT_ROLLOUT_TRANSITION: Final = "specshadow.rollout.transition"
OVERHEAD_STAT: Final = "specshadow.overhead.stat"  # p50 | p99 | max (see instruments)

ACCEPTANCE_SOURCE_VLLM: Final = "vllm_request_metrics"  # local value: vLLM per-request metrics

# --- GenAI conventions: which version, and the opt-in between two generations of names --------
# The GenAI conventions moved to their own repository (open-telemetry/semantic-conventions-genai)
# and renamed the client metrics. Following its guidance for existing instrumentations, the names
# emitted by default stay those specshadow always emitted (core semconv ≤ 1.36); the latest ones
# are emitted under OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental (and both under
# gen_ai_latest_experimental/dup — the /dup suffix the stable HTTP and database migrations define,
# a local extension for GenAI). Pinned: the version below, the schema URL its manifest names.
GENAI_SEMCONV_VERSION: Final = "1.42.0-dev"  # open-telemetry/semantic-conventions-genai
GENAI_SCHEMA_URL: Final = "https://opentelemetry.io/schemas/gen-ai-dev/1.42.0-dev"
LEGACY_SEMCONV_VERSION: Final = "1.36.0"  # core semantic-conventions: the default names below
OPT_IN_ENV: Final = "OTEL_SEMCONV_STABILITY_OPT_IN"
OPT_IN_LATEST: Final = "gen_ai_latest_experimental"
OPT_IN_BOTH: Final = "gen_ai_latest_experimental/dup"
GenAiNames = Literal["legacy", "latest", "both"]  # which generation(s) of names are emitted

# --- Metric names ---------------------------------------------------------------------------------
# spec ≤ 1.36 (default): one token-usage histogram split by gen_ai.token.type.
METRIC_OPERATION_DURATION: Final = "gen_ai.client.operation.duration"  # spec (legacy)
METRIC_TIME_TO_FIRST_CHUNK: Final = "gen_ai.client.operation.time_to_first_chunk"  # spec (legacy)
METRIC_TIME_PER_OUTPUT_CHUNK: Final = "gen_ai.client.operation.time_per_output_chunk"  # (legacy)
METRIC_TOKEN_USAGE: Final = "gen_ai.client.token.usage"  # spec (legacy)
# spec 1.42.0-dev (opt-in): inference metrics, usage as counters by modality plus per-operation
# token histograms.
METRIC_INFERENCE_DURATION: Final = "gen_ai.client.inference.duration"  # spec (latest)
METRIC_INFERENCE_TIME_TO_FIRST_CHUNK: Final = "gen_ai.client.inference.time_to_first_chunk"
METRIC_INFERENCE_TIME_PER_OUTPUT_CHUNK: Final = "gen_ai.client.inference.time_per_output_chunk"
METRIC_INFERENCE_USAGE_INPUT_TOKENS: Final = "gen_ai.client.inference.usage.input_tokens"
METRIC_INFERENCE_USAGE_OUTPUT_TOKENS: Final = "gen_ai.client.inference.usage.output_tokens"
METRIC_INFERENCE_OPERATION_INPUT_TOKENS: Final = "gen_ai.client.inference.operation.input_tokens"
METRIC_INFERENCE_OPERATION_OUTPUT_TOKENS: Final = "gen_ai.client.inference.operation.output_tokens"
GEN_AI_TOKEN_MODALITY: Final = "gen_ai.token.modality"  # spec (latest): required on usage counters
TOKEN_MODALITY_UNKNOWN: Final = "unknown"  # spec value: OpenAI usage has no per-modality split
# local: semconv has only the server-side gen_ai.server.time_per_output_token
METRIC_TIME_PER_OUTPUT_TOKEN: Final = "specshadow.time_per_output_token"
METRIC_GATEWAY_OVERHEAD: Final = "specshadow.gateway.overhead"  # local
METRIC_TOKENS_PER_EVENT: Final = "specshadow.tokens_per_event"  # local
METRIC_SHADOW_REQUESTS: Final = "specshadow.shadow.requests"  # local
METRIC_BREAKER_STATE: Final = "specshadow.shadow.breaker.state"  # local
METRIC_POLICY_GENERATION: Final = "specshadow.policy.generation"  # local
METRIC_POLICY_RELOAD: Final = "specshadow.policy.reload"  # local
METRIC_POLICY_LAST_RELOAD_SUCCESS: Final = "specshadow.policy.last_reload_success"  # local
METRIC_TELEMETRY_DROPPED: Final = "specshadow.telemetry.dropped"  # local
METRIC_ACCEPTANCE_LENGTH: Final = "specshadow.acceptance.length"  # local
METRIC_COMPARE_RESULTS: Final = "specshadow.compare.results"  # local
METRIC_ROLLOUT_STAGE: Final = "specshadow.rollout.stage"  # local: 0 shadow, 1 canary, 2 live
METRIC_ROLLOUT_SERVE_RATIO: Final = "specshadow.rollout.serve_ratio"  # local
METRIC_ROLLOUT_SERVED: Final = "specshadow.rollout.served"  # local: answers by backend
METRIC_ROLLOUT_GUARD_VALUE: Final = "specshadow.rollout.guard.value"  # local
METRIC_ROLLOUT_GUARD_THRESHOLD: Final = "specshadow.rollout.guard.threshold"  # local
METRIC_ROLLOUT_GUARD_BREACHED: Final = "specshadow.rollout.guard.breached"  # local: 0/1
METRIC_ROLLOUT_ROLLBACKS: Final = "specshadow.rollout.rollbacks"  # local
METRIC_ROLLOUT_TRANSITIONS: Final = "specshadow.rollout.transitions"  # local
METRIC_ROLLOUT_FAILOVERS: Final = "specshadow.rollout.failovers"  # local
METRIC_ROLLOUT_DRIFT: Final = "specshadow.rollout.drift_breaches"  # local: by guard and action
METRIC_ROLLOUT_STORE_UP: Final = (
    "specshadow.rollout.store.up"  # local: 1 the shared store answered the last sync
)

# Outcome values of specshadow.shadow.requests (local)
SHADOW_OUTCOMES: Final = ("sampled", "sent", "completed", "failed", "dropped")
# Breaker states as gauge values (local)
BREAKER_CLOSED: Final = 0
BREAKER_HALF_OPEN: Final = 1
BREAKER_OPEN: Final = 2

# --- comparison records as OTLP log records (local) -------------------------------------------
EVENT_RECORD: Final = "specshadow.record"  # local: the log record's event name
RECORD_SCHEMA: Final = "specshadow.record.schema"  # local: e.g. "specshadow.record/1"
