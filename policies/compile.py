"""Policy compilation and the loading entry points: file/mapping/flags → CompiledPolicy.

``compile_policy`` is pure: a validated :class:`~policies.model.PolicyModel` in, a
:class:`~policies.compiled.CompiledPolicy` out, with every lookup the hot path needs
precomputed. ``load_policy`` is the only function here that touches the file system.

Size: every entry point (file, mapping, flags) ends in :func:`compile_policy`, and each policy
section has one small compiler function beside it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from urllib.parse import urlsplit

from core import jsonx
from core.exchange import CaptureSpec, SpeculativeSpec
from core.quality import DEFAULT_MARGINS
from policies.compiled import (
    BackendKind,
    BackendSpec,
    BreakerSpec,
    Budgets,
    CompiledPolicy,
    CounterfactualSpec,
    Decision,
    GuardSpec,
    Ladder,
    LegPlan,
    LikelihoodSpec,
    Matcher,
    MirrorSpec,
    Patterns,
    QualitySpec,
    RolloutSpec,
    RuleSpec,
    Shaping,
    SkipReason,
    SweepSpec,
    Timeouts,
    WorkflowSpec,
)
from policies.errors import PolicyError
from policies.model import (
    LOAD_MATCHED,
    Backend,
    Capture,
    Leg,
    Match,
    PolicyModel,
    Rollout,
    Sweep,
    _check_base_url,
)
from policies.parse import read_yaml, validate_policy

DEFAULT_RULE_NAME = "default"  # the default rule's sampling salt
FLAGS_RULE_NAME = "flags"  # the sampling salt of a policy built from --shadow/--baseline
PRIMARY_NAME = "primary"  # backend name for --primary when the policy names none
_GLOB_CHARS = frozenset("*?[")
_SKIP_REASONS: tuple[SkipReason, ...] = (
    "kill_switch",
    "not_sampled",
    "retry",
    "body_size",
    "no_legs",
)


def load_policy(path: str | os.PathLike[str], *, primary_url: str | None = None) -> CompiledPolicy:
    """Read, validate and compile a policy file; PolicyError (or OSError) on any problem.

    Args:
        path: the policy file; symlinks are followed.
        primary_url: the ``--primary`` flag, which overrides the policy's primary URL.
    """
    source = os.fspath(path)
    with open(source, "rb") as f:
        data = f.read()
    raw = read_yaml(data, source=source)
    return parse_policy(
        raw, source=source, sha256=hashlib.sha256(data).hexdigest(), primary_url=primary_url
    )


def parse_policy(
    raw: Mapping[str, object],
    *,
    source: str,
    sha256: str | None = None,
    primary_url: str | None = None,
) -> CompiledPolicy:
    """Validate and compile an already-parsed policy mapping.

    ``sha256`` defaults to the hash of the mapping's canonical repr (files pass the hash of their
    bytes, so it matches ``sha256sum``).
    """
    model = validate_policy(raw, source=source)
    digest = sha256 or hashlib.sha256(repr(sorted(raw.items(), key=str)).encode()).hexdigest()
    return compile_policy(model, source=source, sha256=digest, primary_url=primary_url)


def policy_from_flags(
    *,
    primary_url: str | None,
    shadow_urls: Sequence[str],
    baseline_url: str | None,
    ratio: float,
    primary_kind: BackendKind | None = None,
    shadow_kinds: Sequence[BackendKind] = (),
    baseline_kind: BackendKind | None = None,
) -> CompiledPolicy:
    """A policy for ``serve --shadow URL… --baseline URL --shadow-ratio R`` without a file.

    Backends are named ``primary``, ``shadow-1``, ``shadow-2``, … and ``baseline``. Each is of
    the kind given (``--primary-kind``, ``--shadow-kind`` — one for every shadow, or one per
    shadow in order — ``--baseline-kind``; ``specshadow serve`` passes the stated or detected
    kind), else ``openai`` (only standard fields are sent, no ``/metrics`` are read). Every
    request is decided by one rule named ``flags`` at ``ratio``.
    """
    problems = [f"--shadow: {_url_problem(u)}" for u in shadow_urls if _url_problem(u)]
    for flag, url in (("--baseline", baseline_url), ("--primary", primary_url)):
        if url is not None and _url_problem(url):
            problems.append(f"{flag}: {_url_problem(url)}")
    if not 0.0 <= ratio <= 1.0:
        problems.append(f"--shadow-ratio: must be between 0 and 1, got {ratio}")
    if len(shadow_kinds) > 1 and len(shadow_kinds) != len(shadow_urls):
        problems.append(
            f"--shadow-kind: give one for every --shadow or one per --shadow "
            f"({len(shadow_urls)}), got {len(shadow_kinds)}"
        )
    if problems:
        raise PolicyError(problems, source="flags")
    kinds = list(shadow_kinds) * len(shadow_urls) if len(shadow_kinds) == 1 else list(shadow_kinds)
    backends: dict[str, object] = {
        f"shadow-{i}": {"url": u, "kind": kinds[i - 1] if kinds else "openai"}
        for i, u in enumerate(shadow_urls, 1)
    }
    legs: list[object] = [{"backend": n, "role": "candidate"} for n in backends]
    if baseline_url is not None:
        backends["baseline"] = {"url": baseline_url, "kind": baseline_kind or "openai"}
        legs.append({"backend": "baseline", "role": "baseline"})
    raw: dict[str, object] = {"version": 1, "backends": backends}
    if primary_url is not None and primary_kind is not None:
        backends[PRIMARY_NAME] = {"url": primary_url, "kind": primary_kind}
        raw["primary"] = PRIMARY_NAME
    if legs:
        raw["rules"] = [{"name": FLAGS_RULE_NAME, "ratio": float(ratio), "legs": legs}]
    return parse_policy(raw, source="flags", primary_url=primary_url)


def _url_problem(url: str) -> str | None:
    try:
        _check_base_url(url)
    except ValueError as exc:
        return str(exc)
    return None


def compile_policy(
    model: PolicyModel, *, source: str, sha256: str, primary_url: str | None = None
) -> CompiledPolicy:
    """Pure: a validated model → the hot-path form."""
    t = model.timeouts
    backends = {
        name: _backend(name, b, t.connect_s, t.idle_s) for name, b in model.backends.items()
    }
    primary = backends.get(model.primary) if model.primary is not None else None
    if primary_url is not None:
        primary = _override_primary(primary, primary_url, backends, source)
        backends[primary.name] = primary
    capture = _capture(model.capture)
    rules = tuple(
        _rule(
            r.name, r.match, r.ratio, r.legs, r.capture, backends, capture,
            primary=primary, sweep=r.sweep, rollout=r.rollout,
        )
        for r in model.rules
    )  # fmt: skip
    default = None
    if model.default is not None:
        d = model.default
        default = _rule(
            DEFAULT_RULE_NAME, Match(), d.ratio, d.legs, d.capture, backends, capture,
            primary=primary, sweep=d.sweep, rollout=d.rollout,
        )  # fmt: skip
    key = model.sampling.key
    budgets = model.budgets
    return CompiledPolicy(
        source=source,
        sha256=sha256,
        loaded_unix_ns=time.time_ns(),
        backends=MappingProxyType(backends),
        primary=primary,
        sampling_header=key.removeprefix("header:") if key != "request_id" else None,
        rules=rules,
        default_rule=default,
        budgets=Budgets(
            max_in_flight=budgets.max_in_flight,
            max_rps=budgets.max_rps,
            rps_burst=max(1, math.ceil(budgets.max_rps or 1)),
            max_body_bytes=budgets.max_body_bytes,
            breaker=BreakerSpec(
                budgets.breaker.failures, budgets.breaker.window_s, budgets.breaker.cooldown_s
            ),
        ),
        timeouts=Timeouts(t.connect_s, t.idle_s, t.total_s),
        mirror=MirrorSpec(
            model.mirror.timing, model.mirror.on_client_disconnect, model.mirror.mirror_retries
        ),
        shaping=Shaping(
            model.shaping.force_stream,
            model.shaping.include_metrics,
            model.shaping.override_seed,
            model.shaping.override_temperature,
            # Engine ids for the records and the scorer, asked of shadow legs only when a section
            # that needs them was written (default-on likelihood scores tokenized text instead:
            # not every shadow speaks vLLM's return_token_ids).
            token_ids=model.counterfactual is not None
            or (
                "likelihood" in model.quality.model_fields_set
                and model.quality.likelihood is not None
            ),
        ),
        header_allow=frozenset(model.headers.allow),
        allow_credentials=model.headers.allow_credentials_to_shadows,
        capture=capture,
        kill_switch=model.kill_switch,
        chunk_events=model.telemetry.chunk_events,
        counterfactual=_counterfactual(model, backends),
        quality=_quality(model, backends),
        workflows=WorkflowSpec(model.workflows.session_header, model.workflows.type_header),
    )


def _quality(model: PolicyModel, backends: Mapping[str, BackendSpec]) -> QualitySpec:
    q = model.quality
    lk = q.likelihood
    likelihood = (
        None
        if lk is None
        else LikelihoodSpec(
            scorer=backends[lk.scorer] if lk.scorer is not None else None,
            share=lk.share,
            max_in_flight=lk.max_in_flight,
            timeout_s=lk.timeout_s,
        )
    )
    return QualitySpec(
        margins={**DEFAULT_MARGINS, **q.margins}, alpha=q.alpha, likelihood=likelihood
    )


def _counterfactual(
    model: PolicyModel, backends: Mapping[str, BackendSpec]
) -> CounterfactualSpec | None:
    c = model.counterfactual
    if c is None:
        return None
    return CounterfactualSpec(
        tokenizer=backends[c.tokenizer],
        share=c.share,
        drafters=tuple(backends[d] for d in c.drafters),
        max_in_flight=c.max_in_flight,
        timeout_s=c.timeout_s,
    )


def _backend(name: str, b: Backend, connect_s: float, idle_s: float) -> BackendSpec:
    metrics_url = b.metrics_url
    if metrics_url is None and b.kind in ("vllm", "sglang", "llamacpp", "sim"):
        metrics_url = b.url + "/metrics"
    return BackendSpec(
        name=name,
        url=b.url,
        kind=b.kind,
        api_key_env=b.api_key_env,
        metrics_url=metrics_url,
        connect_s=b.timeout.connect_s or connect_s,
        idle_s=b.timeout.idle_s or idle_s,
        max_connections=b.max_connections,
        server_address=_server_address(b.url),
        replicas=b.replicas,
        speculative=_speculative(b),
        engine=_engine(b),
    )


def _engine(b: Backend) -> dict[str, object] | None:
    """The declared engine block under the record's field names (``name`` is ``engine``)."""
    if b.engine is None:
        return None
    declared = b.engine.model_dump(exclude_none=True)
    if "name" in declared:
        declared["engine"] = declared.pop("name")
    return declared or None


