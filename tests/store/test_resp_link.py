"""The scripts' own Redis connection (``proxy.store.resp``): addresses, order, failures.

The store's behaviour over it is what every Redis test of the store suite checks (they run on
it: ``RedisStore.from_url`` takes it for a ``redis://`` URL); these pin the connection itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
import redis
from redis.exceptions import AuthenticationError, NoScriptError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis_process import RedisServer

from proxy.store import RedisStore, StoreOptions, StoreTimeouts
from proxy.store.resp import RespAddress, RespLink


@pytest.mark.parametrize(
    "url,address",
    [
        ("redis://10.0.0.5:6380/2", RespAddress(host="10.0.0.5", port=6380, db=2)),
        ("redis://localhost", RespAddress(host="localhost")),
        ("redis://:s%40cret@h:1", RespAddress(host="h", port=1, password="s@cret")),
        ("redis://alice:pw@h:1/0", RespAddress(host="h", port=1, username="alice", password="pw")),
        ("redis://h:1?db=4", RespAddress(host="h", port=1, db=4)),
        ("redis://h:1/1?db=2", RespAddress(host="h", port=1, db=2)),  # the query wins
        ("unix:///run/redis.sock?db=1", RespAddress(path="/run/redis.sock", db=1)),
        ("rediss://h:1", None),  # TLS: redis-py's
        ("redis+cluster://h:1", None),  # Cluster: redis-py's
        ("redis://h:1?socket_timeout=2", None),  # an option this link does not speak
        ("redis://h:port", None),
    ],
)
def test_addresses(url: str, address: RespAddress | None) -> None:
    assert RespAddress.from_url(url) == address


def test_a_store_takes_the_link_where_the_url_allows() -> None:
    assert RedisStore.from_url("redis://127.0.0.1:1/0")._link is not None
    assert RedisStore.from_url("rediss://127.0.0.1:1/0")._link is None


async def given_up(link: RespLink, *command: object, after_s: float = 0.05) -> None:
    """A call whose caller gives up (its deadline) before Redis answers."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(after_s):
            await link.execute([command])


def link_to(server: RedisServer, stale_s: float = 2.0, **address: object) -> RespLink:
    return RespLink(
        RespAddress(host="127.0.0.1", port=server.port, **address),  # type: ignore[arg-type]
        connect_timeout_s=1.0,
        stale_s=stale_s,
    )


@pytest.mark.redis
async def test_concurrent_calls_get_their_own_replies(redis_server: RedisServer) -> None:
    link = link_to(redis_server)
    try:
        replies = await asyncio.gather(
            *(link.execute([("ECHO", f"a{i}"), ("ECHO", f"b{i}")]) for i in range(50))
        )
        assert replies == [[f"a{i}".encode(), f"b{i}".encode()] for i in range(50)]
        (error, ok) = await link.execute([("EVALSHA", "0" * 40, 0), ("PING",)])
        assert isinstance(error, NoScriptError) and ok == b"PONG"  # in place, as a pipeline
        (bad,) = await link.execute([("NOSUCHCOMMAND",)])
        assert isinstance(bad, ResponseError)
    finally:
        await link.aclose()


@pytest.mark.redis
async def test_a_call_given_up_leaves_the_next_ones_matched(
    own_redis_server: RedisServer,
) -> None:
    link = link_to(own_redis_server)
    try:
        assert await link.execute([("PING",)]) == [b"PONG"]
        own_redis_server.freeze()
        await given_up(link, "ECHO", "late")
        own_redis_server.thaw()
        assert await link.execute([("ECHO", "next")]) == [b"next"]
    finally:
        await link.aclose()


@pytest.mark.redis
async def test_a_lost_connection_fails_the_waiting_calls_and_is_opened_again(
    own_redis_server: RedisServer,
) -> None:
    link = link_to(own_redis_server)
    try:
        assert await link.execute([("PING",)]) == [b"PONG"]
        own_redis_server.freeze()
        waiting = asyncio.ensure_future(link.execute([("PING",)]))
        await asyncio.sleep(0.05)
        own_redis_server.kill()
        with pytest.raises(RedisConnectionError):
            await waiting
        with pytest.raises(RedisConnectionError):  # nobody listens on the port now
            await link.execute([("PING",)])
        own_redis_server.start()
        assert await link.execute([("PING",)]) == [b"PONG"]
    finally:
        await link.aclose()
    with pytest.raises(RedisConnectionError):
        await link.execute([("PING",)])  # closed for good


