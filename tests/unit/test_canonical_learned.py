"""Learned canonical forms: a part is rewritten only to the form first seen for it."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from proxy.canonical import CanonicalConfig, Canonicalizer, RuleConfig, pipeline
from proxy.canonical.config import RULE_OPTIONS, STABLE_JSON, default_rules
from proxy.canonical.forms import STORE_KIND, FormMemory
from proxy.canonical.learned import FIRST_SEEN, chat_forms_hold
from proxy.canonical.pipeline import REWRITE_RULES
from proxy.store.embedded import EmbeddedStore

CHAT = "/v1/chat/completions"


def tool(name: str, props: Sequence[str], description: str = "Does a thing.") -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string"} for p in props},
                "required": list(props),
            },
        },
    }


def chat(tools: list[Any], system: str = "You help.", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}],
        "tools": tools,
    }
    body.update(extra)
    return body


def learned() -> Canonicalizer:
    return Canonicalizer(forms=FormMemory())


REWRITE_RULE_FNS = dict(REWRITE_RULES)
WEATHER = tool("weather", ["zip", "city"])
SEARCH = tool("search", ["query"])


def test_first_request_is_forwarded_as_it_came() -> None:
    """Tools out of name order, schema keys unsorted: the first request is not rewritten."""
    canon = learned()
    body = chat([WEATHER, SEARCH], system="Line one.  \r\nLine two.  ")
    result = canon.apply(CHAT, body)
    assert result.body is body
    assert result.fired == () and result.changes == ()
    assert dict(canon.counters)[STABLE_JSON] == 0


def test_a_stable_application_is_never_rewritten() -> None:
    """The same request ten times: never rewritten, no rule counted."""
    canon = learned()
    for _ in range(10):
        body = chat([WEATHER, SEARCH], system="Trailing blank. \nCRLF\r\n")
        assert canon.apply(CHAT, body).body is body
    assert sum(canon.counters.values()) == 0


def test_shuffled_tools_become_the_first_seen_order() -> None:
    """The same tool set in another order, with its schema keys in another order: rewritten
    to the first form, byte for byte."""
    canon = learned()
    first = chat([WEATHER, SEARCH])
    canon.apply(CHAT, first)
    shuffled_weather = tool("weather", ["city", "zip"])
    shuffled_weather["function"]["parameters"]["required"] = ["zip", "city"]
    shuffled_weather["function"] = dict(reversed(list(shuffled_weather["function"].items())))
    result = canon.apply(CHAT, chat([SEARCH, shuffled_weather]))
    assert result.fired == (STABLE_JSON,)
    assert json.dumps(result.body["tools"]) == json.dumps(first["tools"])
    assert [c.kind for c in result.changes] == [FIRST_SEEN]


def test_a_different_set_is_its_own_form() -> None:
    """A tool set with one more tool is a new set: forwarded as it came, then learned."""
    canon = learned()
    canon.apply(CHAT, chat([WEATHER, SEARCH]))
    other = chat([SEARCH, WEATHER, tool("clock", [])])
    assert canon.apply(CHAT, other).body is other


def test_required_order_is_meaning() -> None:
    """Two schemas differing in the order of ``required`` are different sets (array order is
    kept by the identity), so neither is rewritten to the other."""
    canon = learned()
    canon.apply(CHAT, chat([WEATHER]))
    other_required = tool("weather", ["zip", "city"])
    other_required["function"]["parameters"]["required"] = ["city", "zip"]
    body = chat([other_required])
    assert canon.apply(CHAT, body).body is body


def assistant_call(arguments: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        ],
    }


def with_history(arguments: str) -> dict[str, Any]:
    body = chat([])
    body["messages"][1:1] = [
        {"role": "user", "content": "q"},
        assistant_call(arguments),
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    return body


def test_tool_call_arguments_keep_their_first_spelling() -> None:
    """Arguments resent as the application first sent them are untouched; re-serialized
    differently later, they are rewritten to that first spelling (not to sorted JSON)."""
    canon = learned()
    first = with_history('{"zip": "1", "city": "Paris"}')
    assert canon.apply(CHAT, first).body is first
    again = with_history('{"zip": "1", "city": "Paris"}')
    assert canon.apply(CHAT, again).body is again
    result = canon.apply(CHAT, with_history('{"city":"Paris","zip":"1"}'))
    args = result.body["messages"][2]["tool_calls"][0]["function"]["arguments"]
    assert args == '{"zip": "1", "city": "Paris"}'
    assert result.fired == (STABLE_JSON,)
    assert result.changes[0].path == "messages[*].tool_calls[*].function.arguments"


def test_whitespace_variants_become_the_first_seen_text() -> None:
    """A system prompt first seen with CRLF and trailing blanks stays so; an LF variant of it
    is rewritten back to the first one (the text the backend has cached)."""
    canon = learned()
    first = "Rules:  \r\n- be brief\r\n"
    assert canon.apply(CHAT, chat([], system=first)).body["messages"][0]["content"] == first
    result = canon.apply(CHAT, chat([], system="Rules:\n- be brief\n"))
    assert result.fired == ("whitespace",)
    assert result.body["messages"][0]["content"] == first


def test_shuffled_tools_with_other_line_ends_are_the_same_set() -> None:
    """Order and description line ends both differ: still one set, rewritten to the first."""
    canon = learned()
    first = chat([WEATHER, tool("search", ["query"], "Find.\nThings.")])
    canon.apply(CHAT, first)
    result = canon.apply(CHAT, chat([tool("search", ["query"], "Find.  \r\nThings."), WEATHER]))
    assert result.body["tools"] == first["tools"]


def test_namespaces_learn_apart() -> None:
    """One tenant's first form is not another's."""
    canon = learned()
    canon.apply(CHAT, chat([WEATHER, SEARCH]), namespace="a")
    body = chat([SEARCH, WEATHER])
    assert canon.apply(CHAT, body, namespace="b").body is body
    assert canon.apply(CHAT, chat([SEARCH, WEATHER]), namespace="a").fired == (STABLE_JSON,)


def test_the_input_is_never_mutated() -> None:
    """Rewriting to a learned form copies; the client's body is left as it was."""
    canon = learned()
    canon.apply(CHAT, chat([WEATHER, SEARCH]))
    body = chat([SEARCH, WEATHER], system="x  \r\n")
    before = copy.deepcopy(body)
    canon.apply(CHAT, body)
    assert body == before


