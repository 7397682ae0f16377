"""A simulated vLLM OpenAI server with known ground truth, for tests, benchmarks and the demo.

It answers chat and completions requests (streaming and not) with deterministic tokens derived from
the prompt, paced like an engine (prefill, then one chunk per engine step), in ``plain`` or
``speculative`` mode (each step emits accepted + 1 tokens, acceptance drawn from a seeded model),
exposes vLLM-shaped per-request metrics and Prometheus ``/metrics``, injects faults on request, and
remembers what it sent and when (``SimState``, ``GET /sim/requests``).

Token ids are vLLM-like: ``POST /tokenize`` answers the ids every request is served with, a chat
or completions request with ``"return_token_ids": true`` gets them back in the answer (prompt ids,
and per chunk exactly the ids that chunk's text carries; shapes in :mod:`simulator.render`), and
``drafting="replay"`` drafts with vLLM's own n-gram proposer (or a simulated drafter) over them,
accepting what equals the output — ground truth for counterfactual replays.

``sampling=True`` draws plain-text answers from a known per-prompt token distribution
(:mod:`simulator.sampling`: the exact probabilities, lossless speculative sampling, and lossy
modes that reproduce real speculative-decoding bugs), so quality-equivalence tests between two
servers can be held to a known truth.

Layout: pure cores ``config`` (settings, faults), ``textgen`` (tokens, JSON), ``tokens`` (ids,
chat template), ``ngram`` (vLLM's proposer, ported), ``drafter`` (the simulated draft model),
``acceptance`` (step model drawn or replayed, expected rates), ``sampling`` (sampled
answers and their ground truth), ``request`` (parsing, validation), ``plan`` (the answer),
``render`` (vLLM-shaped bodies); I/O shell ``app`` (aiohttp, ``run_simulator``) with ``metrics``
and ``state``; ``cli`` (``specshadow simulate``).
"""

from simulator.acceptance import ExpectedRates, expected_rates
from simulator.app import SimServer, create_sim_app, run_simulator
from simulator.config import (
    FAULT_HEADER,
    Faults,
    SimConfig,
    parse_faults,
)
from simulator.state import RequestRecord, SentEvent, SimState

__all__ = [
    "FAULT_HEADER",
    "ExpectedRates",
    "Faults",
    "RequestRecord",
    "SentEvent",
    "SimConfig",
    "SimServer",
    "SimState",
    "create_sim_app",
    "expected_rates",
    "parse_faults",
    "run_simulator",
]
