"""What the relay observes of a streamed answer, event by event, without rebuilding it.

``StreamInspector`` timestamps the first token, the first visible token and the last token,
reads usage and timings, and drops the usage-only event the proxy asked for on the client's
behalf (moving llama.cpp's ``timings`` back onto the finishing event). Plain token events, whose
only news is that a token arrived, are recognised from their bytes (``proxy.token_events``), so
that most of a stream is never parsed. The relay (``proxy.relay``) owns the sockets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from proxy.backends import EventKind
from proxy.exchange import Exchange
from proxy.sse import event_data
from proxy.token_events import (
    plain_token_event,
    plain_token_run,
    shaped_events,
    token_shape,
)

SHAPE_MISSES = 3
"""Plain token events in a row a stream's shape may miss before it is given up
(``StreamInspector._learn``): "created", a second's clock in llama-server's chat events, moves
now and then; a field that moves with every event never lets a shape hold."""


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
        """``plain_token_event`` for one event (the splitter's): by the stream's shape when it
        has it, else tested whole (``_learn``)."""
        shape = self._shape
        if shape is not None and shaped_events(event, shape):
            if self._misses:
                self._misses = 0
            return True
        route = self.ex.route
        if not plain_token_event(event, route):
            return False
        self._learn(event, route)
        return True

    def _plain_read(self, chunk: bytes) -> int:
        """How many plain token events ``chunk`` (a whole upstream read) is, one or several; 0
        when it is anything else. By the stream's shape when every event has it, else tested
        whole (``_learn``, from its last event; ``plain_token_run`` refuses a read with ``\r``).
        Without ``\r`` the splitter cuts a read of whole events at its blank lines alone, so
        counting them is what splitting would do."""
        bare = b"\r" not in chunk
        shape = self._shape
        if shape is not None and bare:
            events = shaped_events(chunk, shape)
            if events:
                if self._misses:
                    self._misses = 0
                return events
        route = self.ex.route
        if bare and plain_token_event(chunk, route):
            events, last = 1, chunk
        else:
            events = plain_token_run(chunk, route)
            if not events:
                return 0
            cut = chunk.rfind(b"\n\n", 0, len(chunk) - 2)  # (where the last event starts)
            last = chunk[cut + 2 :] if cut >= 0 else chunk
        self._learn(last, route)
        return events

    def _learn(self, event: bytes, route: str) -> None:
        """``event``, a plain token event, was tested whole: its shape is kept for the next
        ones, unless ``SHAPE_MISSES`` in a row were tested whole (a shape hit resets the count),
        when the stream's events are tested whole from then on."""
        if self._misses < SHAPE_MISSES:
            self._misses += 1
            self._shape = token_shape(event, route) if self._misses < SHAPE_MISSES else None

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
        (``_plain_read``); counted if so.

        The relay then forwards it as it is, without splitting it into events first.
        """
        obs = self.ex.obs
        if self._held is not None or obs.t_first_visible is None:
            return False
        events = self._plain_read(chunk)
        if not events:
            return False
        obs.t_last_token = now
        obs.token_events += events
        return True

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
