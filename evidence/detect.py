"""What kind of server a backend is — ``vllm``, ``sglang``, ``llamacpp``, ``sim`` or ``openai`` —
from what it serves, asked once at startup.

``specshadow serve --primary/--shadow/--baseline URL`` without a policy file has no ``kind:`` to
read, and the kind decides what the gateway gets out of a backend: vLLM's extra request fields,
its ``/metrics`` (acceptance counters, KV cache) and its ``/server_info`` (what speculation it
runs). :func:`detect_kinds` asks each URL, all at once and within ``timeout_s``:

- ``GET /sim/requests`` answering ``{"ids": …}`` → ``sim`` (the specshadow simulator; it also
  answers vLLM's routes, so it is asked first);
- ``GET /get_model_info`` answering ``model_path`` and ``is_generation``, or
  ``GET /get_server_info`` / ``GET /server_info`` answering SGLang's flat server arguments
  (``model_path`` with ``tp_size`` or ``speculative_algorithm``) → ``sglang``;
- ``GET /server_info`` answering a ``vllm_config`` (vLLM in dev mode), ``GET /v1/models`` with a
  model ``owned_by`` ``vllm``, or ``GET /version`` answering ``{"version": …}`` alone while
  ``/v1/models`` names no other owner → ``vllm``;
- ``GET /props`` answering llama.cpp's ``model_path`` with ``build_info`` and ``total_slots``, or
  ``GET /v1/models`` with a model ``owned_by`` ``llamacpp`` → ``llamacpp``;
- anything else that answers → ``openai`` (standard fields only, no ``/metrics``).

A backend that cannot be reached (down, refused, timed out) is ``openai`` with ``reachable``
False and the error: detection never fails a start — the caller says so, and a ``--shadow-kind``
style statement fixes it. Nothing here raises for a backend's answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

import aiohttp

Kind = Literal["vllm", "sglang", "llamacpp", "sim", "openai"]
KINDS: Final[tuple[Kind, ...]] = ("vllm", "sglang", "llamacpp", "sim", "openai")
DEFAULT_TIMEOUT_S: Final = 2.0

_PATHS: Final = (
    "/sim/requests",
    "/get_model_info",
    "/get_server_info",
    "/server_info?config_format=json",
    "/v1/models",
    "/version",
    "/props",
)


@dataclass(frozen=True, slots=True)
class Detection:
    """A backend's kind and what showed it (``evidence``: a few words for the startup log)."""

    kind: Kind
    evidence: str
    reachable: bool = True
    error: str | None = None  # why it could not be asked (``reachable`` False)


def _sglang_args(info: object) -> bool:
    return (
        isinstance(info, Mapping)
        and "model_path" in info
        and ("tp_size" in info or "speculative_algorithm" in info)
    )


def _owners(models: object) -> set[str]:
    data = models.get("data") if isinstance(models, Mapping) else None
    if not isinstance(data, list):
        return set()
    return {
        m["owned_by"].lower()
        for m in data
        if isinstance(m, Mapping) and isinstance(m.get("owned_by"), str)
    }


def classify(answers: Mapping[str, Any]) -> Detection:
    """Pure: path → parsed JSON of every 200 answer (a path absent: not served) → the kind."""
    sim = answers.get("/sim/requests")
    if isinstance(sim, Mapping) and "ids" in sim:
        return Detection("sim", "serves the simulator's /sim/requests")
    model_info = answers.get("/get_model_info")
    if isinstance(model_info, Mapping) and {"model_path", "is_generation"} <= model_info.keys():
        return Detection("sglang", "serves SGLang's /get_model_info")
    for path in ("/get_server_info", "/server_info?config_format=json"):
        if _sglang_args(answers.get(path)):
            return Detection("sglang", f"{path.split('?')[0]} has SGLang's server arguments")
    info = answers.get("/server_info?config_format=json")
    if isinstance(info, Mapping) and isinstance(info.get("vllm_config"), Mapping):
        return Detection("vllm", "/server_info has a vllm_config")
    props = answers.get("/props")
    if isinstance(props, Mapping) and {"model_path", "build_info", "total_slots"} <= props.keys():
        return Detection("llamacpp", "serves llama.cpp's /props")
    owners = _owners(answers.get("/v1/models"))
    if "llamacpp" in owners:
        return Detection("llamacpp", "/v1/models: owned_by llamacpp")
    if "sglang" in owners:
        return Detection("sglang", "/v1/models: owned_by sglang")
    if "vllm" in owners:
        return Detection("vllm", "/v1/models: owned_by vllm")
    version = answers.get("/version")
    if (
        isinstance(version, Mapping)
        and set(version) == {"version"}
        and isinstance(version["version"], str)
        and not owners
    ):
        return Detection("vllm", "/version answers like vLLM's")
    if not answers:
        return Detection(
            "openai", "none of vLLM's, SGLang's, llama.cpp's or the simulator's routes answered"
        )
    return Detection("openai", "no vLLM, SGLang, llama.cpp or simulator route answered like one")


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[Any, BaseException | None]:
    """The parsed JSON of a 200 answer (None otherwise) and a transport error, if any."""
    try:
        async with session.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                return None, None
            try:
                return await resp.json(content_type=None), None
            except ValueError:
                return None, None
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return None, exc


async def detect_kind(session: aiohttp.ClientSession, url: str) -> Detection:
    """Ask ``url`` (a base URL without ``/v1``) what it is; see the module doc."""
    base = url.rstrip("/")
    results = await asyncio.gather(*(_get(session, base + path) for path in _PATHS))
    answers = {p: body for p, (body, _e) in zip(_PATHS, results, strict=True) if body is not None}
    errors = [e for _b, e in results if e is not None]
    if not answers and len(errors) == len(_PATHS):
        exc = errors[0]
        what = type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, TimeoutError):
            what = "no answer in time"
        return Detection("openai", "not reachable at startup", reachable=False, error=what)
    return classify(answers)


async def detect_kinds(
    urls: Mapping[str, str], *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> dict[str, Detection]:
    """Name → URL in, name → :class:`Detection` out; every URL asked at once, each within
    ``timeout_s`` in all."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(url: str) -> Detection:
            try:
                return await asyncio.wait_for(detect_kind(session, url), timeout_s + 0.5)
            except TimeoutError:
                return Detection("openai", "not reachable at startup", False, "no answer in time")

        found = await asyncio.gather(*(one(u) for u in urls.values()))
    return dict(zip(urls, found, strict=True))
