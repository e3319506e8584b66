"""Plain token events recognised from their bytes: events whose only news is that a token
arrived, which the relay counts without parsing (``proxy.stream_inspect``).

``plain_token_event`` tests one event, ``plain_token_run`` a read of several. ``token_shape``
cuts a plain event around its token's text, and ``shaped_events`` finds the events of a read
that are that shape around other texts: a backend writes a stream's token events alike but for
their text, so after the first the rest are compared rather than tested whole.
"""

from __future__ import annotations

from proxy.backends.apis import MESSAGES, RESPONSES
from proxy.backends.base import COMPLETIONS, NATIVE_COMPLETION

# Byte patterns of a plain token event, one whose only news is that a token arrived. A pattern
# with quotes can only occur in the raw JSON as a key (inside a string its quotes are escaped).
_CHAT_TOKENS: tuple[bytes, ...] = (
    b'"content":"',
    b'"reasoning_content":"',
    b'"reasoning":"',
    b'"tool_calls":[',
)
_TEXT_TOKENS: tuple[bytes, ...] = (b'"text":"',)
_NATIVE_TOKENS: tuple[bytes, ...] = (b'"content":"',)
_NEWS = (b'"usage"', b'"timings"', b'"error"')
"""Keys that make an event worth parsing: usage, timings or an error to read."""
_BACKSLASH = ord("\\")


# The Responses and Messages APIs: an ``event:`` line, then the data line of a visible token.
_API_TOKENS: dict[str, tuple[bytes, bytes, bytes]] = {
    RESPONSES: (b"event: response.output_text.delta\ndata: {", b'"delta":"', b""),
    MESSAGES: (b"event: content_block_delta\ndata: {", b'"text":"', b'"type":"text_delta"'),
}


def _plain_api_event(event: bytes, head: bytes, pattern: bytes, marker: bytes) -> bool:
    if (
        not event.startswith(head)
        or event.find(b"\n", len(head)) < len(event) - 2
        or not event.endswith(b"\n\n")
    ):
        return False  # not exactly the event line and one data line ending in "\n\n"
    if marker and marker not in event:
        return False
    for key in _NEWS:
        if key in event:
            return False
    at = event.find(pattern)
    return at >= 0 and event[at + len(pattern) : at + len(pattern) + 1] != b'"'


def plain_token_event(event: bytes, route: str) -> bool:
    """True when ``event`` is certainly one ``data:`` line carrying a token and nothing else.

    Such events are most of a stream and need no parsing once the first visible token has been
    timed: every other event (a finish reason, usage, timings, an error, several data lines,
    anything unexpected) answers False and is parsed as before. On the Responses and Messages
    routes, the event is a text delta: its ``event:`` line and one data line.
    """
    api = _API_TOKENS.get(route)
    if api is not None:
        return _plain_api_event(event, *api)
    if (
        not event.startswith(b"data: {")
        or event.find(b"\n") < len(event) - 2
        or not event.endswith(b"\n\n")
    ):
        # Not one data line ending in a blank line ("\n\n"); a read may also stop one line
        # break short of it (the event's end comes with the next read).
        return False
    marker, patterns = _data_patterns(route)
    if marker not in event:
        return False
    for key in _NEWS:
        if key in event:
            return False
    return _carries_token(event, patterns)


def _data_patterns(route: str) -> tuple[bytes, tuple[bytes, ...]]:
    """A plain data event's marker (nothing finishes) and token keys on ``route``."""
    if route == NATIVE_COMPLETION:
        return b'"stop":false', _NATIVE_TOKENS
    return b'"finish_reason":null', _TEXT_TOKENS if route == COMPLETIONS else _CHAT_TOKENS


