"""One ``/metrics`` for a gateway of several worker processes (``serve --workers N``).

A scrape reaches whichever worker the kernel hands the connection to, yet it must describe the
whole gateway. The design, chosen so a counter never goes backwards:

- **Snapshots on disk are the truth.** Every worker writes its own collection as JSON to
  ``<dir>/w<index>-<pid>.json`` (a temporary file and ``os.replace``: a reader sees the old
  snapshot or the new, never half) — every :data:`FLUSH_INTERVAL_S`, when a sibling asks, and
  when its telemetry shuts down (after the last exchange was counted).
- **A scrape asks, then reads.** The answering worker writes its own snapshot, asks every
  sibling over a private unix socket (``w<index>-<pid>.sock``, one line ``flush``) to write
  theirs now, waits for each answer (at most :data:`ASK_TIMEOUT_S`; a sibling that does not
  answer is read as of its last snapshot), then merges every file. Everything a scrape ever
  showed was on disk first.
- **A worker that is gone is folded.** The supervisor, when it reaps a worker, adds that worker's
  last snapshot's counters and histograms into ``retired.json`` (which lists the folded pids)
  and deletes its files; a scrape skips any file whose pid ``retired.json`` lists. So a crashed
  or restarted worker's counts stay in the sums (no counter reset for Prometheus' ``rate()``),
  and its gauges — which described a process that no longer exists — go away.

How families merge (one reading of every live snapshot plus the retired sums):

==================================  =======================================================
counter (monotonic sum)             summed per label set, retired workers included
up-down counter (non-monotonic)     summed per label set over live workers
gauge                               one series per worker: label ``specshadow_worker="<i>"``
histogram (explicit buckets)        bucket counts, sum and count added per label set (min,
                                    max: the extremes), retired workers included
==================================  =======================================================

The counts a worker made after its last snapshot are lost if it is killed (SIGKILL, OOM): at
most :data:`FLUSH_INTERVAL_S` of its traffic, never shown before, so never taken back.

:class:`FleetPullReader` is a :class:`~otel.prometheus.PullMetricReader` whose ``collect_now``
returns the merged data, so ``Telemetry.render_prometheus`` and the renderer are unchanged.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from core import jsonx
from otel.prometheus import PullMetricReader

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 2.0  # a worker's snapshot is at most this old when it is killed
ASK_TIMEOUT_S = 1.0  # per sibling, per scrape
WORKER_LABEL = "specshadow.worker"  # rendered specshadow_worker: a gauge's per-worker series
RETIRED = "retired.json"
_LOCK = "retired.lock"
_SCOPE = InstrumentationScope("specshadow.workers")

# One snapshot: {"worker": i, "pid": p, "unix": t, "metrics": [family, ...]} where a family is
# {"name", "unit", "description", "kind": counter|updown|gauge|histogram, "points": [...]}.
Snapshot = dict[str, Any]
Key = tuple[tuple[str, Any], ...]


def _key(attributes: Mapping[str, Any]) -> Key:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in attributes.items()))


def snapshot(data: MetricsData | None, *, worker: int, pid: int) -> Snapshot:
    """This process's collection as a JSON-able document (cumulative values)."""
    families: list[dict[str, Any]] = []
    for rm in data.resource_metrics if data is not None else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                family = _family(metric)
                if family is not None:
                    families.append(family)
    return {"worker": worker, "pid": pid, "unix": time.time(), "metrics": families}


def _family(metric: Metric) -> dict[str, Any] | None:
    data = metric.data
    head = {"name": metric.name, "unit": metric.unit, "description": metric.description}
    if isinstance(data, Histogram):
        points = [
            {
                "attributes": dict(p.attributes or {}),
                "bounds": list(p.explicit_bounds),
                "counts": list(p.bucket_counts),
                "sum": p.sum,
                "count": p.count,
                "min": p.min,
                "max": p.max,
            }
            for p in data.data_points
        ]
        return {**head, "kind": "histogram", "points": points}
    if isinstance(data, Sum):
        kind = "counter" if data.is_monotonic else "updown"
    elif isinstance(data, Gauge):
        kind = "gauge"
    else:  # exponential histograms: not used by specshadow's instruments
        return None
    values = [{"attributes": dict(p.attributes or {}), "value": p.value} for p in data.data_points]
    return {**head, "kind": kind, "points": values}


@dataclass(slots=True)
class _Merged:
    name: str
    unit: str
    description: str
    kind: str
    points: dict[Key, dict[str, Any]]


