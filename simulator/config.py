"""Simulator settings: one frozen :class:`SimConfig` per simulated server, plus fault knobs.

Everything that decides what the simulator says and when lives here, so a test that holds the
config also holds the ground truth's parameters (see :func:`simulator.acceptance.expected_rates`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

from simulator.engine_info import check_engine
from simulator.lookahead import parse as parse_lookahead

Mode = Literal["plain", "speculative"]
Batching = Literal["independent", "continuous"]
Drafting = Literal["probabilistic", "replay"]
SamplingDefect = Literal[
    "none", "greedy_collapse", "draft_temperature_ignored", "different_model", "logit_noise"
]
SAMPLING_DEFECTS: tuple[str, ...] = (
    "none",
    "greedy_collapse",
    "draft_temperature_ignored",
    "different_model",
    "logit_noise",
)
Acceptance = float | tuple[float, ...]

# Header that injects faults into one request (same syntax as ``SimConfig.faults``).
FAULT_HEADER = "x-sim-fault"


@dataclass(frozen=True, slots=True)
class Faults:
    """Misbehaviour to inject. Parsed from ``"status=503,hang_after=3"`` by :func:`parse_faults`.

    - ``status``: answer with this HTTP status and an OpenAI-shaped error body instead.
    - ``hang_before_headers``: never send headers (until the client leaves or the server stops).
    - ``hang_after``: after this many SSE events (``data:`` lines, role chunk included), stop
      sending but keep the connection open. Non-streaming: headers are sent, the body never is.
    - ``drop_after``: after this many SSE events, abort the TCP connection (transport.abort()).
      Non-streaming: abort after headers.
    - ``slow_headers_s``: extra delay before the response headers.
    - ``malformed``: emit one broken-JSON ``data:`` event halfway through the output (streaming);
      a truncated JSON body (non-streaming).
    """

    status: int | None = None
    hang_before_headers: bool = False
    hang_after: int | None = None
    drop_after: int | None = None
    slow_headers_s: float = 0.0
    malformed: bool = False

    def merged(self, other: Faults) -> Faults:
        """``self`` with every knob that ``other`` sets taking precedence."""
        return Faults(
            status=other.status if other.status is not None else self.status,
            hang_before_headers=self.hang_before_headers or other.hang_before_headers,
            hang_after=other.hang_after if other.hang_after is not None else self.hang_after,
            drop_after=other.drop_after if other.drop_after is not None else self.drop_after,
            slow_headers_s=other.slow_headers_s or self.slow_headers_s,
            malformed=self.malformed or other.malformed,
        )

    @property
    def any(self) -> bool:
        return self != Faults()


class FaultSyntaxError(ValueError):
    """An ``x-sim-fault`` header or ``--fault`` value that cannot be parsed."""


def parse_faults(text: str) -> Faults:
    """Parse ``"status=503, hang_after=3, malformed"`` (comma- or semicolon-separated)."""
    faults = Faults()
    for raw in text.replace(";", ",").split(","):
        item = raw.strip()
        if not item:
            continue
        key, _, value = item.partition("=")
        key = key.strip().replace("-", "_")
        value = value.strip()
        try:
            if key == "status":
                faults = replace(faults, status=int(value))
            elif key == "hang_before_headers" and not value:
                faults = replace(faults, hang_before_headers=True)
            elif key == "hang_after":
                faults = replace(faults, hang_after=int(value))
            elif key == "drop_after":
                faults = replace(faults, drop_after=int(value))
            elif key == "slow_headers":
                faults = replace(faults, slow_headers_s=float(value))
            elif key == "malformed" and not value:
                faults = replace(faults, malformed=True)
            else:
                raise FaultSyntaxError(f"unknown fault {item!r}")
        except ValueError as exc:
            if isinstance(exc, FaultSyntaxError):
                raise
            raise FaultSyntaxError(f"bad value in fault {item!r}") from exc
    if faults.status is not None and not 400 <= faults.status <= 599:
        raise FaultSyntaxError(f"fault status must be 4xx/5xx, got {faults.status}")
    return faults


def _check_probs(name: str, value: Acceptance, k: int) -> None:
    probs = (value,) if isinstance(value, float | int) else value
    if not isinstance(value, float | int) and len(probs) != k:
        raise ValueError(f"{name}: expected {k} per-position values, got {len(probs)}")
    for p in probs:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name}: expected 0 <= p <= 1, got {p}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated vLLM server.

    Text: ``max_tokens`` (default ``default_max_tokens``) caps a natural length drawn from the
    prompt hash in ``[min_output_tokens, max_output_tokens]``; structured outputs and tool calls
    take the length of their JSON instead.

    Speculation (``mode="speculative"``): after the prefill step (1 token), each decode step drafts
    with probability ``coverage`` (per category: ``category_coverage``), ``num_speculative_tokens``
    drafts (never past the end of the output), each accepted with the conditional probability in
    ``acceptance`` (a float for every position, or one value per position; per category:
    ``category_acceptance``), the chain stopping at the first rejection; the step emits
    accepted + 1 tokens. ``divergence_at``: speculative output differs from plain from that output
    token index on (to test diffing); ``None`` keeps the lossless property.

    Timing (``batching="independent"``, the default): the prefill takes ``prefill_base_s +
    prefill_per_token_s × prompt_tokens`` and emits the first token; each decode step takes
    ``step_s`` (+ ``spec_step_overhead_s`` in speculative mode, the proposer's cost), whatever
    else runs. At most ``max_num_seqs`` requests run at once; the rest queue.

    ``batching="continuous"``: one engine steps every running request together and a step's
    time grows with the batch — ``step_s`` (memory-bound floor) + ``step_slot_s`` per verification
    slot (compute-bound slope: 1 per plain request, drafted + 1 per speculative one) +
    ``draft_s`` per drafting request (a draft model's cost) + the prefill of requests admitted
    in that step (:mod:`simulator.engine`). ``kv_overhead_fraction``: extra KV cache a speculative
    request holds per token (a drafter's own cache), which lowers the concurrency that fits.

    Replayed drafts (``drafting="replay"``, speculative mode): instead of drawing steps, the
    server runs a real proposer over the request's token ids (:mod:`simulator.tokens`) and
    accepts a draft's longest prefix that equals the actual output (:mod:`simulator.acceptance`
    documents the step contract). ``proposer="ngram"``: vLLM's n-gram proposer
    (:mod:`simulator.ngram`) with ``prompt_lookup_min`` / ``prompt_lookup_max``;
    ``proposer="draft_model"``: a simulated greedy drafter whose prediction of each token is the
    actual token with probability ``drafter_match`` (per category: ``category_drafter_match``).
    ``acceptance`` and ``coverage`` do not apply; ``max_model_len`` caps the drafts as in vLLM
    (the simulator still serves a longer prompt, which then never drafts). The literal n-gram port
    costs CPU at planning time: about 0.2 s for 256 output tokens over a 4,600-token prompt.
    ``lookahead`` (replayed drafts): a dynamic draft-length rule instead of a fixed
    ``num_speculative_tokens`` (:mod:`simulator.lookahead`: Hugging Face's heuristic, EMA tiers,
    the elastic EWMA, a drafter's confidence exit).

    Copying (``copy``, per category ``category_copy``): the probability that each segment of a
    text answer copies a span (4–24 pieces) of the prompt's content or of the answer so far
    instead of fresh words — what makes n-gram drafts land. Seeded by the prompt, so servers with
    the same copy settings answer the same text; ``0.0`` keeps the plain word answers.

    ``GET /server_info?config_format=json`` answers like vLLM in dev mode (``server_info``):
    ``speculative_config`` is null in plain mode, else ``proposer`` as its ``method``,
    ``num_speculative_tokens``, ``prompt_lookup_min`` / ``prompt_lookup_max`` (n-gram) and
    ``rejection_sample_method`` (``synthetic`` declares a lossy
    verification — pair it with ``divergence_at`` for outputs that show it). ``engine``: what else
    the server says it runs (version, dtype, quantization, KV-cache dtype, prefix caching, …:
    :mod:`simulator.engine_info`), changeable mid-run through ``SimServer.engine``.

    Sampling (``sampling=True``; :mod:`simulator.sampling` is the ground truth): plain-text
    answers (not structured outputs, not tool calls, which stay deterministic) are drawn token by
    token from a known per-prompt Markov model named by ``model_salt`` (another salt is another
    model), EOS between ``min_output_tokens`` and ``max_output_tokens``. The request's
    ``temperature`` (absent: 1.0, as in vLLM and the OpenAI API) and ``top_p`` (absent: 1.0)
    apply; ``temperature: 0`` is greedy, the model's argmax, so greedy answers are the same on
    every server with the same model and in both modes. A request ``seed`` makes the draw
    reproducible, else every request draws fresh entropy (two servers answering the same prompt
    draw independently). ``copy`` does not apply to sampled text. Reported logprobs are the
    model's raw ones (temperature 1, no truncation: vLLM's ``raw_logprobs``). In speculative mode
    the steps of a sampled answer come from real speculative sampling (lossless) with a drafter
    whose logits are the model's plus a fixed perturbation of std ``draft_logit_sigma`` (0: the
    drafter is the model, every draft accepted), not from ``acceptance``; ``coverage`` still
    decides which steps draft. With ``drafting="replay"`` the answer is drawn plainly and the
    steps replayed over it (accepting a one-hot draft iff it equals the drawn token *is*
    speculative sampling for one-hot drafts).

    ``sampling_defect`` (needs ``sampling``) reproduces real speculative-decoding bugs:
    ``greedy_collapse`` commits the argmax whatever the temperature (an EAGLE verify path that
    commits argmax); ``draft_temperature_ignored`` (speculative, drawn drafts) draws drafts at
    temperature 1 while acceptance uses the request's temperature — biased; ``different_model``
    samples from ``√(1 − w²) × target + w × another model``, ``w = defect_strength`` in (0, 1];
    ``logit_noise`` adds fresh Gaussian noise of std ``logit_noise_sigma`` (> 0) to the target's
    logits at every position before sampling (a numerics bug), greedy requests included.

    Requests vLLM will not speculate on (``vllm/v1/spec_decode/utils.py``,
    ``is_spec_decode_unsupported``): in speculative mode a request with ``frequency_penalty`` ≠ 0,
    ``presence_penalty`` ≠ 0, ``repetition_penalty`` ≠ 1 or ``min_p`` > 0 is served with plain
    decoding — one token per step, no drafts in its ``metrics`` nor in ``vllm:spec_decode_*`` —
    with or without ``sampling``; the penalties themselves do not change the answer. (Some vLLM
    versions also exclude requests with ``logprobs``; the simulator does not.)
    """

    model: str = "sim-model"
    aliases: tuple[str, ...] = ()
    mode: Mode = "plain"
    num_speculative_tokens: int = 4
    acceptance: Acceptance = 0.7
    category_acceptance: Mapping[str, Acceptance] = field(default_factory=dict)
    coverage: float = 1.0
    category_coverage: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0
    divergence_at: int | None = None
    min_output_tokens: int = 16
    max_output_tokens: int = 256
    default_max_tokens: int = 64
    prefill_base_s: float = 0.02
    prefill_per_token_s: float = 0.0
    step_s: float = 0.005
    spec_step_overhead_s: float = 0.0
    max_num_seqs: int = 256
    always_metrics: bool = False
    stamp_events: bool = True
    faults: Faults = field(default_factory=Faults)
    max_records: int = 10_000
    hang_max_s: float = 300.0
    kv_cache_capacity_tokens: int = 65_536
    batching: Batching = "independent"
    step_slot_s: float = 0.0
    draft_s: float = 0.0
    kv_overhead_fraction: float = 0.0
    proposer: str = "ngram"
    drafting: Drafting = "probabilistic"
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    drafter_match: float = 0.7
    # A dynamic draft-length rule for replayed drafts (simulator.lookahead), e.g.
    # "heuristic:start=4,floor=1,cap=8"; None: num_speculative_tokens every step.
    lookahead: str | None = None
    category_drafter_match: Mapping[str, float] = field(default_factory=dict)
    max_model_len: int = 4096
    copy: float = 0.0
    category_copy: Mapping[str, float] = field(default_factory=dict)
    rejection_sample_method: str = "standard"
    # More of vLLM's speculative_config as /server_info reports it (``use_heterogeneous_vocab``,
    # ``enable_adaptive_verification``, ``draft_sample_method``, …); decoding is unchanged.
    speculative_settings: Mapping[str, object] = field(default_factory=dict)
    server_info: bool = True
    engine: Mapping[str, object] = field(default_factory=dict)
    sampling: bool = False
    model_salt: str = "target"
    sampling_defect: SamplingDefect = "none"
    logit_noise_sigma: float = 0.0
    defect_strength: float = 1.0
    draft_logit_sigma: float = 0.7

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if k < 1:
            raise ValueError(f"num_speculative_tokens: expected >= 1, got {k}")
        if self.mode not in ("plain", "speculative"):
            raise ValueError(f"mode: expected 'plain' or 'speculative', got {self.mode!r}")
        _check_probs("acceptance", self.acceptance, k)
        for cat, value in self.category_acceptance.items():
            _check_probs(f"category_acceptance[{cat!r}]", value, k)
        for cat, cov in {"": self.coverage, **self.category_coverage}.items():
            if not 0.0 <= cov <= 1.0:
                raise ValueError(f"coverage{f'[{cat!r}]' if cat else ''}: expected 0..1, got {cov}")
        if not 1 <= self.min_output_tokens <= self.max_output_tokens:
            raise ValueError("expected 1 <= min_output_tokens <= max_output_tokens")
        if self.default_max_tokens < 1 or self.max_num_seqs < 1 or self.max_records < 1:
            raise ValueError("default_max_tokens, max_num_seqs and max_records must be >= 1")
        if self.batching not in ("independent", "continuous"):
            raise ValueError(
                f"batching: expected 'independent' or 'continuous', got {self.batching!r}"
            )
        if min(self.step_s, self.step_slot_s, self.draft_s, self.kv_overhead_fraction) < 0:
            raise ValueError("step_s, step_slot_s, draft_s and kv_overhead_fraction must be >= 0")
        if self.divergence_at is not None and self.divergence_at < 0:
            raise ValueError("divergence_at: expected >= 0")
        if self.drafting not in ("probabilistic", "replay"):
            raise ValueError(
                f"drafting: expected 'probabilistic' or 'replay', got {self.drafting!r}"
            )
        if self.drafting == "replay" and self.proposer not in ("ngram", "draft_model"):
            raise ValueError(
                f"drafting='replay' needs proposer 'ngram' or 'draft_model', got {self.proposer!r}"
            )
        if self.lookahead is not None:
            parse_lookahead(self.lookahead)  # a clear error for an unknown rule or constant
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("expected 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.max_model_len < 1:
            raise ValueError("max_model_len: expected >= 1")
        for name, table, default in (
            ("copy", self.category_copy, self.copy),
            ("drafter_match", self.category_drafter_match, self.drafter_match),
        ):
            for cat, p in {"": default, **table}.items():
                if not 0.0 <= p <= 1.0:
                    raise ValueError(f"{name}{f'[{cat!r}]' if cat else ''}: expected 0..1, got {p}")
        self._check_sampling()
        object.__setattr__(self, "engine", MappingProxyType(check_engine(self.engine)))
        # Read-only copies: the config is shared by every request of a server.
        object.__setattr__(
            self, "category_acceptance", MappingProxyType(dict(self.category_acceptance))
        )
        object.__setattr__(
            self, "category_coverage", MappingProxyType(dict(self.category_coverage))
        )
        object.__setattr__(self, "category_copy", MappingProxyType(dict(self.category_copy)))
        object.__setattr__(
            self, "category_drafter_match", MappingProxyType(dict(self.category_drafter_match))
        )
        object.__setattr__(self, "aliases", tuple(self.aliases))

    def _check_sampling(self) -> None:
        defect = self.sampling_defect
        if defect not in SAMPLING_DEFECTS:
            raise ValueError(f"sampling_defect: expected one of {SAMPLING_DEFECTS}, got {defect!r}")
        if defect != "none" and not self.sampling:
            raise ValueError(f"sampling_defect={defect!r} needs sampling=True")
        if defect == "draft_temperature_ignored" and (
            not self.speculative or self.drafting != "probabilistic"
        ):
            raise ValueError(
                "sampling_defect='draft_temperature_ignored' needs mode='speculative' with "
                "drafting='probabilistic' (it is a drafter's bug)"
            )
        if not self.model_salt:
            raise ValueError("model_salt: expected a non-empty string")
        if not (self.logit_noise_sigma >= 0.0 and math.isfinite(self.logit_noise_sigma)):
            raise ValueError(f"logit_noise_sigma: expected >= 0, got {self.logit_noise_sigma}")
        if defect == "logit_noise" and self.logit_noise_sigma == 0.0:
            raise ValueError("sampling_defect='logit_noise' needs logit_noise_sigma > 0")
        if not 0.0 < self.defect_strength <= 1.0:
            raise ValueError(f"defect_strength: expected 0 < w <= 1, got {self.defect_strength}")
        if not (self.draft_logit_sigma >= 0.0 and math.isfinite(self.draft_logit_sigma)):
            raise ValueError(f"draft_logit_sigma: expected >= 0, got {self.draft_logit_sigma}")

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model, *(a for a in self.aliases if a != self.model))

    @property
    def speculative(self) -> bool:
        return self.mode == "speculative"

    def acceptance_for(self, category: str) -> tuple[float, ...]:
        """Per-position conditional acceptance probabilities for ``category``."""
        value = self.category_acceptance.get(category, self.acceptance)
        if isinstance(value, float | int):
            return (float(value),) * self.num_speculative_tokens
        return tuple(float(p) for p in value)

    def coverage_for(self, category: str) -> float:
        return self.category_coverage.get(category, self.coverage)

    def copy_for(self, category: str) -> float:
        return self.category_copy.get(category, self.copy)

    def drafter_match_for(self, category: str) -> float:
        return self.category_drafter_match.get(category, self.drafter_match)

    @property
    def replay(self) -> bool:
        """Speculative with replayed drafts (``drafting="replay"``)."""
        return self.speculative and self.drafting == "replay"
