"""Walk two rendered prompts side by side and list the spans that broke their shared prefix.

Given an earlier request A and a later request B of the same application, the walk starts at
their first difference and asks whether the prompts agree again soon after (a *span*: a
timestamp, a UUID, a shuffled key, a changed line ending) or not (new content: the walk ends).
Each span is charged the bytes that agree after it, up to the next span: the prefix a
canonicalizer rule would have kept cacheable. Segment-level equivalences are checked first,
because a reordered JSON object or a re-ended line differs in many places at once:

- ``stable_json``: the tools (or the message, with its tool calls) are equal once object keys
  and the tool list are put in a stable order;
- ``whitespace``: the message is equal once line endings and trailing blanks are normalised.
"""

from __future__ import annotations

import bisect
import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from analyzers.spans import (
    RULE_STABLE_JSON,
    RULE_WHITESPACE,
    SpanKind,
    classify,
    resync,
)
from proxy.canonical.spans import common_run as first_difference
from proxy.fingerprint import Rendered, render

MAX_SPANS = 8
MIN_RUN = 32  # agreeing bytes that settle a span (shorter may be a coincidence)
MAX_CLUSTER = 256  # bytes of short differences and agreements held before calling it new
EXCERPT = 36  # bytes of context either side of a span in examples
STABLE_KINDS = frozenset({"system", "tools"})  # where the proxy learns volatile spans


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's rendered prompt, ready for walking."""

    body: Mapping[str, Any]
    rendered: Rendered
    starts: list[int]

    @classmethod
    def of(cls, route: str, body: Mapping[str, Any]) -> Prompt:
        rendered = render(route, body)
        return cls(body, rendered, [s.start for s in rendered.segments])

    @property
    def data(self) -> bytes:
        return self.rendered.data

    def segment_at(self, offset: int) -> int:
        """Index of the segment holding byte ``offset``."""
        return max(0, bisect.bisect_right(self.starts, offset) - 1)

    def segment_end(self, index: int) -> int:
        return self.starts[index + 1] if index + 1 < len(self.starts) else len(self.data)

    def message(self, index: int) -> Any:
        """The body message rendered as segment ``index`` (None for model/tools segments)."""
        first = next(
            (i for i, s in enumerate(self.rendered.segments) if s.kind not in ("model", "tools")),
            None,
        )
        messages = self.body.get("messages")
        if first is None or index < first or not isinstance(messages, list):
            return None
        pos = index - first
        return messages[pos] if pos < len(messages) else None


@dataclass(frozen=True, slots=True)
class Span:
    """One differing span and what it cost."""

    kind: SpanKind
    where: str  # segment kind in the later request
    lost_bytes: int
    earlier: str  # excerpt of the earlier request, the span in ⟦ ⟧
    later: str


def canonical_json(value: Any, *, sort_tools: bool = False) -> Any:
    """``value`` with object keys sorted, tool-call arguments parsed, optionally tools sorted."""
    if isinstance(value, dict):
        out = {k: canonical_json(v) for k, v in sorted(value.items())}
        args = out.get("arguments")
        if isinstance(args, str):  # tool-call arguments are JSON inside a string
            with contextlib.suppress(orjson.JSONDecodeError):
                out["arguments"] = canonical_json(orjson.loads(args))
        return out
    if isinstance(value, list):
        items = [canonical_json(v) for v in value]
        if sort_tools:
            items.sort(key=dumps)  # items are key-sorted already: a stable tool order
        return items
    return value


_CRLF = re.compile(r"\r\n?")
_TRAILING = re.compile(r"[ \t]+(?=\n|$)")


