"""Through the proxy: a value no detector knows is learned from traffic, relocated, and
reported in the records and in /stats; in dry-run the backend gets the original."""

from __future__ import annotations

from typing import Any

from fakes import LlamaFake, MakeProxy

from tests.admin.stats_schema import assert_valid

BASE = (
    "You are the release assistant of Contoso. Answer briefly and precisely, and name the "
    "build you are talking about when it matters.\n"
)
BUILDS = ["7f3a-19", "8c21-04", "91ab-77", "0d0e-11", "aa12-93"]


def body(n: int) -> dict[str, Any]:
    history: list[dict[str, Any]] = []
    for i in range(n + 1):
        history.append({"role": "user", "content": f"Question {i}?"})
        if i < n:
            history.append({"role": "assistant", "content": f"Answer {i}."})
    system = {"role": "system", "content": f"Build: {BUILDS[n]}\n" + BASE}
    return {"model": "fake-model", "messages": [system, *history]}


async def test_a_learned_span_is_relocated_and_reported(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Two requests reach the backend as sent; the third completes the pattern, and it and the
    next carry a placeholder and a note, and name ``volatile_learned`` and the pattern id;
    /stats lists the pattern with its hits and no value."""
    client, records, _ = await make_proxy(llama_fake.url)
    for n in range(5):
        async with client.post("/v1/chat/completions", json=body(n)) as resp:
            assert resp.status == 200
            learned = n >= 2
            assert (resp.headers.get("X-Prefixgate-Canonical") == "volatile_learned") is learned
        record = await records.wait(n + 1)
        sent = llama_fake.last_body
        assert sent is not None
        if not learned:
            assert sent["messages"] == body(n)["messages"]
            assert record.canonical_rules == [] and record.canonical_learned_spans is None
        else:
            assert sent["messages"][0]["content"] == "Build: [[build_1]]\n" + BASE
            assert sent["messages"][-1]["content"].endswith(f"[[build_1]] = {BUILDS[n]}")
            assert record.canonical_rules == ["volatile_learned"]
            assert record.canonical_learned_spans is not None
    assert record.canonical_notes_restored == 2  # turns 3 and 4's notes, put back on turn 5
    async with client.admin.get("/stats") as resp:
        stats = await resp.json()
    assert_valid(stats)
    (span,) = stats["canonical"]["learned_spans"]
    assert span["id"] == record.canonical_learned_spans[0]
    assert span["hits"] == 3 and span["value_class"] == "token" and span["origin"] == "traffic"
    assert not any(b in str(stats) for b in BUILDS)


async def test_dry_run_forwards_the_original(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """``volatile_learned`` in dry-run: learned and reported as dry-run, never forwarded."""
    canonical = {"rules": {"volatile_learned": {"dry_run": True}}}
    client, records, _ = await make_proxy(llama_fake.url, canonical=canonical)
    for n in range(5):
        async with client.post("/v1/chat/completions", json=body(n)) as resp:
            assert resp.status == 200
            assert "X-Prefixgate-Canonical" not in resp.headers
        record = await records.wait(n + 1)
        assert llama_fake.last_body is not None
        assert llama_fake.last_body["messages"] == body(n)["messages"]
        assert record.canonical_rules == []
    assert record.canonical_dry_run_rules == ["volatile_learned"]
    assert record.canonical_learned_spans is not None
