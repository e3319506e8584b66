"""``RecordWriter``: finished records delivered to the log line, the sinks and the learners.

The record's line is written synchronously (cheap, and never to be lost); then every sink gets the
record (metrics, tests) and every learner the record with the stage results it was built from
(the scheduler's rates, the prefix index, the statistics), after the response has ended, so none
of it sits on the client's critical path. Records are built and written in batches, a moment
after their requests ended (``RecordWriter.submit``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import structlog

from proxy.log import info_line, lines_held
from proxy.records import RECORD_EVENT, RequestRecord, monotonic

RecordSink = Callable[[RequestRecord], Awaitable[None] | None]
StagesT = TypeVar("StagesT")
Learner = Callable[[RequestRecord, StagesT], Awaitable[None] | None]
"""A sink that learns from the record and the stage results it was built from."""


class RecordWriter(Generic[StagesT]):
    """Delivers finished records to their sinks, off the request's critical path.

    The structlog line is written synchronously (it is cheap and must never be lost); then
    every sink gets the record (metrics, tests), and every learner the record with the stage
    results it was built from (the scheduler's rates, the prefix index and the statistics).
    Async work a sink returns runs as a background task, tracked so shutdown can drain it.

    ``submit`` hands over a record still to be built. It is built and written with the others
    that end meanwhile, together, ``BATCH_DELAY_S`` after the first of them ended or as soon
    as ``BATCH_MAX`` have: interleaved with the relaying of other answers the same work costs
    far more, its code and data pushed out of the processor's caches by everything in
    between, and the batch's lines go out in one write. Each is built and emitted in its own
    request's logging context, in the order the requests ended.

    A request that ends alone waits too: built right after its answer's end was written, its
    record would hold up the client's next request, which arrives a moment later (and, on one
    machine, the client itself, woken on the processor the proxy keeps busy). Their moment
    waits, too, while some request has no token out yet (``hold_while``): at one stream they
    then go between two tokens of the next answer. What reads the records' effects,
    ``/metrics`` and ``/stats``, calls ``flush_ended`` first.
    """

    BATCH_MAX = 32
    BATCH_DELAY_S = 0.002
    HOLD_MAX_S = 0.010
    """How long records may wait, at most, for ``hold_while``'s requests."""

    def __init__(self, *, logger: structlog.typing.FilteringBoundLogger) -> None:
        self._log = logger
        self._sinks: list[RecordSink] = []
        self._learners: list[Learner[StagesT]] = []
        self._tasks: set[asyncio.Future[None]] = set()
        self._flushers: list[Callable[[], Awaitable[None]]] = []
        self._ended: list[
            tuple[Callable[[], RequestRecord], StagesT | None, contextvars.Context]
        ] = []
        self._timer: asyncio.Handle | None = None
        self._closed = False
        """Drained for good (shutdown): a record handed over later goes at once."""
        self._hold: Callable[[], bool] | None = None
        self._held_since = 0.0

    def hold_while(self, busy: Callable[[], bool]) -> None:
        """When their moment comes, held records wait on (up to ``HOLD_MAX_S`` in all) while
        ``busy()``: some request has no token out yet, and what runs now would come between
        it and its first token (its body's reads, its answer's head and first event)."""
        self._hold = busy

    def add_flusher(self, flush: Callable[[], Awaitable[None]]) -> None:
        """``drain`` also applies what ``flush`` holds queued (the store's write behind)."""
        self._flushers.append(flush)

    def add_sink(self, sink: RecordSink) -> None:
        """Hand every finished record to ``sink``."""
        self._sinks.append(sink)

    def add_learner(self, learner: Learner[StagesT]) -> None:
        """Hand every finished record, with its stage results, to ``learner`` (after the sinks)."""
        self._learners.append(learner)

    def emit(self, record: RequestRecord, stages: StagesT | None = None) -> None:
        """Write the canonical log line and hand the record to every sink and learner.

        Learners run only for a record emitted with its ``stages``.
        """
        fields = record.as_dict()
        if not info_line(RECORD_EVENT, fields):
            self._log.info(RECORD_EVENT, **fields)
        for sink in self._sinks:
            self._deliver(sink, record)
        if stages is not None:
            for learner in self._learners:
                self._deliver(learner, record, stages)

    def submit(
        self,
        build: Callable[[], RequestRecord],
        stages: StagesT | None = None,
        *,
        at_once: bool = False,
    ) -> None:
        """Build a finished request's record (``build``) and ``emit`` it, with the others that
        end meanwhile: ``BATCH_DELAY_S`` after the first of them, or in the loop's next turn
        once ``BATCH_MAX`` are held (never inside the handler that ended last: it does not pay
        for the others). ``at_once`` (a request cut short at shutdown): what is held goes now,
        this one last. A record that cannot be built or written is logged, never raised."""
        if not self._ended:
            self._held_since = monotonic()
        self._ended.append((build, stages, contextvars.copy_context()))
        if at_once or self._closed:
            self.flush_ended()
        elif len(self._ended) >= self.BATCH_MAX:
            self._flush_after(0.0)
        elif self._timer is None:
            self._flush_after(self.BATCH_DELAY_S)

    def _flush_after(self, delay_s: float) -> None:
        if self._timer is not None:
            if delay_s > 0.0:
                return
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        empty = contextvars.Context()  # each record runs in its own request's, not the caller's
        if delay_s > 0.0:
            self._timer = loop.call_later(delay_s, self._due, context=empty)
        else:
            self._timer = loop.call_soon(self.flush_ended, context=empty)

    def _due(self) -> None:
        """The held records' moment: they go, unless ``hold_while``'s check says to wait (and
        they have waited less than ``HOLD_MAX_S``), in which case they look again shortly."""
        hold = self._hold
        if hold is not None and monotonic() - self._held_since < self.HOLD_MAX_S:
            try:
                busy = hold()
            except Exception:  # a broken check must not keep the records
                busy = False
            if busy:
                self._timer = None
                self._flush_after(self.BATCH_DELAY_S / 4)
                return
        self.flush_ended()

    def flush_ended(self) -> None:
        """Build and emit every record ``submit`` holds, in the order they came."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        ended, self._ended = self._ended, []
        try:
            with lines_held():
                for build, stages, context in ended:
                    context.run(self._build_and_emit, build, stages)
        except Exception:  # the lines' one write failed: as a single line's write would
            self._log.exception("record_failed")

    def _build_and_emit(self, build: Callable[[], RequestRecord], stages: StagesT | None) -> None:
        try:
            self.emit(build(), stages)
        except Exception:  # a bug must cost the request its record, not the others theirs
            self._log.exception("record_failed")

    def _deliver(self, sink: Callable[..., Awaitable[None] | None], *args: Any) -> None:
        try:
            result = sink(*args)
        except Exception:  # a sink must never break the traffic it observes
            self._log.exception("record_sink_failed", sink=repr(sink))
            return
        if result is not None:
            self.spawn(result)

    def spawn(self, aw: Awaitable[None]) -> None:
        """Run background work for a finished request (tracked, errors logged)."""
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.error("record_sink_failed", exc_info=exc)

    async def settled(self, limit_s: float) -> None:
        """Emit the records held so far and wait, at most ``limit_s``, for the background work
        they started (a learner's store writes): what reads their effects (``/stats``) then
        counts every request that has ended. Unlike ``drain``, it does not wait for work that
        starts meanwhile."""
        self.flush_ended()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=limit_s)

    async def drain(self, limit_s: float = 5.0, *, final: bool = False) -> None:
        """Emit the records still held, wait (bounded) for background sink work and apply the
        writes it queued, e.g. at shutdown or in tests. ``final`` (shutdown): a record handed
        over afterwards (a handler still ending) is written at once, not held for a timer that
        may never fire."""
        if final:
            self._closed = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit_s
        while True:
            self.flush_ended()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=max(deadline - loop.time(), 0.0))
            for flush in self._flushers:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(flush(), timeout=max(deadline - loop.time(), 0.001))
            if (not self._tasks and not self._ended) or loop.time() >= deadline:
                return

    @property
    def pending(self) -> Sequence[asyncio.Future[None]]:
        return tuple(self._tasks)
