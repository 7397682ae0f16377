"""Request parsing and validation (pure): an OpenAI request body → :class:`SimRequest`.

Validation mirrors vLLM's OpenAI server where a client can tell the difference: unreadable JSON and
bad fields are 400, an unknown model is 404, ``stream_options`` without ``stream`` is 400, and an
absent ``max_tokens`` falls back to a default.

Responses API bodies (``input``, ``instructions``, ``max_output_tokens``, ``text.format``, flat
function ``tools``) are read into the chat form — an ``input`` string is one user message,
``instructions`` a system message before it — so a Responses request and the equivalent chat
request get the same answer (``return_token_ids`` is ignored there, as vLLM's Responses API has
no such field). ``previous_response_id`` is a 404, as on vLLM without a response
store (``VLLM_ENABLE_RESPONSES_API_STORE`` unset).

Prompt tokens are the ids of :mod:`simulator.tokens` — the chat template with the generation
prompt (offered tools included) for chat and Responses requests, the text's ids (or the given ids)
for completions — so ``usage.prompt_tokens`` is the ``count`` that ``POST /tokenize`` answers for
the same prompt (:func:`parse_tokenize` reads that endpoint's bodies).

``return_token_ids`` (vLLM ≥ 0.10.2; a boolean, ``null`` meaning false, anything else a 400) asks
chat and completions answers to carry the prompt's ids and the generated ids;
:mod:`simulator.render` documents where they go.

Sampling parameters: ``temperature``, ``top_p`` and ``seed`` are read for sampled answers
(``SimConfig.sampling``), and ``frequency_penalty``, ``presence_penalty``,
``repetition_penalty`` and ``min_p`` decide ``spec_decode_unsupported`` (vLLM serves such a
request without speculation). A sampling server validates them as vLLM does (400 for a negative
temperature, ``top_p`` outside (0, 1], a seed that is not a 64-bit integer, penalties out of
range); any other server ignores malformed values, answering exactly as before.

Size: one validator per body the simulator accepts (chat, completions, Responses, tokenize,
detokenize), sharing the field readers and the error type that mirror vLLM's status codes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from core import jsonx
from simulator.config import SimConfig
from simulator.tokens import chat_ids, content_pieces, decode_piece, text_ids, text_pieces

Route = Literal["chat", "completions", "responses"]
_SAMPLING_EPS = 1e-5  # vLLM's: a min_p at or below it is off


class SimRequestError(Exception):
    """A request vLLM would refuse; becomes an OpenAI-shaped error body with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def error_type(self) -> str:
        return {400: "BadRequestError", 404: "NotFoundError"}.get(
            self.status, "InternalServerError"
        )


@dataclass(frozen=True, slots=True)
class SimRequest:
    """The parts of a request body that decide the simulated answer."""

    route: Route
    model: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    max_tokens: int
    logprobs: bool
    top_logprobs: int
    include_metrics: bool
    json_schema: Mapping[str, Any] | None  # response_format json_schema's schema
    json_mode: bool  # response_format json_object or json_schema
    tool: Mapping[str, Any] | None  # the function definition a tool call goes to
    canonical: bytes  # what the output is a function of (model, max_tokens, stream excluded)
    prompt_ids: tuple[int, ...]  # what POST /tokenize answers for this prompt
    source_pieces: tuple[str, ...]  # the prompt's content pieces (what a copying answer copies)
    user_messages: int
    prompt_token_ids: bool = False  # a completions prompt given as token ids
    prompt_logprobs: int | None = None
    return_token_ids: bool = False  # vLLM's ``return_token_ids`` (chat and completions only)
    temperature: float | None = None  # absent: vLLM's default, 1.0 (:attr:`effective_temperature`)
    top_p: float = 1.0
    seed: int | None = None
    spec_decode_unsupported: bool = False  # penalties or min_p: vLLM serves it without drafts

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def effective_temperature(self) -> float:
        return 1.0 if self.temperature is None else self.temperature