def _speculative(b: Backend) -> SpeculativeSpec | None:
    s = b.speculative
    if s is None:
        return None
    return SpeculativeSpec(
        s.method,
        s.num_speculative_tokens,
        s.label,
        s.verification,
        s.prompt_lookup_min,
        s.prompt_lookup_max,
        s.cross_vocabulary,
    )


def _server_address(url: str) -> str:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _override_primary(
    primary: BackendSpec | None, url: str, backends: Mapping[str, BackendSpec], source: str
) -> BackendSpec:
    problem = _url_problem(url)
    if problem:
        raise PolicyError(f"--primary: {problem}", source=source)
    base = _check_base_url(url)
    if primary is not None:
        metrics = primary.metrics_url
        if metrics == primary.url + "/metrics":
            metrics = base + "/metrics"
        return dataclasses.replace(
            primary, url=base, metrics_url=metrics, server_address=_server_address(base)
        )
    if PRIMARY_NAME in backends:
        raise PolicyError(
            f"--primary: the policy has a shadow backend named {PRIMARY_NAME!r}; rename it or "
            "set 'primary:' in the policy",
            source=source,
        )
    return _backend(PRIMARY_NAME, Backend(url=base, kind="openai"), 2.0, 60.0)


def _capture(c: Capture) -> CaptureSpec:
    return CaptureSpec(text="off" if c.text is False else c.text, redact=frozenset(c.redact))


