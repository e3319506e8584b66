"""How many prefix bytes a rule made stable, measured on the rendered prompt.

The rendered prompt is the byte string the fingerprint hashes (``proxy.fingerprint.render``):
model, tools, then each message. A rule that rewrites something at byte offset ``d`` of that
string removed an instability there; after it, the prompt is stable up to a *limit*:

- for a volatile rule, the start of the note, which carries the values and so still changes;
- for ``stable_json`` and ``whitespace``, the start of the last message (the newest message is
  new on every request anyway), or the end of a raw completion prompt.

The gain is ``max(0, limit - d)``: the bytes a cache can now reuse that it could not reuse
when this rule's instability changed, other instabilities aside.
"""

from __future__ import annotations

from typing import Any

from proxy.fingerprint import Rendered, render


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


class Renders:
    """Renders of the bodies one ``apply`` call passes through, each rendered once."""

    __slots__ = ("_cache", "route")

    def __init__(self, route: str) -> None:
        self.route = route
        self._cache: dict[int, tuple[dict[str, Any], Rendered]] = {}

    def of(self, body: dict[str, Any]) -> Rendered:
        hit = self._cache.get(id(body))
        if hit is not None and hit[0] is body:
            return hit[1]
        rendered = render(self.route, body)
        self._cache[id(body)] = (body, rendered)  # holding the body keeps its id unique
        return rendered

    def rewrite_gain(self, before: dict[str, Any], after: dict[str, Any]) -> int:
        """The gain of a rewrite that leaves nothing volatile behind."""
        new = self.of(after)
        first = common_prefix(self.of(before).data, new.data)
        last = new.segments[-1] if new.segments else None
        limit = (
            last.start if last is not None and last.kind in ("message", "system") else len(new.data)
        )
        return max(0, limit - first)

    def first_change(self, before: dict[str, Any], after: dict[str, Any]) -> int:
        """The offset of the first rendered byte that differs."""
        return common_prefix(self.of(before).data, self.of(after).data)
