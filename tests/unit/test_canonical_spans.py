"""Learned volatile spans: values no detector knows, learned from traffic and relocated."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any

import pytest

from proxy.canonical import CanonicalConfig, Canonicalizer, RuleConfig
from proxy.canonical.forms import FormMemory
from proxy.canonical.span_memory import CANDIDATES, RECENT, SpanMemory
from proxy.canonical.spans import SpanPattern, judge_pair, template_spans
from proxy.store.embedded import EmbeddedStore

CHAT = "/v1/chat/completions"
BASE = (
    "You are the release assistant of Contoso. Answer briefly and precisely, and name the "
    "build you are talking about when it matters.\n"
)
BUILDS = ["7f3a-19", "8c21-04", "91ab-77", "0d0e-11", "aa12-93", "5b5b-20", "c0de-42"]


def system(value: str, template: str = "Build: {v}\n" + BASE) -> dict[str, Any]:
    return {"role": "system", "content": template.format(v=value)}


def chat_turn(n: int, values: Sequence[str] = BUILDS) -> dict[str, Any]:
    """The n-th request of a chat loop whose system prompt carries a fresh build id."""
    history: list[dict[str, Any]] = []
    for i in range(n + 1):
        history.append({"role": "user", "content": f"Question {i}?"})
        if i < n:
            history.append({"role": "assistant", "content": f"Answer {i}."})
    return {"model": "m", "messages": [system(values[n]), *history]}


def run(c: Canonicalizer, bodies: Sequence[dict[str, Any]]) -> list[Any]:
    out = []
    for body in bodies:
        out.append(c.apply(CHAT, body))
    return out


@pytest.mark.parametrize(
    ("a", "b", "shown", "value_class"),
    [
        ("Build: 7f3a-19\n" + BASE, "Build: 8c21-04\n" + BASE, "Build: ⟨token⟩⏎", "token"),
        (BASE + "Request #4812 from the desk.", BASE + "Request #4813 from the desk.",
         "Request #⟨digits⟩ from th", "digits"),
        (BASE + "Use ticket=AB12CD; always.", BASE + "Use ticket=XY99ZQ; always.",
         "Use ticket=⟨alnum⟩; always", "alnum"),
        (BASE + "Nonce: dGVzdA== ok", BASE + "Nonce: Zm9vYmFyYg== ok", "Nonce: ⟨token⟩ ok⏎",
         "token"),
        (BASE + "Codeword: falcon\nBe kind.", BASE + "Codeword: mango\nBe kind.",
         "Codeword: ⟨alnum⟩⏎", "alnum"),
    ],
)  # fmt: skip
def test_a_differing_value_is_judged_by_its_anchors_and_class(
    a: str, b: str, shown: str, value_class: str
) -> None:
    """Build ids, counters, query values, base64 nonces and random words are learnable values
    with the literal text around them as anchors."""
    (pattern,) = judge_pair(a, b)
    assert pattern.describe() == shown and pattern.value_class == value_class
    assert SpanPattern.from_json(json.loads(json.dumps(pattern.as_json()))) == pattern


def test_two_values_close_together_are_two_patterns() -> None:
    """``Build: 7f3a-19 Request #4812``: each value is learned on its own."""
    a, b = "Build: 7f3a-19 Request #4812\n" + BASE, "Build: 8c21-04 Request #4813\n" + BASE
    assert [p.label for p in judge_pair(a, b)] == ["build", "request"]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (BASE + "Answer this: what is the weather", BASE + "Answer this: tell me a story"),
        ("Totally different text " * 6, "Nothing in common here at all " * 6),
        (BASE + "Key: " + "a" * 70, BASE + "Key: " + "b" * 70),  # too long for a value
        (BASE + "\n7f3a\n" + BASE, BASE + "\n8c21\n" + BASE),  # nothing before it on its line
        ("Build: 7f3a", "Build: 8c21"),  # no template around it
        (BASE + "Now: [[datetime_0]] here.", BASE + "Now: [[datetime_1]] here."),  # placeholders
    ],
)
def test_content_is_not_a_learnable_value(a: str, b: str) -> None:
    """Sentences, rewritten texts, long runs and values with no literal anchor are not learned."""
    assert judge_pair(a, b) == []