@pytest.mark.redis
async def test_password_user_and_database(own_redis_server: RedisServer) -> None:
    admin = redis.Redis(port=own_redis_server.port)
    admin.execute_command("ACL", "SETUSER", "alice", "on", ">wonder", "~*", "+@all")
    admin.config_set("requirepass", "hunter2")
    admin.close()
    links = [
        link_to(own_redis_server, password="hunter2", db=3),
        link_to(own_redis_server, username="alice", password="wonder"),
    ]
    try:
        assert await links[0].execute([("SET", "k", "v")]) == [b"OK"]
        assert await links[1].execute([("SELECT", 3), ("GET", "k")]) == [b"OK", b"v"]
        wrong = link_to(own_redis_server, password="nope")
        links.append(wrong)
        with pytest.raises(AuthenticationError):
            await wrong.execute([("PING",)])
        anonymous = link_to(own_redis_server)
        links.append(anonymous)
        (refused,) = await anonymous.execute([("GET", "k")])
        assert isinstance(refused, AuthenticationError)  # NOAUTH, as redis-py reports it
        store = RedisStore.from_url(
            f"redis://:hunter2@127.0.0.1:{own_redis_server.port}/5", StoreOptions()
        )
        try:
            assert await store.warm()
            await store.record_prefix("default", "http://r:1", [1, 2, 3], 100)
            got = await store.longest_match("default", ["http://r:1"], [1, 2, 3])
            assert got == {"http://r:1": 3} and not store.degraded
        finally:
            await store.aclose()
    finally:
        for link in links:
            await link.aclose()


@pytest.mark.redis
async def test_a_connection_that_stopped_answering_is_dropped(
    own_redis_server: RedisServer,
) -> None:
    """A peer gone without closing the connection: once its oldest call has waited
    ``stale_s``, the next caller to give up drops it, and later calls use a new one."""
    link = link_to(own_redis_server, stale_s=0.2)
    try:
        assert await link.execute([("PING",)]) == [b"PONG"]
        first = link._protocol
        own_redis_server.freeze()
        for _ in range(2):
            await given_up(link, "PING")
        assert link._protocol is first  # young unanswered calls: kept
        await asyncio.sleep(0.25)
        await given_up(link, "PING")
        assert link._protocol is None  # dropped
        own_redis_server.thaw()
        assert await link.execute([("ECHO", "again")]) == [b"again"]
        assert link._protocol is not first
    finally:
        await link.aclose()


@pytest.mark.redis
async def test_a_connect_every_caller_gave_up_on_is_not_reused(
    own_redis_server: RedisServer,
) -> None:
    link = link_to(own_redis_server)
    try:
        await given_up(link, "PING", after_s=0.0001)  # before the connect is done
        await asyncio.sleep(0.05)
        assert link._connecting is None
        assert await link.execute([("PING",)]) == [b"PONG"]
    finally:
        await link.aclose()


# -- a call's deadline judges Redis, not the proxy's loop ----------------------------------------


def stall_the_loop(seconds: float) -> None:
    """Block the event loop, as a busy proxy's turn does (timers come due, sockets fill)."""
    time.sleep(seconds)


@contextlib.asynccontextmanager
async def connected(server: RedisServer) -> AsyncIterator[RespLink]:
    """A link to ``server``, its connection made (a call's deadline then covers Redis alone)."""
    link = link_to(server)
    try:
        assert await link.execute([("PING",)]) == [b"PONG"]
        yield link
    finally:
        await link.aclose()


@pytest.mark.redis
async def test_a_reply_a_busy_loop_notices_late_still_counts(
    own_redis_server: RedisServer,
) -> None:
    """The loop stalls past the deadline while Redis answers: the turn that finds the deadline
    due reads the reply first, and the call has its answer."""
    loop = asyncio.get_running_loop()
    async with connected(own_redis_server) as link:
        call = asyncio.ensure_future(link.execute([("ECHO", "x")], loop.time() + 0.005))
        await asyncio.sleep(0)  # sent
        stall_the_loop(0.05)  # the deadline passes, Redis answers
        assert await call == [b"x"]


