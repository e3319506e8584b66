"""Synthetic chat workloads for the cache-gains benchmark, each a driver of real requests.

Every workload is deterministic (seeded text, fixed clocks) so the direct run and the run through
prefixgate send byte-identical requests; workloads that carry a conversation forward append the
answer the backend actually gave. Prompts are kept to a few hundred tokens because the benchmark
runs a real model on two CPU cores (SmolLM2 prefills about 180 tokens/s there).

* ``shared_system``: one long system prompt, many users, one short question each;
* ``multi_turn``: several conversations, turn by turn, interleaved;
* ``agent_loop``: a tool-using agent whose system prompt states the current time (to the
  second, so it changes on every request) followed by tool calls and tool results;
* ``rag``: a fixed document set; each question comes with the three documents a retriever
  ranked highest, in rank order;
* ``claude_code``: a replay of the first requests of one public Claude Code trace
  (tests/data/traces/claude-code, kv-cache-tester); each prefix block id becomes a few
  words of synthetic text (the same id, the same text), every ``stride``-th block kept, so two
  requests share exactly the prefix the trace says they share, at a scale a small model can
  prefill.
"""

from __future__ import annotations

import json
import math
import random
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from analyzers.inputs import read_input

if TYPE_CHECKING:
    from loadgen import Result

Send = Callable[[dict[str, Any]], Awaitable["Result"]]
Workload = Callable[[Send, "Scale"], Awaitable[None]]

_VOCABULARY = (
    "account access action address agent answer apply area assist balance bank billing block "
    "branch budget build cache call card case change charge check claim clear client code "
    "contract cost count credit customer data date debit delay deliver device document domain "
    "draft email entry error event expense export field file filter fixed form format fund "
    "group guide history hold import invoice issue item job key label ledger level limit line "
    "list local lock log manage match member message method model module month name network "
    "note number offer open order owner page parcel party payment period plan policy price "
    "print process product profile project query queue rate record refund region report "
    "request reset result return review role rule run sample schedule score search section "
    "server service session share shift signal source stage state status step stock store "
    "support system table task team term test ticket time total track transfer type update "
    "upload user value vendor version view volume warning window work zone"
)
WORDS = tuple(_VOCABULARY.split())
# The public traces ship with the tests, xz-compressed as published (see their README).
TRACE_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces" / "claude-code"
CLAUDE_TRACE = "trace_0038.json.xz"


@dataclass(frozen=True, slots=True)
class Scale:
    """How big each workload is (``QUICK`` for the smoke test)."""

    users: int = 16
    system_words: int = 280
    conversations: int = 3
    turns: int = 4
    agent_turns: int = 8
    rag_docs: int = 8
    rag_queries: int = 10
    claude_requests: int = 16
    claude_stride: int = 8
    claude_words: int = 5
    max_tokens: int = 16
    fleet_conversations: int = 3
    fleet_turns: int = 5
    fleet_system_words: int = 400
    chat_turns: int = 6
    chat_system_words: int = 500
    learned_turns: int = 8
    learned_conversations: int = 3


QUICK = Scale(
    users=3,
    system_words=60,
    conversations=2,
    turns=2,
    agent_turns=2,
    rag_docs=3,
    rag_queries=2,
    claude_requests=3,
    claude_stride=32,
    claude_words=3,
    max_tokens=4,
    fleet_conversations=3,
    fleet_turns=3,
    fleet_system_words=60,
    chat_turns=3,
    chat_system_words=60,
    learned_turns=4,
    learned_conversations=2,
)


def prose(rng: random.Random, words: int) -> str:
    """``words`` words of pseudo-English sentences."""
    out: list[str] = []
    while len(out) < words:
        n = rng.randint(6, 14)
        sentence = [rng.choice(WORDS) for _ in range(n)]
        sentence[0] = sentence[0].capitalize()
        sentence[-1] += "."
        out.extend(sentence)
    return " ".join(out[:words])


def chat(messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }


async def shared_system(send: Send, scale: Scale) -> None:
    rng = random.Random(1)
    system = "You are the support assistant of Northwind Bank. " + prose(rng, scale.system_words)
    for u in range(scale.users):
        question = f"Hello, I am customer {1000 + u}. " + prose(rng, 12).rstrip(".") + "?"
        await send(
            chat(
                [{"role": "system", "content": system}, {"role": "user", "content": question}],
                scale.max_tokens,
            )
        )


