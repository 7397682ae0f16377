"""What speculative decoding a backend runs, in its own words — and the policy's, side by side.

Pure: :func:`from_vllm` reads vLLM's ``GET /server_info?config_format=json`` (served only with
``VLLM_SERVER_DEV_MODE=1``): ``vllm_config.speculative_config`` gives the ``method``,
``num_speculative_tokens``, its batch-size schedule (``num_speculative_tokens_per_batch_size``)
and how drafts are verified — ``rejection_sample_method`` or the older ``acceptance_method``,
read against the one list of known modes (:mod:`evidence.verification`: ``standard`` and
``block`` lossless, ``synthetic`` and ``fly`` lossy, anything else ``unknown`` and never called
lossless) — with ``draft_sample_method``, ``enable_adaptive_verification`` (each step verifies a
budget chosen per request: the configured depth is an upper bound) and ``use_heterogeneous_vocab``
(a drafter with its own vocabulary: ``cross_vocabulary``). :func:`from_sglang` reads
SGLang's ``GET /get_server_info`` (``GET /server_info`` in newer releases, asked when the old
path is not served): ``speculative_algorithm``, ``speculative_num_steps``, and
``speculative_accept_threshold_single`` / ``_acc`` — below 1.0 SGLang accepts drafts the target
would not have sampled (lossy). :func:`resolve` merges the policy's declaration with the report:
the backend's answer wins for what it reports; ``lossy`` from either side wins over
``lossless``; every disagreement is listed. :func:`from_llamacpp` reads llama.cpp's ``GET /slots``
(``speculative``, and ``speculative.types`` once a slot served a request) and the width of its
per-position acceptance counter (the draft maximum); llama.cpp reports no verification mode.

I/O shell: :class:`ServerInfoProbe` asks every ``vllm``/``sglang``/``llamacpp``/``sim`` backend once at
start and every ``refresh_s`` after (a restart may change the config), logs each new
disagreement with the policy once, and answers :meth:`ServerInfoProbe.reported` for records.
An endpoint that is not served (vLLM without dev mode: 404) is not an error: the backend simply
reports nothing, and the policy's declaration is all there is.

The same probe reads each backend's whole engine configuration, reduced to what changes speed or
output (:mod:`evidence.engine_config`): from the server-info answer, and for vLLM-shaped backends
also ``/version`` and the ``vllm:cache_config_info`` labels of ``/metrics`` (``/inference/v1/config``
when ``/server_info`` is not served); :meth:`ServerInfoProbe.engine` answers it for records, the
policy's ``engine`` declaration filling what no endpoint said.

Size: one engine's account of its speculation is read, probed and merged with the policy's in one
vocabulary (:class:`ReportedSpec`): the readers of vLLM, SGLang and llama.cpp are a few lines each
and change with the probe that asks for them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from core.exchange import SpeculativeSpec
from core.jsonx import as_int, as_number
from core.wire import BACKEND_KEEPALIVE_S
from evidence.engine_config import (
    EngineConfig,
    cache_config_info,
    from_llamacpp as engine_from_llamacpp,
    from_sglang as engine_from_sglang,
    from_vllm as engine_from_vllm,
    llamacpp_speculative_type,
    per_position_width,
    resolve_engine,
    version_of,
)
from evidence.verification import Reading, vllm_verification

log = logging.getLogger(__name__)

InfoSource = Literal["vllm_server_info", "sglang_server_info", "llamacpp_props"]
VerificationSource = Literal["policy", "vllm_server_info", "sglang_server_info", "llamacpp_props"]
ProbeStatus = Literal["pending", "reported", "not_served", "unreachable"]

# Paths by backend kind; the simulator answers vLLM's.
INFO_PATHS: Mapping[str, tuple[str, InfoSource]] = {
    "vllm": ("/server_info?config_format=json", "vllm_server_info"),
    "sim": ("/server_info?config_format=json", "vllm_server_info"),
    "sglang": ("/get_server_info", "sglang_server_info"),
    "llamacpp": ("/props", "llamacpp_props"),
}
# Where a kind's newer releases moved the endpoint: asked when the first path is not served
# (SGLang renamed /get_server_info to /server_info, keeping the old name for a while).
FALLBACK_PATHS: Mapping[str, str] = {"sglang": "/server_info"}


@dataclass(frozen=True, slots=True)
class ReportedSpec:
    """A backend's own account of its speculative decoding (``speculative`` False: none)."""

    source: InfoSource
    speculative: bool
    method: str | None = None
    num_speculative_tokens: int | None = None
    verification: Reading | None = None
    verification_detail: str | None = None  # the engine setting behind ``verification``
    schedule: tuple[tuple[int, int, int], ...] | None = None  # [batch from, to, k], vLLM
    prompt_lookup_min: int | None = None  # vLLM's n-gram lookup window
    prompt_lookup_max: int | None = None
    # vLLM: each step verifies a per-request budget (k is an upper bound); how drafts are sampled;
    # a drafter with its own vocabulary (``use_heterogeneous_vocab``).
    adaptive_verification: bool | None = None
    draft_sample_method: str | None = None
    cross_vocabulary: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "speculative": self.speculative,
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "verification": self.verification,
            "verification_detail": self.verification_detail,
            "schedule": [list(s) for s in self.schedule] if self.schedule else None,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
            "adaptive_verification": self.adaptive_verification,
            "draft_sample_method": self.draft_sample_method,
            "cross_vocabulary": self.cross_vocabulary,
        }