@pytest.mark.redis
async def test_a_reply_that_comes_while_the_late_turn_runs_still_counts(
    own_redis_server: RedisServer,
) -> None:
    """Redis answers while the late turn runs (after that turn's read, before its deadline
    timer): the call looks again after the loop's next read, and has its answer."""
    loop = asyncio.get_running_loop()
    async with connected(own_redis_server) as link:
        own_redis_server.freeze()
        deadline = loop.time() + 0.01

        def busy() -> None:  # a callback of the same turn, due just before the deadline
            own_redis_server.thaw()
            time.sleep(0.05)  # Redis answers meanwhile

        loop.call_at(deadline - 0.001, busy)
        call = asyncio.ensure_future(link.execute([("ECHO", "y")], deadline))
        await asyncio.sleep(0)  # sent, to a frozen Redis
        stall_the_loop(0.02)  # past both: the next turn runs busy, then the deadline's timer
        assert await call == [b"y"]


@pytest.mark.redis
async def test_a_deadline_fails_the_call_redis_has_not_answered(
    own_redis_server: RedisServer,
) -> None:
    loop = asyncio.get_running_loop()
    async with connected(own_redis_server) as link:
        own_redis_server.freeze()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await link.execute([("ECHO", "never")], start + 0.02)
        assert 0.02 <= loop.time() - start < 0.5  # at the deadline, not Redis's socket timeout
        loop.call_later(0.06, own_redis_server.thaw)  # answers after the deadline: too late
        with pytest.raises(TimeoutError):
            await link.execute([("ECHO", "late")], loop.time() + 0.02)
        await asyncio.sleep(0.1)
        assert await link.execute([("ECHO", "next")]) == [b"next"]  # still in step


@pytest.mark.redis
async def test_a_deadline_bounds_the_connect_too(own_redis_server: RedisServer) -> None:
    """A Redis that accepts the connection and never answers the handshake."""
    link = link_to(own_redis_server, password="pw")
    loop = asyncio.get_running_loop()
    try:
        own_redis_server.freeze()
        start = loop.time()
        with pytest.raises(TimeoutError):
            await link.execute([("PING",)], start + 0.02)
        assert loop.time() - start < 0.5  # not the link's 1 s connect timeout
    finally:
        own_redis_server.thaw()
        await link.aclose()


@pytest.mark.redis
async def test_the_store_does_not_put_its_own_lag_down_to_redis(
    own_redis_server: RedisServer,
) -> None:
    """A lookup whose answer the busy proxy reads after its deadline: the answer is used and
    the breaker stays closed (asyncio's own deadline would have cancelled the call)."""
    store = RedisStore.from_url(f"redis://127.0.0.1:{own_redis_server.port}/0", StoreOptions())
    try:
        assert await store.warm()
        await store.record_prefix("default", "http://r:1", [1, 2, 3], 100)
        lookup = asyncio.ensure_future(store.longest_match("default", ["http://r:1"], [1, 2, 3]))
        await asyncio.sleep(0)  # sent
        stall_the_loop(0.05)  # ten lookup deadlines
        assert await lookup == {"http://r:1": 3}
        assert not store.degraded and store.failures == 0
        await store.remember("default", "form", {"k": b"v"}, ttl_s=60)
        recall = asyncio.ensure_future(store.recall("default", "form", ["k", "j"]))
        await asyncio.sleep(0)  # sent: the memory's calls take the link too
        stall_the_loop(0.05)
        assert await recall == [b"v", None]
        assert not store.degraded and store.failures == 0
        own_redis_server.freeze()  # a Redis that does not answer still opens the breaker
        assert await store.longest_match("default", ["http://r:1"], [1, 2, 3]) == {}
        assert store.degraded and store.failures == 1
    finally:
        own_redis_server.thaw()
        await store.aclose()


@pytest.mark.redis
async def test_a_restarts_second_round_trip_has_its_own_window_after_a_late_first(
    own_redis_server: RedisServer,
) -> None:
    """Redis lost its scripts (a restart): the lookup's first replies say so, read late by a
    busy loop; the round trip that sends the scripts' source is not given up at once."""
    opts = StoreOptions(timeouts=StoreTimeouts(lookup_s=0.02, write_s=0.05))
    store = RedisStore.from_url(f"redis://127.0.0.1:{own_redis_server.port}/0", opts)
    admin = redis.Redis(port=own_redis_server.port)
    try:
        assert await store.warm()
        await store.record_prefix("default", "http://r:1", [1, 2, 3], 100)
        admin.script_flush()
        lookup = asyncio.ensure_future(store.longest_match("default", ["http://r:1"], [1, 2, 3]))
        await asyncio.sleep(0)  # sent: Redis answers NOSCRIPT
        stall_the_loop(0.1)  # five deadlines
        assert await lookup == {"http://r:1": 3}
        assert not store.degraded and store.failures == 0
    finally:
        admin.close()
        await store.aclose()