async def multi_turn(send: Send, scale: Scale) -> None:
    rng = random.Random(2)
    convs: list[list[dict[str, Any]]] = []
    for c in range(scale.conversations):
        context = f"Conversation {c}. Here are my notes: " + prose(rng, scale.system_words // 2)
        convs.append(
            [
                {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                {"role": "user", "content": context + " What should I do first?"},
            ]
        )
    for turn in range(scale.turns):
        for messages in convs:
            result = await send(chat(messages, scale.max_tokens * 2))
            messages.append({"role": "assistant", "content": result.text or "OK."})
            if turn + 1 < scale.turns:
                follow = prose(rng, 14).rstrip(".") + "?"
                messages.append({"role": "user", "content": follow})


AGENT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "file or directory path"},
                    "query": {"type": "string", "description": "what to look for"},
                },
                "required": ["path"],
            },
        },
    }
    for name, desc in (
        ("read_file", "Read a file from the workspace and return its text."),
        ("search_code", "Search the workspace for a pattern and return matching lines."),
        ("run_tests", "Run the test suite under a path and return the failures."),
    )
]


def tool_turn(call_id: str, tool: str, args: str, result: str) -> list[dict[str, Any]]:
    """One agent turn of a scripted history: the assistant's tool call, then the tool's result."""
    call = {"id": call_id, "type": "function", "function": {"name": tool, "arguments": args}}
    return [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def agent_bodies(scale: Scale, volatile: bool = True) -> list[dict[str, Any]]:
    """The agent loop's requests: one conversation, a clock to the second in the system prompt
    (``volatile``; without it, the workload's ceiling), every request after the first ending
    with a tool result. Scripted: the bodies do not depend on the answers."""
    rng = random.Random(3)
    clock = datetime(2026, 11, 30, 22, 41, 7, tzinfo=UTC)
    instructions = "You are a coding agent in a Python repository. " + prose(
        rng, scale.system_words
    )
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "The billing export fails on empty ledgers. Fix it."}
    ]
    bodies = []
    for turn in range(scale.agent_turns):
        now = clock + timedelta(seconds=23 * turn)
        header = f"Current time: {now.isoformat().replace('+00:00', 'Z')}\n" if volatile else ""
        system = header + instructions
        bodies.append(
            chat(
                [{"role": "system", "content": system}, *history],
                scale.max_tokens,
                tools=AGENT_TOOLS,
            )
        )
        tool = AGENT_TOOLS[turn % len(AGENT_TOOLS)]["function"]["name"]
        args = json.dumps({"path": f"billing/export_{turn}.py", "query": "ledger"})
        history += tool_turn(f"call_{turn}", tool, args, prose(rng, scale.system_words // 5))
    return bodies


async def agent_loop(send: Send, scale: Scale) -> None:
    for body in agent_bodies(scale):
        await send(body)


CHAT_VOLATILE = ("plain", "clock_id", "epoch", "learned")


def chat_loop_bodies(
    scale: Scale,
    volatile: str = "clock_id",
    *,
    turns: int | None = None,
    conversations: int = 1,
) -> list[dict[str, Any]]:
    """A chat loop's requests: ``conversations`` conversations of one application, one after
    the other, each of ``turns`` (default ``scale.chat_turns``) turns under a system prompt of
    ``scale.chat_system_words`` words, the assistant's replies scripted (so the bodies do not
    depend on the answers).

    ``volatile``: what the system prompt starts with: ``clock_id`` a ``date(1)``-style clock
    and a fresh 32-hex reference on every request, ``epoch`` a clock in epoch seconds
    (``Clock: 1764542467``), ``learned`` two values of formats no detector knows, fresh on
    every request (``Build: 7f3a-19`` and ``Ticket: #4812``), ``plain`` nothing (the
    workload's ceiling).
    """
    if volatile not in CHAT_VOLATILE:
        raise ValueError(f"volatile must be one of {CHAT_VOLATILE}")
    rng = random.Random(11)
    instructions = "You are the travel desk assistant of Contoso. " + prose(
        rng, scale.chat_system_words
    )
    clock = datetime(2026, 12, 1, 22, 41, 7, tzinfo=UTC)
    refs = random.Random(12)
    bodies = []
    count = 0
    for _ in range(conversations):
        history: list[dict[str, Any]] = []
        for turn in range(scale.chat_turns if turns is None else turns):
            now = clock + timedelta(seconds=41 * turn + 3)
            if volatile == "clock_id":
                header = f"Now: {now.strftime('%a %b %d %H:%M:%S UTC %Y')}\n"
                header += f"Reference: {refs.getrandbits(128):032x}\n"
            elif volatile == "epoch":
                header = f"Clock: {int(now.timestamp())}\n"
            elif volatile == "learned":
                header = f"Build: {refs.getrandbits(16):04x}-{refs.randrange(100):02d}\n"
                header += f"Ticket: #{4812 + 7 * count}\n"
            else:
                header = ""
            count += 1
            history.append({"role": "user", "content": prose(rng, 16).rstrip(".") + "?"})
            messages = [{"role": "system", "content": header + instructions}, *history]
            bodies.append(chat(messages, scale.max_tokens))
            history.append({"role": "assistant", "content": prose(rng, 30)})
    return bodies


def learned_bodies(scale: Scale, volatile: str, *, apps: bool) -> list[dict[str, Any]]:
    """``chat_learned``: one chat loop of ``scale.learned_turns`` turns whose system prompt
    carries two values no detector knows; ``chat_learned_apps``: ``scale.learned_conversations``
    conversations of ``scale.chat_turns`` turns of that application, one after the other (the
    proxy learns the template once, in the first conversation)."""
    if apps:
        return chat_loop_bodies(scale, volatile, conversations=scale.learned_conversations)
    return chat_loop_bodies(scale, volatile, turns=scale.learned_turns)


async def rag(send: Send, scale: Scale) -> None:
    rng = random.Random(4)
    docs = [f"[doc {d}] " + prose(rng, scale.system_words // 3) for d in range(scale.rag_docs)]
    popularity = [1.0 / (d + 1) for d in range(scale.rag_docs)]  # a few documents answer most
    system = (
        "Answer the question using only the documents in the context. Cite the document "
        "numbers you used. If the documents do not contain the answer, say so."
    )
    for _ in range(scale.rag_queries):
        ranked: list[int] = []
        while len(ranked) < min(3, scale.rag_docs):
            d = rng.choices(range(scale.rag_docs), weights=popularity)[0]
            if d not in ranked:
                ranked.append(d)
        context = "\n\n".join(docs[d] for d in ranked)
        question = prose(rng, 12).rstrip(".") + "?"
        user = f"Context:\n{context}\n\nQuestion: {question}"
        await send(
            chat(
                [{"role": "system", "content": system}, {"role": "user", "content": user}],
                scale.max_tokens,
            )
        )


def block_text(trace: str, block: int, words: int) -> str:
    """The synthetic text of one prefix block: the same id always gives the same words."""
    rng = random.Random(f"{trace}:{block}")
    return " ".join(rng.choice(WORDS) for _ in range(words))


def claude_code_requests(scale: Scale, path: Path | None = None) -> list[dict[str, Any]]:
    """The trace's first requests as chat bodies (system = the system-and-tools blocks)."""
    path = path or TRACE_DIR / CLAUDE_TRACE
    trace = json.loads(read_input(path))
    block = int(trace["block_size"])
    system_blocks = math.ceil((trace["system_tokens"] + trace["tool_tokens"]) / block)
    bodies = []
    for req in trace["requests"][: scale.claude_requests]:
        ids: list[int] = req["hash_ids"]
        kept = list(range(0, len(ids), scale.claude_stride))
        if kept[-1] != len(ids) - 1:
            kept.append(len(ids) - 1)  # the newest block: what this request adds
        system = [
            block_text(trace["id"], ids[i], scale.claude_words) for i in kept if i < system_blocks
        ]
        rest = [
            block_text(trace["id"], ids[i], scale.claude_words) for i in kept if i >= system_blocks
        ]
        messages = [{"role": "system", "content": " ".join(system)}]
        messages.append({"role": "user", "content": " ".join(rest) or "continue"})
        bodies.append(chat(messages, min(scale.max_tokens, int(req["out"]))))
    return bodies


async def claude_code(send: Send, scale: Scale) -> None:
    for body in claude_code_requests(scale):
        await send(body)


FLEET_TOOLS: list[dict[str, Any]] = [
    *AGENT_TOOLS,
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Replace a file's text in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "file path"},
                    "text": {"type": "string", "description": "the new text"},
                },
                "required": ["path", "text"],
            },
        },
    },
]
FLEET_VOLATILE = ("plain", "fixed", "clock")


