"""The benchmark client's pure analysis: event splitting, ttft, coalesced and stalled detection."""

from __future__ import annotations

import json

from bench.analysis import analyze, split_events
from bench.client import Read, StreamResult
from bench.tables import render_table

MS = 1_000_000
ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}


def event(sent_ns: int, obj: object) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj)
    return b": sent_ns=%d\ndata: %s\n\n" % (sent_ns, data.encode())


def token(text: str) -> dict[str, object]:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def result(*reads: tuple[int, bytes], status: int = 200) -> StreamResult:
    return StreamResult(
        arm="a",
        index=0,
        warmup=False,
        t_send_ns=0,
        end_ns=reads[-1][0] if reads else 0,
        status=status,
        error=None,
        reads=tuple(Read(t, b) for t, b in reads),
    )


def test_an_event_split_across_reads_is_timed_by_the_read_that_completes_it():
    raw = event(1 * MS, token("Hi"))
    events = split_events([Read(2 * MS, raw[:7]), Read(3 * MS, raw[7:])])
    assert [(e.recv_ns, e.sent_ns, e.text, e.read_index) for e in events] == [
        (3 * MS, 1 * MS, "Hi", 1)
    ]


def test_ttft_is_the_first_event_with_content_not_the_role_chunk():
    m = analyze(
        result(
            (2 * MS, event(1 * MS, ROLE)),
            (25 * MS, event(24 * MS, token("a"))),
            (45 * MS, event(44 * MS, token("b")) + event(44 * MS, "[DONE]")),
        )
    )
    assert m.error is None
    assert m.ttft_ns == 25 * MS and m.e2e_ns == 45 * MS
    assert m.chunk_gaps_ns == (20 * MS,) and m.sent_gaps_ns == (20 * MS,)
    assert m.text == "ab" and m.output_events == 2 and m.reads == 3


def test_output_events_sent_5ms_apart_but_read_together_are_coalesced():
    m = analyze(
        result(
            (
                50 * MS,
                event(20 * MS, token("a")) + event(40 * MS, token("b")) + event(41 * MS, "[DONE]"),
            )
        )
    )
    assert m.coalesced == 1
    assert m.chunk_gaps_ns == (0,)


def test_output_events_sent_together_and_read_together_are_not_coalesced():
    m = analyze(
        result(
            (
                50 * MS,
                event(49 * MS, token("a"))
                + event(49 * MS + 10, token("b"))
                + event(49 * MS, "[DONE]"),
            )
        )
    )
    assert m.coalesced == 0 and m.stalled == 0


def test_an_event_delivered_more_than_10ms_after_it_was_sent_is_stalled():
    m = analyze(result((12 * MS, event(1 * MS, token("a"))), (13 * MS, event(12 * MS, "[DONE]"))))
    assert m.stalled == 1
    assert m.delivery_ns == (11 * MS, 1 * MS)


def test_a_stream_without_done_or_with_a_bad_status_is_an_error():
    assert analyze(result((1 * MS, event(0, token("a"))))).error == "no [DONE]"
    assert analyze(result((1 * MS, b"{}"), status=500)).error == "status 500"
    assert analyze(result((1 * MS, event(0, "[DONE]")))).error == "no output"


def test_tables_right_align_numbers_and_left_align_text():
    table = render_table("T", ("arm", "ms"), [("a", 1.5), ("long-arm", None)])
    lines = table.splitlines()
    assert lines[4] == "a         1.500"
    assert lines[5] == "long-arm      -"