def merge(live: Sequence[Snapshot], retired: Sequence[Mapping[str, Any]] = ()) -> list[_Merged]:
    """Every family of ``live`` snapshots (and the ``retired`` counters and histograms) merged
    by the rules in this module's docstring, in first-seen order."""
    out: dict[str, _Merged] = {}
    sources: list[tuple[Mapping[str, Any], bool]] = [(s, True) for s in live]
    sources += [({"metrics": list(retired)}, False)]
    for snap, is_live in sources:
        for family in snap.get("metrics", ()):
            kind = family["kind"]
            if not is_live and kind not in ("counter", "histogram"):
                continue
            merged = out.get(family["name"])
            if merged is None:
                merged = out[family["name"]] = _Merged(
                    family["name"],
                    family.get("unit") or "",
                    family.get("description") or "",
                    kind,
                    {},
                )
            elif merged.kind != kind:
                log.warning("metric %s is a %s in one worker and a %s in another: the second is "
                            "left out", family["name"], merged.kind, kind)  # fmt: skip
                continue
            for point in family["points"]:
                attributes = dict(point["attributes"])
                if kind == "gauge":
                    attributes[WORKER_LABEL] = str(snap.get("worker"))
                _add(merged, _key(attributes), attributes, point)
    return list(out.values())


def _add(merged: _Merged, key: Key, attributes: dict[str, Any], point: Mapping[str, Any]) -> None:
    have = merged.points.get(key)
    if have is None:
        merged.points[key] = {**point, "attributes": attributes}
        if "counts" in point:
            merged.points[key]["counts"] = list(point["counts"])
        return
    if merged.kind == "histogram":
        if list(have["bounds"]) != list(point["bounds"]):
            log.warning("histogram %s has other buckets in one worker: left out", merged.name)
            return
        have["counts"] = [a + b for a, b in zip(have["counts"], point["counts"], strict=True)]
        have["sum"] += point["sum"]
        have["count"] += point["count"]
        have["min"] = _extreme(min, have.get("min"), point.get("min"))
        have["max"] = _extreme(max, have.get("max"), point.get("max"))
    else:
        have["value"] += point["value"]


def _extreme(pick: Any, a: float | None, b: float | None) -> float | None:
    values = [v for v in (a, b) if v is not None]
    return pick(values) if values else None


def metrics_data(families: Sequence[_Merged]) -> MetricsData:
    """The merged families as the SDK's ``MetricsData`` (what :func:`otel.prometheus.render`
    reads)."""
    now = time.time_ns()
    metrics: list[Metric] = []
    for f in families:
        data: Sum | Gauge | Histogram
        if f.kind == "histogram":
            data = Histogram(
                data_points=[
                    HistogramDataPoint(
                        attributes=p["attributes"],
                        start_time_unix_nano=0,
                        time_unix_nano=now,
                        count=p["count"],
                        sum=p["sum"],
                        bucket_counts=p["counts"],
                        explicit_bounds=p["bounds"],
                        min=p.get("min") or 0.0,
                        max=p.get("max") or 0.0,
                    )
                    for p in f.points.values()
                ],
                aggregation_temporality=AggregationTemporality.CUMULATIVE,
            )
        else:
            points = [
                NumberDataPoint(
                    attributes=p["attributes"],
                    start_time_unix_nano=0,
                    time_unix_nano=now,
                    value=p["value"],
                )
                for p in f.points.values()
            ]
            if f.kind == "gauge":
                data = Gauge(data_points=points)
            else:
                data = Sum(
                    data_points=points,
                    aggregation_temporality=AggregationTemporality.CUMULATIVE,
                    is_monotonic=f.kind == "counter",
                )
        metrics.append(Metric(f.name, f.description, f.unit, data))
    scope = ScopeMetrics(scope=_SCOPE, metrics=metrics, schema_url="")
    return MetricsData([ResourceMetrics(Resource.get_empty(), [scope], schema_url="")])