def _int_field(body: Mapping[str, Any], key: str, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SimRequestError(400, f"{key} must be an integer >= {minimum}", param=key)
    return value


def _number(
    body: Mapping[str, Any], key: str, strict: bool, ok: Callable[[float], bool], rule: str
) -> float | None:
    """A float field; a bad one is a 400 when ``strict``, else ignored (``None``)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any double
            number = math.inf
        if math.isfinite(number) and ok(number):
            return number
    if strict:
        raise SimRequestError(400, f"{key} must be {rule}, got {value!r}", param=key)
    return None


@dataclass(frozen=True, slots=True)
class _SamplingParams:
    temperature: float | None
    top_p: float
    seed: int | None
    spec_decode_unsupported: bool


def _penalty_ok(value: float) -> bool:
    return -2.0 <= value <= 2.0


def _sampling_params(body: Mapping[str, Any], strict: bool) -> _SamplingParams:
    """``temperature``, ``top_p``, ``seed`` and whether vLLM would speculate (see
    ``SimConfig``). Validated like vLLM when ``strict`` (a sampling server); otherwise bad
    values are ignored, so a server that does not sample answers exactly as before."""
    temperature = _number(body, "temperature", strict, lambda v: v >= 0.0, "a number >= 0")
    top_p = _number(body, "top_p", strict, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
    raw_seed = body.get("seed")
    seed: int | None = None
    if raw_seed is not None:
        if (
            isinstance(raw_seed, int)
            and not isinstance(raw_seed, bool)
            and -(2**63) <= raw_seed < 2**63
        ):
            seed = raw_seed
        elif strict:
            raise SimRequestError(
                400, f"seed must be a 64-bit integer, got {raw_seed!r}", param="seed"
            )
    frequency = _number(body, "frequency_penalty", strict, _penalty_ok, "in [-2, 2]")
    presence = _number(body, "presence_penalty", strict, _penalty_ok, "in [-2, 2]")
    repetition = _number(body, "repetition_penalty", strict, lambda v: v > 0.0, "a number > 0")
    min_p = _number(body, "min_p", strict, lambda v: 0.0 <= v <= 1.0, "in [0, 1]")
    unsupported = (
        (frequency or 0.0) != 0.0
        or (presence or 0.0) != 0.0
        or (repetition if repetition is not None else 1.0) != 1.0
        or (min_p or 0.0) > _SAMPLING_EPS
    )
    return _SamplingParams(temperature, 1.0 if top_p is None else top_p, seed, unsupported)


def _pick_tool(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    tools = body.get("tools")
    choice = body.get("tool_choice", "auto")
    if not tools or choice == "none":
        return None
    if not isinstance(tools, list):
        raise SimRequestError(400, "tools must be a list", param="tools")
    functions: list[Mapping[str, Any]] = [
        t["function"]
        for t in tools
        if isinstance(t, Mapping)
        and isinstance(t.get("function"), Mapping)
        and "name" in t["function"]
    ]
    if not functions:
        raise SimRequestError(400, "tools must contain function definitions", param="tools")
    if isinstance(choice, Mapping):
        wanted = (choice.get("function") or {}).get("name")
        for fn in functions:
            if fn["name"] == wanted:
                return fn
        raise SimRequestError(
            400, f"tool_choice names unknown function {wanted!r}", param="tool_choice"
        )
    return functions[0]


def _responses_as_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses API body in the chat form the rest of the parser reads (see the module doc)."""
    previous = body.get("previous_response_id")
    if previous is not None:
        raise SimRequestError(
            404, f"Response with id '{previous}' not found.", param="previous_response_id"
        )
    raw_input = body.get("input")
    messages: list[Any] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
    elif isinstance(raw_input, list) and raw_input:
        for item in raw_input:
            if not isinstance(item, Mapping):
                raise SimRequestError(400, "input items must be objects", param="input")
            if "role" in item:
                messages.append({"role": item["role"], "content": item.get("content")})
            else:  # function_call / function_call_output items: kept as context
                messages.append({"role": str(item.get("type", "item")), "content": dict(item)})
    else:
        raise SimRequestError(400, "input must be a string or a non-empty list", param="input")
    out: dict[str, Any] = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    out["messages"] = messages
    out.pop("stream_options", None)  # Responses has its own (obfuscation); usage always comes
    if "max_output_tokens" in body:
        out["max_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), Mapping) else None
    if isinstance(fmt, Mapping):
        if fmt.get("type") == "json_schema":
            out["response_format"] = {"type": "json_schema", "json_schema": dict(fmt)}
        else:
            out["response_format"] = {"type": fmt.get("type")}
    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [
            {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            if isinstance(t, Mapping) and t.get("type") == "function"
            else t
            for t in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    include = body.get("include")
    out["logprobs"] = isinstance(include, list) and "message.output_text.logprobs" in include
    return out


def parse_request(route: Route, raw: bytes, config: SimConfig) -> SimRequest:
    """Validate ``raw`` like vLLM would, or raise :class:`SimRequestError`."""
    try:
        body = jsonx.loads(raw)
    except jsonx.JSONDecodeError as exc:
        raise SimRequestError(400, f"JSON decode error: {exc}") from exc
    if not isinstance(body, Mapping):
        raise SimRequestError(400, "request body must be a JSON object")
    if route == "responses":
        body = _responses_as_chat(body)
    model = body.get("model", config.model)
    if not isinstance(model, str) or model not in config.served_names:
        raise SimRequestError(404, f"The model `{model}` does not exist.", param="model")
    stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    if options is not None and not stream:
        raise SimRequestError(
            400, "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    options = options if isinstance(options, Mapping) else {}
    n = _int_field(body, "n", minimum=1)
    if n not in (None, 1):
        raise SimRequestError(400, "the simulator supports n=1 only", param="n")
    max_tokens = _int_field(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", minimum=1)
    response_format = body.get("response_format")
    json_schema: Mapping[str, Any] | None = None
    json_mode = False
    if isinstance(response_format, Mapping):
        kind = response_format.get("type")
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, Mapping) else None
            if not isinstance(schema, Mapping):
                raise SimRequestError(
                    400, "response_format.json_schema.schema is required", param="response_format"
                )
            json_schema, json_mode = schema, True
        elif kind == "json_object":
            json_mode = True
        elif kind not in ("text", None):
            raise SimRequestError(
                400, f"unknown response_format type {kind!r}", param="response_format"
            )

    return_token_ids = body.get("return_token_ids") if route != "responses" else None
    if return_token_ids is not None and not isinstance(return_token_ids, bool):
        raise SimRequestError(400, "return_token_ids must be a boolean", param="return_token_ids")

    tool: Mapping[str, Any] | None = None
    as_ids = False
    prompt_logprobs: int | None = None
    prompt_ids: list[int]
    source: list[str]
    if route in ("chat", "responses"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SimRequestError(400, "messages must be a non-empty list", param="messages")
        if not all(isinstance(m, Mapping) and "role" in m for m in messages):
            raise SimRequestError(400, "every message needs a role", param="messages")
        tool = _pick_tool(body)
        tools = body.get("tools")
        prompt_ids = chat_ids(messages, tools=tools if isinstance(tools, list) else None)
        source = content_pieces(messages)
        user_messages = sum(1 for m in messages if m.get("role") == "user")
        canonical = chat_canonical(messages, tool, json_schema, json_mode)
        logprobs = bool(body.get("logprobs", False))
        top = _int_field(body, "top_logprobs", minimum=0) or 0
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = text_ids(prompt)
            source = text_pieces(prompt)
        elif (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
        ):
            prompt_ids, as_ids = list(prompt), True
            source = [p for p in map(decode_piece, prompt) if p is not None]
        else:
            raise SimRequestError(
                400, "prompt must be a string or a list of token ids", param="prompt"
            )
        user_messages = 1
        canonical = jsonx.dumps(
            {"prompt": prompt, "json_schema": json_schema, "json_mode": json_mode}, sort_keys=True
        )
        top_or_none = _int_field(body, "logprobs", minimum=0)
        logprobs = top_or_none is not None
        top = top_or_none or 0
        prompt_logprobs = _int_field(body, "prompt_logprobs", minimum=0)
    sampling = _sampling_params(body, config.sampling)
    return SimRequest(
        route=route,
        model=model,
        stream=stream,
        include_usage=route == "responses" or bool(options.get("include_usage", False)),
        continuous_usage=bool(options.get("continuous_usage_stats", False)),
        max_tokens=max_tokens if max_tokens is not None else config.default_max_tokens,
        logprobs=logprobs,
        top_logprobs=top,
        include_metrics=bool(body.get("include_metrics", False)) or config.always_metrics,
        json_schema=json_schema,
        json_mode=json_mode,
        tool=tool,
        canonical=canonical,
        prompt_ids=tuple(prompt_ids),
        source_pieces=tuple(source),
        user_messages=user_messages,
        prompt_token_ids=as_ids,
        prompt_logprobs=prompt_logprobs,
        return_token_ids=bool(return_token_ids),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        spec_decode_unsupported=sampling.spec_decode_unsupported,
    )


def chat_canonical(
    messages: Any,
    tool: Mapping[str, Any] | None,
    json_schema: Mapping[str, Any] | None,
    json_mode: bool,
) -> bytes:
    """The canonical bytes of a chat (or Responses) request: what its answer is a function of."""
    return jsonx.dumps(
        {"messages": messages, "tool": tool, "json_schema": json_schema, "json_mode": json_mode},
        sort_keys=True,
    )


def classify(request: SimRequest, header: str | None) -> str:
    """The request's category: the header when given, else a simple classification."""
    if header:
        return header.strip()
    if request.tool is not None:
        return "tool_call"
    if request.json_mode:
        return "structured_output"
    if request.user_messages > 1:
        return "multi_turn"
    return "chat"


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """A ``POST /tokenize`` body, read: the prompt's ids, and whether to spell them out."""

    ids: tuple[int, ...]
    return_token_strs: bool


def _model_field(body: Mapping[str, Any], config: SimConfig) -> None:
    model = body.get("model", config.model)
    if model is not None and (not isinstance(model, str) or model not in config.served_names):
        raise SimRequestError(404, f"The model `{model}` does not exist.", param="model")


def _object(raw: bytes) -> Mapping[str, Any]:
    try:
        body = jsonx.loads(raw)
    except jsonx.JSONDecodeError as exc:
        raise SimRequestError(400, f"JSON decode error: {exc}") from exc
    if not isinstance(body, Mapping):
        raise SimRequestError(400, "request body must be a JSON object")
    return body


def _bool_field(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise SimRequestError(400, f"{key} must be a boolean", param=key)
    return value


def parse_tokenize(raw: bytes, config: SimConfig) -> TokenizeRequest:
    """vLLM's ``/tokenize`` body: ``{"prompt": str, "add_special_tokens"?}`` or ``{"messages":
    [...], "add_generation_prompt"? (default true), "tools"?}``; ``model`` and
    ``return_token_strs`` optional. The ids are the ones a request with that prompt is served with.
    """
    body = _object(raw)
    _model_field(body, config)
    strs = _bool_field(body, "return_token_strs", False)
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, Mapping) and "role" in m for m in messages
        ):
            raise SimRequestError(
                400, "messages must be a list of messages with a role", param="messages"
            )
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise SimRequestError(400, "tools must be a list", param="tools")
        generation = _bool_field(body, "add_generation_prompt", True)
        _bool_field(body, "add_special_tokens", False)
        return TokenizeRequest(tuple(chat_ids(messages, generation, tools=tools)), strs)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise SimRequestError(400, "prompt must be a string (or give messages)", param="prompt")
    _bool_field(body, "add_special_tokens", True)  # no BOS token: nothing to add
    return TokenizeRequest(tuple(text_ids(prompt)), strs)


def parse_detokenize(raw: bytes, config: SimConfig) -> tuple[int, ...]:
    """vLLM's ``/detokenize`` body: ``{"tokens": [ids...], "model"?}``."""
    body = _object(raw)
    _model_field(body, config)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise SimRequestError(400, "tokens must be a list of token ids", param="tokens")
    return tuple(tokens)
