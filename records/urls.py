"""A store named by URL, parsed once: ``sqlite:///PATH``, ``chdb:///DIR`` and
``clickhouse://[USER[:PASSWORD]@]HOST[:PORT]/DB``, each with ``?name=value`` options.

Two arguments name stores this way: ``--store`` (the records, :mod:`records.stores`: every
scheme, a plain path is SQLite) and ``--state`` (the rollout state a fleet shares,
:mod:`rollout.store`: ``sqlite`` or ``clickhouse``, a plain path is one process's JSON file).
Each says which schemes and options it takes; the rules of the URL itself — where the path, the
host, the port and the database are, what makes each one wrong — are written here alone, so the
two arguments cannot drift apart. Every error is one line naming the URL (without its query) and
what is wrong with it.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Collection
from dataclasses import dataclass, field

from core.faults import BadInput

CLICKHOUSE_PORT = 8123


class StoreURLError(BadInput, ValueError):
    """A store URL that cannot be used (the message says which part and why)."""


@dataclass(frozen=True)
class StoreURL:
    kind: str  # "sqlite" | "chdb" | "clickhouse"
    path: str = ""  # sqlite file, chdb folder
    host: str = ""
    port: int = CLICKHOUSE_PORT
    database: str = "default"
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    options: dict[str, str] = field(default_factory=dict)

    def label(self) -> str:
        """The URL without its password: what logs and errors print."""
        if self.kind == "clickhouse":
            who = f"{self.user}@" if self.user else ""
            return f"clickhouse://{who}{self.host}:{self.port}/{self.database}"
        if self.kind == "chdb":
            return f"chdb://{self.path}"
        return self.path

    def option(self, name: str, default: float, *, most: float | None = None) -> float:
        """The number option ``name`` (``default`` when absent): positive, at most ``most``."""
        text = self.options.get(name)
        if text is None:
            return default
        try:
            value = float(text)
        except ValueError:
            raise StoreURLError(
                f"{self.label()}: ?{name}= must be a number, got {text!r}"
            ) from None
        if value <= 0 or (most is not None and value > most):
            bound = "positive" if most is None else f"in (0, {most:g}]"
            raise StoreURLError(f"{self.label()}: ?{name}= must be {bound}, got {text!r}")
        return value


def parse_url(
    text: str,
    *,
    schemes: Collection[str],
    options: Collection[str],
    sqlite_example: str = "store.sqlite",
) -> StoreURL:
    """``text`` (which has a ``scheme://``) parsed; StoreURLError naming what is wrong.
    ``schemes``: the ones the caller takes; ``options``: the query names it knows."""
    bare = text.split("?", 1)[0]
    parts = urllib.parse.urlsplit(text)
    found = dict(urllib.parse.parse_qsl(parts.query))
    unknown = sorted(set(found) - set(options))
    if unknown:
        known = f" (known: {', '.join(sorted(options))})" if options else ""
        raise StoreURLError(f"{bare}: unknown option(s) {', '.join(unknown)}{known}")
    if parts.scheme not in schemes:
        listed = ", ".join(f"{s}://" for s in schemes)
        raise StoreURLError(f"{bare}: unknown scheme {parts.scheme!r} (a path, {listed})")
    if parts.scheme == "sqlite":
        path = parts.netloc + parts.path
        if not path:
            raise StoreURLError(f"{text}: no file path (sqlite:///path/to/{sqlite_example})")
        return StoreURL("sqlite", path=path, options=found)
    if parts.scheme == "chdb":
        if parts.netloc:
            raise StoreURLError(f"{text}: chdb URLs name a folder: chdb:///path/to/dir")
        if not parts.path:
            raise StoreURLError(f"{text}: no folder (chdb:///path/to/dir)")
        return StoreURL("chdb", path=parts.path, options=found)
    if not parts.hostname:
        raise StoreURLError(f"{text}: no host (clickhouse://host:{CLICKHOUSE_PORT}/db)")
    try:
        port = parts.port or CLICKHOUSE_PORT
    except ValueError:
        raise StoreURLError(f"{bare}: the port is not a number") from None
    database = parts.path.strip("/") or "default"
    if not database.replace("_", "").isalnum():
        raise StoreURLError(f"{text}: database name {database!r} is not a plain identifier")
    return StoreURL(
        "clickhouse",
        host=parts.hostname,
        port=port,
        database=database,
        user=urllib.parse.unquote(parts.username) if parts.username else None,
        password=urllib.parse.unquote(parts.password) if parts.password else None,
        options=found,
    )
