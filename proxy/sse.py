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


class EventSplitter:
    """Incremental splitter: feed bytes, get back complete events (with their separators)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        """Yield every event completed by ``chunk``; keep the unfinished tail."""
        buf = self._buf + chunk if self._buf else chunk
        pos = 0
        for m in _BOUNDARY.finditer(buf):
            yield buf[pos : m.end()]
            pos = m.end()
        self._buf = buf[pos:]

    def flush(self) -> bytes:
        """Whatever is left when the stream ends (an event without its final blank line)."""
        rest, self._buf = self._buf, b""
        return rest

    @property
    def pending(self) -> int:
        return len(self._buf)


def event_data(event: bytes) -> bytes | None:
    """The joined ``data:`` payload of one event, or None for comment-only events."""
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
