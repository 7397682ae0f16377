"""The Responses API's answer shapes, as vLLM 0.32 writes them (pure): stream events and the body.

A stream is a sequence of typed events, each sent as ``event: <type>`` and ``data: <json>`` with
a ``sequence_number`` counting from 0, and no ``[DONE]``: ``response.created`` and
``response.in_progress`` acknowledge the request; ``response.output_item.added`` (and, for a
message, ``response.content_part.added``) open the output; one ``response.output_text.delta`` —
or ``response.function_call_arguments.delta`` for a tool call — per engine step carries the
tokens; the ``*.done`` events close the item; ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut the answer) carries the whole response
with its usage and, when asked for, vLLM's per-request ``metrics``.

All output is one item: a message with one ``output_text`` part, or one ``function_call`` whose
name (the plan's first token) is announced in ``response.output_item.added``.
"""

from __future__ import annotations

from typing import Any

from core import jsonx
from simulator.plan import Plan
from simulator.render import chat_logprobs
from simulator.request import SimRequest

SentEvent = tuple[str, bytes]  # (event type, data line)


def response_id_for(request_id: str) -> str:
    return f"resp_{request_id}"


def _usage(plan: Plan) -> dict[str, Any]:
    output = len(plan.tokens)
    return {
        "input_tokens": plan.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": plan.prompt_tokens + output,
    }


class ResponsesRender:
    """The events (or the body) of one Responses API answer; numbers events as it makes them."""

    def __init__(
        self, request: SimRequest, *, response_id: str, created: int, model: str, plan: Plan
    ) -> None:
        self._request = request
        self._id = response_id
        self._created = created
        self._model = model
        self._plan = plan
        self._seq = 0
        suffix = response_id.removeprefix("resp_")[:32]
        self._item_id = ("fc_" if plan.kind == "tool_call" else "msg_") + suffix
        self._call_id = f"call_{suffix}"

    # -- pieces -----------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> SentEvent:
        data = jsonx.dumps({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        return kind, data

    def _logprobs(self, start: int, end: int) -> list[dict[str, Any]]:
        if not self._request.logprobs:
            return []
        plan = self._plan
        content = chat_logprobs(
            plan.tokens[start:end], plan.logprobs[start:end], self._request.top_logprobs
        )["content"]
        return [{k: v for k, v in e.items() if k != "bytes"} for e in content]

    def _item(self, done: bool) -> dict[str, Any]:
        plan = self._plan
        status = "completed" if done else "in_progress"
        if plan.kind == "tool_call":
            return {
                "type": "function_call",
                "id": self._item_id,
                "call_id": self._call_id,
                "name": plan.tool_name,
                "arguments": plan.arguments if done else "",
                "status": status,
            }
        content = [self._part(done)] if done else []
        return {
            "type": "message",
            "id": self._item_id,
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _part(self, done: bool) -> dict[str, Any]:
        text = self._plan.text if done else ""
        logprobs = self._logprobs(0, len(self._plan.tokens)) if done else []
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    @property
    def _final_status(self) -> str:
        return "incomplete" if self._plan.finish_reason == "length" else "completed"

    def response(self, *, done: bool, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """The ``response`` object: in progress (no output yet) or final, with usage."""
        request = self._request
        status = self._final_status if done else "in_progress"
        body: dict[str, Any] = {
            "id": self._id,
            "object": "response",
            "created_at": self._created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": None,
            "max_output_tokens": request.max_tokens,
            "model": self._model,
            "output": [self._item(True)] if done else [],
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": 1.0,
            "text": {"format": {"type": "json_object" if request.json_mode else "text"}},
            "tool_choice": "auto",
            "tools": [],
            "top_p": 1.0,
            "truncation": "disabled",
            "usage": _usage(self._plan) if done else None,
            "user": None,
            "metadata": {},
        }
        if metrics is not None:
            body["metrics"] = metrics
        return body

    # -- the stream ---------------------------------------------------------------------------

    def opening(self) -> list[SentEvent]:
        events = [
            self._event("response.created", response=self.response(done=False)),
            self._event("response.in_progress", response=self.response(done=False)),
            self._event("response.output_item.added", output_index=0, item=self._item(False)),
        ]
        if self._plan.kind != "tool_call":
            events.append(
                self._event(
                    "response.content_part.added",
                    item_id=self._item_id,
                    output_index=0,
                    content_index=0,
                    part=self._part(False),
                )
            )
        return events

    def delta(self, start: int, end: int) -> SentEvent | None:
        """The event carrying output tokens ``[start, end)``; None when they carry no delta (a
        tool call's name, announced by ``response.output_item.added``)."""
        plan = self._plan
        if plan.kind == "tool_call":
            arguments = "".join(plan.tokens[max(start, 1) : end])
            if not arguments:
                return None
            return self._event(
                "response.function_call_arguments.delta",
                item_id=self._item_id,
                output_index=0,
                delta=arguments,
            )
        return self._event(
            "response.output_text.delta",
            item_id=self._item_id,
            output_index=0,
            content_index=0,
            delta="".join(plan.tokens[start:end]),
            logprobs=self._logprobs(start, end),
        )

    def closing(self, metrics: dict[str, Any] | None) -> list[SentEvent]:
        """The ``*.done`` events and the terminal event (last)."""
        plan = self._plan
        events: list[SentEvent] = []
        if plan.kind == "tool_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=self._item_id,
                    output_index=0,
                    arguments=plan.arguments,
                )
            )
        else:
            events += [
                self._event(
                    "response.output_text.done",
                    item_id=self._item_id,
                    output_index=0,
                    content_index=0,
                    text=plan.text,
                    logprobs=self._logprobs(0, len(plan.tokens)),
                ),
                self._event(
                    "response.content_part.done",
                    item_id=self._item_id,
                    output_index=0,
                    content_index=0,
                    part=self._part(True),
                ),
            ]
        events.append(
            self._event("response.output_item.done", output_index=0, item=self._item(True))
        )
        events.append(
            self._event(
                f"response.{self._final_status}",
                response=self.response(done=True, metrics=metrics),
            )
        )
        return events
