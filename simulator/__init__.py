"""A simulated vLLM OpenAI server with known ground truth, for tests, benchmarks and the demo.

It answers chat and completions requests (streaming and not) with deterministic tokens derived from
the prompt, paced like an engine (prefill, then one chunk per engine step), in ``plain`` or
``speculative`` mode (each step emits accepted + 1 tokens, acceptance drawn from a seeded model),
exposes vLLM-shaped per-request metrics and Prometheus ``/metrics``, injects faults on request, and
remembers what it sent and when (``SimState``, ``GET /sim/requests``).

Layout: pure cores ``config`` (settings, faults), ``textgen`` (tokens, JSON), ``acceptance``
(step model, expected rates), ``request`` (parsing, validation), ``plan`` (the answer),
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