def parse_schedule(raw: object) -> tuple[tuple[int, int, int], ...] | None:
    """vLLM's ``[[batch from, batch to, k], …]``; None when absent or malformed."""
    if not isinstance(raw, list):
        return None
    rows: list[tuple[int, int, int]] = []
    for row in raw:
        values = [v for v in map(as_int, row) if v is not None] if isinstance(row, list) else []
        if len(values) != 3 or len(row) != 3:
            return None
        rows.append((values[0], values[1], values[2]))
    return tuple(rows) or None


def from_vllm(info: Mapping[str, Any]) -> ReportedSpec | None:
    """vLLM's ``/server_info`` JSON → its speculative config (None: not that shape)."""
    config = info.get("vllm_config")
    if not isinstance(config, Mapping):
        return None
    spec = config.get("speculative_config")
    if spec is None:
        return ReportedSpec("vllm_server_info", speculative=False)
    if not isinstance(spec, Mapping):
        return None
    method = spec.get("method")
    # ``acceptance_method``: vLLM V0's name for the same choice.
    verification, detail = vllm_verification(
        spec.get("rejection_sample_method"), spec.get("acceptance_method")
    )
    adaptive, sampling = spec.get("enable_adaptive_verification"), spec.get("draft_sample_method")
    hetero = spec.get("use_heterogeneous_vocab")
    schedule = parse_schedule(spec.get("num_speculative_tokens_per_batch_size"))
    return ReportedSpec(
        "vllm_server_info",
        speculative=True,
        method=method if isinstance(method, str) else None,
        num_speculative_tokens=as_int(spec.get("num_speculative_tokens")),
        verification=verification,
        verification_detail=detail,
        schedule=schedule or None,
        prompt_lookup_min=as_int(spec.get("prompt_lookup_min")) or None,
        prompt_lookup_max=as_int(spec.get("prompt_lookup_max")) or None,
        adaptive_verification=adaptive if isinstance(adaptive, bool) else None,
        draft_sample_method=sampling if isinstance(sampling, str) else None,
        cross_vocabulary=hetero if isinstance(hetero, bool) else None,
    )


def from_sglang(info: Mapping[str, Any]) -> ReportedSpec | None:
    """SGLang's ``/get_server_info`` JSON (server args, flat) → its speculative config."""
    if "speculative_algorithm" not in info:
        return None
    algorithm = info.get("speculative_algorithm")
    if not algorithm or not isinstance(algorithm, str):
        return ReportedSpec("sglang_server_info", speculative=False)
    single = as_number(info.get("speculative_accept_threshold_single"))
    acc = as_number(info.get("speculative_accept_threshold_acc"))
    relaxed = [
        f"{name}={value:g}"
        for name, value in (
            ("speculative_accept_threshold_single", single),
            ("speculative_accept_threshold_acc", acc),
        )
        if value is not None and value < 1.0
    ]
    verification: Reading | None = None
    detail = None
    if relaxed:
        verification, detail = "lossy", ", ".join(relaxed)
    elif single is not None or acc is not None:
        verification, detail = "lossless", "speculative_accept_threshold_* = 1"
    return ReportedSpec(
        "sglang_server_info",
        speculative=True,
        method=algorithm.lower(),
        num_speculative_tokens=as_int(info.get("speculative_num_steps")),
        verification=verification,
        verification_detail=detail,
    )


