"""Backend metrics scraper: polls each backend's ``/metrics`` for load and windowed acceptance.

Pure core: :func:`parse_sample` (Prometheus text → :class:`MetricsSample`, parsed with
``prometheus_client``'s own parser) and :func:`window_stats` (samples → rates). I/O shell:
:class:`MetricsScraper`, run as one tracked task (``TaskSet.spawn(scraper.run(), …)``); it never
touches a request path.

Window arithmetic (docs/concepts.md, "Acceptance, three ways"), over the samples of the last ``window_s`` seconds:

The counters under vLLM's names or llama.cpp's (``llamacpp:spec_decode_num_drafts_total``,
``…_num_draft_tokens_total``, ``…_num_accepted_tokens_total``,
``…_num_accepted_tokens_per_pos_total{position=i}``: the same meanings):

- ``draft_acceptance_rate`` = Δ``vllm:spec_decode_num_accepted_tokens_total`` /
  Δ``vllm:spec_decode_num_draft_tokens_total``;
- ``mean_acceptance_length`` = 1 + Δaccepted / Δ``vllm:spec_decode_num_drafts_total``;
- ``per_position`` [i] = Δ``..._num_accepted_tokens_per_pos_total{position=i}`` / Δdrafts.

Load gauges, read every poll (≤ 1 s apart by default, often enough to follow load): requests
running and waiting and KV-cache usage, under vLLM's names (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, formerly ``vllm:gpu_cache_usage_perc``)
or SGLang's (``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``)
or llama.cpp's (``llamacpp:requests_processing``, ``llamacpp:requests_deferred``; it serves no
KV-cache usage).
Every sample is kept for ``window_s`` (bounded), so :meth:`MetricsScraper.nearest` answers "what
was this backend's load when that leg was dispatched?" for records built seconds later. The
numbers are one replica's: a metrics URL behind a load balancer answers for one server at a time.

Counters are summed over label sets (engines, models); running and waiting too; KV usage is the
largest engine's. A counter that goes *down* between two
samples means the backend restarted: like Prometheus' ``rate()``, the increase is then the new
value itself. A backend that is down only records failures; its window resumes when it is back.
Each poll retries connection failures with tenacity (short exponential backoff) before it counts
as failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from core.wire import BACKEND_KEEPALIVE_S

log = logging.getLogger(__name__)

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# llama.cpp's server names the same counters with its own prefix.
LLAMACPP = {
    "llamacpp:spec_decode_num_drafts_total": DRAFTS,
    "llamacpp:spec_decode_num_draft_tokens_total": DRAFT_TOKENS,
    "llamacpp:spec_decode_num_accepted_tokens_total": ACCEPTED,
    "llamacpp:spec_decode_num_accepted_tokens_per_pos_total": PER_POS,
}
KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
# Load gauges by engine: (running, waiting, KV usage 0..1) names; the first found wins.
LOAD_GAUGES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (
        (RUNNING,),
        ("vllm:num_requests_waiting",),
        (KV_USAGE, "vllm:gpu_cache_usage_perc"),
    ),
    "sglang": (("sglang:num_running_reqs",), ("sglang:num_queue_reqs",), ("sglang:token_usage",)),
    "llamacpp": (("llamacpp:requests_processing",), ("llamacpp:requests_deferred",), ()),
}
_RUNNING = {name for names in LOAD_GAUGES.values() for name in names[0]}
_WAITING = {name for names in LOAD_GAUGES.values() for name in names[1]}
_KV = {name for names in LOAD_GAUGES.values() for name in names[2]}


@dataclass(frozen=True, slots=True)
class MetricsSample:
    """One scrape of one backend. Counters are totals since the backend started."""

    t_ns: int  # perf_counter_ns when the body arrived
    unix_ns: int
    drafts: float | None  # None: the backend exposes no spec-decode counters
    draft_tokens: float | None
    accepted: float | None
    per_position: tuple[float, ...]
    kv_cache_usage_perc: float | None
    num_requests_running: float | None
    num_requests_waiting: float | None = None


@dataclass(frozen=True, slots=True)
class WindowStats:
    """Acceptance of one backend over a window of samples (``None`` when nothing drafted)."""

    window_s: float
    samples: int
    drafts: float
    draft_tokens: float
    accepted: float
    draft_acceptance_rate: float | None
    mean_acceptance_length: float | None
    per_position: tuple[float | None, ...]


def parse_sample(text: str, *, t_ns: int, unix_ns: int) -> MetricsSample:
    """Parse a ``/metrics`` body (Prometheus text format)."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = LLAMACPP.get(s.name, s.name)
            if name == PER_POS:
                try:
                    pos = int(s.labels.get("position", ""))
                except ValueError:
                    continue
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            elif name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
                sums[name] = sums.get(name, 0.0) + s.value
            elif s.name in _RUNNING:
                sums["running"] = sums.get("running", 0.0) + s.value
            elif s.name in _WAITING:
                sums["waiting"] = sums.get("waiting", 0.0) + s.value
            elif s.name in _KV:
                sums["kv"] = max(sums.get("kv", 0.0), s.value)
    positions = tuple(per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)) if per_pos else ()
    return MetricsSample(
        t_ns=t_ns,
        unix_ns=unix_ns,
        drafts=sums.get(DRAFTS),
        draft_tokens=sums.get(DRAFT_TOKENS),
        accepted=sums.get(ACCEPTED),
        per_position=positions,
        kv_cache_usage_perc=sums.get("kv"),
        num_requests_running=sums.get("running"),
        num_requests_waiting=sums.get("waiting"),
    )


