"""What the store failure tests (single Redis and cluster) share: bounded calls, log events."""

from __future__ import annotations

import time
from collections.abc import Awaitable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")


def events(logs: list[MutableMapping[str, Any]], name: str) -> list[MutableMapping[str, Any]]:
    """The captured structlog events called ``name``."""
    return [e for e in logs if e["event"] == name]


async def timed(aw: Awaitable[T], bound_s: float) -> T:
    """Await ``aw`` and assert it took less than ``bound_s``."""
    start = time.perf_counter()
    result = await aw
    elapsed = time.perf_counter() - start
    assert elapsed < bound_s, f"took {elapsed * 1000:.1f} ms"
    return result