def from_llamacpp(slots: object, positions: int | None) -> ReportedSpec | None:
    """llama.cpp's ``/slots`` (+ the per-position counter's width, its draft maximum) → what it
    speculates with. Its verification is not reported: a draft is accepted where it equals the
    token the target samples (lossless), unless the server was started with synthetic acceptance
    (``--spec-synth-len`` / ``--spec-synth-rates``: lossy), which no endpoint shows — declare
    ``verification: lossy`` in the policy for such a server."""
    speculates, kind = llamacpp_speculative_type(slots)
    if speculates is None:
        return None
    if not speculates:
        return ReportedSpec("llamacpp_props", speculative=False)
    return ReportedSpec(
        "llamacpp_props", speculative=True, method=kind, num_speculative_tokens=positions
    )


def parse_info(source: InfoSource, info: object) -> ReportedSpec | None:
    if not isinstance(info, Mapping):
        return None
    if source == "llamacpp_props":
        return None  # llama.cpp's speculation is read from /slots (ServerInfoProbe)
    return from_vllm(info) if source == "vllm_server_info" else from_sglang(info)


def _declared_json(spec: SpeculativeSpec) -> dict[str, Any]:
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "label": spec.label,
        "verification": spec.verification,
        "prompt_lookup_min": spec.prompt_lookup_min,
        "prompt_lookup_max": spec.prompt_lookup_max,
        "cross_vocabulary": spec.cross_vocabulary,
    }


def method_key(method: str) -> str:
    """``n-gram``, ``NGRAM`` and ``ngram`` are one method."""
    return method.lower().replace("-", "").replace("_", "")


def mismatches(declared: SpeculativeSpec | None, reported: ReportedSpec | None) -> list[str]:
    """Where the policy and the backend disagree, one sentence each."""
    if declared is None or reported is None:
        return []
    out: list[str] = []
    if not reported.speculative:
        if declared.method is not None or (declared.num_speculative_tokens or 0) > 0:
            out.append("the policy declares speculative decoding; the backend reports none")
        return out
    if (
        declared.method is not None
        and reported.method is not None
        and method_key(declared.method) != method_key(reported.method)
    ):
        out.append(f"method: the policy says {declared.method}, the backend {reported.method}")
    k, rk = declared.num_speculative_tokens, reported.num_speculative_tokens
    if k is not None and rk is not None and k != rk:
        out.append(f"num_speculative_tokens: the policy says {k}, the backend {rk}")
    v, rv = declared.verification, reported.verification
    if v is not None and rv is not None and v != rv:
        out.append(
            f"verification: the policy says {v}, the backend reports {rv} "
            f"({reported.verification_detail})"
        )
    return out


Claim = tuple[Reading | None, VerificationSource | None, str | None]


def _verification(declared: SpeculativeSpec | None, reported: ReportedSpec | None) -> Claim:
    """``lossy`` if anyone says so, else ``unknown`` if the backend names a mode nobody listed (a
    declaration of ``lossless`` does not make it so), else ``lossless`` if anyone says so; with
    who and why."""
    claims: list[Claim] = []
    if reported is not None and reported.verification is not None:
        claims.append((reported.verification, reported.source, reported.verification_detail))
    if declared is not None and declared.verification is not None:
        claims.append((declared.verification, "policy", "declared in the policy"))
    for wanted in ("lossy", "unknown", "lossless"):
        for claim in claims:
            if claim[0] == wanted:
                return claim
    return None, None, None


def resolve(
    declared: SpeculativeSpec | None, reported: ReportedSpec | None
) -> dict[str, Any] | None:
    """The record's ``legs[].speculative``: what is known, where it came from, disagreements.

    None when neither side says anything. The backend's report wins for method and depth (a
    backend reporting no speculation has depth 0); ``lossy`` wins over ``unknown``, which wins
    over ``lossless``. ``cross_vocabulary`` is true when the backend reports heterogeneous-
    vocabulary drafting or the policy declares it; ``adaptive_verification`` and
    ``draft_sample_method`` are the backend's.
    """
    if declared is None and reported is None:
        return None
    running = reported if reported is not None and reported.speculative else None
    method = running.method if running is not None else None
    depth = running.num_speculative_tokens if running is not None else None
    if reported is not None and not reported.speculative:
        depth = 0
    if declared is not None:
        method = method or declared.method
        depth = declared.num_speculative_tokens if depth is None else depth
    verification, source, detail = _verification(declared, running)
    lookup = (
        (running.prompt_lookup_min, running.prompt_lookup_max)
        if running is not None and running.prompt_lookup_max is not None
        else (declared.prompt_lookup_min, declared.prompt_lookup_max)
        if declared is not None
        else (None, None)
    )
    return {
        "method": method,
        "num_speculative_tokens": depth,
        "prompt_lookup_min": lookup[0],
        "prompt_lookup_max": lookup[1],
        "label": declared.label if declared is not None else None,
        "verification": verification,
        "verification_source": source,
        "verification_detail": detail,
        "adaptive_verification": running.adaptive_verification if running is not None else None,
        "draft_sample_method": running.draft_sample_method if running is not None else None,
        "cross_vocabulary": _cross_vocabulary(declared, running),
        "declared": _declared_json(declared) if declared is not None else None,
        "reported": reported.to_json() if reported is not None else None,
        "mismatches": mismatches(declared, reported),
    }


