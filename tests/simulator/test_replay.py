"""Replayed speculative drafts over HTTP: /tokenize, the metrics a counterfactual replay must
reproduce (recomputed here from /tokenize ids alone), lossless text, copying answers, and the
simulated drafter read back by teacher forcing."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from simulator import SimConfig, SimServer
from tests.simulator.conftest import FAST, StartSim
from tests.simulator.helpers import brute_force, replayed_steps, split_events

K = 4
CODE = (
    "def add(a, b):\n    return a + b\n\n"
    "def sub(a, b):\n    return a - b\n\n"
    "class Calc:\n    def mul(self, a, b):\n        return a * b\n\n"
    "    def div(self, a, b):\n        if b == 0:\n            raise ValueError(b)\n"
    "        return a / b\n"
)
COPYING: dict[str, Any] = {
    **FAST,
    "copy": 0.6,
    "min_output_tokens": 60,
    "max_output_tokens": 160,
    "default_max_tokens": 500,
}
REPLAY = SimConfig(
    mode="speculative", drafting="replay", num_speculative_tokens=K, seed=3, **COPYING
)


def code_messages(i: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You refactor Python."},
        {"role": "user", "content": f"Task {i}: add type hints to this module.\n\n{CODE}"},
    ]


async def post_json(
    session: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with session.post(url, data=data, headers=hdrs) as resp:
        return resp.status, json.loads(await resp.read())


async def tokenize(session: aiohttp.ClientSession, server: SimServer, body: Any) -> list[int]:
    status, out = await post_json(session, f"{server.base_url}/tokenize", body)
    assert status == 200, out
    assert out["count"] == len(out["tokens"]) and out["token_strs"] is None
    assert out["max_model_len"] == server.config.max_model_len
    return list(out["tokens"])


async def stream(
    session: aiohttp.ClientSession, server: SimServer, route: str, body: dict[str, Any]
) -> tuple[list[str], dict[str, Any]]:
    """The output chunks' texts and the final usage chunk (with its metrics)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    body["include_metrics"] = True
    async with session.post(f"{server.base_url}/v1/{route}", json=body) as resp:
        assert resp.status == 200
        events = split_events(await resp.read())
    chunks: list[str] = []
    final: dict[str, Any] = {}
    for event in events:
        if event.data == "[DONE]":
            continue
        obj = event.json()
        if not obj["choices"]:
            final = obj
            continue
        choice = obj["choices"][0]
        text = choice.get("text") if route == "completions" else choice["delta"].get("content")
        if text:
            chunks.append(text)
    return chunks, final


def summary(steps: list[tuple[int, int]]) -> dict[str, Any]:
    """vLLM's per-request speculative metrics of ``steps``, computed here."""
    drafting = [(d, a) for d, a in steps if d]
    if not drafting:
        return {}
    accepted = sum(a for _, a in drafting)
    histogram = [0] * (K + 1)
    for _, a in drafting:
        histogram[a] += 1
    return {
        "num_spec_steps": len(drafting),
        "num_draft_tokens": sum(d for d, _ in drafting),
        "num_accepted_draft_tokens": accepted,
        "acceptance_histogram": histogram,
        "mean_acceptance_length": round(1 + accepted / len(drafting), 6),
    }


def ngram(context: list[int], k: int) -> list[int]:
    return brute_force(context, 2, 4, 4096, k)


