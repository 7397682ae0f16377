"""``specshadow serve``: the command line of the gateway process, and how it starts.

Flags and ``SPECSHADOW_*`` variables become :class:`~gateway.settings.Settings`, the ``OTEL_*``
variables telemetry settings, and :func:`specshadow.app.build_app` the application — all inside
one fail-fast path: a bad value, a port already in use, a primary whose host does not resolve, a
policy backend whose ``api_key_env`` variable is not set — each ends the command with exit status
2 and one line on stderr that names what was wrong, before anything listens (a flag argparse
rejects keeps argparse's message and status).

The policy-free start (``--primary URL --shadow URL [--baseline URL]``) needs each backend's kind
(``vllm``, ``sglang``, ``llamacpp``, ``sim``, ``openai``): it decides vLLM's request fields, whether ``/metrics``
are scraped (acceptance, KV cache) and whether the backend is asked what it runs. A kind stated
with ``--primary-kind`` / ``--shadow-kind`` / ``--baseline-kind`` is used as is; otherwise each
backend is asked at startup (:mod:`evidence.detect`, a couple of seconds at most), and one that
cannot be reached is ``openai`` — with a warning that says so.

With ``--workers N`` (N > 1) the same checks run once in this process, which then binds the
port and supervises N forked workers (:mod:`specshadow.workers`, :mod:`gateway.workers`).

Once the application is built, a few INFO lines say what this process will do (the primary, each
shadow with its role, kind — stated, detected or from the policy — and share, the store, the
policy file, the state file); flags that do nothing in this combination get a warning.

Size: the flags (a quarter of the file) and the one fail-fast startup path they feed — each step
turns a flag into a checked value or one line on stderr; apart, a flag and its check would drift.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast
from urllib.parse import urlsplit

from evidence.detect import DEFAULT_TIMEOUT_S, KINDS, Detection, detect_kinds
from gateway.serve import ListenError, check_listen, listen_problem, serve_app
from gateway.settings import PREFIX, Settings, SettingsError, default_state_path
from otel.settings import TelemetrySettings
from otel.setup import build_telemetry
from policies.compile import FLAGS_RULE_NAME, PRIMARY_NAME, policy_from_flags
from policies.compiled import BackendKind, CompiledPolicy
from policies.errors import PolicyError
from policies.store import PolicyStore
from records.cli import add_store_argument
from records.stores import check_store
from rollout.store import open_store, parse_state_url
from specshadow.app import build_app
from specshadow.workers import run_workers, state_for_workers

log = logging.getLogger(__name__)

RESOLVE_TIMEOUT_S = 5.0  # the primary's host name; slower than this: a warning, not a failure


def register(sub: Any) -> None:
    d = Settings()
    p: argparse.ArgumentParser = sub.add_parser(
        "serve",
        help="run the gateway in front of the primary upstream",
        description="Run the OpenAI-compatible gateway: every request goes to the primary, a "
        "sampled share is mirrored to shadow backends (a policy file, or the policy-free "
        "--shadow/--baseline flags). Every flag can also be set as SPECSHADOW_<FIELD>.",
    )
    p.add_argument("--host", default=None, help=f"address to bind (default {d.host})")
    p.add_argument("--port", type=int, default=None, help=f"port to bind (default {d.port})")
    p.add_argument(
        "--primary",
        default=None,
        metavar="URL",
        help="the primary upstream's base URL, e.g. http://127.0.0.1:8000 (default: the "
        "policy's primary)",
    )
    p.add_argument(
        "--policy",
        default=None,
        metavar="FILE",
        help="policy file (YAML); hot-reloaded on change/SIGHUP (default: none, the "
        "policy-free flags below)",
    )
    p.add_argument(
        "--shadow",
        action="append",
        default=[],
        metavar="URL",
        help="policy-free start: mirror to this candidate (repeatable; default: none)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="URL",
        help="policy-free start: a baseline leg (default: none)",
    )
    p.add_argument(
        "--shadow-ratio",
        type=float,
        default=None,
        metavar="R",
        help=f"policy-free start: share mirrored, 0..1 (default {d.shadow_ratio:g})",
    )
    kinds = ", ".join(KINDS)
    p.add_argument(
        "--primary-kind",
        choices=KINDS,
        default=None,
        metavar="KIND",
        help=f"policy-free start: what the primary is ({kinds}; default: asked at startup)",
    )
    p.add_argument(
        "--shadow-kind",
        action="append",
        choices=KINDS,
        default=[],
        metavar="KIND",
        help=f"policy-free start: what the --shadow backends are ({kinds}); once for all, or "
        "once per --shadow in order (default: each is asked at startup)",
    )
    p.add_argument(
        "--baseline-kind",
        choices=KINDS,
        default=None,
        metavar="KIND",
        help=f"policy-free start: what the --baseline is ({kinds}; default: asked at startup)",
    )
    add_store_argument(p, read=False)
    p.add_argument(
        "--scrape-interval",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds between backends' /metrics scrapes (default {d.scrape_interval_s:g})",
    )
    p.add_argument(
        "--state",
        default=None,
        metavar="PATH|URL",
        help="rollout state (stages, sticky rollbacks): a file, or a store replicas share — "
        "sqlite:///PATH (one host), clickhouse://HOST:PORT/DB (a fleet); "
        "default $XDG_STATE_HOME/specshadow/rollout.json",
    )
    p.add_argument(
        "--workers",
        default=None,
        metavar="N",
        help="gateway processes on the one port, supervised (restarted when they die); 0 or "
        "'auto': one per CPU; more than 1 needs a shared --state (default: sqlite:///… beside "
        f"the default state file) (default {d.workers})",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        metavar="N",
        help=f"larger bodies get 413 (default {d.max_body_bytes})",
    )
    up = d.upstream
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds to connect to the primary (default {up.connect_timeout_s:g})",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        metavar="S",
        help=f"max seconds between reads (default {up.idle_timeout_s:g})",
    )
    p.add_argument(
        "--keepalive",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds an idle pooled connection to a backend is kept; keep it below the "
        f"backends' own keep-alive (vLLM: 5) (default {up.keepalive_s:g})",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help=f"pool size per upstream (default {up.max_connections})",
    )
    p.set_defaults(func=run)


# Settings field (or upstream_<field>) → the flag that sets it, for error messages.
FLAGS: dict[str, str] = {
    "host": "--host",
    "port": "--port",
    "primary_url": "--primary",
    "policy_path": "--policy",
    "shadow_urls": "--shadow",
    "baseline_url": "--baseline",
    "shadow_ratio": "--shadow-ratio",
    "primary_kind": "--primary-kind",
    "shadow_kinds": "--shadow-kind",
    "baseline_kind": "--baseline-kind",
    "store_path": "--store",
    "state_path": "--state",
    "scrape_interval_s": "--scrape-interval",
    "workers": "--workers",
    "max_body_bytes": "--max-body-bytes",
    "upstream_connect_timeout_s": "--connect-timeout",
    "upstream_idle_timeout_s": "--idle-timeout",
    "upstream_keepalive_s": "--keepalive",
    "upstream_max_connections": "--max-connections",
}


class StartupError(Exception):
    """The gateway cannot start; each of ``problems`` is one line for an operator."""

    def __init__(self, *problems: str) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as Settings overrides (None: not given)."""
    return {
        "host": args.host,
        "port": args.port,
        "primary_url": args.primary,
        "policy_path": args.policy,
        "shadow_urls": tuple(args.shadow) or None,
        "baseline_url": args.baseline,
        "shadow_ratio": args.shadow_ratio,
        "primary_kind": args.primary_kind,
        "shadow_kinds": tuple(args.shadow_kind) or None,
        "baseline_kind": args.baseline_kind,
        "store_path": args.store,
        "scrape_interval_s": args.scrape_interval,
        "workers": args.workers,
        "max_body_bytes": args.max_body_bytes,
        "upstream_connect_timeout_s": args.connect_timeout,
        "upstream_idle_timeout_s": args.idle_timeout,
        "upstream_keepalive_s": args.keepalive,
        "upstream_max_connections": args.max_connections,
    }


