"""Notes that cost once: the note put in a message is remembered and restored on later turns.

The application never sees the proxy's rewrite, so on the next turn it resends the message
that held the note without it, and the backend's cache stopped where the note was. With the
memory, the proxy remembers, for each message it put a note in, the note and where it went,
keyed by a hash of that message as the application sent it and of everything before it (the
stable segments with their values masked, and every earlier message). When the application
resends the message, the note is put back exactly where it was: the history reaches the
backend byte-identical to the previous turn, notes included, and is cached.

A new note then restates only the values that differ from what the notes restored in this
request's history already say (a clock that ticked, a new request id); values that did not
change are not repeated. When nothing changed, no new note is written. What the model reads is
therefore always complete: every placeholder's current value is in the newest note that names
it, and only notes that are actually in the forwarded prompt count. If a memory entry is gone
(expired, evicted, another store), that note is simply not restored and the new note restates
every value: the request stays correct, only less of it is cached.

The memory is an in-process LRU in front of the store's shared memory (``recall`` /
``remember``, embedded or Redis, so every proxy replica agrees): ``keys_to_recall`` names the
keys a request needs that the LRU does not hold, the handler recalls them within the store's
lookup deadline, and writes go to the store in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

from proxy.canonical.slots import leading_system_indexes

MEMORY_KIND = "note"
NOTE_ROLES = ("user", "tool")  # the roles a note is ever put in


class NoteStore(Protocol):
    """The part of ``PrefixStore`` the memory uses."""

    async def recall(self, namespace: str, kind: str, keys: Sequence[str]) -> list[bytes | None]:
        """The values remembered under ``keys``."""
        ...

    async def remember(
        self, namespace: str, kind: str, items: Mapping[str, bytes], ttl_s: float
    ) -> None:
        """Keep each value under its key."""
        ...


@dataclass(frozen=True, slots=True)
class NoteEntry:
    """The note put in one message: its text, where it went, and the values it states."""

    note: str  # "" when the message got no note (nothing had changed)
    prefix: bool  # before the message's text (else after)
    part_type: str  # the text part's type, when the content was a list
    values: tuple[tuple[str, str], ...]  # (placeholder, value), in the note's order

    def encode(self) -> bytes:
        """The entry as stored."""
        return json.dumps(
            {"n": self.note, "p": self.prefix, "t": self.part_type, "v": self.values},
            separators=(",", ":"),
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> NoteEntry | None:
        """The entry, or None for anything that is not one (a foreign or damaged value)."""
        try:
            obj = json.loads(data)
            values = tuple((str(p), str(v)) for p, v in obj["v"])
            return cls(str(obj["n"]), bool(obj["p"]), str(obj["t"]), values)
        except (ValueError, KeyError, TypeError):
            return None


_ABSENT = NoteEntry("", False, "text", ())  # recalled and known to hold no note


def _digest(*parts: bytes) -> bytes:
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def message_keys(body: dict[str, Any], seed: bytes) -> dict[int, str]:
    """The memory key of every message after the leading system ones, by index.

    Each key hashes the message (as sent) and the key before it, starting from ``seed`` (the
    namespace, the model and the stable segments with their values masked): the same message
    after the same history of the same application gets the same key.
    """
    messages = body.get("messages")
    if not isinstance(messages, list):
        return {}
    first = len(leading_system_indexes(body))
    keys: dict[int, str] = {}
    prev = seed
    for index in range(first, len(messages)):
        prev = _digest(prev, _dumps(messages[index]))
        keys[index] = prev.hex()
    return keys


def seed_of(namespace: str, body: dict[str, Any], masked_stable: Sequence[str]) -> bytes:
    """The chain's start: namespace, model and the stable segments with values masked."""
    model = body.get("model")
    return _digest(
        namespace.encode(),
        str(model).encode() if model is not None else b"",
        *(text.encode() for text in masked_stable),
    )


class NoteMemory:
    """Which note the proxy put in which message: an LRU in front of the store."""

    def __init__(
        self, store: NoteStore | None = None, *, ttl_s: float = 86_400.0, max_entries: int = 65_536
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._local: OrderedDict[tuple[str, str], NoteEntry] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.write_failures = 0

    def get(self, namespace: str, key: str) -> NoteEntry | bool | None:
        """The entry, ``None`` when known to hold none, ``False`` when not held locally."""
        entry = self._local.get((namespace, key))
        if entry is None:
            return False
        self._local.move_to_end((namespace, key))
        return None if entry is _ABSENT else entry

    def _keep(self, namespace: str, key: str, entry: NoteEntry) -> None:
        slot = (namespace, key)
        self._local[slot] = entry
        self._local.move_to_end(slot)
        while len(self._local) > self.max_entries:
            self._local.popitem(last=False)

    def put(self, namespace: str, key: str, entry: NoteEntry) -> None:
        """Remember the entry here, and in the store in the background."""
        self._keep(namespace, key, entry)
        if self.store is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): local only
            return
        task = loop.create_task(self._write(namespace, {key: entry.encode()}))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, namespace: str, items: Mapping[str, bytes]) -> None:
        assert self.store is not None
        try:
            await self.store.remember(namespace, MEMORY_KIND, items, self.ttl_s)
        except Exception:  # a store failure costs later turns their cache, never this request
            self.write_failures += 1

    async def recall(self, namespace: str, keys: Sequence[str]) -> None:
        """Fetch the entries of ``keys`` from the store into the LRU (absent ones as absent)."""
        if not keys:
            return
        values: list[bytes | None] = [None] * len(keys)
        if self.store is not None:
            with contextlib.suppress(Exception):
                values = await self.store.recall(namespace, MEMORY_KIND, keys)
        for key, value in zip(keys, values, strict=False):
            entry = NoteEntry.decode(value) if value is not None else None
            self._keep(namespace, key, entry if entry is not None else _ABSENT)

    async def drain(self) -> None:
        """Wait for the background writes (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


@dataclass(slots=True)
class NoteContext:
    """One request's use of the memory: where to look, and what it found or missed."""

    memory: NoteMemory
    namespace: str
    defer_misses: bool = False  # report local misses instead of relocating without them
    missing: list[str] = field(default_factory=list)
    restored: int = 0  # notes put back into the history
    restated: int = 0  # values the new note states
    omitted: int = 0  # values the new note leaves to a restored one


def restore_history(
    body: dict[str, Any],
    keys: Mapping[int, str],
    upto: int,
    ctx: NoteContext,
    place: Any,
) -> tuple[dict[str, Any], dict[str, str]] | None:
    """``body`` with the remembered notes of its messages before ``upto`` put back, and the
    values those notes state (the latest per placeholder); None when some entry must first be
    recalled from the store (``ctx.missing`` names them).

    ``place(body, index, content, entry)`` puts one note back and returns the new body.
    """
    messages = body["messages"]
    found: list[tuple[int, NoteEntry]] = []
    for index in sorted(keys):
        if index >= upto:
            break
        message = messages[index]
        if type(message) is not dict or message.get("role") not in NOTE_ROLES:
            continue
        entry = ctx.memory.get(ctx.namespace, keys[index])
        if entry is False:
            ctx.missing.append(keys[index])
        elif isinstance(entry, NoteEntry) and entry.note:
            found.append((index, entry))
    if ctx.missing and ctx.defer_misses:
        return None
    known: dict[str, str] = {}
    for index, entry in found:
        content = body["messages"][index].get("content")
        if not isinstance(content, str | list):
            continue
        body = place(body, index, content, entry)
        known.update(entry.values)
        ctx.restored += 1
    return body, known