async def test_tokenize_answers_the_ids_each_route_is_served_with(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim(REPLAY)
    messages = code_messages(0)
    chat_ids = await tokenize(session, sim, {"model": "sim-model", "messages": messages})
    no_prompt = await tokenize(session, sim, {"messages": messages, "add_generation_prompt": False})
    assert chat_ids[: len(no_prompt)] == no_prompt and len(chat_ids) == len(no_prompt) + 3
    text_ids = await tokenize(session, sim, {"prompt": CODE, "add_special_tokens": True})
    assert text_ids == await tokenize(session, sim, {"prompt": CODE, "add_special_tokens": False})
    for route, body, ids in (
        ("chat/completions", {"messages": messages, "max_tokens": 5}, chat_ids),
        ("completions", {"prompt": CODE, "max_tokens": 5}, text_ids),
        ("responses", {"input": messages, "max_output_tokens": 5}, chat_ids),
    ):
        status, out = await post_json(session, f"{sim.base_url}/v1/{route}", body)
        assert status == 200, out
        usage = out["usage"]
        assert usage.get("prompt_tokens", usage.get("input_tokens")) == len(ids), route
    status, spelled = await post_json(
        session, f"{sim.base_url}/tokenize", {"prompt": "Hi there", "return_token_strs": True}
    )
    assert status == 200 and spelled["token_strs"] == ["Hi", " there"]
    status, back = await post_json(session, f"{sim.base_url}/detokenize", {"tokens": chat_ids})
    assert status == 200 and "Task 0: add type hints" in back["prompt"]
    assert back["prompt"].startswith("<|im_start|>system\nYou refactor Python.<|im_end|>\n")


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"nothing": 1}, 400, "prompt"),
        ({"prompt": 5}, 400, "prompt"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": [{"content": "no role"}]}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"}, 400,
         "add_generation_prompt"),
        ({"model": "other", "prompt": "x"}, 404, "model"),
    ],
)  # fmt: skip
async def test_tokenize_refuses_a_malformed_body_with_an_openai_error(
    start_sim: StartSim, session: aiohttp.ClientSession, body: Any, status: int, param: str | None
) -> None:
    sim = await start_sim(SimConfig(prefill_base_s=0.0, step_s=0.0))
    got, out = await post_json(session, f"{sim.base_url}/tokenize", body)
    assert got == status
    assert set(out["error"]) == {"message", "type", "param", "code"}
    assert out["error"]["code"] == status and out["error"]["param"] == param
    got, out = await post_json(session, f"{sim.base_url}/detokenize", {"tokens": [2**31 - 2]})
    assert got == 400 and out["error"]["param"] == "tokens"


