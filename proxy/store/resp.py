"""One pipelined connection to one Redis, for the store's scripts and its small memory: the
request path's calls.

redis-py's asyncio client spends some 250-400 µs of the proxy's CPU on one pipelined lookup
(its connection pool, its pipeline object, the command and reply plumbing), several times the
loopback round trip the lookup waits for. ``RespLink`` is the least a client can do: commands
packed by hiredis and written to one connection as they come, and the replies, parsed by
hiredis, handed back in order to whoever is waiting for them. Concurrent callers share the
connection (Redis answers a connection's commands in order); a caller that gave up (its deadline
passed) leaves its replies to be read and dropped, so the ones behind stay matched. A call's
deadline (``execute``) counts against Redis only a reply Redis had not sent when the proxy's
event loop came to look, not one a busy loop read late.

It speaks RESP2 to a plain Redis or Valkey over TCP (``redis://``) or a Unix socket
(``unix://``), with the URL's password (and user) and database. TLS and Cluster URLs keep to
redis-py (``RedisStore`` decides; it keeps one link for lookups and one for batched writes). A
connection lost fails every waiting call with redis-py's ``ConnectionError`` and is opened again
by the next call; one whose oldest call has gone unanswered for ``stale_s`` (a peer gone without
closing it) is dropped by the next caller to give up. Error replies are redis-py's
errors, mapped as redis-py maps them (``NoScriptError`` for a script Redis does not hold), so the
store's failure handling is the same whichever client made the call.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis
from redis._parsers.base import BaseParser  # redis-py's own map of error replies
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

Command = Sequence[Any]


@dataclass(frozen=True, slots=True)
class RespAddress:
    """Where and how to connect: a TCP host and port or a Unix socket path, and the handshake."""

    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    username: str | None = None
    password: str | None = None
    db: int = 0

    @classmethod
    def from_url(cls, url: str) -> RespAddress | None:
        """The address of a ``redis://`` or ``unix://`` URL; None for anything else (TLS,
        Cluster, options this link does not speak), which redis-py then serves alone."""
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        if set(query) - {"db"}:
            return None
        try:
            db = 0
            if parts.scheme == "redis":
                path_db = parts.path.lstrip("/")
                if path_db:
                    db = int(path_db)
            if "db" in query:  # the query's database wins, as redis-py has it
                db = int(query["db"][0])
            if parts.scheme == "redis":
                return cls(
                    host=parts.hostname or "127.0.0.1",
                    port=parts.port or 6379,
                    username=unquote(parts.username) if parts.username else None,
                    password=unquote(parts.password) if parts.password else None,
                    db=db,
                )
            if parts.scheme == "unix" and parts.path:
                return cls(
                    path=unquote(parts.path),
                    username=unquote(parts.username) if parts.username else None,
                    password=unquote(parts.password) if parts.password else None,
                    db=db,
                )
        except ValueError:  # a port or database that is not a number: redis-py says so
            return None
        return None

    def handshake(self) -> list[Command]:
        out: list[Command] = []
        if self.password is not None:
            auth = ["AUTH", self.password]
            if self.username:
                auth.insert(1, self.username)
            out.append(auth)
        if self.db:
            out.append(["SELECT", self.db])
        return out


def _wrong_arity(reply: Any) -> bool:
    return isinstance(reply, RedisError) and "wrong number of arguments" in str(reply).lower()


def _error(reply: hiredis.ReplyError) -> RedisError:
    """The exception redis-py raises for the same error reply (``NOSCRIPT``: NoScriptError,
    ``MOVED``, ``ASK``, ``CROSSSLOT``: the cluster's own, ``WRONGPASS``...)."""
    error = BaseParser.parse_error(str(reply))  # type: ignore[no-untyped-call]
    return error if isinstance(error, RedisError) else ResponseError(str(reply))


class _Protocol(asyncio.Protocol):
    def __init__(self, link: RespLink) -> None:
        self._link = link
        self._reader = hiredis.Reader()
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[tuple[asyncio.Future[list[Any]], int, list[Any], float]] = deque()
        """Per call sent: its future, how many replies it waits for, those read, when sent."""
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self.waiting
        reader.feed(data)
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as exc:  # not Redis on the other end
                self._fail(RedisConnectionError(f"bad reply from Redis: {exc}"))
                if self.transport is not None:
                    self.transport.abort()
                return
            if reply is False:
                return
            if not waiting:  # nobody asked for it: the connection is out of step
                self._fail(RedisConnectionError("unexpected reply from Redis"))
                if self.transport is not None:
                    self.transport.abort()
                return
            future, expected, replies, _ = waiting[0]
            replies.append(_error(reply) if isinstance(reply, hiredis.ReplyError) else reply)
            if len(replies) == expected:
                waiting.popleft()
                if not future.done():  # else its caller gave up: the replies are dropped
                    future.set_result(replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def _fail(self, exc: Exception) -> None:
        self.lost = True
        self._link._dropped(self)
        while self.waiting:
            future, _, _, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)


def _expire(future: asyncio.Future[list[Any]], loop: asyncio.AbstractEventLoop) -> None:
    """A call's deadline is due: fail it unless its replies are read by the loop's next read.

    asyncio runs a turn's socket reads (``data_received``) before the timers due in that turn,
    so when a late turn finds both a deadline due and the reply in the socket, the reply is
    read first and this finds the call done. A reply that came while that turn's callbacks ran
    is read at the start of the next turn, before the timers due then (``call_later(0)``
    lands there): the call fails only if its replies are still missing after that read, i.e.
    Redis had not answered when the loop came to look. (This is the selector event loop's
    order, the one the proxy runs on. A reply larger than one read, 256 KiB, may still need a
    turn more: the store's replies are numbers and short lists.)
    """
    if not future.done():
        loop.call_later(0.0, _time_out, future)


def _time_out(future: asyncio.Future[list[Any]]) -> None:
    if not future.done():
        future.set_exception(TimeoutError("no reply from Redis by the deadline"))


class RespLink:
    """One shared, pipelined connection; ``execute`` sends commands and returns their replies
    (error replies as redis-py's exceptions, as values in place, as a pipeline does)."""

    def __init__(
        self, address: RespAddress, *, connect_timeout_s: float, stale_s: float = 2.0
    ) -> None:
        self.address = address
        self._connect_timeout_s = connect_timeout_s
        self._stale_s = stale_s
        """A call unanswered this long means the connection is dead (a peer gone without a
        reset): the next caller to give up drops it, and the call after opens a new one."""
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None
        self._closed = False

    async def execute(
        self, commands: Sequence[Command], deadline: float | None = None
    ) -> list[Any]:
        """The replies to ``commands``, sent in one write.

        ``deadline`` (the event loop's clock): TimeoutError if the replies have not been read
        by then. It judges Redis, not the proxy: replies waiting in the socket when the loop
        comes to look count, even when a busy loop comes a few milliseconds late (``_expire``),
        where a deadline that cancels the caller (``asyncio.timeout``) would fail the call.
        A connect under way is still cut at the deadline as the loop sees it (it goes on in
        the background and the next call uses it): a reconnect is rare, and takes several
        turns of the loop that no single look could judge.
        """
        if not commands:
            return []
        loop = asyncio.get_running_loop()
        protocol = self._protocol
        if protocol is None or protocol.lost:
            if deadline is None:
                protocol = await self._connect()
            else:
                async with asyncio.timeout_at(deadline):
                    protocol = await self._connect()
        transport = protocol.transport
        if protocol.lost or transport is None or transport.is_closing():
            raise RedisConnectionError("connection to Redis lost")
        future: asyncio.Future[list[Any]] = loop.create_future()
        transport.write(b"".join([hiredis.pack_command(tuple(c)) for c in commands]))
        protocol.waiting.append((future, len(commands), [], loop.time()))
        timer = None if deadline is None else loop.call_at(deadline, _expire, future, loop)
        try:
            return await future
        except (asyncio.CancelledError, TimeoutError):  # gave up: is the connection dead?
            if future.done() and not future.cancelled():
                future.exception()  # retrieved: a deadline and a cancel that came together
            waiting = protocol.waiting
            if waiting and loop.time() - waiting[0][3] > self._stale_s:
                protocol._fail(RedisConnectionError("Redis stopped answering"))
                transport.abort()  # every call on it has failed; the next one reconnects
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def _connect(self) -> _Protocol:
        if self._closed:
            raise RedisConnectionError("the store is closed")
        connecting = self._connecting
        if connecting is None:
            connecting = self._connecting = asyncio.ensure_future(self._open())
            connecting.add_done_callback(self._connected)
        return await asyncio.shield(connecting)

    def _connected(self, connecting: asyncio.Future[_Protocol]) -> None:
        """A connect attempt ended (even with every caller gone): the next call starts anew."""
        if self._connecting is connecting:
            self._connecting = None
        if not connecting.cancelled():
            connecting.exception()  # retrieved: a failed connect is reported to its callers

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        a = self.address
        protocol: _Protocol | None = None
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if a.path is not None:
                    _, protocol = await loop.create_unix_connection(lambda: _Protocol(self), a.path)
                else:
                    _, protocol = await loop.create_connection(
                        lambda: _Protocol(self), a.host, a.port
                    )
                hello = a.handshake()
                replies = await self._hello(protocol, hello) if hello else []
                if replies and a.username and _wrong_arity(replies[0]):
                    # A server before ACLs (Redis 5) knows AUTH with a password only.
                    replies = await self._hello(protocol, [["AUTH", a.password], *hello[1:]])
                for reply in replies:
                    if isinstance(reply, RedisError):
                        raise reply
            if self._closed:
                raise RedisConnectionError("the store is closed")
        except BaseException as exc:  # refused, timed out, refused the password, cancelled
            if protocol is not None and protocol.transport is not None:
                protocol.transport.close()
            if isinstance(exc, OSError):
                raise RedisConnectionError(f"cannot connect to Redis: {exc}") from exc
            raise
        self._protocol = protocol
        return protocol

    @staticmethod
    async def _hello(protocol: _Protocol, commands: list[Command]) -> list[Any]:
        assert protocol.transport is not None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        protocol.transport.write(b"".join([hiredis.pack_command(tuple(c)) for c in commands]))
        protocol.waiting.append((future, len(commands), [], loop.time()))
        return await future

    def _dropped(self, protocol: _Protocol) -> None:
        if self._protocol is protocol:
            self._protocol = None

    async def aclose(self) -> None:
        self._closed = True
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
