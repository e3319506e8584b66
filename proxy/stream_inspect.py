"""What the relay observes of a streamed answer, event by event, without rebuilding it.

``StreamInspector`` timestamps the first token, the first visible token and the last token,
reads usage and timings, and drops the usage-only event the proxy asked for on the client's
behalf (moving llama.cpp's ``timings`` back onto the finishing event). ``plain_token_event`` and
``plain_token_run`` recognise, from bytes alone, events whose only news is that a token arrived,
so that most of a stream is never parsed; once one has passed, the stream's next token events are
compared with its ``token_shape`` (the same bytes around another text) rather than tested whole.
The relay (``proxy.relay``) owns the sockets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from proxy.backends import EventKind
from proxy.backends.apis import MESSAGES, RESPONSES
from proxy.backends.base import COMPLETIONS, NATIVE_COMPLETION
from proxy.exchange import Exchange
from proxy.sse import event_data

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


_BACKSLASH = ord("\\")

SHAPE_MISSES = 3
"""Plain token events in a row a stream's shape may miss before it is given up
(``StreamInspector._plain``): "created", a second's clock in llama-server's chat events, moves
now and then; a field that moves with every event never lets a shape hold."""


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
    if route == NATIVE_COMPLETION:
        marker, patterns = b'"stop":false', _NATIVE_TOKENS
    else:
        marker = b'"finish_reason":null'
        patterns = _TEXT_TOKENS if route == COMPLETIONS else _CHAT_TOKENS
    for part in parts:
        if not part.startswith(b"data: {") or marker not in part:
            return 0
        if not _carries_token(part, patterns):
            return 0
    return len(parts)


class StreamInspector:
    """Looks at each SSE event on its way through; decides only whether it is forwarded.

    Events are parsed until the first visible token has been timed; after that, a plain token
    event (``plain_token_event``) is only counted, and everything else is still parsed.
    """

    __slots__ = ("_held", "_misses", "_shape", "ex")

    def __init__(self, ex: Exchange) -> None:
        self.ex = ex
        self._held: tuple[bytes, dict[str, Any]] | None = None
        self._shape: tuple[bytes, bytes] | None = None
        """The latest plain token event's ``token_shape``: the next ones are compared with it
        (a backend writes a stream's token events alike but for their text)."""
        self._misses = 0
        """Plain token events in a row tested whole (no shape yet, or the shape missed them);
        at ``SHAPE_MISSES`` the stream's events differ elsewhere too (llama.cpp's native
        ``tokens``, the Responses API's ``sequence_number``) or carry no text (tool calls), and
        each is tested whole from then on, no shape kept."""

    def _plain(self, event: bytes) -> bool:
        """``plain_token_event``: by ``_shape`` when the event has it, else tested whole (and
        then its shape kept)."""
        shape = self._shape
        if shape is not None:
            head, tail = shape
            start, end = len(head), len(event) - len(tail)  # the text, looked at in place
            if (
                end > start
                and event.startswith(head)
                and event.endswith(tail)
                and event.find(b'"', start, end) < 0
                and event.find(b"\n", start, end) < 0
                and event[end - 1] != _BACKSLASH
            ):
                if self._misses:
                    self._misses = 0
                return True
        route = self.ex.route
        if not plain_token_event(event, route):
            return False
        if self._misses < SHAPE_MISSES:  # (a shape hit since the last learned resets it)
            self._misses += 1
            self._shape = token_shape(event, route) if self._misses < SHAPE_MISSES else None
        return True

    def process(
        self, event: bytes, now: float, out: list[bytes], *, not_plain: bool = False
    ) -> None:
        """Observe ``event`` and append what should reach the client to ``out`` (``not_plain``:
        ``_plain`` has said no to it already)."""
        ex, obs = self.ex, self.ex.obs
        if not not_plain and obs.t_first_visible is not None and self._plain(event):
            self._count_token(now)
            self._release(out)
            out.append(event)
            return
        data = event_data(event)
        obj: Any = None
        if data is not None and data != b"[DONE]":
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = None
        if not isinstance(obj, dict):
            self._release(out)
            out.append(event)
            return
        kind = ex.dialect.classify_event(ex.route, obj, obs)
        if kind is EventKind.TOKEN or kind is EventKind.VISIBLE:
            if obs.t_first_token is None:
                obs.t_first_token = now
                if ex.on_first_token is not None:
                    ex.on_first_token(obj)
            if kind is EventKind.VISIBLE and obs.t_first_visible is None:
                obs.t_first_visible = now
            obs.t_last_token = now
            obs.token_events += 1
        elif kind is EventKind.ERROR:
            ex.error = "upstream_stream_error"
        if ex.strip_usage:
            if kind is EventKind.USAGE_ONLY:
                self._release(out, carry=ex.dialect.carried_on_strip(obj))
                return
            if _finishes(obj):
                self._release(out)
                self._held = (event, obj)
                return
        self._release(out)
        out.append(event)

    def process_all(self, events: list[bytes], now: float, out: list[bytes]) -> None:
        """``process`` each of ``events`` (one read's, in order); a run of plain token events
        once the first visible token is timed is counted at once, as ``process`` counts each."""
        obs, plain = self.ex.obs, self._plain
        i, n = 0, len(events)
        while i < n:
            if obs.t_first_visible is not None and self._held is None:
                j = i
                while j < n and plain(events[j]):
                    j += 1
                if j > i:
                    obs.t_last_token = now
                    obs.token_events += j - i
                    out += events[i:j]
                    i = j
                if i < n:  # one that is not plain: parsed, not tested again
                    self.process(events[i], now, out, not_plain=True)
            else:
                self.process(events[i], now, out)
            i += 1

    def plain_chunk(self, chunk: bytes, now: float) -> bool:
        """Whether ``chunk`` (a whole upstream read) is one plain token event, or several
        (``plain_token_run``); counted if so.

        The relay then forwards it as it is, without splitting it into events first.
        """
        obs = self.ex.obs
        if self._held is not None or obs.t_first_visible is None:
            return False
        if b"\r" not in chunk and self._plain(chunk):
            # One event, unless a "\r\r" inside is a separator the splitter would cut at.
            events = 1
        else:
            events = self._plain_run(chunk)
            if not events:
                return False
        obs.t_last_token = now
        obs.token_events += events
        return True

    def _plain_run(self, chunk: bytes) -> int:
        """``plain_token_run``: by ``_shape`` when the read is nothing but events of it (a busy
        proxy's read of a dozen token events), else tested whole.

        Walked in place: each event is the shape's head, a text up to the next quote, and the
        shape's tail there, the next one starting where it ends. Each then ends with the one
        blank line it holds (the shape's event had no other line break but an API event's
        own line, in its head; the texts have none), so, without ``\r``, the ``EventSplitter``
        cuts the read into exactly these events."""
        shape = self._shape
        if shape is not None and b"\r" not in chunk:
            head, tail = shape
            size, events, pos = len(chunk), 0, 0
            while pos < size and chunk.startswith(head, pos):
                start = pos + len(head)
                end = chunk.find(b'"', start)  # the text's end: it holds no quote
                if (
                    end <= start
                    or not chunk.startswith(tail, end)
                    or chunk[end - 1] == _BACKSLASH
                    or chunk.find(b"\n", start, end) >= 0
                ):
                    break
                pos = end + len(tail)
                events += 1
            else:
                if events and pos == size:
                    if self._misses:
                        self._misses = 0
                    return events
        route = self.ex.route
        events = plain_token_run(chunk, route)
        if events and self._misses < SHAPE_MISSES:  # learned again, as ``_plain`` does
            self._misses += 1
            cut = chunk.rfind(b"\n\n", 0, len(chunk) - 2)  # (the last event's start)
            last = chunk[cut + 2 :] if cut >= 0 else chunk
            self._shape = token_shape(last, route) if self._misses < SHAPE_MISSES else None
        return events

    def forwardable(self, chunk: bytes) -> bool:
        """Whether ``process`` would forward every event of ``chunk`` (a whole upstream read,
        nothing of an earlier one left in the splitter) as it came, so that it can reach the
        client before it is read (``read_forwarded``): nothing is held back, the read ends where
        an event ends (the splitter then cuts it exactly and keeps nothing), and, where the
        proxy asked for the usage itself, no event is one the relay holds or removes (a choice
        finishing, usage)."""
        if self._held is not None or b"\r" in chunk:
            return False
        # "\n\n" the one separator, cut from the left: a run of line breaks ends the read
        # exactly when it is even ("\n\n\n" leaves one behind, the next event's start).
        breaks = len(chunk) - len(chunk.rstrip(b"\n"))
        if breaks < 2 or breaks % 2:
            return False
        if not self.ex.strip_usage:
            return True
        if b'"usage"' in chunk:
            return False
        return chunk.count(b'"finish_reason"') == chunk.count(b'"finish_reason":null')

    def read_forwarded(self, events: list[bytes], now: float) -> None:
        """``process`` ``events``, which went to the client as they came (``forwardable``)."""
        self.process_all(events, now, [])
        self._held = None  # (none is: sent already, it must not go again)

    def _count_token(self, now: float) -> None:
        """A plain token event passed: it is the latest token, and one more."""
        self.ex.obs.t_last_token = now
        self.ex.obs.token_events += 1

    def _release(self, out: list[bytes], carry: Mapping[str, Any] | None = None) -> None:
        if self._held is None:
            return
        event, obj = self._held
        self._held = None
        if carry:
            obj.update(carry)
            event = b"data: " + orjson.dumps(obj) + b"\n\n"
        out.append(event)

    def finish(self, out: list[bytes]) -> None:
        self._release(out)


def _finishes(obj: Mapping[str, Any]) -> bool:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)