async def test_server_info_reports_the_ngram_lookup_window(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    sim = await start_sim(
        SimConfig(mode="speculative", drafting="replay", prompt_lookup_min=3, prompt_lookup_max=5)
    )
    async with session.get(f"{sim.base_url}/server_info?config_format=json") as resp:
        spec = (await resp.json())["vllm_config"]["speculative_config"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4
    assert (spec["prompt_lookup_min"], spec["prompt_lookup_max"]) == (3, 5)


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
async def test_replayed_ngram_metrics_equal_a_recomputation_from_tokenize_ids(
    start_sim: StartSim, session: aiohttp.ClientSession, route: str
) -> None:
    sim = await start_sim(REPLAY)
    totals = {"drafts": 0, "accepted": 0}
    for i in range(6):
        if route == "completions":
            body: dict[str, Any] = {"prompt": f"# Task {i}\n{CODE}"}
            prompt = await tokenize(session, sim, {"prompt": body["prompt"]})
        else:
            body = {"messages": code_messages(i)}
            prompt = await tokenize(session, sim, body)
        chunks, final = await stream(session, sim, route, body)
        text = "".join(chunks)
        out = await tokenize(session, sim, {"prompt": text, "add_special_tokens": False})
        assert final["usage"]["completion_tokens"] == len(out)
        steps = replayed_steps(prompt, out, K, ngram)
        # One chunk per engine step, each carrying exactly that step's tokens.
        assert len(chunks) == len(steps)
        pos = 0
        for chunk, (_, accepted) in zip(chunks, steps, strict=True):
            ids = await tokenize(session, sim, {"prompt": chunk})
            assert ids == out[pos : pos + accepted + 1]
            pos += accepted + 1
        want = summary(steps)
        got = final["metrics"].get("speculative_decoding", {})
        assert {key: got.get(key) for key in want} == want
        totals["drafts"] += want.get("num_spec_steps", 0)
        totals["accepted"] += want.get("num_accepted_draft_tokens", 0)
    assert totals["drafts"] > 20 and totals["accepted"] / totals["drafts"] > 1.0


async def test_plain_and_replay_servers_answer_the_same_text(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    plain = await start_sim(SimConfig(mode="plain", **COPYING))
    replay = await start_sim(REPLAY)
    drafter = await start_sim(
        SimConfig(mode="speculative", drafting="replay", proposer="draft_model", **COPYING)
    )
    for i in range(4):
        for route, body in (
            ("chat/completions", {"messages": code_messages(i)}),
            ("completions", {"prompt": f"{i}: {CODE}"}),
        ):
            texts = {
                name: "".join((await stream(session, sim, route, body))[0])
                for name, sim in (("plain", plain), ("replay", replay), ("drafter", drafter))
            }
            assert texts["plain"] == texts["replay"] == texts["drafter"], route
            assert len(texts["plain"]) > 100


async def test_copying_answers_make_ngram_drafts_land_on_code_prompts(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    lengths: dict[float, list[float]] = {}
    for copy in (0.0, 0.7):
        sim = await start_sim(
            SimConfig(
                mode="speculative", drafting="replay", **{**COPYING, "copy": 0.0},
                category_copy={"code": copy},
            )
        )  # fmt: skip
        for i in range(8):
            body = {"messages": code_messages(i), "include_metrics": True}
            status, out = await post_json(
                session,
                f"{sim.base_url}/v1/chat/completions",
                body,
                headers={"x-specshadow-category": "code"},
            )
            assert status == 200
            sd = out["metrics"].get("speculative_decoding")
            lengths.setdefault(copy, []).append(sd["mean_acceptance_length"] if sd else 1.0)
    assert sum(lengths[0.0]) / 8 < 1.3
    assert sum(lengths[0.7]) / 8 > 2.0


async def test_replayed_drafter_metrics_equal_what_teacher_forcing_reads_back(
    start_sim: StartSim, session: aiohttp.ClientSession
) -> None:
    config = SimConfig(
        mode="speculative",
        drafting="replay",
        proposer="draft_model",
        drafter_match=0.75,
        num_speculative_tokens=K,
        **COPYING,
    )
    sim = await start_sim(config)
    for i in range(3):
        body = {"messages": code_messages(i)}
        prompt = await tokenize(session, sim, body)
        chunks, final = await stream(session, sim, "chat/completions", body)
        out = await tokenize(session, sim, {"prompt": "".join(chunks)})
        full = prompt + out
        status, forced = await post_json(
            session,
            f"{sim.base_url}/v1/completions",
            {"prompt": full, "max_tokens": 1, "prompt_logprobs": 1},
        )
        assert status == 200, forced
        rows = forced["choices"][0]["prompt_logprobs"]
        assert len(rows) == len(full) and rows[0] is None
        argmax: list[int | None] = [None]
        for i_pos, row in enumerate(rows[1:], start=1):
            assert str(full[i_pos]) in row
            best = [int(t) for t, v in row.items() if v["rank"] == 1]
            assert len(best) == 1 and len(row) <= 2
            argmax.append(best[0])

        def drafter(context: list[int], k: int, argmax: list[int | None] = argmax) -> list[int]:
            return [t for t in argmax[len(context) : len(context) + k] if t is not None]

        steps = replayed_steps(prompt, out, K, drafter)
        j = 1
        for drafted, accepted in steps[1:]:  # a drafter always drafts k, never past the end
            assert drafted == min(K, len(out) - j - 1)
            j += accepted + 1
        want = summary(steps)
        got = final["metrics"]["speculative_decoding"]
        assert {key: got.get(key) for key in want} == want
        assert 1.5 < got["mean_acceptance_length"] < 1 + K