def fleet_bodies(
    scale: Scale, volatile: str = "fixed", *, conversations: int | None = None
) -> list[dict[str, Any]]:
    """The fleet workload's requests, in the order they are sent.

    ``conversations`` agents (default ``scale.fleet_conversations``, meant to be at least 1.5x
    the backend's slots) share one system prompt and one tool set; they are interleaved turn by
    turn (agent 0, 1, 2, 0, 1, 2, ...), so more conversations are live than the backend has
    slots. Every request after an agent's first ends with a tool result: its history grows by
    one assistant tool call and one tool message a turn. The tools arrive in another order on
    every request (as clients that build the list from a dict or a registry send them).

    ``volatile``: what the system prompt carries besides the shared instructions: ``plain``
    nothing, and the tools in one order (the workload's ceiling), ``fixed`` today's date and a
    per-conversation session id (a UUID), ``clock`` a clock to the second (changing on every
    request) and the session id.
    The bodies do not depend on the answers (the agents' tool calls are scripted), so the same
    list is sent direct and through the proxy, and the ideal is computed from it offline.
    """
    if volatile not in FLEET_VOLATILE:
        raise ValueError(f"volatile must be one of {FLEET_VOLATILE}")
    k = scale.fleet_conversations if conversations is None else conversations
    rng = random.Random(7)
    instructions = (
        "You are a coding agent working in a Python repository. Use the tools to read, search, "
        "test and edit files; answer with one tool call at a time. "
        + prose(rng, scale.fleet_system_words)
    )
    tasks = [
        f"Task {c}: the {rng.choice(WORDS)} {rng.choice(WORDS)} module fails its tests. Fix it."
        for c in range(k)
    ]
    sessions = [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(k)]
    clock = datetime(2026, 12, 1, 9, 14, 3, tzinfo=UTC)
    histories: list[list[dict[str, Any]]] = [[] for _ in range(k)]
    bodies = []
    n = 0
    for turn in range(scale.fleet_turns):
        for c in range(k):
            if volatile == "plain":
                header = ""
            elif volatile == "fixed":
                header = f"Today's date: 2026-12-01. Session id: {sessions[c]}.\n"
            else:
                now = clock + timedelta(seconds=17 * n + 3 * c)
                header = f"Current time: {now.strftime('%a %b %d %H:%M:%S UTC %Y')}. "
                header += f"Session id: {sessions[c]}.\n"
            tools = list(FLEET_TOOLS)
            if volatile != "plain":  # the ceiling's clients send one tool order
                random.Random(f"tools:{c}:{turn}").shuffle(tools)
            messages = [
                {"role": "system", "content": header + instructions},
                {"role": "user", "content": tasks[c]},
                *histories[c],
            ]
            bodies.append(chat(messages, scale.max_tokens, tools=tools))
            n += 1
            tool = FLEET_TOOLS[(turn + c) % len(FLEET_TOOLS)]["function"]["name"]
            args = json.dumps({"path": f"pkg/module_{c}_{turn}.py", "query": "failure"})
            histories[c] += tool_turn(f"call_{c}_{turn}", tool, args, prose(rng, 40))
    return bodies