def settings_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> Settings:
    """Flags over ``SPECSHADOW_*`` variables; raises SettingsError naming the flag or variable.

    Without ``--state`` the state is the default JSON file, or with more than one worker a
    SQLite store beside it (:func:`specshadow.workers.state_for_workers`)."""
    settings = Settings.from_env(
        environ,
        flags=FLAGS,
        **_overrides(args),
        state_path=args.state or environ.get("SPECSHADOW_STATE_PATH"),
        reload_on_sighup=True,
    )
    state, problem = state_for_workers(
        settings.state_path, default_state_path(environ), settings.worker_count()
    )
    if problem is not None:
        raise SettingsError([problem])
    return replace(settings, state_path=state)


def given(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Settings field → the flag or variable that set it, for the fields someone set."""
    out = {
        name: f"{PREFIX}{name.upper()}" for name in FLAGS if f"{PREFIX}{name.upper()}" in environ
    }
    out.update({k: FLAGS[k] for k, v in _overrides(args).items() if v is not None})
    return out


def idle_flags(settings: Settings, set_by: Mapping[str, str]) -> list[str]:
    """A warning for every flag that does nothing in this combination."""
    out: list[str] = []
    quick = ("shadow_urls", "baseline_url", "shadow_ratio", "primary_kind", "shadow_kinds",
             "baseline_kind")  # fmt: skip
    if settings.policy_path:
        ignored = [set_by[k] for k in quick if k in set_by]
        if ignored:
            out.append(
                f"{', '.join(ignored)} {'does' if len(ignored) == 1 else 'do'} nothing with "
                "--policy: the policy file names the backends, their kinds and shares"
            )
        return out
    legs = bool(settings.shadow_urls) or settings.baseline_url is not None
    if "shadow_ratio" in set_by and not legs:
        out.append(f"{set_by['shadow_ratio']} does nothing without --shadow or --baseline")
    elif "shadow_ratio" in set_by and settings.shadow_ratio == 0.0:
        out.append(f"{set_by['shadow_ratio']} is 0: nothing is mirrored")
    if "shadow_kinds" in set_by and not settings.shadow_urls:
        out.append(f"{set_by['shadow_kinds']} does nothing without --shadow")
    if "baseline_kind" in set_by and settings.baseline_url is None:
        out.append(f"{set_by['baseline_kind']} does nothing without --baseline")
    if settings.baseline_url is not None and not settings.shadow_urls:
        out.append(
            "--baseline without --shadow: the baseline is mirrored, but there is no candidate "
            "for it to be the noise floor of"
        )
    return out


@dataclass(frozen=True, slots=True)
class KindOf:
    """A backend's kind and where it came from: ``stated`` (a flag), ``detected`` (asked at
    startup; ``evidence`` says how), ``fallback`` (could not be asked) or ``policy``."""

    kind: str
    source: str
    evidence: str | None = None


def flag_backends(settings: Settings) -> dict[str, tuple[str, str, str | None]]:
    """Name → (URL, flag, stated kind) of every backend of the policy-free start."""
    out: dict[str, tuple[str, str, str | None]] = {}
    if settings.primary_url:
        out[PRIMARY_NAME] = (settings.primary_url, "--primary-kind", settings.primary_kind)
    kinds = settings.shadow_kinds
    for i, url in enumerate(settings.shadow_urls, 1):
        stated = (kinds[0] if len(kinds) == 1 else kinds[i - 1]) if kinds else None
        out[f"shadow-{i}"] = (url, "--shadow-kind", stated)
    if settings.baseline_url is not None:
        out["baseline"] = (settings.baseline_url, "--baseline-kind", settings.baseline_kind)
    return out


def kinds_of(
    backends: Mapping[str, tuple[str, str, str | None]], detected: Mapping[str, Detection]
) -> dict[str, KindOf]:
    """Stated kinds win; then what detection found; a backend that could not be asked is
    ``openai`` (and a warning says so)."""
    out: dict[str, KindOf] = {}
    for name, (url, flag, stated) in backends.items():
        if stated is not None:
            out[name] = KindOf(stated, "stated")
            continue
        found = detected.get(name)
        if found is None or not found.reachable:
            why = found.error if found is not None else "not asked"
            log.warning(
                "backend %s (%s) could not be asked what it is (%s): treated as openai — standard "
                "request fields only, no /metrics, no server info, so no acceptance or KV data; "
                "state it with %s KIND",
                name, url, why, flag,
            )  # fmt: skip
            out[name] = KindOf("openai", "fallback", why)
        else:
            out[name] = KindOf(found.kind, "detected", found.evidence)
    return out


def flags_policy(settings: Settings, kinds: Mapping[str, KindOf]) -> PolicyStore:
    """The policy of the policy-free start, every backend of its resolved kind."""

    def kind(name: str) -> BackendKind | None:
        k = kinds.get(name)
        return cast(BackendKind, k.kind) if k is not None else None

    shadow = [kind(f"shadow-{i}") for i in range(1, len(settings.shadow_urls) + 1)]
    policy = policy_from_flags(
        primary_url=settings.primary_url,
        shadow_urls=settings.shadow_urls,
        baseline_url=settings.baseline_url,
        ratio=settings.shadow_ratio,
        primary_kind=kind(PRIMARY_NAME),
        shadow_kinds=[k for k in shadow if k is not None],
        baseline_kind=kind("baseline"),
    )
    return PolicyStore(policy, primary_url=settings.primary_url)


async def resolve_host(url: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> str | None:
    """Why ``url``'s host does not resolve (one phrase), or None: it does, or it took too long
    to say (then a warning — a slow resolver is no reason to refuse to start)."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return None
    loop = asyncio.get_running_loop()
    try:
        await asyncio.wait_for(
            loop.getaddrinfo(host, parts.port or 80, type=socket.SOCK_STREAM), timeout_s
        )
    except socket.gaierror as exc:
        return f"cannot resolve host {host!r}: {exc.strerror}"
    except TimeoutError:
        log.warning("the primary's host %r did not resolve within %g s", host, timeout_s)
    return None


