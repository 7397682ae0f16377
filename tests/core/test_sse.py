"""SSE decoder: WHATWG event-stream parsing, incremental and split-independent."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from core.sse import SSEDecoder, SSEEvent


def decode(*chunks: bytes) -> tuple[list[SSEEvent], SSEDecoder]:
    decoder = SSEDecoder()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(decoder.feed(chunk))
    events.extend(decoder.flush())
    return events, decoder


def msg(
    data: str, *, event: str = "message", id: str | None = None, retry: int | None = None
) -> SSEEvent:
    return SSEEvent(event=event, data=data, id=id, retry=retry)


CASES: list[tuple[str, list[bytes], list[SSEEvent]]] = [
    # Single-event chunks take a fast path; state left by earlier chunks must still apply.
    ("one-event chunk after an event name", [b"event: e\n", b"data: a\n\n"], [msg("a", event="e")]),
    ("one-event chunk after retry", [b"retry: 5\n", b"data: a\n\n"], [msg("a", retry=5)]),
    ("one-event chunk after a data line", [b"data: a\n", b"data: b\n\n"], [msg("a\nb")]),
    ("one-event chunk keeps the last id", [b"id: 1\n\n", b"data: a\n\n"], [msg("a", id="1")]),
    ("one-event chunk after a partial line", [b"da", b"data: a\n\n"], []),
    (
        "bom after the first chunk is not stripped",
        [b"data: a\n\n", b"\xef\xbb\xbfdata: b\n\n"],
        [msg("a")],
    ),
    ("one-event chunk with empty data", [b"data: \n\n"], [msg("")]),
    ("lf", [b"data: a\n\n"], [msg("a")]),
    ("crlf", [b"data: a\r\n\r\n"], [msg("a")]),
    ("cr", [b"data: a\r\r"], [msg("a")]),
    ("mixed line ends", [b"data: a\r\ndata: b\rdata: c\n\r\n"], [msg("a\nb\nc")]),
    (
        "cr and lf split across chunks are one line end",
        [b"data: a\r", b"\n", b"\r", b"\n"],
        [msg("a")],
    ),
    (
        "an empty chunk between cr and lf keeps them one line end",
        [b"data: a\r", b"", b"\ndata: b\r\n\r\n"],
        [msg("a\nb")],
    ),
    ("cr then lf-led chunk of more lines", [b"data: a\r", b"\ndata: b\n\n"], [msg("a\nb")]),
    (
        "u2028 and u0085 are not line breaks",
        ["data: a\u2028b\u0085c\n\n".encode()],
        [msg("a\u2028b\u0085c")],
    ),
    ("multi-line data joined by lf", [b"data: x\ndata:y\ndata:  z\n\n"], [msg("x\ny\n z")]),
    ("comments are skipped", [b": ping\n\n:\ndata: a\n: mid\n\n"], [msg("a")]),
    ("event name", [b"event: delta\ndata: a\n\n"], [msg("a", event="delta")]),
    ("empty event name means message", [b"event:\ndata: a\n\n"], [msg("a")]),
    (
        "event name resets after dispatch",
        [b"event: e\ndata: a\n\ndata: b\n\n"],
        [msg("a", event="e"), msg("b")],
    ),
    (
        "id persists across events",
        [b"id: 7\ndata: a\n\ndata: b\n\n"],
        [msg("a", id="7"), msg("b", id="7")],
    ),
    (
        "id with nul is ignored",
        [b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n"],
        [msg("a", id="1"), msg("b", id="1")],
    ),
    (
        "empty id resets",
        [b"id: 1\ndata: a\n\nid\ndata: b\n\n"],
        [msg("a", id="1"), msg("b", id="")],
    ),
    (
        "retry digits only",
        [b"retry: 3000\ndata: a\n\nretry: 1x\ndata: b\n\n"],
        [msg("a", retry=3000), msg("b")],
    ),
    ("field without colon", [b"data\ndata\n\n"], [msg("\n")]),
    ("only one leading space stripped", [b"data:   a\n\n"], [msg("  a")]),
    ("unknown fields ignored", [b"foo: bar\ndata: a\n\n"], [msg("a")]),
    ("empty data buffer is not dispatched", [b"event: x\n\nretry: 5\n\ndata: a\n\n"], [msg("a")]),
    ("data with empty value is dispatched", [b"data:\n\n"], [msg("")]),
    ("leading bom dropped", [b"\xef\xbb", b"\xbfdata: a\n\n"], [msg("a")]),
    ("bom only at start", [b"data: a\n\n\xef\xbb\xbfdata: b\n\n"], [msg("a")]),
    (
        "split multi-byte utf-8",
        [b"data: \xe2", b"\x82", b"\xac\xf0\x9f", b"\x98\x80\n\n"],
        [msg("€😀")],
    ),
    ("invalid utf-8 replaced", [b"data: \xff\xe2\x82\n\n"], [msg("\ufffd\ufffd")]),
    (
        "done sentinel is an ordinary event",
        [b"data: {}\n\ndata: [DONE]\n\n"],
        [msg("{}"), msg("[DONE]")],
    ),
    (
        "one byte at a time",
        [bytes([b]) for b in b"event: e\r\ndata: a\r\n\r\n"],
        [msg("a", event="e")],
    ),
    ("unterminated event discarded at eof", [b"data: a\n\ndata: b\n"], [msg("a")]),
    ("unterminated line discarded at eof", [b"data: a\n\ndata: b"], [msg("a")]),
]


@pytest.mark.parametrize(("chunks", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decoder_follows_event_stream_rules(chunks: list[bytes], expected: list[SSEEvent]) -> None:
    events, _ = decode(*chunks)
    assert events == expected


def test_comments_are_counted() -> None:
    _, decoder = decode(b": ping\n\n: ping\ndata: a\n\n:x\n")
    assert decoder.comments == 3


def test_events_are_returned_by_the_chunk_whose_blank_line_completes_them() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: a\n") == []
    assert decoder.feed(b"\ndata: b") == [msg("a")]
    assert decoder.pending_bytes == len(b"data: b")
    assert decoder.feed(b"\n\n") == [msg("b")]
    assert decoder.pending_bytes == 0


def test_clean_end_of_stream_is_not_incomplete() -> None:
    _, decoder = decode(b"data: a\n\n: trailing comment\n")
    assert not decoder.incomplete_at_eof


@pytest.mark.parametrize("tail", [b"data: b\n", b"data: b", b"event: x\n", b"data: b\r"])
def test_cut_stream_is_flagged_incomplete_at_eof(tail: bytes) -> None:
    events, decoder = decode(b"data: a\n\n", tail)
    assert events == [msg("a")]
    assert decoder.incomplete_at_eof


def test_five_mib_single_data_line_arrives_whole() -> None:
    payload = b"x" * (5 * 1024 * 1024)
    wire = b"data: " + payload + b"\r\n\r\n"
    chunks = [wire[i : i + 65536] for i in range(0, len(wire), 65536)]
    events, _ = decode(*chunks)
    assert len(events) == 1
    assert len(events[0].data) == len(payload)


# -- property: decoding does not depend on how the bytes were split ------------------------------

_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"], blacklist_characters="\r\n"),
    max_size=12,
)
_EVENTS = st.lists(
    st.tuples(
        st.lists(_TEXT, min_size=1, max_size=3),  # data lines
        st.sampled_from([None, "delta", "error"]),  # event name
        st.sampled_from([None, "1", "abc"]),  # id
        st.booleans(),  # a comment before the event
    ),
    max_size=5,
)
_ENDS = (b"\n", b"\r", b"\r\n")


@settings(max_examples=120, deadline=None)
@given(
    events=_EVENTS,
    end_choices=st.lists(st.integers(0, 2), min_size=40, max_size=40),
    cut_points=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_decoding_is_independent_of_chunk_boundaries(
    events: list[tuple[list[str], str | None, str | None, bool]],
    end_choices: list[int],
    cut_points: list[int],
) -> None:
    ends = iter(end_choices * 2)
    wire = bytearray()

    def line(content: bytes) -> None:
        wire.extend(content + _ENDS[next(ends)])

    expected: list[SSEEvent] = []
    last_id: str | None = None
    for lines, name, id_, comment in events:
        if comment:
            line(b": keep-alive")
        if name is not None:
            line(b"event: " + name.encode())
        if id_ is not None:
            line(b"id: " + id_.encode())
            last_id = id_
        for text in lines:
            line(b"data: " + text.encode())
        # A blank line right after a CR must not be a lone LF: CR+LF is one line end.
        blank = _ENDS[next(ends)]
        wire.extend(b"\r" if wire.endswith(b"\r") and blank == b"\n" else blank)
        expected.append(msg("\n".join(lines), event=name or "message", id=last_id))
    wire_bytes = bytes(wire)
    cuts = sorted(c % (len(wire_bytes) + 1) for c in cut_points)
    chunks = [wire_bytes[a:b] for a, b in zip([0, *cuts], [*cuts, len(wire_bytes)], strict=True)]

    whole, _ = decode(wire_bytes)
    split, decoder = decode(*chunks)
    assert whole == expected
    assert split == expected
    assert not decoder.incomplete_at_eof


def test_raw_events_carry_undecoded_data_and_metadata() -> None:
    decoder = SSEDecoder()
    raw = decoder.feed_raw(
        b"event: e\nid: 3\nretry: 10\ndata: a\ndata: \xe2\x82\xac\n\ndata: b\n\n"
    )
    assert raw == [("a\n€".encode(), b"e", "3", 10), (b"b", None, "3", None)]