def in_order(name: str, bodies: Callable[[Scale], list[dict[str, Any]]]) -> Workload:
    """A driver sending ``bodies(scale)`` one after another."""

    async def run(send: Send, scale: Scale) -> None:
        for body in bodies(scale):
            await send(body)

    run.__name__ = name
    return run


WORKLOADS: dict[str, Workload] = {
    "shared_system": shared_system,
    "multi_turn": multi_turn,
    "agent_loop": agent_loop,
    "rag": rag,
    "claude_code": claude_code,
    "fleet_fixed": in_order("fleet_fixed", lambda s: fleet_bodies(s, "fixed")),
    "fleet_clock": in_order("fleet_clock", lambda s: fleet_bodies(s, "clock")),
    "chat_clock_id": in_order("chat_clock_id", lambda s: chat_loop_bodies(s, "clock_id")),
    "chat_epoch": in_order("chat_epoch", lambda s: chat_loop_bodies(s, "epoch")),
    "chat_learned": in_order("chat_learned", lambda s: learned_bodies(s, "learned", apps=False)),
    "chat_learned_apps": in_order(
        "chat_learned_apps", lambda s: learned_bodies(s, "learned", apps=True)
    ),
}

# The requests of each workload's ceiling (the same conversations with nothing volatile), for
# the workloads whose bodies do not depend on the answers: the bench reports the ideal share
# of these beside the measured runs.
CEILINGS: dict[str, Callable[[Scale], list[dict[str, Any]]]] = {
    "agent_loop": lambda scale: agent_bodies(scale, volatile=False),
    "fleet_fixed": lambda scale: fleet_bodies(scale, "plain"),
    "fleet_clock": lambda scale: fleet_bodies(scale, "plain"),
    "chat_clock_id": lambda scale: chat_loop_bodies(scale, "plain"),
    "chat_epoch": lambda scale: chat_loop_bodies(scale, "plain"),
    "chat_learned": lambda scale: learned_bodies(scale, "plain", apps=False),
    "chat_learned_apps": lambda scale: learned_bodies(scale, "plain", apps=True),
}