def _cross_vocabulary(
    declared: SpeculativeSpec | None, running: ReportedSpec | None
) -> bool | None:
    """True when either side says the drafter has its own vocabulary; False when the backend
    says it has not and the policy does not say it has; None when nobody says."""
    said = [
        s.cross_vocabulary
        for s in (running, declared)
        if s is not None and s.cross_vocabulary is not None
    ]
    return any(said) if said else None


@dataclass(slots=True)
class _InfoTarget:
    name: str
    url: str
    source: InfoSource
    declared: SpeculativeSpec | None
    status: ProbeStatus = "pending"
    reported: ReportedSpec | None = None
    last_error: str | None = None
    warned: frozenset[str] = frozenset()
    fallback: str | None = None  # the URL to ask when ``url`` is not served (FALLBACK_PATHS)
    base: str = ""  # the backend's base URL (``/version``, ``/metrics``)
    declared_engine: Mapping[str, Any] | None = None
    engine: EngineConfig | None = None
    polled: ReportedSpec | None = None  # llama.cpp: what /slots said at the last poll


def _learning(target: _InfoTarget) -> bool:
    """A llama.cpp server that speculates but has not yet said how (its type shows once a slot
    served a request, its depth once a request drafted): asked again soon, not in a minute."""
    spec = target.polled
    return (
        target.source == "llamacpp_props"
        and spec is not None
        and spec.speculative
        and (spec.method is None or spec.num_speculative_tokens is None)
    )


@dataclass(frozen=True, slots=True)
class ProbeView:
    """A :class:`ServerInfoProbe`'s answers for some backends at one moment (its ``view``), with
    the probe's own ``engine`` and ``reported`` lookups; a backend outside it is unknown."""

    known: Mapping[str, tuple[EngineConfig | None, ReportedSpec | None]]

    def engine(self, name: str) -> EngineConfig | None:
        got = self.known.get(name)
        return got[0] if got is not None else None

    def reported(self, name: str) -> ReportedSpec | None:
        got = self.known.get(name)
        return got[1] if got is not None else None


@dataclass(frozen=True, slots=True)
class InfoTarget:
    """One backend to ask: base URL (no ``/v1``), kind, and the policy's declaration."""

    url: str
    kind: str
    declared: SpeculativeSpec | None = None
    engine: Mapping[str, Any] | None = None  # the policy's ``engine`` declaration


