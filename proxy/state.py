"""Typed application state: one ``ProxyState`` under one ``AppKey``, and per-request keys."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from proxy.config import Settings
from proxy.fleet import Fleet
from proxy.prefixes import PrefixTracker
from proxy.records import RecordBuilder, RecordWriter
from proxy.store import PrefixStore

# (route, body) -> (body to forward, rules that fired, whether the body changed)
Canonicalize = Callable[[str, dict[str, Any]], tuple[dict[str, Any], list[str], bool]]


def no_canonicalization(route: str, body: dict[str, Any]) -> tuple[dict[str, Any], list[str], bool]:
    return body, [], False


@dataclass(slots=True)
class ProxyState:
    """Everything the handlers share, opened and closed with the application."""

    settings: Settings
    session: aiohttp.ClientSession
    fleet: Fleet
    store: PrefixStore
    tracker: PrefixTracker
    writer: RecordWriter
    builder: RecordBuilder
    canonicalize: Canonicalize = no_canonicalization


STATE = web.AppKey("prefixgate_state", ProxyState)
REQUEST_ID = web.RequestKey("prefixgate_request_id", str)
T_START = web.RequestKey("prefixgate_t_start", float)
