"""Slots on a server that has them (llama-server): how a request is pinned, and the slot endpoints.

``SlotApi`` is the request side: the body field that pins a request to a slot (``id_slot``), which
a client may have set itself, and which the server echoes on the events of its answer.
``SlotEndpoint`` is the server side, as the scheduler uses it:

* ``GET /slots``: per slot ``id``, ``n_ctx``, ``is_processing`` and, once it ran a task,
  ``id_task`` and ``n_prompt_tokens``. On by default (``--no-slots`` turns it off: 501).
* ``POST /slots/{id}?action=save`` ``{"filename": ...}`` writes the slot's KV cache to a file in
  the server's ``--slot-save-path``; ``?action=restore`` loads such a file into a slot. Without
  ``--slot-save-path`` both answer an error. A save of a busy slot waits until the slot is idle.

Every call is bounded and returns None (or False) on any failure: slot scheduling degrades to
leaving the choice to the server, it never fails a request.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.log import get_logger

log = get_logger()

UNSUPPORTED = (404, 405, 501)  # "this server does not do that", not "try again later"


def _slot_id(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


@dataclass(frozen=True, slots=True)
class SlotApi:
    """How requests name a slot on a server with slots, and how to reach its slot endpoints."""

    field: str = "id_slot"
    """The body field that pins a request to a slot; the server reports it on its events."""

    def client_slot(self, body: Mapping[str, Any]) -> int | None:
        """The slot the client pinned the request to itself, if any."""
        return _slot_id(body.get(self.field))

    def pin(self, body: MutableMapping[str, Any], slot: int) -> None:
        """Pin the request in ``body`` to ``slot``."""
        body[self.field] = slot

    def reported_slot(self, event: Mapping[str, Any]) -> int | None:
        """The slot the server says served a request (on an event or a response)."""
        return _slot_id(event.get(self.field))

    def endpoint(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> SlotEndpoint:
        """The slot endpoints of the server at ``url``."""
        return SlotEndpoint(session, url, headers=headers)


class SlotEndpoint:
    """The slot endpoints of one llama-server."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        self._session = session
        self.url = url
        self._headers = dict(headers or {})
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.slots_supported = True
        self.save_supported = True

    async def read(self) -> list[Mapping[str, Any]] | None:
        """The ``/slots`` list, or None (unavailable now; ``slots_supported`` says if ever)."""
        try:
            async with self._session.get(
                self.url + "/slots", headers=self._headers, timeout=self._timeout
            ) as resp:
                if resp.status in UNSUPPORTED:
                    self.slots_supported = False
                    return None
                if resp.status != 200:
                    return None
                data = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        if not isinstance(data, list):
            return None
        return [e for e in data if isinstance(e, Mapping)]

    async def _action(self, slot: int, action: str, filename: str, limit_s: float) -> bool:
        try:
            async with self._session.post(
                f"{self.url}/slots/{slot}",
                params={"action": action},
                json={"filename": filename},
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=limit_s),
            ) as resp:
                body = await resp.read()
                if resp.status == 200:
                    return True
                if resp.status in UNSUPPORTED:
                    self.save_supported = False
                log.warning(
                    "slot_action_failed",
                    backend=self.url,
                    action=action,
                    slot=slot,
                    status=resp.status,
                    detail=body[:200].decode("utf-8", "replace"),
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning(
                "slot_action_failed",
                backend=self.url,
                action=action,
                slot=slot,
                detail=exc.__class__.__name__,
            )
        return False

    async def save(self, slot: int, filename: str, *, limit_s: float = 10.0) -> bool:
        """Write ``slot``'s cache to ``filename`` (waits while the slot is busy)."""
        return await self._action(slot, "save", filename, limit_s)

    async def restore(self, slot: int, filename: str, *, limit_s: float = 10.0) -> bool:
        """Load ``filename`` into ``slot``."""
        return await self._action(slot, "restore", filename, limit_s)
