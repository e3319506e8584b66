"""Dates and times the backend's chat template puts into every prompt.

Some Jinja chat templates (Llama 3.x, some Qwen and Hermes variants) print the current date
(``strftime_now("%d %b %Y")``) or time into the system header of every prompt. No rewrite of the
request can move that value: the backend adds it after the proxy. A date costs the prefix cache
once a day; a time of day costs it on every request.

llama-server reports its template (``/props`` ``chat_template``) and renders a request without
running it (``POST /apply-template``). A template that calls a clock is rendered twice, a little
over a second apart, with the same tiny request: if the two prompts differ, the template prints
a time that changes between requests (``kind = "time"``); if not, a date (``kind = "date"``).
The byte offset where they first differ says how much of every prompt stays cacheable.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

CLOCK_CALL = re.compile(r"\b(?:strftime_now|now)\s*\(")
PROBE_REQUEST: Mapping[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
RENDER_GAP_S = 1.1  # more than a second: a template printing seconds shows it


@dataclass(frozen=True, slots=True)
class TemplateClock:
    """The backend's template prints the clock into every prompt."""

    renders_differ: bool | None
    """Two renders a second apart differed (None: the server would not render)."""
    first_difference: int | None = None
    """Character offset where they first differed."""

    @property
    def kind(self) -> str:
        """``time`` (changes between requests), else ``date`` (changes once a day)."""
        return "time" if self.renders_differ else "date"

    def as_dict(self) -> dict[str, Any]:
        """For ``/stats``."""
        return {
            "kind": self.kind,
            "renders_differ": self.renders_differ,
            "first_difference": self.first_difference,
        }


def calls_clock(template: Any) -> bool:
    """Whether a Jinja template's source calls ``strftime_now`` (or ``now``)."""
    return isinstance(template, str) and CLOCK_CALL.search(template) is not None


def first_difference(a: str, b: str) -> int | None:
    """The first offset where ``a`` and ``b`` differ (None when equal)."""
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


async def render(
    session: aiohttp.ClientSession,
    base_url: str,
    *,
    headers: Mapping[str, str] | None = None,
    limit_s: float = 3.0,
) -> str | None:
    """The prompt llama-server's template makes of ``PROBE_REQUEST`` (None: not rendered)."""
    try:
        async with session.post(
            base_url + "/apply-template",
            json=PROBE_REQUEST,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=limit_s),
        ) as resp:
            if resp.status != 200:
                return None
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    prompt = data.get("prompt") if isinstance(data, dict) else None
    return prompt if isinstance(prompt, str) else None


async def probe_template_clock(
    session: aiohttp.ClientSession,
    base_url: str,
    template: Any,
    *,
    headers: Mapping[str, str] | None = None,
    gap_s: float = RENDER_GAP_S,
) -> TemplateClock | None:
    """What the template's clock does, or None when it calls none. Never raises."""
    if not calls_clock(template):
        return None
    first = await render(session, base_url, headers=headers)
    if first is None:
        return TemplateClock(renders_differ=None)
    await asyncio.sleep(gap_s)
    second = await render(session, base_url, headers=headers)
    if second is None:
        return TemplateClock(renders_differ=None)
    at = first_difference(first, second)
    return TemplateClock(renders_differ=at is not None, first_difference=at)