def test_a_rule_in_dry_run_reports_and_forwards_the_original() -> None:
    """``stable_json`` in dry-run: the learned rewrite is reported, the original forwarded."""
    rules = dict(default_rules())
    rules[STABLE_JSON] = RuleConfig(dry_run=True, options=RULE_OPTIONS[STABLE_JSON])
    canon = Canonicalizer(CanonicalConfig(rules=rules), forms=FormMemory())
    canon.apply(CHAT, chat([WEATHER, SEARCH]))
    body = chat([SEARCH, WEATHER])
    result = canon.apply(CHAT, body)
    assert result.body is body
    assert result.dry_run_fired == (STABLE_JSON,) and result.fired == ()


def test_without_forms_the_fixed_form_is_used() -> None:
    """A canonicalizer without a form memory rewrites to the fixed normal form at once."""
    result = Canonicalizer().apply(CHAT, chat([WEATHER, SEARCH]))
    assert [t["function"]["name"] for t in result.body["tools"]] == ["search", "weather"]


def test_the_memory_is_bounded() -> None:
    """Past its entry bound the least recently used forms go."""
    memory = FormMemory(entries=2)
    for key in "abc":
        memory.keep("n", key, b"v")
    assert len(memory) == 2 and memory.local("n", "a") is None


def test_the_memory_is_bounded_in_bytes() -> None:
    """Past its byte bound the least recently used forms go; a form larger than it is not kept."""
    memory = FormMemory(max_bytes=100)
    memory.keep("n", "a", b"x" * 60)
    memory.keep("n", "b", b"x" * 30)
    memory.keep("n", "c", b"x" * 30)
    assert memory.local("n", "a") is None and memory.local("n", "c") is not None
    memory.keep("n", "d", b"x" * 200)
    assert memory.local("n", "d") is None


def test_texts_marked_as_forms_are_bounded_in_bytes() -> None:
    """The fast path's texts are bounded by their bytes: an application whose system prompt
    changes every request (its time, a request id) keeps a bounded memory, least recently
    marked out first, and a text seen again stays known."""
    memory = FormMemory(text_bytes=10_000)
    stable = "You help. " * 10
    for i in range(1_000):
        memory.mark_text("n", "rule", f"It is {i:06d}. " + "You help. " * 50)
        memory.mark_text("n", "rule", stable)
    assert memory.text_bytes <= 10_000
    assert memory.known_text("n", "rule", stable)
    assert not memory.known_text("n", "rule", "It is 000000. " + "You help. " * 50)


async def test_a_second_proxy_adopts_the_first_proxys_form() -> None:
    """Two proxies sharing a store: the one that sees the set second, shuffled, rewrites it to
    the form the first proxy learned; its counters count the request once."""
    store = EmbeddedStore()
    one, two = FormMemory(), FormMemory()
    one.bind(store)
    two.bind(store)
    a, b = Canonicalizer(forms=one), Canonicalizer(forms=two)
    first = chat([WEATHER, SEARCH])
    taught = await a.canonicalize(CHAT, first)
    assert taught.body is first and taught.learned
    await one.drain()
    shared = await store.recall("default", STORE_KIND, list(taught.learned))
    assert shared == list(taught.learned.values())
    result = await b.canonicalize(CHAT, chat([SEARCH, WEATHER]))
    assert result.body["tools"] == first["tools"]
    assert two.adopted == 1
    assert dict(b.counters)[STABLE_JSON] == 1


class _BrokenStore(EmbeddedStore):
    async def recall(self, namespace: str, kind: str, keys: Sequence[str]) -> list[bytes | None]:
        raise ConnectionError("down")

    async def remember(
        self, namespace: str, kind: str, items: Mapping[str, bytes], ttl_s: float
    ) -> None:
        raise ConnectionError("down")