def _rule(
    name: str,
    match: Match,
    ratio: float | str,
    legs: Sequence[Leg],
    capture: Capture | None,
    backends: Mapping[str, BackendSpec],
    policy_capture: CaptureSpec,
    *,
    primary: BackendSpec | None,
    sweep: Sweep | None = None,
    rollout: Rollout | None = None,
) -> RuleSpec:
    load_matched = ratio == LOAD_MATCHED
    primary_replicas = primary.replicas if primary is not None else 1

    def base_share(backend: BackendSpec) -> float:
        if load_matched:  # every shadow replica gets a production replica's arrival rate
            return min(1.0, backend.replicas / primary_replicas)
        return float(ratio)

    plans = tuple(
        LegPlan(leg.role, backends[leg.backend], leg.model, base_share(backends[leg.backend]))
        for leg in legs
    )
    cap = policy_capture if capture is None else _capture(capture)
    named = tuple(dict.fromkeys(p.backend.name for p in plans if p.role == "candidate"))
    skipped = {
        reason: Decision(
            name, reason not in ("not_sampled", "no_legs"), (), reason, cap, None, named
        )
        for reason in _SKIP_REASONS
    }
    spec = _sweep(sweep)
    multiples = spec.multiples if spec is not None else (1.0,)
    ladders = tuple(
        _ladder(name, plans, multiple, cap, step if spec is not None else None, named)
        for step, multiple in enumerate(multiples)
    )
    return RuleSpec(
        name=name,
        matcher=_matcher(match),
        legs=plans,
        capture=cap,
        ladders=ladders,
        skipped=MappingProxyType(skipped),
        load_matched=load_matched,
        sweep=spec,
        rollout=_rollout(rollout, plans),
    )


