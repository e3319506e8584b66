"""One request on a connection and its answer as it arrives (``proxy.wire``)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from proxy.wire.errors import WireBadAnswer, WireClosed, WireError, WireTimeout
from proxy.wire.http1 import AnswerReader, Head

if TYPE_CHECKING:
    from proxy.wire.pool import BackendConnection


class Answering:
    """A request sent on a connection and its answer as it arrives.

    ``head()`` waits for the status line and headers. Then either ``read()`` collects the whole
    body, or ``deliver(sink)`` hands each read's payload to ``sink`` as it arrives and ``wait()``
    returns when the body has ended (or raises why it did not). ``release()`` gives the
    connection back to the pool (only a complete answer's) or closes it.
    """

    def __init__(
        self,
        conn: BackendConnection,
        *,
        idle_s: float | None,
        head_request: bool,
        head_by: float = math.inf,
    ):
        self.conn = conn
        self.loop = conn.loop
        self.idle_s = idle_s
        self.head_by = head_by  # (loop time) the head must have come by then
        self.reader = AnswerReader(head_request=head_request)
        self.got_bytes = False
        self.paused = False
        self._failure: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._parts: list[bytes] = []
        self._sink: Callable[[bytes], None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._arm()

    # -- the caller's side --------------------------------------------------------------

    async def head(self) -> Head:
        while self.reader.head is None:
            await self._wait()
        return self.reader.head

    async def read(self) -> bytes:
        """The whole body (after ``head``)."""
        while not self.reader.done:
            await self._wait()
        return b"".join(self._parts)

    def deliver(self, sink: Callable[[bytes], None]) -> None:
        """From now on each read's payload goes to ``sink`` (what was read already, at once)."""
        self._sink = sink
        if self._parts:
            parts, self._parts = self._parts, []
            sink(b"".join(parts))

    async def wait(self) -> bool:
        """Wait for the body to end (True) or a wake-up (False: ``wake``); raise a failure."""
        if self.reader.done:
            return True
        await self._wait()
        return self.reader.done

    def wake(self) -> None:
        """End the caller's ``wait`` early (the sink needs the caller: backpressure, an error)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def pause(self) -> None:
        if self.paused or self.conn.transport is None:
            return
        self.paused = True
        self.conn.transport.pause_reading()
        self._disarm()

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        if self.conn.transport is not None:
            self.conn.transport.resume_reading()
            self._arm()

    @property
    def complete(self) -> bool:
        return self.reader.done

    @property
    def keep_alive(self) -> bool:
        """Whether the connection may carry another exchange once this answer is complete."""
        return self.reader.keep_alive

    def release(self) -> None:
        """The exchange is over: the connection goes back to the pool, or is closed."""
        self._disarm()
        self._sink = None  # (the relay's method: a cycle through it would keep the answer alive)
        conn = self.conn
        if conn.answering is self:
            conn.answering = None
        if (
            self.reader.done
            and self.reader.keep_alive
            and self._failure is None
            and not self.paused
            and not conn.closed
        ):
            conn.pool.put(conn)
        else:
            conn.close()

    def abort(self) -> None:
        """Give the answer up: the connection is closed at once (the backend sees it); a
        ``wait`` then raises."""
        self._disarm()
        self._sink = None
        self.reader.keep_alive = False
        if self.conn.answering is self:
            self.conn.answering = None
        self.conn.close()
        if not self.reader.done and self._failure is None:
            self._failure = WireError("the answer was given up")
        self.wake()

    async def _wait(self) -> None:
        if self._failure is not None:
            self._raise_failure()
        waiter = self._waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._failure is not None:
            self._raise_failure()

    def _raise_failure(self) -> NoReturn:
        """Raise a copy of the failure: the one kept here never gets the traceback of a raise,
        whose frames hold this answer (and the request's body, in ``send``'s), which would
        make a cycle only the cyclic collector frees."""
        assert self._failure is not None
        raise _copy(self._failure)  # (not bound to a local: the raise's frame would hold it)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc.with_traceback(None)  # (see ``_raise_failure``)
        self._disarm()
        self.reader.keep_alive = False
        self.conn.close()
        self.wake()

    # -- the idle timer: one handle, re-armed lazily (as ``proxy.upstream`` does) ---------

    def _next_deadline(self, now: float) -> float:
        """The idle limit from ``now``, and the head's own deadline until the head has come."""
        deadline = now + self.idle_s if self.idle_s else math.inf
        return min(deadline, self.head_by) if self.reader.head is None else deadline

    def _arm(self) -> None:
        deadline = self._next_deadline(self.loop.time())
        self._deadline = deadline
        if deadline == math.inf:
            self._disarm()
            return
        timer = self._timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(deadline, self._due)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        if self.reader.done or self.paused:
            return
        now = self.loop.time()
        if self._deadline > now:
            if self._deadline != math.inf:
                self._timer = self.loop.call_at(self._deadline, self._due)
            return
        if self.reader.head is None and now >= self.head_by:
            self._fail(WireTimeout("the backend's answer head did not come in time"))
            return
        what = "the answer's head" if self.reader.head is None else "the rest of the answer"
        self._fail(WireTimeout(f"the backend sent nothing for {self.idle_s:g} s ({what})"))

    # -- the connection's side -------------------------------------------------------------

    def lost(self, exc: Exception | None) -> None:
        if self.reader.done or self._failure is not None:
            return
        if exc is None and not self.conn.closed_here and self.reader.ended_by_close():
            self._disarm()  # a body that ends with the connection, ended
            self.wake()
            return
        why = f": {exc.__class__.__name__}" if exc is not None else ""
        self._fail(
            WireClosed(f"the backend closed the connection{why}", before_answer=not self.got_bytes)
        )

    def received(self, data: bytes) -> None:
        reader = self.reader
        if self._failure is not None or reader.done:
            self.conn.close()  # bytes past the end of the answer: not reusable
            return
        self.got_bytes = True
        if self._timer is not None:
            self._deadline = self._next_deadline(self.loop.time())
        had_head = reader.head is not None
        try:
            payload = reader.feed(data)
        except WireBadAnswer as exc:
            self._fail(exc)
            return
        if not had_head:
            if reader.head is None:
                return
            if self.head_by != math.inf:  # the head's own deadline is met: the idle one's left
                self._deadline = self._next_deadline(self.loop.time())
                if self._deadline == math.inf:
                    self._disarm()
            self.wake()
        if payload:
            sink = self._sink
            if sink is not None:
                sink(payload)
            else:
                self._parts.append(payload)
        if reader.done:
            self._disarm()
            self.wake()


def _copy(exc: BaseException) -> BaseException:
    """``exc`` again, without its traceback (``__init__`` not run: its attributes copied)."""
    clone = type(exc).__new__(type(exc), *exc.args)
    clone.args = exc.args  # (a class whose own ``__init__`` sets them: ``__new__`` may not)
    clone.__dict__.update(exc.__dict__)
    return clone