async def test_a_store_that_fails_costs_only_the_sharing() -> None:
    """Recall and remember failing: requests are forwarded as they came, then learned locally."""
    memory = FormMemory()
    memory.bind(_BrokenStore())
    canon = Canonicalizer(forms=memory)
    body = chat([WEATHER, SEARCH])
    assert (await canon.canonicalize(CHAT, body)).body is body
    await memory.drain()
    result = await canon.canonicalize(CHAT, chat([SEARCH, WEATHER]))
    assert result.body["tools"] == body["tools"]


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/messages"])
def test_other_apis_learn_their_tool_order(route: str) -> None:
    """Responses and Messages tools: the first order is kept, a later shuffle rewritten to it."""
    schema = "parameters" if route == "/v1/responses" else "input_schema"
    b = {"name": "b", schema: {"type": "object", "properties": {"y": {}, "x": {}}}}
    a = {"name": "a", schema: {}}
    if route == "/v1/responses":
        b["type"] = a["type"] = "function"

    def body(tools: list[Any]) -> dict[str, Any]:
        if route == "/v1/responses":
            return {"model": "m", "input": "hi", "tools": tools}
        return {
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools,
        }

    canon = learned()
    first = body([b, a])
    assert canon.apply(route, first).body is first
    assert canon.apply(route, body([a, b])).body["tools"] == [b, a]


def _skips_nothing(view: Any, body: dict[str, Any]) -> bool:
    """What ``chat_forms_hold`` stands for: both learned rules pass ``body`` as it came."""
    canon = learned()
    for name in (STABLE_JSON, "whitespace"):
        rule = canon.config.rule(name)
        fn = canon._learned(view, name, REWRITE_RULE_FNS[name], False)
        outcome = fn("chat", body, rule)
        if outcome.body is not body or outcome.changes or outcome.skipped:
            return False
    return not view.learned  # (nothing learned or marked anew either)


def test_a_request_already_in_its_forms_skips_the_learned_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``chat_forms_hold`` answers True only where both learned rules would pass every part
    as it came; a text first seen, a variant of a known one, a tool list, tool-call arguments
    or a content list make it False (the rules then run)."""
    memory = FormMemory()
    canon = Canonicalizer(forms=memory)
    view = memory.view("default")
    known = "Rules:  \r\n- be brief\r\n"
    canon.apply(CHAT, chat([], system=known))  # the form of the system text
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    cases: list[tuple[dict[str, Any], bool]] = [
        (chat([], system=known), True),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, True),
        (chat([], system="Rules:\n- be brief\n"), False),  # a variant: rewritten
        (chat([], system="Never seen."), False),  # first seen: its form is learned
        (chat([WEATHER], system=known), False),
        (chat([], system=known, functions=[WEATHER["function"]]), False),
        (
            chat(
                [],
                system=known,
                messages=[
                    {"role": "developer", "content": known},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                ],
            ),
            False,
        ),
        (
            chat([], messages=[{"role": "system", "content": [{"type": "text", "text": known}]}]),
            False,
        ),
        (
            chat([], messages=[{"role": "developer", "content": known}, "odd", {"role": ["x"]}]),
            True,
        ),
        (chat([], messages=[{"role": "system", "content": None}, {"role": "user"}]), True),
        (
            chat(
                [],
                system=known,
                messages=[{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}],
            ),
            False,
        ),
    ]
    for body, holds in cases:
        assert chat_forms_hold(view, body) is holds, body
        if holds:
            assert _skips_nothing(view, body), body

    # The same requests through a canonicalizer that always runs the rules: the same answers
    # and the same forms learned, whatever the two rules' settings (off, dry-run).
    def outcome(result: Any) -> tuple[Any, ...]:
        return (
            result.body,
            result.fired,
            result.dry_run_fired,
            result.changes,
            result.skipped,
            dict(result.learned),
        )

    ws = "whitespace"
    for name, enabled, dry in (
        (ws, True, False),
        (ws, False, False),
        (ws, True, True),
        (STABLE_JSON, True, True),
    ):
        rules = dict(default_rules())
        rules[name] = RuleConfig(enabled=enabled, dry_run=dry, options=RULE_OPTIONS[name])
        config = CanonicalConfig(rules=rules)
        fast_memory, slow_memory = FormMemory(), FormMemory()
        fast = Canonicalizer(config, forms=fast_memory)
        slow = Canonicalizer(config, forms=slow_memory)
        for body, _ in [(chat([], system=known), True), *cases, *cases]:
            before = copy.deepcopy(body)
            with monkeypatch.context() as m:
                m.setattr(pipeline, "chat_forms_hold", lambda *_: False)
                expected = slow.apply(CHAT, copy.deepcopy(body))
            result = fast.apply(CHAT, body)
            assert body == before
            assert outcome(result) == outcome(expected), (name, enabled, dry, body)
        assert (len(fast_memory), fast_memory.text_bytes) == (
            len(slow_memory),
            slow_memory.text_bytes,
        )
