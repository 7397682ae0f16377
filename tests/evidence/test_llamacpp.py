"""llama.cpp's server read as a backend kind: per-request ``timings``, ``/metrics`` under its
``llamacpp:`` names, ``/props`` and ``/slots``, detection. The shapes are those of the real server
(xllamacpp 2026.10.11549, build 11549: answers copied from it); the real server itself is driven
by the ``llamacpp`` tier (tests/llamacpp)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from evidence.acceptance import leg_acceptance, summarize
from evidence.detect import classify
from evidence.engine_config import from_llamacpp, per_position_width, resolve_engine
from evidence.scrape import parse_sample, window_stats
from evidence.serverinfo import (
    InfoTarget,
    ServerInfoProbe,
    _learning,
    from_llamacpp as spec_from_llamacpp,
)
from tests.core.test_timings import DONE, chat_chunk, record, sse, usage

TIMINGS = {
    "cache_n": 0,
    "prompt_n": 36,
    "prompt_ms": 1.388,
    "predicted_n": 20,
    "predicted_ms": 7.278,
    "draft_n": 66,
    "draft_n_accepted": 9,
}


def _stream(final_extra: dict[str, Any]) -> Any:
    feeds = [(sse(chat_chunk({"content": "ab"})), 10 * (i + 1)) for i in range(4)]
    finish = chat_chunk({}, finish="length")
    tail = {**chat_chunk({}), "choices": [], "usage": usage(24, 4), **final_extra}
    return record([*feeds, (sse(finish), 90), (sse(tail), 95), (DONE, 100)])


def test_streamed_timings_on_the_last_chunk_are_the_per_request_counts():
    acc = leg_acceptance(_stream({"timings": TIMINGS}))
    assert acc.source == "llamacpp_timings"
    assert (acc.num_draft_tokens, acc.num_accepted_tokens) == (66, 9)
    assert acc.draft_acceptance_rate == pytest.approx(9 / 66)
    # llama.cpp counts drafting steps only in /metrics: no per-request length, never a made-up one
    assert acc.num_drafts is None and acc.mean_acceptance_length is None


def test_a_non_streamed_body_carries_the_same_counts():
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}],
        "object": "chat.completion",
        "usage": usage(36, 20),
        "timings": TIMINGS,
    }
    rec = record([(json.dumps(body).encode(), 40)], content_type="application/json")
    acc = leg_acceptance(rec)
    assert acc.source == "llamacpp_timings"
    assert (acc.num_draft_tokens, acc.num_accepted_tokens) == (66, 9)


def test_timings_without_drafts_say_nothing_and_bad_counts_are_refused():
    plain = {k: v for k, v in TIMINGS.items() if not k.startswith("draft")}
    assert leg_acceptance(_stream({"timings": plain})).source is None
    wrong = {**TIMINGS, "draft_n_accepted": 67}  # more accepted than drafted
    assert leg_acceptance(_stream({"timings": wrong})).source is None


def test_pooled_rates_take_llamacpp_legs_and_lengths_do_not():
    a = leg_acceptance(_stream({"timings": TIMINGS}))
    b = leg_acceptance(_stream({"timings": {**TIMINGS, "draft_n": 34, "draft_n_accepted": 31}}))
    out = summarize([("x", a), ("x", b)])["x"]
    assert (out.num_draft_tokens, out.num_accepted_tokens) == (100, 40)
    assert out.draft_acceptance_rate == pytest.approx(0.4)
    assert out.mean_acceptance_length is None and out.num_drafts == 0


METRICS = """# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total {tokens}
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total {accepted}
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total {drafts}
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="0"}} {p0}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="1"}} {p1}
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="2"}} 0
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="3"}} 0
"""


def test_the_backend_window_reads_llamacpp_counters_per_position_included():
    before = parse_sample(
        METRICS.format(tokens=66, accepted=1, drafts=18, p0=1, p1=0), t_ns=0, unix_ns=0
    )
    after = parse_sample(
        METRICS.format(tokens=166, accepted=41, drafts=43, p0=26, p1=15),
        t_ns=2_000_000_000,
        unix_ns=2_000_000_000,
    )
    assert (after.num_requests_running, after.num_requests_waiting) == (2, 1)
    assert after.kv_cache_usage_perc is None  # llama.cpp serves none
    w = window_stats([before, after])
    assert w is not None
    assert (w.drafts, w.draft_tokens, w.accepted) == (25, 100, 40)
    assert w.draft_acceptance_rate == pytest.approx(0.4)
    assert w.mean_acceptance_length == pytest.approx(1 + 40 / 25)
    assert w.per_position == pytest.approx((25 / 25, 15 / 25, 0.0, 0.0))
    assert per_position_width(METRICS.format(tokens=1, accepted=1, drafts=1, p0=1, p1=0)) == 4
    assert per_position_width("llamacpp:spec_decode_num_drafts_total 0\n") is None


PROPS: dict[str, Any] = {
    "default_generation_settings": {"params": {"speculative.types": "none"}, "n_ctx": 512},
    "total_slots": 2,
    "model_alias": "tiny-llama",
    "model_ftype": "all F32",
    "model_path": "/cache/models/tiny/target.gguf",
    "endpoint_metrics": True,
    "build_info": "b0-unknown",
}
SLOTS_IDLE = [{"id": 0, "n_ctx": 512, "speculative": True, "is_processing": False}] * 2
SLOTS_SERVED = [
    SLOTS_IDLE[0],
    {**SLOTS_IDLE[0], "id": 1, "params": {"speculative.types": "draft-simple", "seed": 1}},
]
SLOTS_PLAIN = [{"id": 0, "n_ctx": 512, "speculative": False, "is_processing": False}]


def test_props_give_the_engine_and_slots_the_speculation_once_known():
    base = from_llamacpp(PROPS, SLOTS_IDLE, None)
    assert base == {
        "engine": "llamacpp",
        "version": "b0-unknown",
        "model": "/cache/models/tiny/target.gguf",
        "quantization": "all F32",
        "max_num_seqs": 2,
        "max_model_len": 512,
    }  # speculating, but how is not known yet: no speculative block (unknown, not changed)
    served = from_llamacpp(PROPS, SLOTS_SERVED, 4)
    assert served is not None
    assert served["speculative"] == {"method": "draft-simple", "num_speculative_tokens": 4}
    plain = from_llamacpp(PROPS, SLOTS_PLAIN, None)
    assert plain is not None and plain["speculative"] is None
    # the base fingerprint (what the confound gate compares) is the same all along
    configs = [resolve_engine({"props": ("llamacpp_props", c)}) for c in (base, served, plain)]
    assert len({c.base_fingerprint for c in configs if c is not None}) == 1
    assert from_llamacpp({"model_path": "x"}) is None  # not llama.cpp's /props


def test_slots_report_the_proposer_and_its_depth_but_no_verification():
    spec = spec_from_llamacpp(SLOTS_SERVED, 4)
    assert spec is not None
    assert (spec.speculative, spec.method, spec.num_speculative_tokens) == (
        True,
        "draft-simple",
        4,
    )
    assert spec.verification is None  # synthetic acceptance is invisible: the policy declares it
    plain = spec_from_llamacpp(SLOTS_PLAIN, None)
    assert plain is not None and not plain.speculative
    assert spec_from_llamacpp({"not": "slots"}, None) is None


MODELS = {
    "object": "list",
    "data": [{"id": "tiny-llama", "object": "model", "owned_by": "llamacpp"}],
}


def test_detection_finds_llamacpp_from_props_or_its_models_owner():
    assert classify({"/props": PROPS}).kind == "llamacpp"
    assert classify({"/v1/models": MODELS}).kind == "llamacpp"
    # llama.cpp also answers /v1/models without /props (endpoint off): still found
    assert classify({"/v1/models": MODELS, "/props": {"x": 1}}).kind == "llamacpp"
    assert classify({"/props": {"model_path": "m"}}).kind == "openai"


async def test_the_probe_reads_props_slots_and_metrics_and_asks_again_until_it_knows(
    aiohttp_server: Any,
) -> None:
    state: dict[str, Any] = {"slots": SLOTS_IDLE, "metrics": "llamacpp:requests_processing 0\n"}

    async def props(_: web.Request) -> web.Response:
        return web.json_response(PROPS)

    async def slots(_: web.Request) -> web.Response:
        return web.json_response(state["slots"])

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=state["metrics"])

    app = web.Application()
    app.router.add_get("/props", props)
    app.router.add_get("/slots", slots)
    app.router.add_get("/metrics", metrics)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    probe = ServerInfoProbe({"llama": InfoTarget(url, "llamacpp")})
    async with aiohttp.ClientSession() as session:
        await probe.poll_once(session)
        engine = probe.engine("llama")
        assert engine is not None and engine.values["engine"] == "llamacpp"
        assert "speculative" not in engine.values
        first = engine.base_fingerprint
        reported = probe.reported("llama")
        assert reported is not None and reported.speculative and reported.method is None
        assert _learning(probe._targets["llama"])  # asked again in 2 s, not in a minute
        state["slots"] = SLOTS_SERVED
        state["metrics"] = METRICS.format(tokens=10, accepted=5, drafts=4, p0=3, p1=2)
        await probe.poll_once(session)
    engine = probe.engine("llama")
    assert engine is not None and engine.base_fingerprint == first
    assert engine.values["speculative"] == {"method": "draft-simple", "num_speculative_tokens": 4}
    assert engine.sources["speculative"] == "llamacpp_props"
    reported = probe.reported("llama")
    assert reported is not None and (reported.method, reported.num_speculative_tokens) == (
        "draft-simple",
        4,
    )
    assert not _learning(probe._targets["llama"])


def test_a_policy_states_kind_llamacpp_and_its_metrics_are_scraped_by_default() -> None:
    from policies.compile import parse_policy

    policy = parse_policy(
        {
            "version": 1,
            "backends": {
                "prim": {"url": "http://127.0.0.1:1", "kind": "llamacpp"},
                "cand": {"url": "http://127.0.0.1:2", "kind": "llamacpp"},
            },
            "primary": "prim",
            "default": {"ratio": 1.0, "legs": [{"backend": "cand", "role": "candidate"}]},
        },
        source="test",
    )
    cand = policy.backends["cand"]
    assert cand.kind == "llamacpp"
    assert cand.metrics_url == "http://127.0.0.1:2/metrics"


def test_synthetic_acceptance_declared_lossy_is_recorded_lossy_never_lossless() -> None:
    """llama.cpp shows no verification mode (synthetic acceptance only in its log): the record
    takes the policy's word, and without one says nothing — never ``lossless`` on its own."""
    from core.exchange import SpeculativeSpec
    from evidence.serverinfo import resolve

    reported = spec_from_llamacpp(SLOTS_SERVED, 4)
    declared = SpeculativeSpec(verification="lossy")
    out = resolve(declared, reported)
    assert out is not None
    assert (out["verification"], out["verification_source"]) == ("lossy", "policy")
    assert (out["method"], out["num_speculative_tokens"]) == ("draft-simple", 4)
    alone = resolve(None, reported)
    assert alone is not None and alone["verification"] is None