async def _preflight(
    primary_url: str | None, ask: Mapping[str, str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> tuple[str | None, dict[str, Detection]]:
    """The primary's host resolved and the backends in ``ask`` asked what they are, at once."""
    resolving = resolve_host(primary_url) if primary_url else asyncio.sleep(0, None)
    detecting = detect_kinds(ask, timeout_s=timeout_s) if ask else asyncio.sleep(0, {})
    problem, detected = await asyncio.gather(resolving, detecting)
    return problem, detected


def missing_api_keys(policy: CompiledPolicy, environ: Mapping[str, str] = os.environ) -> list[str]:
    """One line per backend whose ``api_key_env`` names a variable that is not set."""
    out = []
    for name, b in policy.backends.items():
        if b.api_key_env and b.api_key_env not in environ:
            out.append(
                f"backend {name}: api_key_env names {b.api_key_env}, which is not set "
                "(export it, or remove api_key_env if the backend needs no key)"
            )
        elif b.api_key_env and not environ[b.api_key_env]:
            log.warning(
                "backend %s: %s is empty: no Authorization header is sent", name, b.api_key_env
            )
    return out


def _pct(share: float) -> str:
    return f"{share * 100:.3g} %"


def summary(
    settings: Settings, policy: CompiledPolicy, kinds: Mapping[str, KindOf] | None
) -> list[str]:
    """The startup summary, a few lines: primary; each shadow with role, kind and share; store,
    policy and state."""

    def kind_text(name: str, declared: str) -> str:
        k = kinds.get(name) if kinds is not None else None
        if k is None:
            return f"{declared} (from the policy)"
        if k.source == "detected":
            return f"{k.kind} (detected: {k.evidence})"
        if k.source == "fallback":
            return f"{k.kind} (not reachable at startup, assumed)"
        return f"{k.kind} (stated)"

    lines = []
    p = policy.primary
    primary_url = settings.primary_url or (p.url if p is not None else "?")
    pname = p.name if p is not None else PRIMARY_NAME
    pkind = kind_text(pname, p.kind) if p is not None else "openai"
    named = "" if pname == PRIMARY_NAME else f" {pname}"  # not "primary primary"
    lines.append(f"primary{named} at {primary_url}: {pkind}")
    roles: dict[str, set[str]] = {}
    shares: dict[str, list[str]] = {}
    for rule in policy.all_rules:
        how = "load_matched" if rule.load_matched else "sweep" if rule.sweep else ""
        stage = rule.rollout.stage if rule.rollout is not None else None
        for leg in rule.legs:
            if leg.role == "primary":
                continue
            roles.setdefault(leg.backend.name, set()).add(leg.role)
            # The policy's stage: a rollback the state keeps is adopted after this line.
            staged = f"rollout {stage} as the policy states, unless a rollback is kept"
            extra = ", ".join(x for x in (how, staged if stage else "") if x)
            # The policy-free start's one rule is every request, not a rule the user named.
            of = "requests" if rule.name == FLAGS_RULE_NAME else f"rule {rule.name}"
            shares.setdefault(leg.backend.name, []).append(
                f"{_pct(leg.share)} of {of}" + (f" ({extra})" if extra else "")
            )
    shadows = [n for n in policy.backends if p is None or n != p.name]
    for name in shadows:
        b = policy.backends[name]
        role = "/".join(sorted(roles.get(name, ()))) or "in no rule"
        mirrored = "; ".join(shares.get(name, ())) or "never mirrored"
        lines.append(
            f"shadow {name} ({role}) at {b.url}: {kind_text(name, b.kind)}; mirrored {mirrored}"
        )
    if not shadows:
        lines.append("no shadow: requests go to the primary only")
    if policy.kill_switch:
        lines.append("kill switch on: nothing is mirrored")
    source = (
        f"policy {settings.policy_path}"
        if settings.policy_path
        else "policy: none (the --shadow/--baseline flags)"
    )
    store = f"store {settings.store_path}" if settings.store_path else "store: none (no records)"
    lines.append(f"{store}; {source}; state {settings.state_path or 'in memory'}")
    return lines


def _policy_problem(exc: OSError) -> str:
    if exc.filename:
        return f"--policy: cannot read {exc.filename}: {exc.strerror}"
    return str(exc)


def prepare(
    settings: Settings, environ: Mapping[str, str] = os.environ
) -> tuple[PolicyStore, dict[str, KindOf] | None]:
    """The policy (file, or flags with each backend's kind resolved) after the checks that need
    the network: the primary's host resolves, every ``api_key_env`` is set. Raises
    StartupError, PolicyError, SettingsError."""
    if settings.policy_path:
        try:
            store = PolicyStore.open(settings.policy_path, primary_url=settings.primary_url)
        except OSError as exc:
            raise StartupError(_policy_problem(exc)) from None
        p = store.current.primary
        primary_url = settings.primary_url or (p.url if p is not None else None)
        _check_primary(primary_url, settings, asyncio.run(_preflight(primary_url, {}))[0])
        kinds = None
    else:
        if not settings.primary_url:
            raise StartupError(
                "a primary upstream is required: --primary URL or `primary:` in the policy"
            )
        flags_policy(settings, {})  # every URL checked (PolicyError) before one is asked
        backends = flag_backends(settings)
        ask = {name: url for name, (url, _f, stated) in backends.items() if stated is None}
        problem, detected = asyncio.run(_preflight(settings.primary_url, ask))
        _check_primary(settings.primary_url, settings, problem)
        kinds = kinds_of(backends, detected)
        store = flags_policy(settings, kinds)
    missing = missing_api_keys(store.current, environ)
    if missing:
        raise StartupError(*missing)
    return store, kinds


def _check_primary(url: str | None, settings: Settings, problem: str | None) -> None:
    if problem is not None:
        flag = "--primary" if settings.primary_url else "the policy's primary"
        raise StartupError(f"{flag} {url}: {problem}")


def scrape_idle(settings: Settings, set_by: Mapping[str, str], policy: CompiledPolicy) -> list[str]:
    if "scrape_interval_s" in set_by and not any(b.metrics_url for b in policy.backends.values()):
        return [
            f"{set_by['scrape_interval_s']} does nothing: no backend has /metrics to scrape "
            "(every one is of kind openai, with no metrics_url)"
        ]
    return []


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        set_by = given(args)
        for warning in idle_flags(settings, set_by):
            log.warning("%s", warning)
        workers = settings.worker_count()
        if settings.port != 0:
            check_listen(settings.host, settings.port)
        store, kinds = prepare(settings)
        for warning in scrape_idle(settings, set_by, store.current):
            log.warning("%s", warning)
        if workers > 1:
            # Forked after the checks and the detection: every worker runs this policy.
            # Each store opened once here, not once per worker: one line, not one per worker.
            if settings.store_path:
                check_store(settings.store_path)
            if settings.state_path and "://" in settings.state_path:
                open_store(parse_state_url(settings.state_path)).close()
            for line in summary(settings, store.current, kinds):
                log.info("%s", line)
            return run_workers(settings, store, count=workers)
        telemetry = build_telemetry(TelemetrySettings.from_env())
        app = build_app(settings, policy=store, telemetry=telemetry)
    except (SettingsError, StartupError) as exc:
        for problem in exc.problems:
            print(f"specshadow serve: {problem}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"specshadow serve: {exc}", file=sys.stderr)
        return 2
    except (PolicyError, OSError, ValueError) as exc:
        # Startup fails fast, with the same message a reload would log.
        print(f"specshadow serve: {exc}", file=sys.stderr)
        return 2
    for line in summary(settings, store.current, kinds):
        log.info("%s", line)

    async def stopping(_app: object) -> None:  # SIGINT or SIGTERM: say so, as --workers does
        log.info(
            "stopping: no new connections; requests, streams and shadow legs in flight drain "
            "for up to %g s",
            settings.shutdown_timeout_s,
        )

    app.on_shutdown.insert(0, stopping)
    try:
        serve_app(app, settings, print_=lambda msg: log.info("%s", msg))
    except OSError as exc:
        # Bound between the check and the start (a race), or an address the check could not see.
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        print(f"specshadow serve: {listen_problem(settings.host, settings.port, exc)}",
              file=sys.stderr)  # fmt: skip
        return 2
    log.info("stopped")
    return 0
