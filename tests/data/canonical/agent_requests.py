"""Realistic agent requests, built the way applications build them, for canonicalizer tests.

The pieces beside this module are an agent's system prompt (a template with the current date,
time, session id and trace id in it), an OpenAI tool list as the SDK sends it (Pydantic-made
schemas with ``$defs``, ``anyOf`` and nested objects, next to hand-written ones) and an agent
conversation with tool calls. ``request`` assembles a chat body; its knobs reproduce the ways
real applications vary a request that is logically the same: another timestamp, another
session, tools in another order, object keys in another order, tool-call arguments serialized
with other spacing and key order.
"""

from __future__ import annotations

import copy
import json
import random
from datetime import UTC, datetime
from pathlib import Path
from string import Template
from typing import Any

HERE = Path(__file__).parent
CHAT = "/v1/chat/completions"
MODEL = "qwen2.5-coder-7b-instruct"
WHEN = datetime(2026, 11, 30, 22, 41, 7, tzinfo=UTC)
SESSION = "550e8400-e29b-41d4-a716-446655440000"
TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"

_PROMPT = Template((HERE / "agent_system_prompt.txt").read_text())
_TOOLS: list[dict[str, Any]] = json.loads((HERE / "tools.json").read_text())
_CONVERSATION: list[dict[str, Any]] = json.loads((HERE / "conversation.json").read_text())


def system_prompt(when: datetime = WHEN, session: str = SESSION, trace: str = TRACE) -> str:
    """The agent's system prompt as the application renders it at ``when``."""
    return _PROMPT.substitute(
        date_long=f"{when:%A}, {when:%B} {when.day}, {when:%Y}",
        now_iso=when.strftime("%Y-%m-%dT%H:%M:%SZ"),
        session_id=session,
        trace_id=trace,
    )


def tools() -> list[dict[str, Any]]:
    """A fresh copy of the tool list."""
    return copy.deepcopy(_TOOLS)


def conversation() -> list[dict[str, Any]]:
    """A fresh copy of the conversation (ends with a user message)."""
    return copy.deepcopy(_CONVERSATION)


def shuffle_keys(value: Any, rng: random.Random) -> Any:
    """``value`` with the keys of every object in a random order."""
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: shuffle_keys(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [shuffle_keys(v, rng) for v in value]
    return value


def reserialize_arguments(messages: list[dict[str, Any]], rng: random.Random) -> None:
    """Re-serialize every tool call's arguments with shuffled keys and random spacing."""
    for message in messages:
        for call in message.get("tool_calls") or ():
            args = shuffle_keys(json.loads(call["function"]["arguments"]), rng)
            spacing = rng.choice([(",", ":"), (", ", ": ")])
            call["function"]["arguments"] = json.dumps(args, separators=spacing)


def request(
    *,
    when: datetime = WHEN,
    session: str = SESSION,
    seed: int | None = None,
    turns: int = 1,
    crlf: bool = False,
) -> dict[str, Any]:
    """A chat request of the agent.

    ``seed`` shuffles the tool order, every object's key order and the tool-call arguments'
    serialization; ``turns`` repeats the conversation to make the request longer; ``crlf``
    gives the system prompt Windows line endings.
    """
    prompt = system_prompt(when, session)
    if crlf:
        prompt = prompt.replace("\n", "\r\n")
    history: list[dict[str, Any]] = []
    for _ in range(turns):
        history += conversation()
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "system", "content": prompt}, *history],
        "tools": tools(),
        "tool_choice": "auto",
        "temperature": 0.2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if seed is not None:
        rng = random.Random(seed)
        rng.shuffle(body["tools"])
        body["tools"] = shuffle_keys(body["tools"], rng)
        reserialize_arguments(body["messages"], rng)
    return body


def request_of_size(target_bytes: int, **kwargs: Any) -> dict[str, Any]:
    """A request whose JSON is about ``target_bytes`` long.

    Longer: more turns of the conversation. Shorter than one turn: the oldest messages of the
    conversation are left out (it still ends with the user's newest message).
    """
    base = len(json.dumps(request(turns=1, **kwargs)))
    per_turn = len(json.dumps(conversation()))
    turns = max(1, 1 + round((target_bytes - base) / per_turn))
    body = request(turns=turns, **kwargs)
    while len(json.dumps(body)) > target_bytes and len(body["messages"]) > 2:
        del body["messages"][1]
    return body