class ServerInfoProbe:
    """Asks each backend what it runs (see the module doc). ``reported`` is safe from any thread."""

    def __init__(
        self,
        targets: Mapping[str, InfoTarget],
        *,
        refresh_s: float = 60.0,
        retry_s: float = 2.0,
        timeout_s: float = 5.0,
        keepalive_s: float = BACKEND_KEEPALIVE_S,
    ) -> None:
        """``keepalive_s``: how long an idle connection to a backend is kept between polls (the
        gateway's ``upstream.keepalive_s``)."""
        self.refresh_s = refresh_s
        self._keepalive_s = keepalive_s
        self.retry_s = retry_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._targets: dict[str, _InfoTarget] = {}
        # Backends that cannot be asked still have their declared engine (never polled).
        self._declared: dict[str, EngineConfig] = {}
        for name, t in targets.items():
            path = INFO_PATHS.get(t.kind)
            if path is not None:
                fallback = FALLBACK_PATHS.get(t.kind)
                self._targets[name] = _InfoTarget(
                    name,
                    t.url + path[0],
                    path[1],
                    t.declared,
                    fallback=t.url + fallback if fallback else None,
                    base=t.url,
                    declared_engine=t.engine,
                    engine=resolve_engine({}, t.engine),
                )
            elif t.engine:
                declared = resolve_engine({}, t.engine)
                if declared is not None:
                    self._declared[name] = declared

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._targets)

    def reported(self, name: str) -> ReportedSpec | None:
        target = self._targets.get(name)
        return target.reported if target is not None else None

    def engine(self, name: str) -> EngineConfig | None:
        """The backend's reduced engine configuration (reported, else declared; None: unknown)."""
        target = self._targets.get(name)
        return target.engine if target is not None else self._declared.get(name)

    def view(self, names: Iterable[str]) -> ProbeView:
        """What the probe knows of ``names`` now, frozen: a record built later (the evidence
        worker lags the event loop) carries the configuration its legs ran on, not a later one.
        Two dict lookups per name; the objects are immutable and replaced, never changed."""
        return ProbeView({n: (self.engine(n), self.reported(n)) for n in names})

    def status(self, name: str) -> ProbeStatus | None:
        target = self._targets.get(name)
        return target.status if target is not None else None

    async def run(self) -> None:
        """Ask until cancelled: soon again while a backend is unreachable (or a llama.cpp server
        has not yet said how it speculates), else every refresh."""
        connector = aiohttp.TCPConnector(keepalive_timeout=self._keepalive_s)
        async with aiohttp.ClientSession(timeout=self._timeout, connector=connector) as session:
            while True:
                await self.poll_once(session)
                waiting = any(
                    t.status == "unreachable" or _learning(t) for t in self._targets.values()
                )
                await asyncio.sleep(self.retry_s if waiting else self.refresh_s)

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._poll(session, t) for t in self._targets.values()))

    async def _poll(self, session: aiohttp.ClientSession, target: _InfoTarget) -> None:
        try:
            async with session.get(target.url) as resp:
                if resp.status == 404 and target.fallback is not None:
                    # A newer release serves it elsewhere: ask there from now on.
                    target.url, target.fallback = target.fallback, None
                    await self._poll(session, target)
                    return
                if resp.status in (401, 403, 404, 405):
                    target.status, target.last_error = "not_served", f"HTTP {resp.status}"
                    await self._poll_engine(session, target, None)
                    return
                resp.raise_for_status()
                info = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            target.status, target.last_error = "unreachable", f"{type(exc).__name__}: {exc}"
            return
        await self._poll_engine(session, target, info)
        if target.source == "llamacpp_props":
            reported = target.polled
        else:
            reported = parse_info(target.source, info)
        if reported is None:
            target.status, target.last_error = "not_served", "unrecognised server info"
            return
        target.status, target.reported, target.last_error = "reported", reported, None
        new = set(mismatches(target.declared, reported)) - target.warned
        for problem in sorted(new):
            log.warning("backend %s: %s", target.name, problem)
        target.warned |= new

    async def _poll_engine(
        self, session: aiohttp.ClientSession, target: _InfoTarget, info: object
    ) -> None:
        """The backend's engine configuration from ``info`` and, vLLM-shaped, the other endpoints
        (each optional: one not served just says nothing)."""
        parts: dict[str, tuple[str, Mapping[str, Any]]] = {}
        if target.source == "llamacpp_props":
            slots = await self._get(session, target.base + "/slots", json=True)
            width = per_position_width(
                await self._get(session, target.base + "/metrics", json=False)
            )
            target.polled = from_llamacpp(slots, width)
            got = engine_from_llamacpp(info, slots, width) if isinstance(info, Mapping) else None
            if got is not None:
                parts["props"] = ("llamacpp_props", got)
        elif target.source == "sglang_server_info":
            got = engine_from_sglang(info) if isinstance(info, Mapping) else None
            if got is not None:
                parts["server_info"] = ("sglang_server_info", got)
        else:
            if not isinstance(info, Mapping):
                info = await self._get(session, target.base + "/inference/v1/config", json=True)
                source = "vllm_inference_config"
            else:
                source = "vllm_server_info"
            got = engine_from_vllm(info) if isinstance(info, Mapping) else None
            version = version_of(await self._get(session, target.base + "/version", json=True))
            if version is not None:
                parts["version"] = ("vllm_version", {"engine": "vllm", "version": version})
            if got is not None:
                parts["server_info"] = (source, got)
            text = await self._get(session, target.base + "/metrics", json=False)
            cache = cache_config_info(text) if isinstance(text, str) else {}
            if cache:
                parts["metrics"] = ("vllm_cache_config_info", cache)
        if parts or target.engine is None:
            target.engine = resolve_engine(parts, target.declared_engine)

    async def _get(self, session: aiohttp.ClientSession, url: str, *, json: bool) -> object:
        """One optional GET: the JSON (or text), None when not served or unreachable."""
        try:
            async with session.get(url) as resp:
                if resp.status != 200:
                    return None
                return await (resp.json(content_type=None) if json else resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
