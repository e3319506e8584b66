"""The Redis store's calls: each bounded, and guarded by the store's circuit breaker.

Every call is bounded (``StoreTimeouts``) and guarded by a circuit breaker (``StoreHealth``):
Redis down, hung or restarted costs a request ``lookup_s`` (and what the proxy's own loop is
late by), and the store reconnects by itself (redis-py opens a new connection on the next call
after one was dropped). The deadline of a call on one of the store's own links (the scripts and
``recall`` on the scripts' link, the batched writes and ``remember`` on the writes') is the
link's (``RespLink.execute``): the call fails only if Redis had not answered when the loop came
to look, so a proxy whose own loop runs late does not open the breaker on a Redis that answered
in time.

Redis Cluster (``redis+cluster://`` / ``rediss+cluster://``; the client and its layout are
``proxy.store.redis_cluster``'s): pipelines are split per node and sent in parallel. One
breaker guards the whole cluster: a node down degrades the store (every call answers its
neutral result, the traffic flows), exactly as a single Redis down does. While the cluster
still serves the other nodes' slots, a probe that lands on one of them closes the breaker until
the next call to the dead node opens it again: a ``store_degraded`` / ``store_recovered`` pair
per ``breaker_s`` at most, until the cluster fails the node over (or declares itself down).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from proxy.store.base import StoreOptions
from proxy.store.health import StoreHealth
from proxy.store.redis_cluster import CLUSTER_ANSWERS, ClusterLayout
from proxy.store.redis_layout import Call
from proxy.store.resp import Command, RespLink

T = TypeVar("T")
_log = structlog.get_logger("prefixgate.store")
# What a failed Redis call can raise: redis-py's errors (the cluster client's own ones are not
# RedisErrors: "cannot be connected", "slot not covered"), socket errors it did not translate,
# and our own deadline.
_FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)


async def _within(call: Awaitable[T], timeout_s: float) -> T:
    """``call``'s result, or TimeoutError at ``timeout_s`` sharp.

    Unlike ``asyncio.timeout``, the deadline does not wait for the cancelled call to unwind:
    redis-py can take up to its socket timeout to do so (a connection being set up to a Redis
    that accepts and never answers), and the caller may be a request on its critical path.
    The abandoned call finishes being cancelled in the background.
    """
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except BaseException:  # the caller itself was cancelled
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise TimeoutError
    return task.result()


STALE_READ = object()
"""In place of a read's result (``_eval_all``'s ``reads``): the read missed Redis's script
cache and ran again only after writes of the same pipeline had run, so it may have seen them."""


def _raised(results: list[Any]) -> list[Any]:
    """``results``, or the first error among them raised (a pipeline's errors come in place)."""
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned call's failure is already accounted for


class RedisCalls:
    """One store's connections (redis-py's client, the scripts' and the writes' links), its
    breaker, and the guarded, bounded calls every operation goes through."""

    def __init__(
        self,
        client: Redis | RedisCluster,
        options: StoreOptions,
        *,
        owns_client: bool,
        link: RespLink | None,
        write_link: RespLink | None,
    ) -> None:
        self._client = client
        self._link = link
        """The scripts' own connection (``proxy.store.resp``), where the URL allows one."""
        self._write_link = write_link or link
        """The batched writes' (``apply_writes``): a lookup never waits behind a batch."""
        self._opts = options
        self._owns_client = owns_client
        self._health = StoreHealth(store="redis", breaker_s=options.timeouts.breaker_s)
        self._closed = False
        self._layout: ClusterLayout | None = None
        if isinstance(client, RedisCluster):
            timeouts = options.timeouts
            self._layout = ClusterLayout(client, timeout_s=max(timeouts.read_s, timeouts.connect_s))
        self._hinted = False

    # -- state ----------------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self._health.degraded

    @property
    def failures(self) -> int:
        """Failed Redis calls since start-up."""
        return self._health.failures

    @property
    def client(self) -> Redis | RedisCluster:
        return self._client

    @property
    def options(self) -> StoreOptions:
        """The sizing, retention and deadlines the store was opened with."""
        return self._opts

    @property
    def cluster(self) -> bool:
        """Whether the store talks to a Redis Cluster."""
        return self._layout is not None

    async def aclose(self) -> None:
        """Close the client if this store created it; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._layout is not None:
            await self._layout.aclose()
        if self._link is not None:
            await self._link.aclose()
        if self._write_link is not None and self._write_link is not self._link:
            await self._write_link.aclose()
        if self._owns_client:
            await self._client.aclose()

    async def _linked(
        self, op: str, link: RespLink, timeout_s: float, commands: Sequence[Command]
    ) -> list[Any] | None:
        """``commands``' replies on ``link`` under the link's deadline, ``timeout_s`` from now
        (as ``_scripts``), guarded; None when they failed, or were not sent (the breaker
        open, the store closed)."""
        deadline = asyncio.get_running_loop().time() + timeout_s

        async def call() -> list[Any] | None:
            return _raised(await link.execute(commands, deadline))

        return await self._guarded(op, None, None, call)

    async def _guarded(
        self,
        op: str,
        timeout_s: float | None,
        neutral: T,
        call: Callable[[], Awaitable[T]],
    ) -> T:
        """Run ``call`` within ``timeout_s``; on any failure answer ``neutral`` and note it.

        ``timeout_s`` None: ``call`` keeps its own deadline (the scripts' link, ``_scripts``).
        """
        if self._closed or not self._health.allow():
            return neutral
        try:
            if timeout_s is None:
                result = await call()
            elif self._layout is not None and self._layout.pending:
                result = await _within(self._layout.then(call), timeout_s)
            else:
                result = await _within(call(), timeout_s)
        except _FAILURES as exc:
            self._failed(op, exc)
            return neutral
        except BaseException:  # cancelled from outside (e.g. the client went away)
            self._health.abandoned()
            raise
        self._health.succeeded()
        return result

    def _failed(self, op: str, exc: BaseException) -> None:
        self._health.failed(op, exc)
        if self._layout is not None and not self._closed:
            self._layout.refresh()
        elif isinstance(exc, CLUSTER_ANSWERS) and not self._hinted:
            self._hinted = True
            _log.error(
                "store_is_a_cluster",
                error=type(exc).__name__,
                detail=str(exc)[:200],
                hint="the Redis URL names a cluster node: use redis+cluster://host:port",
            )

    async def _scripts(
        self,
        op: str,
        timeout_s: float,
        neutral: T,
        calls: Sequence[Call],
        answer: Callable[[list[Any]], T],
        *,
        writes: bool = False,
        reads: int = 0,
    ) -> T:
        """``answer`` to the results of ``calls`` (``_eval_all``) within ``timeout_s``, guarded.

        On the scripts' own connection (``RespLink``: writes on their own one) the deadline is
        the link's: it fails the call only if Redis's replies had not been read when the loop
        came to look, so a proxy too busy to notice an answer in time does not put its own lag
        down to Redis (and open the breaker on it). A frozen or slow Redis still misses it.
        Through redis-py (Cluster, TLS) ``_guarded`` bounds the call. ``reads``: see
        ``_eval_all``.
        """
        if (self._write_link if writes else self._link) is None:

            async def run() -> T:
                return answer(await self._eval_all(calls, writes=writes, reads=reads))

            return await self._guarded(op, timeout_s, neutral, run)

        async def bounded() -> T:
            return answer(
                await self._eval_all(calls, writes=writes, timeout_s=timeout_s, reads=reads)
            )

        return await self._guarded(op, None, neutral, bounded)

    async def _eval_all(
        self,
        calls: Sequence[Call],
        *,
        writes: bool = False,
        timeout_s: float | None = None,
        reads: int = 0,
    ) -> list[Any]:
        """Run each (script, keys, args) in one pipelined round trip (one per node, in parallel,
        on a cluster). ``timeout_s``: the scripts' link's deadline (``_scripts``), from now.
        ``reads``: the first ``reads`` calls read what the store held before the others wrote.

        After a Redis restart the script cache is empty: the calls that failed for it are sent
        once more with the scripts' source (``EVAL`` runs and caches them), one more round trip
        in all, so that the first lookup after a restart still fits its deadline. Only those
        calls run again: a script that did run is never applied twice, and a read among the
        first ``reads`` that runs again after a write of the first trip is ``STALE_READ``.
        Should the first round trip's replies have been read past the deadline (the loop's lag:
        they count), the second has a window of its own, else it would be given up before Redis
        could answer it.
        """
        link = self._write_link if writes else self._link
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s

        async def send(commands: list[Command]) -> list[Any]:
            if link is None:
                return await self._pipelined(commands)
            return await link.execute(commands, deadline)

        results = await send(
            [("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args in calls]
        )
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            if deadline is not None and timeout_s is not None and loop.time() >= deadline:
                deadline = loop.time() + timeout_s
            again = await send(
                [
                    ("EVAL", calls[i][0].source, len(calls[i][1]), *calls[i][1], *calls[i][2])
                    for i in missing
                ]
            )
            for i, r in zip(missing, again, strict=True):
                results[i] = r
            # A read sent again after writes of the first round trip ran may count them (a
            # request's lookup would find its own claim): it is not an answer.
            gone = set(missing)
            if any(i not in gone for i in range(reads, len(calls))):
                for i in missing:
                    if i < reads and not isinstance(results[i], Exception):
                        results[i] = STALE_READ
        return _raised(results)

    async def _pipelined(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """``commands`` in one redis-py pipeline; errors as values in place.

        ``execute_command`` rather than ``pipe.evalsha``: the very same command, but redis-py's
        cluster pipeline refuses the ``evalsha`` method wholesale (it cannot know that each
        script's keys share a slot; ours do, and the cluster client routes EVALSHA by them).
        """
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))
