"""SSE splitting and data extraction: exact bytes out, whatever the chunking."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from proxy.sse import _BOUNDARY, EventSplitter, event_data

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


def reference_data(event: bytes) -> bytes | None:
    """``event_data`` by its lines alone: every ``data:`` line, one leading space dropped."""
    parts = [
        line[6:] if line.startswith(b"data: ") else line[5:]
        for line in event.splitlines()
        if line.startswith(b"data:")
    ]
    return b"\n".join(parts) if parts else None


@given(st.lists(st.sampled_from([b"data: ", b"data:", b"x", b"{}", b" ", b"\n", b"\r", b":"])))
def test_event_data_is_its_lines_data(pieces: list[bytes]) -> None:
    event = b"".join(pieces)
    for whole in (event, event + b"\n\n", b"data: " + event + b"\n\n"):
        assert event_data(whole) == reference_data(whole)


def reference_split(stream: bytes) -> tuple[list[bytes], bytes]:
    """Every event by the separator pattern alone, over the whole stream at once."""
    events, pos = [], 0
    for m in _BOUNDARY.finditer(stream):
        events.append(stream[pos : m.end()])
        pos = m.end()
    return events, stream[pos:]


pieces = st.lists(
    st.sampled_from([b"data: x", b"\n", b"\n\n", b"\r", b"\r\n", b":", b"{}", b"\n\n\n"]),
    max_size=30,
)


@given(pieces, st.lists(st.integers(min_value=0, max_value=120), max_size=8))
def test_any_stream_any_cut_splits_as_the_pattern_does(parts: list[bytes], cuts: list[int]) -> None:
    """Whatever the line ends (the split shortcut for "\n" only, the pattern otherwise) and
    wherever the reads are cut, the events are those the separator pattern finds."""
    stream = b"".join(parts)
    points = sorted({min(c, len(stream)) for c in cuts})
    bounds = zip([0, *points], [*points, len(stream)], strict=True)
    assert split_all([stream[a:b] for a, b in bounds]) == reference_split(stream)
