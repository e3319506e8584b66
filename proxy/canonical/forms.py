"""Learned canonical forms: the first form the proxy saw of each part, shared through the store.

A *part* is something an application may send in different forms that mean the same: a tool list
(in another order, with its schemas' keys in another order), the arguments of a past tool call
(re-serialized), a system prompt (with CRLF one time, LF the next). Each part has an *identity*,
its fixed normal form (sorted, normalised: what the rule's fixed rewrite would produce), and a
*form*, the bytes it had the first time the proxy saw that identity. A later request whose part
has the same identity but other bytes is rewritten to the form; a part already in its form is
left alone. So an application whose requests are already stable is never rewritten, and one that
shuffles is rewritten to what it sent first (the prompt the backend has cached).

``FormMemory`` keeps the forms: an in-process LRU, authoritative for this proxy and read on the
request path without I/O, in front of the store (``PrefixStore.remember`` / ``recall``, kind
``form``), which every proxy replica sharing a Redis reads. A part the LRU does not know is
looked up in the store once (``settle``, within the store's lookup deadline) before the request
goes on; unknown there too, this request's form becomes the form, written to the store in the
background. A store that is down only means each proxy learns on its own: the request is still
forwarded correctly, and a part is never rewritten to anything but a form seen for it.

Two proxies that first see one identity at the same moment in different forms may each keep
their own (the store keeps the last write); each proxy stays consistent with itself, and a proxy
started later adopts the store's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from proxy.sized_lru import SizedLRU

if TYPE_CHECKING:
    from proxy.store.base import PrefixStore

log = structlog.get_logger("prefixgate.canonical")

STORE_KIND = "form"
DEFAULT_ENTRIES = 50_000
DEFAULT_BYTES = 64 * 1024 * 1024
DEFAULT_TTL_S = 7 * 24 * 3600.0
DEFAULT_TEXT_BYTES = 8 * 1024 * 1024
"""Bytes of texts remembered as already in their form (the fast path). A stable application
has a handful; an application whose texts change every request (a timestamp, a request id in
its system prompt) would otherwise fill the entry bound with texts never seen again."""
MAX_MARKED_TEXT = 65_536
"""Longer texts take the slow path: no second copy of them is kept."""


class FormView:
    """The forms of one namespace as one request's rules see them; collects what it learns."""

    __slots__ = ("_memory", "learned", "namespace")

    def __init__(self, memory: FormMemory, namespace: str) -> None:
        self._memory = memory
        self.namespace = namespace
        self.learned: dict[str, bytes] = {}

    def form(self, key: str) -> bytes | None:
        """The form known for ``key`` (a rule-prefixed identity digest), or None."""
        return self._memory.local(self.namespace, key)

    def is_form(self, rule: str, text: str | bytes) -> bool:
        """Whether ``text`` is already known as a form of ``rule``: the fast path of a stable
        application (a string's hash is cached on it, so this costs one dict lookup)."""
        return self._memory.known_text(self.namespace, rule, text)

    def mark_form(self, rule: str, text: str | bytes) -> None:
        """Remember that ``text`` is a form of ``rule``."""
        self._memory.mark_text(self.namespace, rule, text)

    def learn(self, key: str, value: bytes) -> None:
        """``value`` is the first form of ``key`` this proxy sees: keep it, to be settled."""
        self._memory.keep(self.namespace, key, value)
        self.learned[key] = value


class FormMemory:
    """First-seen forms per namespace: a bounded local LRU written through to the store."""

    def __init__(
        self,
        *,
        entries: int = DEFAULT_ENTRIES,
        max_bytes: int = DEFAULT_BYTES,
        ttl_s: float = DEFAULT_TTL_S,
        text_bytes: int = DEFAULT_TEXT_BYTES,
    ) -> None:
        self.ttl_s = ttl_s
        self._local: SizedLRU[tuple[str, str], bytes] = SizedLRU(
            entries=entries, max_bytes=max_bytes, size=lambda slot, form: len(slot[1]) + len(form)
        )
        # Texts known to be forms, for the fast path; bounded by count like the forms and by
        # their bytes (a text evicted here only costs the slow path once).
        self._texts: SizedLRU[tuple[str, str, str | bytes], bool] = SizedLRU(
            entries=entries, max_bytes=text_bytes, size=lambda key, _: len(key[2])
        )
        self._store: PrefixStore | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self.adopted = 0
        """Forms taken from the store that this proxy had not seen (another replica's)."""

    def __len__(self) -> int:
        return len(self._local)

    def bind(self, store: PrefixStore | None) -> None:
        """Share forms through ``store`` (None: this proxy's memory only)."""
        self._store = store

    def view(self, namespace: str) -> FormView:
        """A fresh view for one request of ``namespace``."""
        return FormView(self, namespace)

    def local(self, namespace: str, key: str) -> bytes | None:
        """The locally known form (marked as just used), or None."""
        return self._local.get((namespace, key), touch=True)

    def known_text(self, namespace: str, rule: str, text: str | bytes) -> bool:
        """Whether ``text`` was marked as a form of ``rule`` in ``namespace``."""
        return (namespace, rule, text) in self._texts

    def mark_text(self, namespace: str, rule: str, text: str | bytes) -> None:
        """Mark ``text`` as a form (the least recently marked go beyond the entry and byte
        bounds)."""
        if len(text) <= MAX_MARKED_TEXT:
            self._texts.put((namespace, rule, text), True)

    @property
    def text_bytes(self) -> int:
        """Bytes of the texts marked as forms now."""
        return self._texts.bytes

    def keep(self, namespace: str, key: str, value: bytes) -> None:
        """Hold ``value`` as the form of ``key``; the least recently used go beyond the bounds."""
        self._local.put((namespace, key), value)

    async def settle(self, namespace: str, learned: Mapping[str, bytes]) -> bool:
        """Check the forms one request learned against the store (one bounded round trip).

        Where the store holds another form for a key (another proxy saw it first), that form
        replaces this proxy's and True is returned: the request must be canonicalized again.
        Keys the store does not hold are written to it in the background.
        """
        store = self._store
        if store is None or not learned:
            return False
        keys = list(learned)
        try:
            found = await store.recall(namespace, STORE_KIND, keys)
        except Exception:  # a store failure costs sharing, never the request
            log.warning("form_recall_failed", exc_info=True)
            found = [None] * len(keys)
        again = False
        missing: dict[str, bytes] = {}
        for key, theirs in zip(keys, found, strict=True):
            if theirs is None:
                missing[key] = learned[key]
            elif theirs != learned[key]:
                self.keep(namespace, key, theirs)
                self._texts.clear()  # a text marked as a form may no longer be the form
                self.adopted += 1
                again = True
        if missing:
            task = asyncio.get_running_loop().create_task(self._write(namespace, missing))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)
        return again

    async def _write(self, namespace: str, items: Mapping[str, bytes]) -> None:
        store = self._store
        if store is None:
            return
        try:
            await store.remember(namespace, STORE_KIND, items, self.ttl_s)
        except Exception:
            log.warning("form_remember_failed", exc_info=True)

    async def drain(self) -> None:
        """Wait for the background writes in flight (at shutdown, and in tests)."""
        while self._writes:
            await asyncio.gather(*list(self._writes), return_exceptions=True)
