"""Server-sent events, seen by a relay that must not change them.

``EventSplitter`` cuts a byte stream into whole events (blank-line separated, any of the three
line endings SSE allows) and hands back the exact bytes of each, so the relay forwards them
untouched. ``event_data`` pulls the ``data:`` payload out of one event for inspection; comment
lines (``:`` pings) and other fields are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LONGEST_SEPARATOR = 4


class EventSplitter:
    """Incremental splitter: feed bytes, get back complete events (with their separators).

    Linear in the bytes fed, however long an event is: the unfinished tail grows in place and
    only its new bytes (plus the three before them, where a separator may have begun) are
    searched, so a multi-megabyte event arriving in small chunks does not stall the event loop.
    """

    __slots__ = ("_buf", "_scanned")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._scanned = 0  # bytes of the tail already searched for a separator

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """Yield every event completed by ``chunk``; keep the unfinished tail."""
        buf = self._buf
        if not buf and b"\r" not in chunk:
            # The commonest case: nothing carried over and only "\n" line ends, so "\n\n" is
            # the one separator and a plain split cuts exactly where the pattern would.
            events = chunk.split(b"\n\n")
            rest = events.pop()
            for event in events:
                yield event + b"\n\n"
            if rest:
                buf += rest
            self._scanned = len(buf)
            return
        if not buf:  # events arrive whole, nothing is carried over
            pos = 0
            for m in _BOUNDARY.finditer(chunk):
                yield chunk[pos : m.end()]
                pos = m.end()
            buf += memoryview(chunk)[pos:]
            self._scanned = len(buf)
            return
        start = max(self._scanned - _LONGEST_SEPARATOR + 1, 0)
        buf += chunk
        pos = 0
        for m in _BOUNDARY.finditer(buf, start):
            yield bytes(buf[pos : m.end()])
            pos = m.end()
        del buf[:pos]
        self._scanned = len(buf)

    def flush(self) -> bytes:
        """Whatever is left when the stream ends (an event without its final blank line)."""
        rest = bytes(self._buf)
        self._buf.clear()
        self._scanned = 0
        return rest

    @property
    def pending(self) -> int:
        return len(self._buf)


def event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` payload of one event, or None for comment-only events."""
    if (
        event.startswith(b"data: ")
        and event.find(b"\n") == len(event) - 2
        and event.endswith(b"\n\n")
        and b"\r" not in event
    ):
        return event[6:-2]  # the usual event: one data line (what the lines below give)
    if b"data" not in event:
        return None
    parts: list[bytes] = []
    for line in event.splitlines():
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    if not parts:
        return None
    return b"\n".join(parts)