def test_texts_that_mostly_differ_are_not_one_template() -> None:
    """A text whose rest also changes is new content, whatever short spans it has."""
    assert template_spans("A1 b c d e f g h i j k l", "A2 x y z w v u t s r q p") is None


def test_a_span_is_learned_at_the_third_request_with_three_values_and_relocated() -> None:
    """Requests 1-2 pass untouched; the third completes the pattern and is relocated at once:
    the value is a placeholder in the system prompt and is stated in the note."""
    c = Canonicalizer()
    results = run(c, [chat_turn(n) for n in range(5)])
    assert [r.fired for r in results[:2]] == [(), ()]
    assert all(r.body == chat_turn(n) for n, r in enumerate(results[:2]))
    assert c.spans is not None
    (pattern,) = c.spans.patterns("default")
    third = results[2]
    assert third.fired == ("volatile_learned",) and third.learned_spans == (pattern.id,)
    messages = third.body["messages"]
    assert messages[0]["content"] == "Build: [[build_1]]\n" + BASE
    assert messages[-1]["content"] == "Question 2?\n\n[[build_1]] = 91ab-77"
    stats = c.spans.stats("default")
    assert stats[0]["hits"] == 3 and stats[0]["anchor"] == "Build: "
    assert "7f3a" not in json.dumps(stats)


def test_history_is_byte_identical_across_turns_once_learned() -> None:
    """After learning, each turn's history (the note of the turn before included) reaches the
    backend as it did on the previous turn; the note states only the new value."""
    c = Canonicalizer()
    results = run(c, [chat_turn(n) for n in range(7)])
    for prev, cur in pairwise(results[2:]):
        before = prev.body["messages"]
        assert json.dumps(cur.body["messages"][: len(before)]) == json.dumps(before)
        assert cur.notes_restored >= 1
        assert cur.body["messages"][-1]["content"].count("[[build_1]] = ") == 1


def test_it_needs_k_observations() -> None:
    """Two requests are not enough; nor are many requests with only two values (a prompt
    edited once); min_requests and min_values are options."""
    c = Canonicalizer()
    run(c, [chat_turn(n) for n in range(2)])
    assert c.spans is not None and c.spans.patterns("default") == ()
    two = Canonicalizer()
    run(two, [chat_turn(n, ["v1a", "v2b"] * 4) for n in range(8)])
    assert two.spans is not None and two.spans.patterns("default") == ()
    eager = Canonicalizer(
        CanonicalConfig(
            rules={"volatile_learned": RuleConfig(options={"min_requests": 3, "min_values": 2})}
        )
    )
    run(eager, [chat_turn(n, ["v1a", "v2b"] * 4) for n in range(3)])
    assert eager.spans is not None and len(eager.spans.patterns("default")) == 1


def test_no_learning_from_changing_content() -> None:
    """System prompts that change as a whole, or in sentences, teach nothing; nor do user
    messages, which are never observed."""
    c = Canonicalizer()
    bodies = []
    for n in range(8):
        sentence = " ".join(["word"] * n) or "none"
        bodies.append(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": BASE + f"Today the topic is {sentence} here."},
                    {"role": "user", "content": f"Ticket: {BUILDS[n % 7]}\n" + BASE},
                ],
            }
        )
        bodies.append(
            {
                "model": "m",
                "messages": [{"role": "system", "content": (f"Prompt {n}. " * (n + 9)).strip()}],
            }
        )
    results = run(c, bodies)
    assert c.spans is not None and c.spans.patterns("default") == ()
    assert all(r.fired == () for r in results)


def test_the_memory_is_bounded() -> None:
    """Places, texts per place, candidates per place and patterns per namespace are bounded."""
    memory = SpanMemory(max_places=8, max_patterns=3, min_requests=2, min_values=2)
    for p in range(40):
        for n in range(3):
            text = f"Key{p}: v{n}x{p}\n" + BASE
            memory.observe("ns", [(("tools", p), text, ())])
    assert len(memory._places) == 8
    assert len(memory.patterns("ns")) == 3
    place = next(iter(memory._places.values()))
    assert len(place.recent) <= RECENT and len(place.candidates) <= CANDIDATES
    small = SpanMemory(max_chars=4096)
    for n in range(200):
        small.observe("ns", [(("messages", 0, "content"), f"Text {n}. " * 60, ())])
        small.observe("ns", [(("tools", n), BASE * 3, ())])
    assert small._chars <= 4096 + len(BASE) * 3
    assert sum(len(t) for p in small._places.values() for t in p.recent) == small._chars


