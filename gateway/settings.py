"""Process settings: fixed for the life of the process, from the environment and the CLI.

Policy (what is mirrored where) is separate, file-based and hot-reloaded (``policies``). Every
field can be set by an environment variable ``SPECSHADOW_<FIELD>`` (upper case; the upstream
fields as ``SPECSHADOW_UPSTREAM_<FIELD>``); CLI flags override the environment.

Strict, because a typo in a deployment manifest must fail the rollout, not be ignored:

- booleans take exactly ``true/1/yes/on`` or ``false/0/no/off`` (any case) — ``false`` is false;
- numbers must parse and lie in their range (a port is 0–65535, a timeout is positive, …);
- a ``SPECSHADOW_*`` variable that nothing reads is an error (with the closest known name),
  except the service links Kubernetes injects for a Service named ``specshadow`` (the one
  ``deploy/k8s`` ships): ``SPECSHADOW_SERVICE_HOST``, ``SPECSHADOW_SERVICE_PORT[_<name>]``,
  ``SPECSHADOW_PORT_<n>_<PROTO>[_PROTO|_PORT|_ADDR]`` and ``SPECSHADOW_PORT=tcp://…``, which are
  the cluster's, not the user's, and are left alone;
- every error names the variable (or the CLI flag) it came from, and all are reported at once.

:meth:`Settings.from_env` raises :class:`SettingsError`; ``specshadow serve`` turns it into one
line per problem and exit status 2, before anything listens.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, get_args, get_type_hints

from core.wire import BACKEND_KEEPALIVE_S
from policies.compiled import BackendKind
from rollout.store import parse_state_url

MIB = 1024 * 1024
PREFIX = "SPECSHADOW_"

# SPECSHADOW_* variables that other parts of specshadow read (not process settings of the gateway).
OTHER_VARIABLES: Mapping[str, str] = {
    "SPECSHADOW_TELEMETRY": "telemetry on/off (otel.settings)",
    "SPECSHADOW_CACHE": "cache folder for vLLM's environment and models (backends)",
    "SPECSHADOW_SKIP_VLLM": "skip the real-vLLM tests (tests/vllm)",
    "SPECSHADOW_VLLM_URLS": "reuse running vLLM servers in the tests (tests/vllm)",
}

# What Kubernetes injects into every pod of a namespace for a Service named "specshadow" (docker
# links use the same shapes). SPECSHADOW_PORT collides with the port setting, so it is the link
# only when its value is the link's URL.
_SERVICE_LINK_NAME = re.compile(
    r"SPECSHADOW_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?)"
)
_SERVICE_LINK_URL = re.compile(r"(tcp|udp|sctp)://", re.IGNORECASE)


def is_service_link(name: str, value: str) -> bool:
    """Whether ``name=value`` is a Kubernetes service link for a Service named specshadow."""
    if name == f"{PREFIX}PORT":
        return bool(_SERVICE_LINK_URL.match(value.strip()))
    return bool(_SERVICE_LINK_NAME.fullmatch(name))


_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


class SettingsError(ValueError):
    """One or more settings are invalid; ``problems`` names each variable or flag."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    """How the gateway talks to one upstream (the primary, or a shadow pool)."""

    max_connections: int = 1000  # pooled connections (aiohttp TCPConnector limit)
    connect_timeout_s: float = 10.0  # TCP connect (and TLS) — not a total timeout
    idle_timeout_s: float = 600.0  # max silence between two reads; long streams are fine
    # How long an idle pooled connection to a backend is kept; below the backends' own keep-alive
    # (docs/reliability.md, "Idle connections").
    keepalive_s: float = BACKEND_KEEPALIVE_S
    retry_attempts: int = 3  # connect failures only, before anything reached the client
    retry_initial_s: float = 0.05
    retry_max_s: float = 1.0
    retry_deadline_s: float = 5.0

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for every value out of its range."""
        out = _positive(
            self, ("connect_timeout_s", "idle_timeout_s", "keepalive_s", "retry_deadline_s")
        )
        out += _at_least(self, {"max_connections": 1, "retry_attempts": 1})
        out += _at_least(self, {"retry_initial_s": 0.0, "retry_max_s": 0.0})
        return out


def default_state_path(environ: Mapping[str, str] = os.environ) -> str:
    """Where ``specshadow serve`` keeps rollout state without ``--state``:
    ``$XDG_STATE_HOME/specshadow/rollout.json`` (``~/.local/state/specshadow/rollout.json``)."""
    base = environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "specshadow", "rollout.json")


