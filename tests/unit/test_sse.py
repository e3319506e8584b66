"""SSE splitting and data extraction: exact bytes out, whatever the chunking."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.sse import EventSplitter, event_data

STREAM = (
    b":\n\n"
    b'data: {"a":1}\n\n'
    b'event: x\r\ndata: {"b":2}\r\n\r\n'
    b"data: one\rdata: two\r\r"
    b"data: [DONE]\n\n"
)


def split_all(chunks: list[bytes]) -> tuple[list[bytes], bytes]:
    sp = EventSplitter()
    out: list[bytes] = []
    for c in chunks:
        out.extend(sp.feed(c))
    return out, sp.flush()


def test_events_keep_their_bytes() -> None:
    """Each event comes back with its own separator; joined, they are the input."""
    events, rest = split_all([STREAM])
    assert len(events) == 5
    assert b"".join(events) == STREAM
    assert rest == b""


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM)), max_size=10))
def test_chunking_does_not_matter(cuts: list[int]) -> None:
    """Any cut of the byte stream yields the same events."""
    points = sorted(set(cuts))
    chunks = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    assert split_all(chunks) == split_all([STREAM])


def test_separator_split_across_chunks() -> None:
    """A blank line split between two chunks still ends the event."""
    events, _ = split_all([b'data: {"a":1}\n', b"\ndata: 2\n\n"])
    assert events == [b'data: {"a":1}\n\n', b"data: 2\n\n"]


def test_unterminated_tail_is_flushed() -> None:
    """An event without its final blank line is handed back by flush(), not lost."""
    sp = EventSplitter()
    assert list(sp.feed(b"data: 1\n\ndata: 2")) == [b"data: 1\n\n"]
    assert sp.pending == len(b"data: 2")
    assert sp.flush() == b"data: 2"
    assert sp.flush() == b""


def test_event_data() -> None:
    """data: payloads are joined by newlines; one leading space dropped; comments ignored."""
    assert event_data(b'data: {"a":1}\n\n') == b'{"a":1}'
    assert event_data(b"data:x\ndata:  y\n\n") == b"x\n y"
    assert event_data(b"event: ping\r\ndata: z\r\n\r\n") == b"z"
    assert event_data(b":\n\n") is None
    assert event_data(b": data is coming\n\n") is None
    assert event_data(b"id: 3\n\n") is None
