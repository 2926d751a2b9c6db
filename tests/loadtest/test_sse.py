"""loadtest/sse.py: the event-stream framing, whatever the network reads' boundaries."""

from __future__ import annotations

from loadtest.sse import SSEDecoder

STREAM = (b'data: {"a": 1}\n\n'
          b": keep-alive comment\n\n"
          b"data: two\r\ndata: lines\r\n\r\n"
          b"event: ignored\rid: 7\rdata:no-space \xc3\xa9t\xc3\xa9\r\r"
          b"data: [DONE]\n\n")
EVENTS = ['{"a": 1}', "two\nlines", "no-space \u00e9t\u00e9", "[DONE]"]


def decode(*reads: bytes) -> list[str]:
    decoder = SSEDecoder()
    events = [e for read in reads for e in decoder.feed(read)]
    return events + decoder.close()


def test_events_comments_multi_line_data_and_every_line_ending():
    assert decode(STREAM) == EVENTS


def test_a_read_may_stop_anywhere_even_inside_a_crlf_or_a_utf8_character():
    for cut in range(1, len(STREAM)):
        assert decode(STREAM[:cut], STREAM[cut:]) == EVENTS, STREAM[:cut]


def test_byte_by_byte_reads_give_the_same_events_and_each_as_soon_as_its_blank_line_arrives():
    decoder = SSEDecoder()
    seen = []
    for i in range(len(STREAM)):
        seen.append(decoder.feed(STREAM[i:i + 1]))
    assert [e for events in seen for e in events] == EVENTS
    first_blank_line = STREAM.index(b"\n\n") + 1
    assert seen[first_blank_line] == ['{"a": 1}'] and not any(seen[:first_blank_line])


def test_an_event_the_server_did_not_end_with_a_blank_line_comes_out_at_close():
    decoder = SSEDecoder()
    assert decoder.feed(b"data: last") == []
    assert decoder.close() == ["last"]
    assert decode(b"data: x\n") == ["x"]


def test_events_without_data_and_empty_reads_give_nothing():
    assert decode(b"", b"event: ping\n\n", b"\n\n", b"") == []
