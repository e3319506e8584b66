"""The process's C heap: glibc's malloc left to place large buffers, its free pages given back.

A proxy's large allocations are request-sized (the body, the parsed prompt's strings, the
rendered bytes the fingerprint hashes, the body sent upstream) and short-lived. glibc serves an
allocation from the heap below its mmap threshold and from a fresh ``mmap`` above it; a fresh
mapping costs one page fault per 4 KiB page touched and an ``munmap`` when freed, so with the
threshold pinned low every 512 KB request took about 1,200 faults (a quarter of its CPU).
glibc's own dynamic threshold (it rises to the size of the largest mapping freed) keeps such
buffers in the heap, whose pages are reused warm.

The heap's cost is fragmentation: every socket read allocates a 256 KiB buffer and shrinks it to
what arrived, and the remains, scattered between live objects, keep pages resident that nothing
uses (about 1.8 MiB a minute under ``bench/soak.py``, none of it leaked: ``malloc_trim`` gave it
back). ``HeapTrimmer`` calls ``malloc_trim(0)`` on a timer, which returns every whole free page
of every arena to the system (``madvise(MADV_DONTNEED)``), so resident memory stays flat while
the buffers stay warm between trims.

Elsewhere than glibc (musl, macOS) there is no ``malloc_trim``: nothing is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import time
from typing import Any

from proxy.log import get_logger

_log = get_logger()

TRIM_INTERVAL_S = 10.0
"""Seconds between two trims: long enough that the pages a request reuses are warm for hundreds
of requests, short enough that a busy proxy's fragments never add up to more than a few MiB."""


def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        # The process's own symbols (the C library it runs on among them): no library search,
        # which would run ``ldconfig``.
        trim = ctypes.CDLL(None).malloc_trim
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
        return trim
    return None


class HeapTrimmer:
    """``malloc_trim(0)`` every ``interval_s`` seconds on the running event loop.

    A trim runs on the loop's own thread: it walks the free chunks of each arena under that
    arena's lock, so running it on another thread would only make the loop wait for the lock
    instead. A trim takes 0.2-0.8 ms under ``bench/soak.py``'s load; ``trims`` and ``seconds``
    count them."""

    __slots__ = ("_handle", "_trim", "interval_s", "seconds", "trims")

    def __init__(self, interval_s: float = TRIM_INTERVAL_S, *, trim: Any = None) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self._trim = trim if trim is not None else _malloc_trim()
        self._handle: asyncio.TimerHandle | None = None
        self.trims = 0
        self.seconds = 0.0

    @property
    def available(self) -> bool:
        """Whether this C library can trim at all."""
        return self._trim is not None

    def start(self) -> None:
        """Trim every ``interval_s`` from now on, on the running loop (idempotent)."""
        if self._trim is None or self._handle is not None:
            return
        self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def trim(self) -> None:
        """One trim now."""
        if self._trim is None:
            return
        t0 = time.perf_counter()
        self._trim(0)
        self.seconds += time.perf_counter() - t0
        self.trims += 1

    def _tick(self) -> None:
        self._handle = None
        try:
            self.trim()
        except Exception as exc:  # a C library that has the symbol but refuses: stop trying
            self._trim = None
            _log.warning("heap_trim_failed", error=repr(exc))
            return
        self._handle = asyncio.get_running_loop().call_later(self.interval_s, self._tick)
