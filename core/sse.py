"""SSE decoding: bytes of a ``text/event-stream`` body in, events out (pure, no I/O).

Sits on the tee, *after* each chunk has been written to the client, so it never adds latency to
the primary stream; it still runs once per network chunk of every leg, so it is written for speed.

Follows the WHATWG event-stream parsing rules (the same semantics as httpx-sse and the openai
SDK's decoder), with these traps recorded:

- Line ends are CRLF, LF and CR only. ``str.splitlines`` would also split on U+2028, U+0085 and
  friends, which are legal *inside* a JSON string in a ``data:`` line, so lines are split on bytes.
- A CR at the end of one chunk and an LF at the start of the next are ONE line end.
- Bytes may be split anywhere, including inside a multi-byte UTF-8 character. Lines are decoded
  only once complete; line ends are ASCII and never occur inside a UTF-8 sequence, so decoding
  complete lines gives exactly what an incremental UTF-8 decoder over the whole stream would
  (``errors="replace"``). A leading BOM is dropped, as the spec's "UTF-8 decode" does.
- No line-length limit. An unterminated line is kept as a list of pieces and joined once when its
  line end arrives; each byte is scanned once, so total work is O(n) even for multi-MiB lines.
- An event whose data buffer is empty is not dispatched (spec); httpx-sse dispatches it anyway.
- At end of stream an unterminated event is discarded (spec); :attr:`SSEDecoder.incomplete_at_eof`
  records that it happened so a recorder can say the stream was cut.
- Comment lines are counted and dropped (spec). ``SSEDecoder(keep_comments=True)`` also keeps
  their text in :attr:`SSEDecoder.comment_lines` (the benchmarks read the simulator's
  ``: sent_ns=`` stamps that way). Off, it costs a comment line one ``is None`` test and data
  lines and the one-event fast path nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["RawEvent", "SSEDecoder", "SSEEvent"]

# (data, event, id, retry): a dispatched event before decoding; see SSEDecoder.feed_raw.
RawEvent = tuple[bytes, bytes | None, str | None, int | None]

# Order matters: CRLF must win over a lone CR.
_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
_CR = 0x0D
_LF = 0x0A
_COLON = 0x3A


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched server-sent event.

    ``id`` is the stream's last event ID at dispatch time (it persists across events, per spec);
    ``retry`` is set only on the event whose field block carried a valid ``retry:``.
    """

    event: str
    data: str
    id: str | None
    retry: int | None


class SSEDecoder:
    """Incremental decoder: :meth:`feed` network chunks, get the events they completed."""

    __slots__ = (
        "_at_start",
        "_data",
        "_event",
        "_last_id",
        "_pending",
        "_pending_len",
        "_retry",
        "_skip_lf",
        "comment_lines",
        "comments",
        "incomplete_at_eof",
    )

    def __init__(self, *, keep_comments: bool = False) -> None:
        self._pending: list[bytes] = []  # pieces of the current unterminated line
        self._pending_len = 0
        self._skip_lf = False  # the previous chunk ended in CR: a leading LF is part of it
        self._at_start = True  # no complete line yet (BOM check)
        self._data: list[bytes] = []
        self._event: bytes | None = None
        self._last_id: str | None = None
        self._retry: int | None = None
        self.comments = 0  # comment lines seen (``:`` pings, vLLM/OpenAI keep-alives)
        # keep_comments: each comment line's text, in stream order (after the ``:`` and one space)
        self.comment_lines: list[str] | None = [] if keep_comments else None
        self.incomplete_at_eof = False  # set by flush(): the stream ended mid-line or mid-event

    @property
    def pending_bytes(self) -> int:
        """Bytes of the current unterminated line held back (0 after a clean event boundary)."""
        return self._pending_len

    @property
    def in_event(self) -> bool:
        """True while fields of an event have been read but its dispatching blank line has not."""
        return bool(self._data) or self._event is not None or self._retry is not None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Decode one network chunk; returns the events whose blank line it completed."""
        return [
            SSEEvent(
                event=event.decode("utf-8", "replace") if event else "message",
                data=data.decode("utf-8", "replace"),
                id=id_,
                retry=retry,
            )
            for data, event, id_, retry in self.feed_raw(chunk)
        ]

    def feed_raw(self, chunk: bytes) -> list[RawEvent]:
        """Like :meth:`feed`, without building :class:`SSEEvent` objects (the recorder's hot path).

        Each item is ``(data, event, id, retry)``: ``data`` is the joined data buffer as UTF-8
        bytes (not yet decoded), ``event`` the raw event name or ``None`` for the default.
        """
        if not chunk:  # an empty read must not forget a CR that ended the previous chunk
            return []
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
                if not chunk:
                    return []
        if (  # Fast path: the chunk is exactly one `data: …\n\n` event, the usual shape.
            chunk.startswith(b"data: ")
            and chunk.find(b"\n") == len(chunk) - 2
            and chunk.endswith(b"\n\n")
            and not self._pending
            and not self._data
            and self._event is None
            and self._retry is None
            and b"\r" not in chunk
        ):
            self._at_start = False
            return [(chunk[6:-2], None, self._last_id, None)]
        if b"\r" in chunk:
            lines = _LINE_END.split(chunk)
            self._skip_lf = chunk[-1] == _CR
        else:
            lines = chunk.split(b"\n")
        tail = lines.pop()  # bytes after the last line end (b"" if the chunk ended with one)
        if not lines:
            self._pending.append(tail)
            self._pending_len += len(tail)
            return []
        if self._pending:
            self._pending.append(lines[0])
            lines[0] = b"".join(self._pending)
            self._pending = []
        if self._at_start:
            self._at_start = False
            if lines[0].startswith(_BOM):
                lines[0] = lines[0][3:]
        if tail:
            self._pending.append(tail)
            self._pending_len = len(tail)
        else:
            self._pending_len = 0

        events: list[RawEvent] = []
        data = self._data
        for line in lines:
            if not line:
                if data:
                    events.append(
                        (
                            data[0] if len(data) == 1 else b"\n".join(data),
                            self._event,
                            self._last_id,
                            self._retry,
                        )
                    )
                    data = self._data = []
                self._event = None
                self._retry = None
            elif line[0] == _COLON:
                self.comments += 1
                if self.comment_lines is not None:
                    self.comment_lines.append(
                        (line[2:] if line[1:2] == b" " else line[1:]).decode("utf-8", "replace")
                    )
            elif line.startswith(b"data:"):  # the hot case, spelled out
                data.append(line[6:] if line[5:6] == b" " else line[5:])
            else:
                self._field(line)
        return events

    def flush(self) -> list[SSEEvent]:
        """Signal end of stream. Per spec an unterminated event is discarded, so this returns
        no events; it sets :attr:`incomplete_at_eof` when one was cut off and resets the buffers."""
        self.incomplete_at_eof = self._pending_len > 0 or self.in_event
        self._pending = []
        self._pending_len = 0
        self._skip_lf = False
        self._data = []
        self._event = None
        self._retry = None
        return []

    def _field(self, line: bytes) -> None:
        colon = line.find(b":")
        if colon < 0:
            name, value = line, b""
        else:
            name = line[:colon]
            start = colon + 2 if line[colon + 1 : colon + 2] == b" " else colon + 1
            value = line[start:]
        if name == b"data":
            self._data.append(value)
        elif name == b"event":
            self._event = value
        elif name == b"id":
            if b"\x00" not in value:
                self._last_id = value.decode("utf-8", "replace")
        elif name == b"retry" and value.isdigit():  # bytes.isdigit is ASCII-only, per spec
            self._retry = int(value)
        # Any other field name is ignored (spec).
