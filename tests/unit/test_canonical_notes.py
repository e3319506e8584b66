"""Notes that cost once: earlier turns' notes are restored, a new note states what changed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from proxy.canonical import CanonicalConfig, Canonicalizer
from proxy.canonical.notes import NoteMemory
from proxy.store.embedded import EmbeddedStore

CHAT = "/v1/chat/completions"
SESSION = "550e8400-e29b-41d4-a716-446655440000"


def system(clock: str) -> dict[str, Any]:
    return {"role": "system", "content": f"You are Aria.\nClock: {clock}\nSession: {SESSION}"}


def turns(n: int) -> list[dict[str, Any]]:
    """The application's n-th request of an agent loop: the history grows by a call and a
    result per turn, the system prompt carries a clock that ticks."""
    messages: list[dict[str, Any]] = [
        system(f"22:41:{n:02d}"),
        {"role": "user", "content": "Book a room."},
    ]
    for i in range(n):
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"c{i}",
                        "type": "function",
                        "function": {"name": "search", "arguments": "{}"},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"})
    return messages


def apply(c: Canonicalizer, n: int) -> Any:
    return c.apply(CHAT, {"model": "m", "messages": turns(n)})


def test_history_is_byte_identical_from_turn_to_turn_notes_included() -> None:
    c = Canonicalizer()
    previous = apply(c, 0).body["messages"]
    assert previous[-1]["content"].endswith(f"[[time_1]] = 22:41:00\n[[uuid_1]] = {SESSION}")
    for n in range(1, 5):
        result = apply(c, n)
        messages = result.body["messages"]
        assert json.dumps(messages[: len(previous)]) == json.dumps(previous)
        assert result.notes_restored == n
        # Only the clock changed: the session id is not restated.
        assert messages[-1]["content"] == f"result {n - 1}\n\n[[time_1]] = 22:41:{n:02d}"
        assert result.note_values_omitted == 1
        previous = messages


def test_every_value_reaches_the_model_when_the_memory_lost_its_entries() -> None:
    c = Canonicalizer(notes=NoteMemory(max_entries=1))
    apply(c, 0)
    apply(c, 1)  # evicts turn 0's entry
    result = apply(c, 2)
    text = json.dumps(result.body)
    assert "22:41:02" in text and SESSION in text
    # Turn 0's note (the only one naming the session) is gone: the new note restates it.
    assert result.body["messages"][-1]["content"].endswith(
        f"[[time_1]] = 22:41:02\n[[uuid_1]] = {SESSION}"
    )


def test_no_new_note_when_nothing_changed() -> None:
    c = Canonicalizer()
    first = {"model": "m", "messages": [system("22:41:00"), {"role": "user", "content": "hi"}]}
    c.apply(CHAT, first)
    second = {
        "model": "m",
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ],
    }
    result = c.apply(CHAT, second)
    assert result.body["messages"][-1]["content"] == "again"
    assert result.body["messages"][1]["content"].endswith(f"[[uuid_1]] = {SESSION}")


def test_another_tenant_or_application_does_not_get_the_note() -> None:
    c = Canonicalizer()
    c.apply(CHAT, {"model": "m", "messages": turns(0)}, namespace="a")
    result = c.apply(CHAT, {"model": "m", "messages": turns(1)}, namespace="b")
    assert result.notes_restored == 0
    assert SESSION in result.body["messages"][-1]["content"]


def test_a_second_proxy_recalls_the_notes_from_the_shared_store() -> None:
    async def main() -> None:
        store = EmbeddedStore()
        one = Canonicalizer(notes=NoteMemory(store))
        two = Canonicalizer(notes=NoteMemory(store))
        first = one.apply(CHAT, {"model": "m", "messages": turns(0)})
        assert one.notes is not None
        await one.notes.drain()
        body = {"model": "m", "messages": turns(1)}
        deferred = two.apply(CHAT, body, defer_notes=True)
        assert deferred.recall_notes and deferred.body is body and deferred.fired == ()
        assert two.notes is not None
        await two.notes.recall("default", deferred.recall_notes)
        result = two.apply(CHAT, body)
        assert result.notes_restored == 1
        assert result.body["messages"][:2] == first.body["messages"]

    asyncio.run(main())


def test_the_memory_can_be_turned_off() -> None:
    c = Canonicalizer(CanonicalConfig(note_memory=False))
    apply(c, 0)
    result = apply(c, 1)
    assert result.notes_restored == 0
    assert result.body["messages"][1]["content"] == "Book a room."
