"""How many prefix bytes a rule made stable, measured on the rendered prompt.

The rendered prompt is the byte string the fingerprint hashes (``proxy.fingerprint.render``):
model, tools, then each message (or the raw prompt). A rule that rewrites something at byte
offset ``d`` of it removed an instability there; after it, the prompt is stable up to a
*limit*:

- for a volatile rule, the start of the note, which carries the values and so still changes;
- for ``stable_json`` and ``whitespace``, the start of the last message (the newest message is
  new on every request anyway), or the end of a raw completion prompt.

The gain is ``max(0, limit - d)``: the bytes a cache can now reuse that it could not when this
rule's instability changed, other instabilities aside. Offsets are those of the forwarded
prompt (the would-be prompt in dry-run); where a later rule also rewrote the same segment
before ``d``, they are off by the few bytes that rule added or removed.

Measuring is lazy: ``apply`` only notes the bodies each rule saw and made (they share all
unchanged structure), and the first ``CanonicalResult.measure_gains()`` (or read of
``stable_bytes_gained``) renders each changed segment on its own, plus the whole prompt for its
layout unless the caller passes the fingerprint's (``segments``, ``total_bytes``) of the
forwarded body. The proxy does it when it writes the request's record, after the response, off
the critical path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from proxy.fingerprint import Segment, render

Where = tuple[str, int]  # ("tools", 0), ("message", i) or ("prompt", i)


def common_prefix(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, step = 0, 256  # gallop in growing chunks, then bisect the first unequal one
    while True:
        hi = min(n, lo + step)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, step = hi, step * 2
    while hi - lo > 1:  # the first difference lies in [lo, hi)
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def first_changed(before: dict[str, Any], after: dict[str, Any]) -> Where | None:
    """The first segment that differs between two bodies of one copy-on-write chain.

    Unchanged parts are the same objects in both, so identity finds the segment without
    rendering anything.
    """
    if before.get("tools") is not after.get("tools") or before.get("functions") is not after.get(
        "functions"
    ):
        return ("tools", 0)
    for key, kind in (("messages", "message"), ("prompt", "prompt")):
        old, new = before.get(key), after.get(key)
        if old is new:
            continue
        if not (isinstance(old, list) and isinstance(new, list)):
            return (kind, 0)
        for i, (a, b) in enumerate(zip(old, new, strict=False)):
            if a is not b:
                return (kind, i)
    return None


class GainMeter:
    """Collects what each rule changed during one ``apply``; measures on first request."""

    __slots__ = ("_final", "_forwarded", "_measured", "_pending", "route")

    def __init__(self, route: str) -> None:
        self.route = route
        self._final: dict[str, Any] | None = None
        self._forwarded = False
        self._pending: list[tuple[str, Callable[[Measure], int]]] = []
        self._measured: dict[str, int] | None = None

    def rewrite(self, rule: str, before: dict[str, Any], after: dict[str, Any]) -> None:
        """A rewrite that leaves nothing volatile behind."""

        def gain(m: Measure) -> int:
            where = first_changed(before, after)
            if where is None:
                return 0
            return max(0, m.rewrite_limit() - m.offset(before, after, where))

        self._pending.append((rule, gain))

    def relocation(
        self,
        rule: str,
        before: dict[str, Any],
        replaced: Callable[[], dict[str, Any]],
        without_note: dict[str, Any],
        with_note: dict[str, Any],
        note_message: int,
    ) -> None:
        """A relocation: ``replaced()`` gives ``before`` with only this rule's values replaced;
        the note is in message ``note_message``."""

        def gain(m: Measure) -> int:
            only = replaced()
            first = first_changed(before, only)
            if first is None:
                return 0
            limit = m.offset(without_note, with_note, ("message", note_message))
            return max(0, limit - m.offset(before, only, first))

        self._pending.append((rule, gain))

    def finish(self, final: dict[str, Any], *, forwarded: bool) -> None:
        """The body whose rendering gives the coordinates, and whether it is the one forwarded
        (not in global dry-run), so that the fingerprint's layout of it may be reused."""
        self._final = final
        self._forwarded = forwarded

    def measured(
        self, segments: Sequence[Segment] | None = None, total_bytes: int = 0
    ) -> dict[str, int]:
        """Each rule's gain, computed once.

        ``segments`` and ``total_bytes``: the layout of the forwarded prompt, when the caller
        has it (the fingerprint's ``segments`` and ``total_bytes``); else it is rendered here.
        """
        if self._measured is None:
            if not self._pending or self._final is None:
                self._measured = {}
            else:
                if segments is None or not self._forwarded:
                    rendered = render(self.route, self._final)
                    segments, total_bytes = rendered.segments, len(rendered.data)
                self._measured = self._measure(
                    Measure(self.route, self._final, segments, total_bytes)
                )
            self._pending = []
        return self._measured

    def _measure(self, m: Measure) -> dict[str, int]:
        out: dict[str, int] = {}
        for rule, gain in self._pending:
            try:
                out[rule] = gain(m)
            except Exception:  # a metric must never break the request's record
                continue
        return out


class Measure:
    """Offsets in one rendered prompt, from its layout (segment starts and length)."""

    __slots__ = ("_rendered", "body", "route", "segments", "total_bytes")

    def __init__(
        self, route: str, body: dict[str, Any], segments: Sequence[Segment], total_bytes: int
    ) -> None:
        self.route = route
        self.body = body
        self.segments = segments
        self.total_bytes = total_bytes
        # Rules share bodies (one's output is the next one's input): render each segment once.
        self._rendered: dict[tuple[int, Where], tuple[dict[str, Any], bytes]] = {}

    def _segment_index(self, where: Where) -> int:
        kind, i = where
        if kind == "tools":
            return 1
        if kind == "prompt":
            return 1 + i
        has_tools = self.body.get("tools") is not None or self.body.get("functions") is not None
        return 1 + int(has_tools) + i

    def _segment(self, body: dict[str, Any], where: Where) -> bytes:
        """One segment of ``body`` rendered on its own."""
        hit = self._rendered.get((id(body), where))
        if hit is not None and hit[0] is body:
            return hit[1]
        data = self._render_segment(body, where)
        self._rendered[id(body), where] = (body, data)
        return data

    def _render_segment(self, body: dict[str, Any], where: Where) -> bytes:
        kind, i = where
        if kind == "tools":
            mini = {"tools": body.get("tools"), "functions": body.get("functions")}
        elif kind == "message":
            mini = {"messages": [body["messages"][i]]}
        else:
            prompt = body.get("prompt")
            mini = {"prompt": [prompt[i]] if isinstance(prompt, list) else prompt}
        rendered = render(self.route, mini)
        return rendered.data[rendered.segments[1].start :] if len(rendered.segments) > 1 else b""

    def offset(self, before: dict[str, Any], after: dict[str, Any], where: Where) -> int:
        """Where ``after`` first differs from ``before``, in this prompt's coordinates."""
        index = self._segment_index(where)
        segments = self.segments
        start = segments[index].start if index < len(segments) else self.total_bytes
        return start + common_prefix(self._segment(before, where), self._segment(after, where))

    def rewrite_limit(self) -> int:
        """The start of the last message, or the end of the prompt."""
        segments = self.segments
        if segments and segments[-1].kind in ("message", "system"):
            return segments[-1].start
        return self.total_bytes
