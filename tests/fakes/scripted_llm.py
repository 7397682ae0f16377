"""A scripted OpenAI-compatible LLM with known ground truth: a fixed answer, streamed on a fixed
clock, honouring what the client asked as a real server does.

Unlike :class:`tests.fakes.upstream.FakeUpstream` (fixed bytes, whatever the request), this one
reads the request: ``stream``, ``stream_options.include_usage`` (the usage chunk only when asked,
as OpenAI and vLLM do — the official SDK does not ask by default), chat or completions. So the
truth of every leg is known exactly: the answer's tokens, ``tokens_per_event`` tokens per SSE
event, the first event ``ttft_s`` after the request, one event every ``gap_s`` after it. The
script's TPOT by specshadow's definition, ``(e2e − ttft) / (tokens − 1)``, is :meth:`tpot_s`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from aiohttp import web

# 48 tokens (one per word, with its leading space) whose characters / 4 is 77, far from 48: the
# rough estimate a stream without usage gets.
ANSWER: tuple[str, ...] = tuple(
    " " + word
    for word in [
        "Speculative",
        "decoding",
        "drafts",
        "several",
        "tokens",
        "cheaply",
        "and",
        "verifies",
        "them",
        "in",
        "one",
        "pass",
        "of",
        "the",
        "target",
        "model,",
        "so",
        "latency",
        "falls",
        "when",
        "drafts",
        "are",
        "accepted",
        "often",
        "enough;",
        "the",
        "output",
        "distribution",
        "is",
        "unchanged",
        "because",
        "rejected",
        "drafts",
        "are",
        "resampled",
        "from",
        "the",
        "target",
        "itself",
        "at",
        "every",
        "position,",
        "exactly",
        "as",
        "plain",
        "decoding",
        "would",
        "do",
    ]
)
assert len(ANSWER) == 48


@dataclass
class ScriptedLLM:
    answer: Sequence[str] = ANSWER
    ttft_s: float = 0.02
    gap_s: float = 0.020
    tokens_per_event: int = 1
    model: str = "scripted"
    requests: list[dict[str, object]] = field(default_factory=list)

    def tpot_s(self) -> float:
        events = -(-len(self.answer) // self.tokens_per_event)
        return (events - 1) * self.gap_s / (len(self.answer) - 1)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_post("/v1/completions", self._handle)
        return app

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        chat = request.path.endswith("/chat/completions")
        t0 = time.perf_counter()
        n = len(self.answer)
        usage = {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n}
        if not body.get("stream"):
            await asyncio.sleep(self.ttft_s + (n - 1) * self.gap_s / self.tokens_per_event)
            text = "".join(self.answer)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}}
                if chat
                else {"index": 0, "text": text}
            )
            return web.json_response(
                {
                    "id": "cmpl-1",
                    "object": "chat.completion" if chat else "text_completion",
                    "model": self.model,
                    "choices": [{**choice, "finish_reason": "stop"}],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"

        async def send(obj: dict[str, object]) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(text: str | None, finish: str | None) -> dict[str, object]:
            if chat:
                delta = {"content": text} if text is not None else {}
                c: dict[str, object] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "finish_reason": finish}
            return {"id": "c1", "object": kind, "model": self.model, "choices": [c]}

        if chat:
            await send(
                {
                    "id": "c1",
                    "object": kind,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": {"role": "assistant"}}],
                }
            )
        k = self.tokens_per_event
        for i, start in enumerate(range(0, n, k)):
            due = t0 + self.ttft_s + i * self.gap_s
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            last = start + k >= n
            await send(chunk("".join(self.answer[start : start + k]), "stop" if last else None))
        options = body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            await send(
                {"id": "c1", "object": kind, "model": self.model, "choices": [], "usage": usage}
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
