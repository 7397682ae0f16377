"""A stand-in for the OpenTelemetry Collector's ``file`` exporter behind an OTLP/HTTP receiver.

It receives OTLP/HTTP protobuf exactly like a collector's ``otlp`` receiver and writes each logs
export request as one line of OTLP/JSON — the encoding the contrib ``file`` exporter writes with
``format: json`` (``plog.JSONMarshaler``): proto3 JSON mapping with lowerCamelCase keys, 64-bit
integers as decimal strings, enums as integers, ``traceId``/``spanId`` as hex (not base64), empty
fields left out, one ``{"resourceLogs": [...]}`` object per line.
"""

from __future__ import annotations

import base64
import gzip
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from google.protobuf.json_format import MessageToDict  # type: ignore[import-untyped]
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2

from core import jsonx
from tests.receivers.otlp import OtlpHttpReceiver

_HEX_FIELDS = ("traceId", "spanId")


def otlp_json(request: logs_service_pb2.ExportLogsServiceRequest) -> dict[str, Any]:
    """One export request as the collector's file exporter encodes it."""
    obj = MessageToDict(request, use_integers_for_enums=True)

    def fix(node: Any) -> None:
        if isinstance(node, dict):
            for key in _HEX_FIELDS:
                if key in node:
                    node[key] = base64.b64decode(node[key]).hex()
            for value in node.values():
                fix(value)
        elif isinstance(node, list):
            for value in node:
                fix(value)

    fix(obj)
    return obj


class CollectorFile(OtlpHttpReceiver):
    """An OTLP/HTTP receiver that also appends every logs request to ``path`` as OTLP/JSON."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._write_lock = threading.Lock()

    async def _handle(self, request: web.Request) -> web.Response:
        if request.path == "/v1/logs":
            body = await request.read()
            if request.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            logs = logs_service_pb2.ExportLogsServiceRequest()
            logs.ParseFromString(body)
            with self._write_lock, self.path.open("ab") as f:
                f.write(jsonx.dumps(otlp_json(logs)) + b"\n")
        return await super()._handle(request)


@pytest.fixture
def collector_file(tmp_path: Path) -> Iterator[CollectorFile]:
    receiver = CollectorFile(tmp_path / "collector" / "records.jsonl")
    receiver.path.parent.mkdir(parents=True, exist_ok=True)
    with receiver:
        yield receiver
