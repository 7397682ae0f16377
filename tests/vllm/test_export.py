"""``specshadow records export --format speculators`` on real vLLM (``pytest -m vllm``): every row's
``input_ids`` are the engine's own prompt and output ids, and its ``loss_mask`` is 0 exactly on
the prompt.

A plain vLLM is the primary; the n-gram vLLM the candidate and the token tap's tokenizer. Most
requests ask the primary for ``return_token_ids``: the client then holds the engine's own prompt
ids (``prompt_token_ids``) and output ids (``token_ids``), the ground truth the rows must equal —
the record's prompt ids came from the n-gram server's ``/tokenize``, not from that answer. The
rest do not ask: their rows' output ids (the candidate's generated ids for the same text, or a
re-tokenization) must decode, through the primary's ``/detokenize``, to the text the client got.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import openai
import pytest

from backends.server import SERVED_MODEL_NAME, VllmServer
from core import jsonx
from records.sqlite_store import query_records
from specshadow.inprocess import running_gateway
from specshadow.main import main as cli_main
from tests.vllm.test_counterfactual import CODE, has_id, policy

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
MAX_TOKENS = 32


def bodies() -> list[tuple[dict[str, Any], bool]]:
    """(chat body, asks for the engine's ids) per request."""
    out: list[tuple[dict[str, Any], bool]] = []
    for i, code in enumerate(CODE * 2):
        messages = [{"role": "user", "content": f"Rewrite this code, same behaviour:\n{code}"}]
        temperature = 0 if i < len(CODE) else 0.8
        out.append(({"messages": messages, "temperature": temperature}, i % 4 != 3))
    return out


async def run(servers: Mapping[str, VllmServer], store: Path) -> dict[str, dict[str, Any]]:
    answers: dict[str, dict[str, Any]] = {}
    async with running_gateway(policy(servers), store_path=store) as gw:
        await asyncio.sleep(1.0)  # the server-info probe's first round
        async with openai.AsyncOpenAI(
            base_url=gw.openai_base_url, api_key="k", max_retries=0, timeout=120
        ) as client:
            for i, (body, asks) in enumerate(bodies()):
                r = await client.chat.completions.create(
                    model=SERVED_MODEL_NAME, max_tokens=MAX_TOKENS, **body,
                    extra_body={"return_token_ids": True} if asks else {},
                    extra_headers={"x-request-id": f"ex-{i}", "x-specshadow-category": "code"},
                )  # fmt: skip
                answers[f"ex-{i}"] = {"asked": asks, **r.model_dump()}
                await gw.sink.wait_for(has_id(f"ex-{i}"), timeout_s=120)
    return answers


def detokenize(base_url: str, ids: list[int]) -> str:
    req = urllib.request.Request(
        f"{base_url}/detokenize",
        data=jsonx.dumps({"model": SERVED_MODEL_NAME, "tokens": ids}),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as f:
        text: str = jsonx.loads(f.read())["prompt"]
    return text


def test_exported_rows_are_the_engines_own_ids(
    vllm_servers: dict[str, VllmServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "r.sqlite"
    answers = asyncio.run(run(vllm_servers, store))
    records = {r["exchange_id"]: r for r in query_records(store)}
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
    print(capsys.readouterr().err)
    rows = [jsonx.loads(line) for line in out.read_bytes().splitlines()]
    spoke = {x for x, r in records.items() if r["tokens"] is not None and r["tokens"]["output"]}
    assert {row["exchange_id"] for row in rows} == spoke and len(spoke) >= len(answers) - 1
    checked = decoded = 0
    for row in rows:
        answer = answers[records[row["exchange_id"]]["request_id"]]
        n_prompt = row["loss_mask"].count(0)
        assert row["loss_mask"] == [0] * n_prompt + [1] * (len(row["input_ids"]) - n_prompt)
        if answer["asked"]:
            prompt, output = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
            assert row["input_ids"] == prompt + output, row["exchange_id"]
            assert n_prompt == len(prompt)
            checked += 1
        else:
            text = answer["choices"][0]["message"]["content"]
            ids = row["input_ids"][n_prompt:]
            assert detokenize(vllm_servers["plain"].base_url, ids) == text, row["exchange_id"]
            decoded += 1
    print(f"{checked} rows equal the engine's ids, {decoded} decode to the client's text")
    assert checked >= 5 and decoded >= 1  # of 6 and 2 (the tiny model may end at once)
