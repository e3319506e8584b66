"""Redis (and Valkey) Cluster for the Redis store: its URLs, its client, learning its layout.

``redis+cluster://[user:password@]host:port[,host:port...][/0][?option=value...]``
(``rediss+cluster://`` for TLS) opens redis-py's ``RedisCluster``; the hosts are seed nodes.
The store's keys are laid out by hash tag so that every script touches one slot (see
``proxy.store.redis_layout``); what this module adds is the client and its layout.

Learning the layout (``CLUSTER SLOTS`` and ``COMMAND``, some 20 ms) is longer than a lookup's
5 ms deadline, so it never runs under one: ``ClusterLayout`` runs it in a task of its own,
started when the store opens and again in the background after every failure, so that the
breaker's probe finds a failover or a resharding already picked up (a ``MOVED`` answer is
followed at once by redis-py). Callers wait for it without cancelling it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, ClusterCrossSlotError, ClusterDownError
from redis.exceptions import ConnectionError as RedisConnectionError

T = TypeVar("T")

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
"""URL schemes of a Redis (or Valkey) Cluster, and the plain scheme each stands for."""
CLUSTER_ANSWERS = (AskError, ClusterDownError, ClusterCrossSlotError)
"""Answers only a cluster node gives: a plain ``redis://`` URL that names one."""
# As many connections per node as the single-node client allows (redis-py's cluster default,
# 100, fails calls at once beyond it instead of opening another connection).
_MAX_CONNECTIONS = 2**31


def cluster_url(url: str) -> tuple[str, list[tuple[str, int]]] | None:
    """A cluster URL as redis-py takes it: the plain URL of its first node, and every seed node.

    The seeds are where the client learns the cluster's layout; one is enough, more let a proxy
    start while one of them is down. ``None`` for any other URL.
    """
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    if not sep or plain is None:
        return None
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    auth, at, hosts = rest[:cut].rpartition("@")
    names = [h.strip() for h in hosts.split(",")]
    seeds = [_host_port(name) for name in names]
    return f"{plain}://{auth}{at}{names[0]}{rest[cut:]}", seeds


def _host_port(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError(f"a cluster URL needs host:port for every seed node, got {text!r}")
    return host, int(port) if port else 6379


def cluster_client(url: str, **options: Any) -> RedisCluster | None:
    """A ``RedisCluster`` for a cluster URL (``None`` for any other URL)."""
    parsed = cluster_url(url)
    if parsed is None:
        return None
    plain, seeds = parsed
    return RedisCluster.from_url(
        plain,
        startup_nodes=[ClusterNode(host, port) for host, port in seeds[1:]],
        max_connections=_MAX_CONNECTIONS,
        **options,
    )


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: the failure is a caller's, or the next refresh's


class ClusterLayout:
    """Learns a ``RedisCluster``'s slots in a task of its own, never under a caller's deadline."""

    def __init__(self, client: RedisCluster, *, timeout_s: float) -> None:
        self._client = client
        self._timeout_s = timeout_s
        self._task: asyncio.Task[None] | None = None
        with contextlib.suppress(RuntimeError):  # no running loop: the first call starts it
            asyncio.get_running_loop()
            self._discover(refresh=False)

    @property
    def pending(self) -> bool:
        """Whether the client does not know the slots yet (first call, or after a reset)."""
        return bool(getattr(self._client, "_initialize", True))

    async def then(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call`` once the slots are known.

        A caller's deadline gives up waiting for the discovery, never stops it (``asyncio.wait``
        does not cancel what it waits for), so the next call finds it done.
        """
        task = self._discover(refresh=False)
        await asyncio.wait({task})
        if task.cancelled():  # the store is being closed
            raise RedisConnectionError("the store was closed while learning the cluster's layout")
        task.result()  # its failure is this call's
        return await call()

    def refresh(self) -> None:
        """Relearn the layout in the background (a node may have died, failed over or handed its
        slots on), so that the breaker's probe finds it ready."""
        self._discover(refresh=True)

    async def aclose(self) -> None:
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    def _discover(self, *, refresh: bool) -> asyncio.Task[None]:
        task = self._task
        if task is None or task.done():
            task = asyncio.ensure_future(self._run(refresh))
            task.add_done_callback(_retrieve)
            self._task = task
        return task

    async def _run(self, refresh: bool) -> None:
        async with asyncio.timeout(self._timeout_s):
            if self.pending:
                await self._client.initialize()  # CLUSTER SLOTS, then COMMAND (key positions)
            elif refresh:
                await self._client.nodes_manager.initialize()  # CLUSTER SLOTS only
