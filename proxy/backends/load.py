"""What a server reports about its own load, and how to read it from one answer.

``LoadSource`` is one place a server publishes its running and queued requests (a JSON slot list,
or two Prometheus samples); a dialect lists its sources in ``Capabilities.load_sources``, in the
order they are tried. ``proxy.backend_metrics`` fetches them in the background.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import orjson


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