def _increase(prev: float | None, cur: float | None) -> float:
    if prev is None or cur is None:
        return 0.0
    return cur if cur < prev else cur - prev  # a drop is a restart: count from zero


def window_stats(samples: Sequence[MetricsSample]) -> WindowStats | None:
    """Rates over consecutive ``samples`` (oldest first); None with fewer than two."""
    if len(samples) < 2:
        return None
    drafts = draft_tokens = accepted = 0.0
    width = max(len(s.per_position) for s in samples)
    pos = [0.0] * width
    for prev, cur in pairwise(samples):
        drafts += _increase(prev.drafts, cur.drafts)
        draft_tokens += _increase(prev.draft_tokens, cur.draft_tokens)
        accepted += _increase(prev.accepted, cur.accepted)
        for i in range(len(cur.per_position)):
            before = prev.per_position[i] if i < len(prev.per_position) else 0.0
            pos[i] += _increase(before, cur.per_position[i])
    return WindowStats(
        window_s=(samples[-1].t_ns - samples[0].t_ns) / 1e9,
        samples=len(samples),
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted=accepted,
        draft_acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        mean_acceptance_length=1.0 + accepted / drafts if drafts else None,
        per_position=tuple(p / drafts if drafts else None for p in pos),
    )


@dataclass(frozen=True, slots=True)
class BackendSnapshot:
    """What the scraper knows about one backend right now."""

    name: str
    url: str
    up: bool  # the last poll succeeded
    polls: int
    failures: int  # polls that failed after retries, in total
    last_error: str | None
    last_success_unix_ns: int | None
    window: WindowStats | None
    kv_cache_usage_perc: float | None
    num_requests_running: float | None


def window_json(snap: BackendSnapshot | None) -> dict[str, Any] | None:
    """The record's ``legs[].acceptance.backend_window``: the scraper's window of one backend."""
    if snap is None or snap.window is None:
        return None
    w = snap.window
    return {
        "source": "prometheus",
        "window_s": w.window_s,
        "draft_acceptance_rate": w.draft_acceptance_rate,
        "mean_acceptance_length": w.mean_acceptance_length,
        "per_position": list(w.per_position),
        "kv_cache_usage_perc": snap.kv_cache_usage_perc,
        "num_requests_running": snap.num_requests_running,
    }


@dataclass(slots=True)
class _Target:
    name: str
    url: str
    samples: deque[MetricsSample]
    polls: int = 0
    failures: int = 0
    up: bool = False
    last_error: str | None = None
    last: MetricsSample | None = field(default=None)


