"""Reading a backend's own load: how many requests it is running and how many wait.

The proxy counts the requests it has in flight to each replica, but a backend may also serve
traffic that does not pass through this proxy (or any proxy), and it knows its queue better than
anyone. Where a server exposes those numbers, the fleet reads them in the background on the
health-check interval (never on the request path) and the router folds them into the load it
compares:

==========  ===========================================================================
llama.cpp   ``GET /slots`` (on by default): slots with ``is_processing``; else
            ``GET /metrics`` (needs ``--metrics``): ``llamacpp:requests_processing`` +
            ``llamacpp:requests_deferred``
vLLM        ``GET /metrics``: ``vllm:num_requests_running`` + ``vllm:num_requests_waiting``
            (summed over label sets: one per model name / engine)
other       nothing: the proxy's own counts only
==========  ===========================================================================

llama.cpp's ``/slots`` is asked first because a ``/metrics`` scrape resets llama.cpp's windowed
throughput gauges (``llamacpp:prompt_tokens_seconds``…), which would skew what an operator's own
Prometheus scrape of the same server sees. ``/slots`` has a side effect of its own (it wakes a
server with ``--sleep-idle-seconds`` and restarts its idle timer), so the fleet reads it only
while there is load to see (``proxy.fleet``: asleep and quiet replicas are not read).

This module names servers because load gauges are not part of any dialect's request/response
contract; it is the one place that knows them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from proxy.log import get_logger

log = get_logger()

MAX_BODY_BYTES = 4 * 1024 * 1024  # a vLLM /metrics page is a few hundred KB at most


@dataclass(frozen=True, slots=True)
class BackendLoad:
    """One reading of a backend's own load."""

    running: float
    waiting: float
    source: str
    """The path it was read from (``/slots`` or ``/metrics``)."""

    @property
    def total(self) -> float:
        """Requests the backend holds: running plus queued."""
        return self.running + self.waiting


@dataclass(frozen=True, slots=True)
class LoadSource:
    """Where and how one kind of server reports its load."""

    path: str
    running: str = ""
    waiting: str = ""
    """Prometheus sample names; empty for a JSON ``/slots`` source."""

    def read(self, payload: bytes) -> BackendLoad | None:
        """Parse a 200 answer; None when it does not carry the numbers."""
        if not self.running:
            return _slots_load(payload, self.path)
        gauges = prometheus_samples(
            payload.decode("utf-8", "replace"), (self.running, self.waiting)
        )
        if self.running not in gauges:
            return None
        return BackendLoad(gauges[self.running], gauges.get(self.waiting, 0.0), self.path)


SOURCES: Mapping[str, Sequence[LoadSource]] = {
    "llamacpp": (
        LoadSource("/slots"),
        LoadSource("/metrics", "llamacpp:requests_processing", "llamacpp:requests_deferred"),
    ),
    "vllm": (LoadSource("/metrics", "vllm:num_requests_running", "vllm:num_requests_waiting"),),
}


def prometheus_samples(text: str, names: Collection[str]) -> dict[str, float]:
    """The values of the samples called ``names`` in a Prometheus text page, summed over labels.

    Only lines starting with a wanted name are parsed, so a large page (vLLM's histograms) costs
    one pass of ``startswith`` checks.
    """
    wanted = tuple(n for n in names if n)
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        name = name.strip()
        if name not in wanted:
            continue  # a longer name sharing the prefix (``..._total``, ``..._bucket``)
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            out[name] = out.get(name, 0.0) + value
    return out


def _slots_load(payload: bytes, path: str) -> BackendLoad | None:
    try:
        slots: Any = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(slots, list):
        return None
    busy = 0
    for slot in slots:
        if not isinstance(slot, Mapping):
            return None
        if "is_processing" in slot:
            busy += slot["is_processing"] is True
        elif "state" in slot:  # older servers: 0 idle, 1 processing
            busy += slot["state"] != 0
        else:
            return None
    return BackendLoad(float(busy), 0.0, path)


class LoadReader:
    """Reads one replica's load, remembering which of its dialect's sources answers."""

    __slots__ = ("_preferred",)

    def __init__(self) -> None:
        self._preferred: LoadSource | None = None

    async def read(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        dialect: str,
        *,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> BackendLoad | None:
        """The backend's load now, or None when it does not say (or did not answer)."""
        sources = list(SOURCES.get(dialect, ()))
        if self._preferred in sources:
            sources.remove(self._preferred)
            sources.insert(0, self._preferred)
        for source in sources:
            load = await _fetch(session, base_url + source.path, source, timeout_s, headers)
            if load is not None:
                self._preferred = source
                return load
        self._preferred = None
        return None


async def _fetch(
    session: aiohttp.ClientSession,
    url: str,
    source: LoadSource,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> BackendLoad | None:
    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200 or (resp.content_length or 0) > MAX_BODY_BYTES:
                return None
            payload = await resp.read()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return source.read(payload)