def token_shape(event: bytes, route: str) -> tuple[bytes, bytes] | None:
    """``event`` (one ``plain_token_event`` passes) cut around the text of the token it
    carries: the bytes before the string's first character, and from its closing quote on.
    None when the token is not a string (a tool call's delta).

    Any event that is the same two parts around other text, with no quote, no line break and
    no backslash at its end, is then plain too: it is the same JSON with another string in the
    same place (``StreamInspector`` compares that instead of testing each event whole). As with
    the byte test, the string itself is not checked: a backend's malformed escape is counted
    as a token, not parsed and refused.
    """
    api = _API_TOKENS.get(route)
    patterns = (api[1],) if api is not None else _data_patterns(route)[1]
    for pattern in patterns:
        at = event.find(pattern)
        start = at + len(pattern)
        if at < 0 or event[start : start + 1] in (b'"', b"]"):
            continue
        if not pattern.endswith(b'"'):
            return None  # (a tool call's array)
        end = start
        while True:  # the closing quote: one not escaped by an odd run of backslashes
            end = event.find(b'"', end)
            if end < 0:
                return None
            run = end
            while event[run - 1] == _BACKSLASH:
                run -= 1
            if (end - run) % 2 == 0:
                return event[:start], event[end:]
            end += 1
    return None


def _carries_token(event: bytes, patterns: tuple[bytes, ...]) -> bool:
    """Whether a token key of ``patterns`` in ``event`` has a non-empty value."""
    for pattern in patterns:
        at = event.find(pattern)
        if at >= 0 and event[at + len(pattern) : at + len(pattern) + 1] not in (b'"', b"]"):
            return True
    return False


def plain_token_run(chunk: bytes, route: str) -> int:
    """How many events ``chunk`` holds when it is whole events, each of which
    ``plain_token_event`` would pass; else 0.

    Under load one upstream read often carries several token events. A chunk without ``\r``
    that ends in a blank line splits into exactly the events the ``EventSplitter`` would cut
    (``\n\n`` is then the only separator), so the events are checked in place, and the keys no
    plain event may hold are searched once over the whole chunk (none of them contains a line
    break, so none can span two events).
    """
    if b"\r" in chunk or not chunk.endswith(b"\n\n") or chunk.endswith(b"\n\n\n"):
        return 0  # (a third line break at the end would stay in the splitter)
    for key in _NEWS:
        if key in chunk:
            return 0
    parts = chunk.split(b"\n\n")
    parts.pop()  # what follows the last separator: nothing
    api = _API_TOKENS.get(route)
    if api is not None:
        for part in parts:
            if not _plain_api_event(part + b"\n\n", *api):
                return 0
        return len(parts)
    if chunk.count(b"\n") != 2 * len(parts):
        return 0  # an event of more than one line (each ends in two line breaks)
    marker, patterns = _data_patterns(route)
    for part in parts:
        if not part.startswith(b"data: {") or marker not in part:
            return 0
        if not _carries_token(part, patterns):
            return 0
    return len(parts)


def shaped_events(data: bytes, shape: tuple[bytes, bytes]) -> int:
    """How many events ``data`` is, each the ``shape``'s head, a text and its tail, with
    nothing before, between or after them; 0 when it is not that.

    Walked in place: a text runs to the next quote (it holds none) and must be followed by the
    tail; it is not empty, holds no line break and does not end in a backslash. Each event is
    then the shape's own event with another string in the same place (``token_shape``): as
    plain as it was. Each also ends with the one blank line it holds (the shape's event had no
    other line break but an API event's ``event:`` line, in its head), so, when ``data`` holds
    no ``\r``, the ``EventSplitter`` cuts it into exactly these events.
    """
    head, tail = shape
    size, events, pos = len(data), 0, 0
    while pos < size and data.startswith(head, pos):
        start = pos + len(head)
        end = data.find(b'"', start)
        if (
            end <= start
            or not data.startswith(tail, end)
            or data[end - 1] == _BACKSLASH
            or data.find(b"\n", start, end) >= 0
        ):
            return 0
        pos = end + len(tail)
        events += 1
    return events if pos == size else 0
