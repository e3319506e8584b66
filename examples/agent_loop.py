"""An agent loop with tools whose system prompt carries the current time, through prefixgate.

    .venv/bin/python examples/agent_loop.py [--base-url URL] [--turns 4] [--json]

Agents commonly start their system prompt with "Current time: ...". That one line changes on
every call, and since a backend's prompt cache only reuses an identical *prefix*, everything after
it (instructions, tool schemas, the conversation) is computed again each turn. prefixgate's
canonicalizer moves the value into a note beside the newest user message, so the system prompt
stays byte-identical and the backend serves it from cache. With ``note_placement = "last_suffix"``
in the proxy's ``[canonical]`` table the note goes after the newest tool result instead, and the
tool calls and results of earlier turns stay cached too (see the README's canonicalizer section).

For every model call this prints the prompt tokens, the cached prompt tokens the backend
reported, and the canonicalization rules that fired (response header X-Prefixgate-Canonical).
To see the difference, run it against a proxy started with --no-canonicalize, then against one
without. Tool calls the model makes are run locally (a toy calendar and weather service) and their
results sent back, as a real agent would. The base URL comes from --base-url, else
OPENAI_BASE_URL, else http://localhost:8000/v1.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from openai import OpenAI

GUIDE = """You are Aria, the scheduling assistant of a small architecture studio.
You help the team plan site visits, client meetings and deadlines.
Rules:
1. Always check the calendar with the list_events tool before proposing a time.
2. Check the weather with the get_weather tool before proposing an outdoor site visit.
3. Propose at most two options, each with a date, a start time and a duration.
4. Never double-book a person; travel between sites takes at least 45 minutes.
5. Client meetings happen between 09:00 and 17:00 local time, never on weekends.
6. Keep answers under 80 words and end with a question when a choice is needed.
7. When a request is ambiguous, ask one clarifying question instead of guessing.
8. Site visits need two people: one architect and one engineer.
Studio: 4 architects (Ines, Tom, Priya, Luca), 2 engineers (Sam, Noor), one shared van.
Office: 12 Canal Street; active sites: Harbour Lofts, Mill Lane School, Orchard Pavilion."""

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "list_events",
            "description": "List the calendar events of one person on one day.",
            "parameters": {
                "type": "object",
                "properties": {
                    "person": {"type": "string", "description": "first name"},
                    "date": {"type": "string", "description": "YYYY-MM-DD"},
                },
                "required": ["person", "date"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a site on a day.",
            "parameters": {
                "type": "object",
                "properties": {
                    "site": {"type": "string"},
                    "date": {"type": "string", "description": "YYYY-MM-DD"},
                },
                "required": ["site", "date"],
            },
        },
    },
]

TASKS = (
    "Plan a site visit to Harbour Lofts with Ines this week.",
    "Move it if it rains that day.",
    "Also book a client meeting with the Orchard Pavilion owners.",
    "Who drives the van on the site visit?",
    "Summarise the plan in three bullet points.",
    "Add a reminder to order samples for Mill Lane School.",
)


def list_events(person: str = "", date: str = "") -> str:
    return json.dumps({"person": person, "date": date, "events": [["09:30", "60m", "stand-up"]]})


def get_weather(site: str = "", date: str = "") -> str:
    return json.dumps({"site": site, "date": date, "forecast": "light rain after 14:00"})


LOCAL_TOOLS: dict[str, Callable[..., str]] = {
    "list_events": list_events,
    "get_weather": get_weather,
}


@dataclass(frozen=True, slots=True)
class Call:
    """One model call's cache figures, as the backend reported them through the proxy."""

    turn: int
    prompt_tokens: int
    cached_tokens: int | None
    canonical_rules: str
    tool_calls: int


def system_prompt() -> str:
    # To the microsecond, as many agents write it: a new value on every call.
    return f"Current time: {datetime.now(UTC).isoformat()}\n{GUIDE}"


def run_tools(message: Any) -> list[dict[str, Any]]:
    """Tool results for the model's tool calls (a bad call gets an error result, not a crash)."""
    results = []
    for call in message.tool_calls or []:
        tool = LOCAL_TOOLS.get(call.function.name)
        try:
            args = json.loads(call.function.arguments or "{}")
            content = tool(**args) if tool else f"unknown tool {call.function.name}"
        except (ValueError, TypeError) as exc:
            content = f"bad arguments: {exc}"
        results.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return results


def assistant_turn(message: Any) -> dict[str, Any]:
    """The model's answer as it goes back into the history (tool calls included)."""
    turn: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if message.tool_calls:
        turn["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in message.tool_calls
        ]
    return turn


def agent(client: OpenAI, model: str, turns: int, max_tokens: int) -> list[Call]:
    history: list[dict[str, Any]] = []
    calls: list[Call] = []
    for turn in range(1, turns + 1):
        history.append({"role": "user", "content": TASKS[(turn - 1) % len(TASKS)]})
        for _ in range(3):  # at most three tool rounds per user turn
            raw = client.chat.completions.with_raw_response.create(
                model=model,
                messages=[{"role": "system", "content": system_prompt()}, *history],
                tools=TOOLS,
                max_tokens=max_tokens,
                temperature=0,
            )
            completion = raw.parse()
            message = completion.choices[0].message
            usage = completion.usage
            details = usage.prompt_tokens_details if usage else None
            calls.append(
                Call(
                    turn=turn,
                    prompt_tokens=usage.prompt_tokens if usage else 0,
                    cached_tokens=details.cached_tokens if details else None,
                    canonical_rules=raw.headers.get("x-prefixgate-canonical", ""),
                    tool_calls=len(message.tool_calls or []),
                )
            )
            history.append(assistant_turn(message))
            if not message.tool_calls:
                break
            history.extend(run_tools(message))
    return calls


def print_table(calls: list[Call]) -> None:
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'hit':>6}  tools  canonical rules")
    for c in calls:
        known = c.cached_tokens is not None and c.prompt_tokens > 0
        hit = f"{(c.cached_tokens or 0) / c.prompt_tokens:6.1%}" if known else "     -"
        shown = "-" if c.cached_tokens is None else str(c.cached_tokens)
        print(
            f"{c.turn:>4} {c.prompt_tokens:>7} {shown:>7} {hit}  {c.tool_calls:>5}  "
            f"{c.canonical_rules or '-'}"
        )
    prompt = sum(c.prompt_tokens for c in calls[1:])
    cached = sum(c.cached_tokens or 0 for c in calls[1:])
    if prompt:
        print(
            f"after the first call: {cached} of {prompt} prompt tokens from cache "
            f"({cached / prompt:.1%})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1")
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", action="store_true", help="one JSON object per model call")
    args = parser.parse_args()
    with OpenAI(
        base_url=args.base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused")
    ) as client:
        calls = agent(client, args.model, args.turns, args.max_tokens)
    if args.json:
        for c in calls:
            print(json.dumps(asdict(c)))
    else:
        print_table(calls)


if __name__ == "__main__":
    main()
