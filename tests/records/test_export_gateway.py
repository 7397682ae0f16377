"""``specshadow records export`` on records the gateway wrote, against the engine's own ids.

A plain simulator is the primary and a speculative one the candidate and the token tap's
tokenizer, for half the exchanges (the tap's share). The client asks the primary for vLLM's
``return_token_ids`` on some requests: the answer then carries the engine's own prompt and output
ids — the ground truth, as the client got it from the engine. For the others, the ground truth
is the same request sent straight to the primary with ``return_token_ids`` afterwards (the
simulator answers a greedy request the same way every time). Every exported row's
``input_ids`` must be exactly prompt ids + output ids and its ``loss_mask`` 0 on the prompt, 1
on the output; exchanges outside the tap's share are skipped and counted, and so are
conversations where the capture setting kept no text.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from core import jsonx
from core.exchange import Exchange
from policies.compile import parse_policy
from policies.store import PolicyStore
from records.sqlite_store import query_records
from specshadow.inprocess import running_gateway
from specshadow.main import main as cli_main

PROMPTS = (
    "def total(items):\n    result = 0\n    for item in items:\n        result += item.price\n"
    "    return result\n\nRename result to subtotal.",
    "Tell me about the weather in spring and what to wear on a walk.",
)
N = 16


def policy(primary: str, candidate: str, capture: str) -> PolicyStore:
    raw: dict[str, Any] = {
        "version": 1,
        "backends": {
            "primary": {"url": primary, "kind": "sim"},
            "ngram": {"url": candidate, "kind": "sim"},
        },
        "primary": "primary",
        "default": {"ratio": 1.0, "legs": [{"backend": "ngram", "role": "candidate"}]},
        "capture": {"text": capture},
        "counterfactual": {"tokenizer": "ngram", "share": 0.5},
    }
    return PolicyStore(parse_policy(raw, source="export test"))


def has_id(request_id: str) -> Callable[[Exchange], bool]:
    return lambda exchange: exchange.request_id == request_id


def body(i: int) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": f"{PROMPTS[i % 2]} (variant {i})"}],
        "max_tokens": 40,
        "temperature": 0,
    }


@pytest.fixture
async def exported(
    sims: Callable[..., Awaitable[Any]], tmp_path: Path
) -> tuple[Path, dict[str, tuple[list[int], list[int]]]]:
    copy = {"copy": 0.0, "category_copy": {"code": 0.85}}
    plain = await sims(model="sim-model", max_output_tokens=64, **copy)
    spec = await sims(model="sim-model", mode="speculative", drafting="replay", proposer="ngram",
                      num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4,
                      max_output_tokens=64, **copy)  # fmt: skip
    store = tmp_path / "r.sqlite"
    truth: dict[str, tuple[list[int], list[int]]] = {}
    async with (
        running_gateway(policy(plain.base_url, spec.base_url, "full"), store_path=store) as gw,
        openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="k", max_retries=0) as client,
        openai.AsyncOpenAI(base_url=f"{plain.base_url}/v1", api_key="k", max_retries=0) as direct,
    ):
        for i in range(N):
            asked = i % 3 == 0
            extra = {"return_token_ids": True} if asked else {}
            r = await client.chat.completions.create(
                **body(i), extra_body=extra,
                extra_headers={"x-request-id": f"ex-{i}", "x-specshadow-category": "code"},
            )  # fmt: skip
            if not asked:  # the same request to the engine itself (the header included: the
                # simulator answers by category), asking for its ids
                r = await direct.chat.completions.create(
                    **body(i), extra_body={"return_token_ids": True},
                    extra_headers={"x-specshadow-category": "code"},
                )  # fmt: skip
            dumped = r.model_dump()
            truth[f"ex-{i}"] = (dumped["prompt_token_ids"], dumped["choices"][0]["token_ids"])
        for i in range(N):
            await gw.sink.wait_for(has_id(f"ex-{i}"), timeout_s=30)
    return store, truth


async def test_rows_are_the_engines_own_prompt_and_output_ids(
    exported: tuple[Path, dict[str, tuple[list[int], list[int]]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    store, truth = exported
    records = {r["exchange_id"]: r for r in query_records(store)}
    with_ids = {x for x, r in records.items() if r["tokens"] is not None}
    assert 0 < len(with_ids) < N  # the tap's share: some exchanges only
    out = tmp_path / "train.jsonl"
    argv = [
        "records",
        "export",
        "--store",
        str(store),
        "--format",
        "speculators",
        "--out",
        str(out),
    ]
    assert cli_main(argv) == 0
    rows = [jsonx.loads(line) for line in out.read_bytes().splitlines()]
    assert {row["exchange_id"] for row in rows} == with_ids
    sources = set()
    for row in rows:
        prompt, output = truth[records[row["exchange_id"]]["request_id"]]
        assert prompt and output
        assert row["input_ids"] == prompt + output
        assert row["loss_mask"] == [0] * len(prompt) + [1] * len(output)
        sources.add(row["output_source"])
    # Both ways the tap gets the engine's output ids: the primary's own, or the shadow's that
    # answered the very same text.
    assert sources <= {"engine", "leg:ngram"} and "engine" in sources, sources
    err = capsys.readouterr().err
    assert f"wrote {len(with_ids)} speculators rows of {N} records" in err
    assert f"{N - len(with_ids)} no token ids" in err
    # Conversations: from the captured text, for every exchange (capture: full).
    conv = tmp_path / "conv.jsonl"
    argv = ["records", "export", "--store", str(store), "--format", "conversations", "--out", str(conv)]  # fmt: skip
    assert cli_main(argv) == 0
    rows = [jsonx.loads(line) for line in conv.read_bytes().splitlines()]
    assert len(rows) == N
    for row in rows:
        user, assistant = row["conversations"]
        i = int(records[row["exchange_id"]]["request_id"].split("-")[1])
        assert user == {"role": "user", "content": body(i)["messages"][0]["content"]}
        assert assistant["role"] == "assistant" and assistant["content"]