class MetricsScraper:
    """Polls ``targets`` (name → ``/metrics`` URL) every ``interval_s``; see the module doc.

    ``run()`` loops until cancelled; ``snapshot()`` is cheap and safe to call from another thread
    (it only reads references that the loop replaces whole).
    """

    def __init__(
        self,
        targets: Mapping[str, str],
        interval_s: float = 1.0,
        *,
        window_s: float = 300.0,
        max_samples: int = 1024,
        timeout_s: float = 5.0,
        attempts: int = 3,
        retry_initial_s: float = 0.1,
        retry_max_s: float = 2.0,
        keepalive_s: float = BACKEND_KEEPALIVE_S,
    ) -> None:
        """``keepalive_s``: how long an idle connection to a backend is kept between scrapes
        (the gateway's ``upstream.keepalive_s``: below the backends' own keep-alive)."""
        self.interval_s = interval_s
        self._keepalive_s = keepalive_s
        self.window_s = window_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._attempts = max(1, attempts)
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._targets = {
            name: _Target(name, url, deque(maxlen=max(2, max_samples)))
            for name, url in targets.items()
        }
        self._snapshot: Mapping[str, BackendSnapshot] = {}

    async def run(self) -> None:
        """Poll until cancelled. One session for all targets; failures never end the loop."""
        connector = aiohttp.TCPConnector(keepalive_timeout=self._keepalive_s)
        async with aiohttp.ClientSession(timeout=self._timeout, connector=connector) as session:
            while True:
                await self.poll_once(session)
                await asyncio.sleep(self.interval_s)

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._poll(session, t) for t in self._targets.values()))
        self._snapshot = {name: self._snap(t) for name, t in self._targets.items()}

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> str:
        retrying = AsyncRetrying(
            retry=retry_if_exception_type((aiohttp.ClientError, TimeoutError)),
            stop=stop_after_attempt(self._attempts),
            wait=wait_exponential_jitter(
                multiplier=self._retry_initial_s,
                max=self._retry_max_s,
                jitter=self._retry_initial_s,
            ),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                async with session.get(url) as resp:
                    resp.raise_for_status()
                    return await resp.text()
        raise AssertionError("unreachable: tenacity reraises")  # pragma: no cover

    async def _poll(self, session: aiohttp.ClientSession, target: _Target) -> None:
        target.polls += 1
        try:
            text = await self._fetch(session, target.url)
            sample = parse_sample(text, t_ns=time.perf_counter_ns(), unix_ns=time.time_ns())
        except Exception as exc:  # a poll failure of any kind must not end the scraper's loop
            if not isinstance(exc, aiohttp.ClientError | TimeoutError | ValueError):
                log.warning("unexpected scrape failure for %s", target.name, exc_info=True)
            target.failures += 1
            target.up = False
            target.last_error = f"{type(exc).__name__}: {exc}"
            log.debug("scrape of %s (%s) failed: %r", target.name, target.url, exc)
            return
        target.up = True
        target.last_error = None
        target.last = sample
        target.samples.append(sample)

    def _snap(self, target: _Target) -> BackendSnapshot:
        last = target.last
        horizon = (last.t_ns if last else 0) - int(self.window_s * 1e9)
        recent = [s for s in target.samples if s.t_ns >= horizon]
        return BackendSnapshot(
            name=target.name,
            url=target.url,
            up=target.up,
            polls=target.polls,
            failures=target.failures,
            last_error=target.last_error,
            last_success_unix_ns=last.unix_ns if last else None,
            window=window_stats(recent),
            kv_cache_usage_perc=last.kv_cache_usage_perc if last else None,
            num_requests_running=last.num_requests_running if last else None,
        )

    def snapshot(self) -> Mapping[str, BackendSnapshot]:
        """The latest per-backend state (name → snapshot), as of the last completed poll."""
        return self._snapshot

    def recent_acceptance(self, name: str) -> list[tuple[int, float]]:
        """Backend ``name``'s mean acceptance length over each interval between consecutive
        scrapes that drafted: ``(t_ns of the later scrape, 1 + Δaccepted / Δdrafts)``, oldest
        first (a counter reset skips its interval)."""
        target = self._targets.get(name)
        if target is None:
            return []
        out = []
        for a, b in pairwise(list(target.samples)):
            if a.drafts is None or b.drafts is None or a.accepted is None or b.accepted is None:
                continue
            drafts, accepted = b.drafts - a.drafts, b.accepted - a.accepted
            if drafts > 0 and accepted >= 0:
                out.append((b.t_ns, 1.0 + accepted / drafts))
        return out

    def recent_kv(self, name: str, n: int = 3) -> list[float]:
        """Backend ``name``'s last ``n`` scraped KV-cache usages (0..1), oldest first."""
        target = self._targets.get(name)
        if target is None:
            return []
        values = [s.kv_cache_usage_perc for s in list(target.samples)[-n:]]
        return [v for v in values if v is not None]

    def nearest(self, name: str, unix_ns: int, *, max_age_s: float = 5.0) -> MetricsSample | None:
        """The sample of backend ``name`` closest in time to ``unix_ns`` (None: none that close).

        Safe from another thread: it copies the backend's sample history (a deque the poller
        appends to) before searching it.
        """
        target = self._targets.get(name)
        if target is None:
            return None
        samples = list(target.samples)
        if not samples:
            return None
        times = [s.unix_ns for s in samples]
        i = bisect_left(times, unix_ns)
        best = min(
            (samples[j] for j in (i - 1, i) if 0 <= j < len(samples)),
            key=lambda s: abs(s.unix_ns - unix_ns),
        )
        return best if abs(best.unix_ns - unix_ns) <= max_age_s * 1e9 else None