def normalise_lines(value: Any) -> Any:
    if isinstance(value, str):
        return _TRAILING.sub("", _CRLF.sub("\n", value))
    if isinstance(value, dict):
        return {k: normalise_lines(v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise_lines(v) for v in value]
    return value


def segment_rule(a: Prompt, seg_a: int, b: Prompt, seg_b: int) -> str | None:
    """``stable_json`` or ``whitespace`` when the two segments differ only in that way."""
    kind_a = a.rendered.segments[seg_a].kind
    kind_b = b.rendered.segments[seg_b].kind
    if kind_a != kind_b:
        return None
    if kind_b == "tools":
        ta = (a.body.get("tools"), a.body.get("functions"))
        tb = (b.body.get("tools"), b.body.get("functions"))
        if dumps(ta) != dumps(tb) and _tool_sets_equal(ta, tb):
            return RULE_STABLE_JSON
        return None
    ma, mb = a.message(seg_a), b.message(seg_b)
    if ma is None or mb is None or dumps(ma) == dumps(mb):
        return None
    if canonical_json(ma) == canonical_json(mb):
        return RULE_STABLE_JSON
    if normalise_lines(ma) == normalise_lines(mb):
        return RULE_WHITESPACE
    return None


def dumps(value: Any) -> bytes:
    """Compact JSON in the given key order (dict equality would ignore that order)."""
    try:
        return orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return repr(value).encode()


def _tool_sets_equal(ta: tuple[Any, Any], tb: tuple[Any, Any]) -> bool:
    return [canonical_json(t, sort_tools=True) for t in ta] == [
        canonical_json(t, sort_tools=True) for t in tb
    ]


def _excerpt(data: bytes, lo: int, hi: int) -> str:
    head = data[max(0, lo - EXCERPT) : lo]
    tail = data[hi : hi + EXCERPT]
    text = head + b"\xe2\x9f\xa6" + data[lo:hi] + b"\xe2\x9f\xa7" + tail  # ⟦ ⟧
    return text.decode("utf-8", "replace").replace("\x1e\x1c", "⏎").replace("\x1e", "·")


def walk(a: Prompt, b: Prompt) -> tuple[list[Span], int]:
    """The spans where ``b`` departs from ``a`` and comes back, and the bytes they agree on.

    Short differences separated by short agreements (``Run 7 at 10:00`` against ``Run 8 at
    10:05``) are held as a cluster until a long agreement settles them; if none comes, the
    cluster was new content and is dropped.
    """
    da, db = a.data, b.data
    pa = pb = first_difference(da, 0, db, 0)
    agreed = pa
    spans: list[Span] = []
    pending: list[Span] = []
    pending_agreed = pending_bytes = 0
    # The newest message is new by nature: differences there lose nothing cached after them.
    segments = b.rendered.segments
    stop = segments[-1].start if len(segments) > 2 and segments[-1].kind == "message" else len(db)
    while len(spans) + len(pending) < MAX_SPANS and pa < len(da) and pb < stop:
        seg_a, seg_b = a.segment_at(pa), b.segment_at(pb)
        rule = segment_rule(a, seg_a, b, seg_b)
        if rule is not None:
            a_end, b_end = a.segment_end(seg_a), b.segment_end(seg_b)
            kind = SpanKind(rule, _show(da[pa : pa + 24]), _show(db[pb : pb + 24]), "")
        else:
            found = resync(da, pa, db, pb)
            if found is None:
                break
            a_end, b_end = found
            stable = b.rendered.segments[seg_b].kind in STABLE_KINDS
            kind = classify(da, pa, a_end, db, pb, b_end, stable=stable)
        run = first_difference(da, a_end, db, b_end)
        settled = run >= MIN_RUN or a_end + run >= len(da) or b_end + run >= len(db)
        # A segment rule keeps the rest of its segment cacheable, whatever follows it.
        lost = run + (b_end - pb if rule is not None else 0)
        where = b.rendered.segments[seg_b].kind
        span = Span(kind, where, lost, _excerpt(da, pa, a_end), _excerpt(db, pb, b_end))
        if rule is None and not settled:
            pending.append(span)
            pending_agreed += run
            pending_bytes += b_end - pb + run
            if pending_bytes > MAX_CLUSTER:
                break
            pa, pb = a_end + run, b_end + run
            continue
        spans += (*pending, span)
        agreed += pending_agreed + run
        pending, pending_agreed, pending_bytes = [], 0, 0
        if not settled:
            break
        pa, pb = a_end + run, b_end + run
    return spans, agreed


def _show(data: bytes) -> str:
    return data.decode("utf-8", "replace").replace("\x1e", "·")