def test_dry_run_reports_and_forwards_the_original() -> None:
    """volatile_learned in dry-run: the request is forwarded untouched, the rule and the
    pattern are reported, and learning goes on."""
    config = CanonicalConfig(rules={"volatile_learned": RuleConfig(dry_run=True)})
    c = Canonicalizer(config)
    results = run(c, [chat_turn(n) for n in range(5)])
    assert c.spans is not None
    (pattern,) = c.spans.patterns("default")
    for n, r in enumerate(results[2:], start=2):
        assert r.body == chat_turn(n) and r.fired == ()
        assert r.dry_run_fired == ("volatile_learned",) and r.learned_spans == (pattern.id,)


def test_the_rule_turned_off_learns_nothing() -> None:
    """enabled = false: no memory, no observation, nothing relocated."""
    c = Canonicalizer(CanonicalConfig(rules={"volatile_learned": RuleConfig(enabled=False)}))
    results = run(c, [chat_turn(n) for n in range(5)])
    assert c.spans is None and all(r.fired == () for r in results)


def test_detected_values_are_left_to_their_detectors() -> None:
    """A value a detector finds (a UUID) is relocated by its rule and never learned."""
    c = Canonicalizer()
    ids = [f"550e8400-e29b-41d4-a716-44665544000{n}" for n in range(6)]
    results = run(c, [chat_turn(n, ids) for n in range(6)])
    assert c.spans is not None and c.spans.patterns("default") == ()
    assert all(r.fired == ("volatile_uuids",) for r in results)


class FailingStore:
    """A store whose shared memory is down."""

    async def recall(self, namespace: str, kind: str, keys: Sequence[str]) -> list[bytes | None]:
        raise ConnectionError("down")

    async def remember(
        self, namespace: str, kind: str, items: Mapping[str, bytes], ttl_s: float
    ) -> None:
        raise ConnectionError("down")


async def test_a_store_failure_costs_only_the_sharing() -> None:
    """With the store down every request is still canonicalized; the proxy learns from its
    own traffic and relocates; the failures are counted."""
    c = Canonicalizer()
    assert c.spans is not None
    c.spans.bind(FailingStore())
    results = []
    for n in range(5):
        results.append(await c.canonicalize(CHAT, chat_turn(n)))
    await c.spans.drain()
    assert results[2].fired == results[4].fired == ("volatile_learned",)
    assert c.spans.store_failures >= 2


async def test_a_proxy_relocates_what_another_learned_from_its_first_request() -> None:
    """Two proxies on one store: B's first request reads A's patterns and is relocated."""
    store = EmbeddedStore()
    a, b = Canonicalizer(), Canonicalizer()
    assert a.spans is not None and b.spans is not None
    a.spans.bind(store)
    b.spans.bind(store)
    for n in range(3):
        await a.canonicalize(CHAT, chat_turn(n), namespace="t")
    assert a.spans.patterns("default") == ()
    await a.spans.drain()
    first = await b.canonicalize(CHAT, chat_turn(3), namespace="t")
    assert first.fired == ("volatile_learned",)
    assert b.spans.stats("t")[0]["origin"] == "store"
    other = await b.canonicalize(CHAT, chat_turn(3), namespace="u")  # another tenant's own
    assert other.fired == ()


def test_stable_tools_with_a_learned_description_value() -> None:
    """A value in a tool description is learned and relocated like one in the system prompt."""
    c = Canonicalizer(forms=FormMemory())

    def body(n: int) -> dict[str, Any]:
        tool = {
            "type": "function",
            "function": {
                "name": "deploy",
                "description": f"Deploy the current release (release tag={BUILDS[n]}) to staging.",
                "parameters": {"type": "object"},
            },
        }
        return {
            "model": "m",
            "messages": [{"role": "user", "content": f"Deploy {n}."}],
            "tools": [tool],
        }

    results = run(c, [body(n) for n in range(4)])
    assert results[1].fired == () and results[2].fired == ("volatile_learned",)
    description = results[3].body["tools"][0]["function"]["description"]
    assert "[[tag_1]]" in description and BUILDS[3] not in description