def parse_workers(value: str | int) -> int:
    """``--workers``: a positive number, or ``0`` / ``auto``: one per CPU this process may run on
    (its affinity mask, which a container's cpuset narrows; a CPU *quota* does not show here)."""
    text = str(value).strip().lower()
    if text in ("auto", "0"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - not Linux
            return max(1, os.cpu_count() or 1)
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"expected a number of workers or 'auto', got {value!r}") from None
    if n < 0:
        raise ValueError(f"must be 0 (auto) or more, got {n}")
    return n


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8080
    primary_url: str | None = None
    policy_path: str | None = None
    policy_poll_s: float = 1.0  # how often the policy file's fingerprint is checked
    reload_on_sighup: bool = False  # `serve` turns this on (signal handlers need the main thread)
    shadow_urls: tuple[str, ...] = ()  # policy-free start: candidate legs (--shadow)
    baseline_url: str | None = None  # policy-free start: a baseline leg (--baseline)
    shadow_ratio: float = 1.0  # policy-free start: share of requests mirrored (--shadow-ratio)
    # Policy-free start: what each backend is (vllm, sglang, sim, openai), as stated by
    # --primary-kind / --shadow-kind (one for all shadows or one each) / --baseline-kind.
    # None (or empty): `specshadow serve` asks the backend (evidence.detect); elsewhere openai.
    primary_kind: str | None = None
    shadow_kinds: tuple[str, ...] = ()
    baseline_kind: str | None = None
    max_body_bytes: int = 32 * MIB  # long RAG prompts fit; larger → 413
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    shutdown_timeout_s: float = 30.0  # in-flight streams and shadow legs get this long to finish
    ready_cache_s: float = 1.0  # /readyz probes the primary at most this often
    admin_token: str | None = None  # bearer token for /admin/* from non-loopback peers
    # Worker threads (metric recording, comparisons, span export) take the GIL in turns with the
    # event loop every switch interval. None keeps CPython's 5 ms: an A/B on the 2-core machine
    # (docs/benchmarks.md) found 0.5 ms no better for latency and 3-12 % costlier in CPU.
    gil_switch_interval_s: float | None = None
    store_path: str | None = None  # comparison records (embedded SQLite store); None: not kept
    # Rollout state (stage per rule, sticky rollbacks): a JSON file's path, or a store the
    # replicas share — sqlite:///PATH, clickhouse://host:port/db (rollout.store). None:
    # kept in memory only — embedded uses (tests, the demo); `specshadow serve` always gives one.
    state_path: str | None = None
    scrape_interval_s: float = 1.0  # how often backends' /metrics are scraped (to follow load)
    load_window_s: float = 10.0  # dispatch rates per backend are counted over this window
    # Gateway processes behind the one port (`serve --workers N`, gateway.workers): a number,
    # or "auto" / "0" for one per CPU this process may run on. 1: one process, no supervisor.
    workers: str = "1"

    def worker_count(self) -> int:
        """``workers`` as a number of processes (``auto`` / ``0`` resolved)."""
        return parse_workers(self.workers)

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for every value out of its range (nested upstream fields included)."""
        out = _positive(
            self,
            (
                "policy_poll_s",
                "shutdown_timeout_s",
                "scrape_interval_s",
                "ready_cache_s",
                "load_window_s",
            ),
        )
        out += _at_least(self, {"max_body_bytes": 1})
        if not 0 <= self.port <= 65535:
            out.append(("port", f"must be 0–65535, got {self.port}"))
        if not 0.0 <= self.shadow_ratio <= 1.0:
            out.append(("shadow_ratio", f"must be between 0 and 1, got {self.shadow_ratio}"))
        kinds = get_args(BackendKind)
        for name, values in (
            ("primary_kind", (self.primary_kind,)),
            ("shadow_kinds", self.shadow_kinds),
            ("baseline_kind", (self.baseline_kind,)),
        ):
            for value in values:
                if value is not None and value not in kinds:
                    out.append((name, f"must be one of {', '.join(kinds)}, got {value!r}"))
        if len(self.shadow_kinds) > 1 and len(self.shadow_kinds) != len(self.shadow_urls):
            out.append(
                (
                    "shadow_kinds",
                    f"give one kind for every shadow or one per shadow ({len(self.shadow_urls)}), "
                    f"got {len(self.shadow_kinds)}",
                )
            )
        try:
            parse_workers(self.workers)
        except ValueError as exc:
            out.append(("workers", str(exc)))
        if self.state_path is not None:
            try:
                parse_state_url(self.state_path)
            except ValueError as exc:
                out.append(("state_path", str(exc)))
        if self.gil_switch_interval_s is not None and not self.gil_switch_interval_s > 0:
            out.append(("gil_switch_interval_s", "must be positive"))
        out += [(f"upstream_{name}", msg) for name, msg in self.upstream.problems()]
        return out

    @classmethod
    def known_variables(cls) -> list[str]:
        """Every ``SPECSHADOW_*`` name something in specshadow reads, sorted."""
        return _known(_field_types(cls), _field_types(UpstreamSettings))

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] = os.environ,
        *,
        flags: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> Settings:
        """Build from ``SPECSHADOW_*`` variables, then apply the non-``None`` ``overrides``
        (field names; upstream fields as ``upstream_<field>``).

        ``flags`` maps an override's name to the CLI flag that set it, so an error names
        ``--port`` rather than ``port``. Raises :class:`SettingsError`.
        """
        problems: list[str] = []
        values: dict[str, Any] = {}
        up: dict[str, Any] = {}
        origin: dict[str, str] = {}  # field → where its value came from
        top, nested = _field_types(cls), _field_types(UpstreamSettings)
        for name in sorted(environ):
            if not name.startswith(PREFIX) or name in OTHER_VARIABLES:
                continue
            if is_service_link(name, environ[name]):
                continue
            key = name[len(PREFIX) :].lower()
            raw = environ[name]
            if key.startswith("upstream_") and key[len("upstream_") :] in nested:
                target, types, fname = up, nested, key[len("upstream_") :]
            elif key in top and key != "upstream":
                target, types, fname = values, top, key
            else:
                problems.append(f"{name}: {_unknown(name, top, nested)}")
                continue
            try:
                target[fname] = _parse(types[fname], raw)
            except ValueError as exc:
                problems.append(f"{name}: {exc}")
            origin[key] = name
        for key, value in overrides.items():
            if value is None:
                continue
            if key.startswith("upstream_") and key[len("upstream_") :] in nested:
                up[key[len("upstream_") :]] = value
            elif key in top and key != "upstream":
                values[key] = value
            else:
                raise TypeError(f"Settings has no field {key!r}")
            origin[key] = (flags or {}).get(key, key)
        if problems:
            raise SettingsError(problems)
        settings = cls(**values, upstream=UpstreamSettings(**up))
        problems = [
            f"{origin.get(key, PREFIX + key.upper())}: {msg}" for key, msg in settings.problems()
        ]
        if problems:
            raise SettingsError(problems)
        return settings


def _field_types(cls: type) -> dict[str, Any]:
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


def _known(top: Mapping[str, Any], nested: Mapping[str, Any]) -> list[str]:
    known = [PREFIX + k.upper() for k in top if k != "upstream"]
    known += [f"{PREFIX}UPSTREAM_{k.upper()}" for k in nested]
    return sorted([*known, *OTHER_VARIABLES])


def _unknown(name: str, top: Mapping[str, Any], nested: Mapping[str, Any]) -> str:
    known = _known(top, nested)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown setting{hint} (known: {', '.join(known)})"


def _parse(annotation: Any, raw: str) -> Any:
    """``raw`` as the field's type; ValueError with a message that names what was expected."""
    text = raw.strip()
    if getattr(annotation, "__origin__", None) is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    optional = type(None) in getattr(annotation, "__args__", ())
    if optional and text == "":
        return None
    base = next(a for a in getattr(annotation, "__args__", (annotation,)) if a is not type(None))
    if base is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"expected true/false (or 1/0, yes/no, on/off), got {raw!r}")
    if base is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if base is float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"expected a finite number, got {raw!r}")
        return value
    return raw


def _positive(obj: object, names: tuple[str, ...]) -> list[tuple[str, str]]:
    return [(n, f"must be positive, got {getattr(obj, n)}") for n in names if getattr(obj, n) <= 0]


def _at_least(obj: object, minima: Mapping[str, float]) -> list[tuple[str, str]]:
    return [
        (n, f"must be at least {m:g}, got {getattr(obj, n)}")
        for n, m in minima.items()
        if getattr(obj, n) < m
    ]