# --- the shared folder ---------------------------------------------------------------------------


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(jsonx.dumps(doc))
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        return jsonx.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError:  # cannot happen with os.replace; a foreign file: say so, go on
        log.warning("unreadable metrics snapshot %s: skipped", path)
        return None


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    with open(folder / _LOCK, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pid_of(path: Path) -> int | None:
    stem = path.name.split(".", 1)[0]
    try:
        return int(stem.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return None


def read_folder(folder: Path) -> tuple[list[Snapshot], list[dict[str, Any]]]:
    """(live snapshots, retired families). Worker files are read before ``retired.json`` and
    a file whose pid it lists is skipped, so a worker being folded right now is counted once."""
    files = sorted(folder.glob("w*-*.json"))
    live = [s for s in (_read_json(p) for p in files) if isinstance(s, dict)]
    retired = _read_json(folder / RETIRED) or {"folded": [], "metrics": []}
    folded = set(retired.get("folded", ()))
    return [s for s in live if s.get("pid") not in folded], list(retired.get("metrics", ()))


def retire(folder: Path, pid: int) -> bool:
    """Fold the last snapshot of worker ``pid`` (gone) into ``retired.json`` and delete its
    files. Called by the supervisor when it reaps a worker; False: it had written none."""
    files = list(folder.glob(f"w*-{pid}.json"))
    with _locked(folder):
        retired = _read_json(folder / RETIRED) or {"folded": [], "metrics": []}
        found = False
        for path in files:
            snap = _read_json(path)
            if not isinstance(snap, dict):
                continue
            found = True
            kept = [f for f in snap.get("metrics", ()) if f["kind"] in ("counter", "histogram")]
            folded = merge([], [*retired["metrics"], *kept])
            retired["metrics"] = [
                {
                    "name": f.name,
                    "unit": f.unit,
                    "description": f.description,
                    "kind": f.kind,
                    "points": list(f.points.values()),
                }
                for f in folded
            ]
        retired["folded"] = sorted({*retired.get("folded", ()), pid})
        _write_json(folder / RETIRED, retired)
    for path in [*files, *folder.glob(f"w*-{pid}.sock")]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return found


# --- the worker's side ---------------------------------------------------------------------------


class FleetPullReader(PullMetricReader):
    """A pull reader whose ``collect_now`` (``GET /metrics``) returns the whole gateway's
    metrics: this worker's, every sibling's (asked to flush first) and the retired workers'.

    :meth:`start` opens the flush socket and the periodic flush thread; the reader's
    ``shutdown`` (called when telemetry shuts down, after the last exchange) writes a final
    snapshot and stops both.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        worker: int,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        pid: int | None = None,  # tests: several "workers" in one process
        extra: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
    ) -> None:
        """``extra``: families (in the snapshot's format) that describe the set rather than one
        worker — the supervisor's restarts, the workers ready — added to every scrape as is."""
        super().__init__()
        self.extra = extra
        self.folder = Path(folder)
        self.worker = worker
        self.pid = pid if pid is not None else os.getpid()
        self.flush_interval_s = flush_interval_s
        self.path = self.folder / f"w{worker}-{self.pid}.json"
        self.socket_path = self.folder / f"w{worker}-{self.pid}.sock"
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._flush_lock = threading.Lock()

    def start(self) -> None:
        reader = self

        class _Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(64).strip()
                if line == b"flush":
                    reader.flush()
                    self.wfile.write(b"ok\n")

        with contextlib.suppress(FileNotFoundError):  # left by a process that had this pid
            self.socket_path.unlink()
        server = socketserver.ThreadingUnixStreamServer(str(self.socket_path), _Handler)
        server.daemon_threads = True
        self._server = server
        for target, name in ((server.serve_forever, "metrics-flush-socket"),
                             (self._flush_every, "metrics-flush-timer")):  # fmt: skip
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _flush_every(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        """Write this worker's snapshot now (safe from any thread; never raises)."""
        try:
            with self._flush_lock:
                data = super().collect_now()
                _write_json(self.path, snapshot(data, worker=self.worker, pid=self.pid))
        except Exception:  # telemetry never takes a worker down
            log.exception("metrics snapshot not written to %s", self.path)

    def ask_siblings(self) -> int:
        """Ask every other worker to flush; the number that answered in time."""
        answered = 0
        for sock_path in sorted(self.folder.glob("w*-*.sock")):
            if sock_path == self.socket_path:
                continue
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.settimeout(ASK_TIMEOUT_S)
                    s.connect(str(sock_path))
                    s.sendall(b"flush\n")
                    if s.recv(8).startswith(b"ok"):
                        answered += 1
            except OSError:  # gone, or slow: its last snapshot is read
                continue
        return answered

    def collect_now(self) -> MetricsData | None:
        self.flush()
        self.ask_siblings()
        live, retired = read_folder(self.folder)
        if self.extra is not None:
            try:
                live.append({"worker": None, "metrics": list(self.extra())})
            except Exception:  # telemetry never fails a scrape
                log.exception("the worker set's own metrics were left out")
        return metrics_data(merge(live, retired))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.flush()
