"""Assembling a response from its JSON objects: chat, completions and the Responses API (pure).

The :class:`~core.recorder.StreamRecorder` hands every decoded object here — one SSE event's data,
or a whole non-streaming body — and gets back what kind of event it was (``output``, ``role``,
``usage``, ``error``, ``other``) and how many output tokens it carried, when known exactly. The
:class:`Assembler` keeps the merged output per choice (text, reasoning, tool calls by index,
refusal, logprob tokens), usage, the model and id, the engine's per-request metrics, and errors.

Shapes understood:

- **Chat completions** — ``choices[].delta`` (stream) or ``choices[].message`` (body): content,
  ``reasoning_content``/``reasoning``, ``tool_calls`` merged by index, ``refusal``, logprobs.
- **Completions** — ``choices[].text``, logprobs ``tokens``.
- **Responses API** — stream events typed ``response.*``. Output-bearing: the deltas of output
  text, reasoning text or summary, function-call arguments and refusals; not output:
  ``response.created`` / ``in_progress`` (they only acknowledge the request), item and part
  boundaries, ``*.done``. ``response.completed`` carries usage (``input_tokens``,
  ``output_tokens``) and ends the stream, as do ``response.incomplete`` and ``response.failed``
  (:attr:`Assembler.terminal`); the Responses API sends no ``[DONE]``. Non-streaming: the
  ``response`` object's ``output`` items (messages, function calls, reasoning). All of a
  response's output is one choice (index 0); function calls are its tool calls, by output index.

Per-request speculative-decoding statistics are kept verbatim wherever an engine puts them
(:attr:`Assembler.engine_stats`); :mod:`evidence.acceptance` reads them.

Size: one assembler for three API shapes (chat, completions, the Responses API) — they share the
per-choice accumulators and the output-bearing-event rule that defines TTFT.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from core.timings import ChoiceOutput, EventKind, ToolCall

# Responses API stream events that carry generated output, and what they carry.
_RESPONSES_OUTPUT: dict[str, str] = {
    "response.output_text.delta": "text",
    "response.reasoning_text.delta": "reasoning",
    "response.reasoning_summary_text.delta": "reasoning",
    "response.function_call_arguments.delta": "arguments",
    "response.refusal.delta": "refusal",
}
_RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
_FINISH_REASONS = {"max_output_tokens": "length", "content_filter": "content_filter"}


class ToolAcc:
    __slots__ = ("arguments", "id", "index", "name", "type")

    def __init__(self, index: int) -> None:
        self.index = index
        self.id: str | None = None
        self.type: str | None = None
        self.name: str | None = None
        self.arguments: list[str] = []


class ChoiceAcc:
    """Mutable per-choice accumulator; text is kept once, as pieces joined at freeze."""

    __slots__ = (
        "finish_reason",
        "index",
        "reasoning",
        "refusal",
        "text",
        "token_ids",
        "tokens",
        "tools",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.refusal: list[str] = []
        self.tools: dict[int, ToolAcc] = {}
        self.finish_reason: str | None = None
        self.tokens: list[str] | None = None
        self.token_ids: list[int] | None = None

    def freeze(self) -> ChoiceOutput:
        tools = tuple(
            ToolCall(t.index, t.id, t.type, t.name, "".join(t.arguments))
            for _, t in sorted(self.tools.items())
        )
        return ChoiceOutput(
            index=self.index,
            text="".join(self.text),
            reasoning="".join(self.reasoning),
            tool_calls=tools,
            finish_reason=self.finish_reason,
            refusal="".join(self.refusal) if self.refusal else None,
            tokens=tuple(self.tokens) if self.tokens is not None else None,
            token_ids=tuple(self.token_ids) if self.token_ids is not None else None,
        )


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


class Assembler:
    """Everything learned from a response's objects so far. Shape errors raise (the recorder
    catches them per event); see the module doc."""

    __slots__ = (
        "choices",
        "engine_stats",
        "error",
        "final_usage",
        "logprob_tokens",
        "logprobs_seen",
        "metrics",
        "model",
        "prev_completion_tokens",
        "response_id",
        "terminal",
        "usage",
    )

    def __init__(self) -> None:
        self.choices: dict[int, ChoiceAcc] = {}
        self.usage: Mapping[str, Any] | None = None  # normalised: completion_tokens, prompt_tokens
        self.final_usage = False
        self.prev_completion_tokens = 0
        self.logprobs_seen = False
        self.logprob_tokens = 0
        self.metrics: Mapping[str, Any] | None = None  # vLLM's per-request ``metrics``, verbatim
        # Other engines' per-request speculative stats, verbatim, by where they were found:
        # "choice_stats" (vLLM's earlier per-choice form, TensorRT-LLM's), "meta_info" (SGLang),
        # "timings" (llama.cpp's top-level ``timings``: ``draft_n``, ``draft_n_accepted``).
        self.engine_stats: dict[str, Any] = {}
        self.model: str | None = None
        self.response_id: str | None = None
        self.error: Mapping[str, Any] | None = None
        self.terminal = False  # a Responses API terminal event arrived

    def freeze(self) -> tuple[ChoiceOutput, ...]:
        return tuple(acc.freeze() for _, acc in sorted(self.choices.items()))

    def _choice(self, index: int) -> ChoiceAcc:
        acc = self.choices.get(index)
        if acc is None:
            acc = self.choices[index] = ChoiceAcc(index)
        return acc

    # -- one object ------------------------------------------------------------------------------

    def on_object(self, obj: dict[str, Any], streaming: bool) -> tuple[EventKind, int | None]:
        """Merge one decoded object; returns (event kind, output tokens it carried exactly)."""
        kind = obj.get("type")
        if isinstance(kind, str) and (kind.startswith("response.") or kind == "error"):
            return self._on_response_event(kind, obj)
        if obj.get("object") == "response":
            return self._on_response_body(obj)
        if self.model is None:
            self.model = obj.get("model")
        if self.response_id is None:
            self.response_id = obj.get("id")
        metrics = obj.get("metrics")
        if isinstance(metrics, dict):
            self.metrics = metrics
        timings = obj.get("timings")  # llama.cpp: the body, or a stream's last chunk
        if isinstance(timings, dict):
            self.engine_stats["timings"] = timings
        error = obj.get("error")
        if error is None and obj.get("object") == "error":
            error = obj  # vLLM's older flat ErrorResponse
        if error is not None:
            if self.error is None:
                self.error = error if isinstance(error, dict) else {"message": str(error)}
            return "error", None

        choices = obj.get("choices")
        output = role = False
        logprob_tokens: int | None = None
        if choices:
            for position, choice in enumerate(choices):
                o, r, n = self._on_choice(choice, position)
                output |= o
                role |= r
                if n is not None:
                    logprob_tokens = n if logprob_tokens is None else logprob_tokens + n

        tokens = logprob_tokens
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            completion = usage.get("completion_tokens")
            if choices and streaming:  # usage on a content chunk: continuous usage stats
                if isinstance(completion, int):
                    tokens = completion - self.prev_completion_tokens
                    self.prev_completion_tokens = completion
            else:
                self.final_usage = True
                if not choices:
                    return "usage", None
        if output:
            return "output", tokens
        return ("role" if role else "other"), tokens

    def _on_choice(self, choice: dict[str, Any], position: int) -> tuple[bool, bool, int | None]:
        """Merge one choice (stream delta or body message). Returns (output, role-only, logprobs)."""
        index = choice.get("index", position)
        if type(index) is not int:
            raise TypeError(f"choice index is {type(index).__name__}, not int")
        acc = self._choice(index)
        finish_reason = choice.get("finish_reason")
        if isinstance(finish_reason, str):
            acc.finish_reason = finish_reason
        output = role = False
        delta = choice.get("delta")
        if delta is None:
            delta = choice.get("message")
        if delta is not None:  # chat
            content = delta.get("content")
            if content and isinstance(content, str):
                acc.text.append(content)
                # Fast path: a plain `{"content": …}` delta carries nothing else to look up.
                if len(delta) == 1 and len(choice) <= 4:
                    return True, False, self._take_logprobs(acc, choice.get("logprobs"))
                output = True
            # Some servers send both names with the same text; take one, never both.
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning and isinstance(reasoning, str):
                acc.reasoning.append(reasoning)
                output = True
            tool_calls = delta.get("tool_calls")
            if tool_calls:
                self._merge_tool_calls(acc, tool_calls)
                output = True
            refusal = delta.get("refusal")
            if refusal and isinstance(refusal, str):
                acc.refusal.append(refusal)
                output = True
            role = not output and ("role" in delta or content == "")
        else:  # completions
            text = choice.get("text")
            if text and isinstance(text, str):
                acc.text.append(text)
                output = True
        # vLLM's ``return_token_ids``: the ids this chunk (or the whole body) generated. Never
        # on the fast path above: vLLM sends them beside ``stop_reason``, so the choice is wider.
        ids = choice.get("token_ids")
        if isinstance(ids, list) and ids and all(type(t) is int for t in ids):
            if acc.token_ids is None:
                acc.token_ids = list(ids)
            else:
                acc.token_ids.extend(ids)
        # Per-choice engine statistics: SGLang's meta_info, vLLM's earlier per-choice spec stats.
        meta = choice.get("meta_info")
        if isinstance(meta, dict):
            self.engine_stats["meta_info"] = meta
        stats = (
            choice.get("speculative_decoding_stats")  # vLLM, before metrics.speculative_decoding
            or choice.get("spec_decode_stats")
            or choice.get("speculative_decoding")  # TensorRT-LLM's serve
        )
        if isinstance(stats, dict):
            self.engine_stats["choice_stats"] = stats
        return (
            output,
            role and finish_reason is None,
            self._take_logprobs(acc, choice.get("logprobs")),
        )

    @staticmethod
    def _merge_tool_calls(acc: ChoiceAcc, tool_calls: list[dict[str, Any]]) -> None:
        for position, call in enumerate(tool_calls):
            index = call.get("index", position)
            if type(index) is not int:
                raise TypeError(f"tool call index is {type(index).__name__}, not int")
            tool = acc.tools.get(index)
            if tool is None:
                tool = acc.tools[index] = ToolAcc(index)
            if tool.id is None:
                tool.id = _str_or_none(call.get("id"))
            if tool.type is None:
                tool.type = _str_or_none(call.get("type"))
            function = call.get("function")
            if function:
                if tool.name is None:
                    tool.name = _str_or_none(function.get("name"))
                arguments = function.get("arguments")
                if arguments and isinstance(arguments, str):
                    tool.arguments.append(arguments)

    def _take_logprobs(self, acc: ChoiceAcc, logprobs: dict[str, Any] | None) -> int | None:
        if not logprobs:
            return None
        entries = logprobs.get("content")  # chat: [{"token": …, "logprob": …}, …]
        if isinstance(entries, list):
            tokens = [str(e.get("token", "")) for e in entries]
            # llama.cpp names each token's id there (``"id": 201``): its generated ids.
            ids = [e.get("id") for e in entries]
            if ids and all(type(t) is int for t in ids):
                if acc.token_ids is None:
                    acc.token_ids = []
                acc.token_ids.extend(ids)
        else:
            raw = logprobs.get("tokens")  # completions: ["tok", …]
            if not isinstance(raw, list):
                return None
            tokens = [str(t) for t in raw]
        return self._add_tokens(acc, tokens)

    def _add_tokens(self, acc: ChoiceAcc, tokens: list[str]) -> int:
        if acc.tokens is None:
            acc.tokens = tokens
        else:
            acc.tokens.extend(tokens)
        self.logprobs_seen = True
        self.logprob_tokens += len(tokens)
        return len(tokens)

    # -- the Responses API ---------------------------------------------------------------------

    def _on_response_event(self, kind: str, event: dict[str, Any]) -> tuple[EventKind, int | None]:
        carries = _RESPONSES_OUTPUT.get(kind)
        if carries is not None:
            delta = event.get("delta")
            if not isinstance(delta, str) or not delta:
                return "other", None
            acc = self._choice(0)
            tokens = None
            if carries == "text":
                acc.text.append(delta)
                logprobs = event.get("logprobs")
                if isinstance(logprobs, list) and logprobs:
                    tokens = self._add_tokens(acc, [str(e.get("token", "")) for e in logprobs])
            elif carries == "reasoning":
                acc.reasoning.append(delta)
            elif carries == "refusal":
                acc.refusal.append(delta)
            else:
                index = event.get("output_index", 0)
                tool = acc.tools.get(index) if type(index) is int else None
                if tool is None:
                    tool = acc.tools[index if type(index) is int else len(acc.tools)] = ToolAcc(
                        index if type(index) is int else len(acc.tools)
                    )
                tool.arguments.append(delta)
            return "output", tokens
        if kind == "response.output_item.added":
            item = event.get("item")
            index = event.get("output_index")
            if (
                isinstance(item, dict)
                and item.get("type") == "function_call"
                and type(index) is int
            ):
                tool = self._choice(0).tools.setdefault(index, ToolAcc(index))
                tool.id = tool.id or _str_or_none(item.get("call_id") or item.get("id"))
                tool.type = "function"
                tool.name = tool.name or _str_or_none(item.get("name"))
            return "other", None
        if kind == "error":
            nested = event.get("error")
            error: dict[str, Any] = nested if isinstance(nested, dict) else event
            self.error = self.error or {k: v for k, v in error.items() if k != "type"}
            return "error", None
        response = event.get("response")
        if isinstance(response, dict):
            self._note_response(response)
        if kind in _RESPONSES_TERMINAL:
            self.terminal = True
            if kind == "response.failed":
                failure = (response or {}).get("error") if isinstance(response, dict) else None
                self.error = self.error or (
                    failure if isinstance(failure, dict) else {"message": kind}
                )
                return "error", None
            return ("usage" if self.usage is not None else "other"), None
        return "other", None

    def _note_response(self, response: Mapping[str, Any]) -> None:
        """Id, model, status, usage and metrics of a Responses API ``response`` object."""
        if self.response_id is None:
            self.response_id = _str_or_none(response.get("id"))
        if self.model is None:
            self.model = _str_or_none(response.get("model"))
        metrics = response.get("metrics")
        if isinstance(metrics, dict):
            self.metrics = metrics
        usage = response.get("usage")
        if isinstance(usage, dict):
            # The chat names, so every consumer reads one shape; the original is kept beside.
            self.usage = {
                "prompt_tokens": usage.get("input_tokens"),
                "completion_tokens": usage.get("output_tokens"),
                "total_tokens": usage.get("total_tokens"),
                "responses_usage": usage,
            }
            self.final_usage = True
        status = response.get("status")
        if status in ("completed", "incomplete", "failed"):
            details = response.get("incomplete_details")
            reason = details.get("reason") if isinstance(details, dict) else None
            acc = self._choice(0)
            acc.finish_reason = (
                "stop" if status == "completed" else _FINISH_REASONS.get(str(reason), str(status))
            )
            if any(t.name for t in acc.tools.values()) and status == "completed":
                acc.finish_reason = "tool_calls"

    def _on_response_body(self, body: dict[str, Any]) -> tuple[EventKind, int | None]:
        """A non-streaming Responses API body: its ``output`` items, then id/usage/status."""
        acc = self._choice(0)
        output = False
        for index, item in enumerate(body.get("output") or ()):
            if not isinstance(item, dict):
                continue
            kind = item.get("type")
            if kind == "message":
                for part in item.get("content") or ():
                    if isinstance(part, dict) and part.get("type") == "output_text":
                        text = part.get("text")
                        if isinstance(text, str) and text:
                            acc.text.append(text)
                            output = True
                    elif isinstance(part, dict) and part.get("type") == "refusal":
                        refusal = part.get("refusal")
                        if isinstance(refusal, str) and refusal:
                            acc.refusal.append(refusal)
                            output = True
            elif kind == "function_call":
                tool = acc.tools.setdefault(index, ToolAcc(index))
                tool.id = _str_or_none(item.get("call_id") or item.get("id"))
                tool.type = "function"
                tool.name = _str_or_none(item.get("name"))
                arguments = item.get("arguments")
                if isinstance(arguments, str):
                    tool.arguments.append(arguments)
                output = True
            elif kind == "reasoning":
                for part in [*(item.get("summary") or ()), *(item.get("content") or ())]:
                    text = part.get("text") if isinstance(part, dict) else None
                    if isinstance(text, str) and text:
                        acc.reasoning.append(text)
                        output = True
        self._note_response(body)
        error = body.get("error")
        if isinstance(error, dict):
            self.error = error
            return "error", None
        return ("output" if output else "other"), None