def _rollout(rollout: Rollout | None, plans: Sequence[LegPlan]) -> RolloutSpec | None:
    """The compiled rollout; its candidate is the named leg, else the only candidate leg
    (validated before compiling)."""
    if rollout is None:
        return None
    candidates = [p for p in plans if p.role == "candidate"]
    serving = next((p for p in candidates if p.backend.name == rollout.candidate), candidates[0])
    g = rollout.guards
    # Defaults of keys added later (on_config_change, on_drift, guards.acceptance_drop_max) are
    # left out, so blocks written before them keep their fingerprint and so their state.
    dumped = rollout.model_dump(mode="json")
    for key, default in (("on_config_change", "restart"), ("on_drift", "canary")):
        if dumped.get(key) == default:
            dumped.pop(key)
    if dumped["guards"].get("acceptance_drop_max") == 0.2:
        dumped["guards"].pop("acceptance_drop_max")
    block = jsonx.dumps(dumped, sort_keys=True)
    return RolloutSpec(
        stage=rollout.stage,
        serve_ratio=rollout.serve_ratio,
        steps=tuple(rollout.steps) if rollout.steps else None,
        hold_requests=rollout.hold.min_requests,
        hold_s=rollout.hold.min_s,
        reference_ratio=rollout.reference_ratio,
        candidate=serving,
        guards=GuardSpec(
            g.min_samples,
            g.window,
            g.confidence,
            g.e2e_p99_ratio_max,
            g.tpot_p99_ratio_max,
            g.error_rate_delta_max,
            g.divergence_rate_max,
            g.tokens_per_event_min,
            g.kv_usage_max,
            g.sampled_divergence_max,
            g.acceptance_drop_max,
        ),
        fingerprint=hashlib.sha256(block).hexdigest()[:16],
        on_config_change=rollout.on_config_change,
        on_drift=rollout.on_drift,
    )


def _sweep(sweep: Sweep | None) -> SweepSpec | None:
    if sweep is None:
        return None
    hold_s = sweep.hold_s if sweep.hold_s is not None else (None if sweep.hold_requests else 60.0)
    return SweepSpec(
        multiples=tuple(sweep.multiples),
        hold_ns=int(hold_s * 1e9) if hold_s is not None else None,
        hold_requests=sweep.hold_requests,
        repeat=sweep.repeat,
    )


def _ladder(
    name: str,
    plans: tuple[LegPlan, ...],
    multiple: float,
    cap: CaptureSpec,
    step: int | None,
    named: tuple[str, ...],
) -> Ladder:
    """The decisions at one sweep step: one rung per distinct share (see ``Ladder``)."""
    scaled = tuple(dataclasses.replace(p, share=min(1.0, p.share * multiple)) for p in plans)
    shares = sorted({p.share for p in scaled if p.share > 0}, reverse=True)
    if not shares:
        return ((0.0, Decision(name, False, (), "not_sampled", cap, step, named)),)
    return tuple(
        (
            share,
            Decision(
                name, True, tuple(p for p in scaled if p.share >= share), None, cap, step, named
            ),
        )
        for share in shares
    )


def _matcher(m: Match) -> Matcher:
    bucket = m.prompt_bytes
    return Matcher(
        routes=frozenset(m.routes) if m.routes is not None else None,
        models=_maybe_patterns(m.models),
        stream=m.stream,
        headers=tuple((name, _patterns(values)) for name, values in (m.headers or {}).items()),
        min_prompt_bytes=bucket.min if bucket is not None else 0,
        max_prompt_bytes=bucket.max if bucket is not None else None,
        categories=_maybe_patterns(m.categories),
    )


def _maybe_patterns(values: Sequence[str] | None) -> Patterns | None:
    return None if values is None else _patterns(values)


def _patterns(values: Sequence[str]) -> Patterns:
    globs = [v for v in values if _GLOB_CHARS & set(v)]
    exact = frozenset(v for v in values if v not in globs)
    regex = re.compile("|".join(fnmatch.translate(g) for g in globs)) if globs else None
    return Patterns(exact, regex)
