"""Conversation keys through the proxy: prompt_cache_key and session headers route, hosted-only
fields are removed for strict dialects, and records carry the key's hash, never its value."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import LlamaFake, MakeProxy, ProxyClient, VllmFake, fleet_proxy, serve

from proxy.config import ConfigError, resolve
from proxy.hosted import HOSTED_FIELDS, HostedFields, hash_key
from proxy.state import STATE


def turn(text: str, **fields: Any) -> dict[str, Any]:
    """A short chat request: a shared system prompt, then ``text``."""
    return {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": "You are terse. " * 40},
            {"role": "user", "content": text},
        ],
        **fields,
    }


async def post(client: ProxyClient, body: dict[str, Any], **headers: str) -> None:
    async with client.post("/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


@pytest.fixture
async def two(aiohttp_server: Any) -> list[LlamaFake]:
    """Two llama.cpp fakes."""
    return [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]


async def test_one_key_sticks_to_one_replica(two: list[LlamaFake], make_proxy: MakeProxy) -> None:
    """Requests with one prompt_cache_key and unrelated prompts all go to one replica."""
    client, records, _ = await fleet_proxy(make_proxy, *two)
    for i in range(8):
        await post(client, turn(f"unrelated question number {i} " * (i + 1), prompt_cache_key="t1"))
    await records.wait(8)
    assert len({r.backend for r in records}) == 1
    assert {r.route_reason for r in records} == {"key_affinity"}
    assert {r.affinity_source for r in records} == {"prompt_cache_key"}


async def test_different_keys_spread(two: list[LlamaFake], make_proxy: MakeProxy) -> None:
    """Twenty keys over two replicas land on both (1 in 500,000 to miss by chance)."""
    client, records, _ = await fleet_proxy(make_proxy, *two)
    for i in range(20):
        await post(client, turn("same question", prompt_cache_key=f"thread-{i}"))
    await records.wait(20)
    assert {r.backend for r in records} == {f.url for f in two}
    assert len({r.affinity_key for r in records}) == 20


async def test_key_does_not_override_health(two: list[LlamaFake], make_proxy: MakeProxy) -> None:
    """The key's replica ejected: its requests go to the healthy one, and come back after."""
    client, records, app = await fleet_proxy(make_proxy, *two)
    fleet = app[STATE].fleet
    await post(client, turn("hello", prompt_cache_key="k"))
    home = (await records.wait(1)).backend
    assert home is not None
    fleet.report_failure(fleet[home], "down for the test")
    await post(client, turn("hello again", prompt_cache_key="k"))
    moved = await records.wait(2)
    assert moved.backend != home and moved.route_reason == "key_affinity"
    await fleet.check_all()  # the fake answers /health again: restored
    await post(client, turn("and again", prompt_cache_key="k"))
    assert (await records.wait(3)).backend == home


async def test_key_obeys_the_load_gate(two: list[LlamaFake], make_proxy: MakeProxy) -> None:
    """The key's replica reports a queue: the request goes to the other one ("load_gate")."""
    client, records, app = await fleet_proxy(make_proxy, *two)
    await post(client, turn("hello", prompt_cache_key="k"))
    home = (await records.wait(1)).backend
    busy = next(f for f in two if f.url == home)
    busy.serve_metrics = True
    busy.load_running, busy.load_waiting = 4, 8
    await app[STATE].fleet.check_all()
    await post(client, turn("hello again", prompt_cache_key="k"))
    gated = await records.wait(2)
    assert gated.backend != home and gated.route_reason == "load_gate"


async def test_session_headers_are_keys(two: list[LlamaFake], make_proxy: MakeProxy) -> None:
    """x-session-affinity / x-session-id key a request when the body has no prompt_cache_key;
    the body's key comes first, and an empty value is no key."""
    client, records, _ = await fleet_proxy(make_proxy, *two)
    await post(client, turn("a"), **{"X-Session-Id": "s1"})
    await post(client, turn("b"), **{"x-session-affinity": "s1", "x-session-id": "other"})
    await post(client, turn("c", prompt_cache_key="p"), **{"x-session-id": "s1"})
    await post(client, turn("d", prompt_cache_key=""), **{"x-session-id": ""})
    await records.wait(4)
    first, second, third, fourth = records[:4]
    assert first.affinity_source == "x-session-id"
    assert second.affinity_source == "x-session-affinity"
    assert first.affinity_key == second.affinity_key
    assert third.affinity_source == "prompt_cache_key"
    assert third.affinity_key != first.affinity_key
    assert fourth.affinity_key is None
    assert fourth.route_reason in {"miss", "affinity"}


async def test_record_carries_the_hash_never_the_value(
    two: list[LlamaFake], make_proxy: MakeProxy
) -> None:
    """The record holds the key's 16-hex-digit hash (per tenant) and not the raw key."""
    client, records, _ = await fleet_proxy(make_proxy, *two)
    secret = "thread-4f1d9c0e-very-private"
    await post(client, turn("hi", prompt_cache_key=secret))
    record = await records.wait(1)
    assert record.affinity_key == f"{hash_key(secret):016x}"
    assert secret not in str(record.as_dict())
    assert hash_key(secret, "tenant-a") != hash_key(secret)


async def test_logged_body_carries_the_hash(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """With --log-prompts the logged body's prompt_cache_key is the hash; the backend got the
    key itself."""
    client, records, _ = await make_proxy(llama_fake.url, log_prompts=True)
    await post(client, turn("hi", prompt_cache_key="thread-secret-1"))
    record = await records.wait(1)
    assert record.body["prompt_cache_key"] == record.affinity_key
    assert "thread-secret-1" not in str(record.as_dict())
    assert llama_fake.requests[-1]["prompt_cache_key"] == "thread-secret-1"


async def test_key_splits_no_prefix(two: list[LlamaFake], make_proxy: MakeProxy) -> None:
    """Two keys on one prompt fingerprint the same: the key seeds neither chain nor salt."""
    client, records, _ = await fleet_proxy(make_proxy, *two)
    await post(client, turn("same", prompt_cache_key="one"))
    await post(client, turn("same", prompt_cache_key="two"))
    await post(client, turn("same"))
    await records.wait(3)
    assert len({r.prefix_anchor for r in records}) == 1
    assert len({tuple(map(tuple, r.prefix_segments)) for r in records}) == 1


async def test_other_policies_ignore_the_key(two: list[LlamaFake], make_proxy: MakeProxy) -> None:
    """round-robin stays round-robin with a key: key affinity belongs to prefix-affinity."""
    client, records, _ = await fleet_proxy(make_proxy, *two, policy="round-robin")
    for _ in range(4):
        await post(client, turn("x", prompt_cache_key="k"))
    await records.wait(4)
    assert {r.route_reason for r in records} == {"round_robin"}
    assert len({r.backend for r in records}) == 2


async def test_hosted_fields_kept_for_llamacpp_and_vllm(
    llama_fake: LlamaFake, vllm_fake: VllmFake, make_proxy: MakeProxy
) -> None:
    """llama.cpp and vLLM ignore unknown fields: by default they get the body as sent."""
    fields = {"prompt_cache_key": "k", "prompt_cache_retention": "24h", "store": False}
    for fake in (llama_fake, vllm_fake):
        client, records, _ = await make_proxy(fake.url)
        await post(client, turn("hi", **fields))
        record = await records.wait(1)
        assert all(fake.requests[-1][k] == v for k, v in fields.items())
        assert record.hosted_fields_stripped is None


async def test_hosted_fields_stripped_for_a_generic_server(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """A generic OpenAI-compatible server loses every hosted field, the key still routes, and
    the record lists what was removed; other fields pass untouched."""
    client, records, _ = await make_proxy(llama_fake.url, dialect="openai")
    body = turn("hi", prompt_cache_key="k", prompt_cache_retention="in_memory", temperature=0.5)
    body |= {"safety_identifier": "u1", "metadata": {"a": "b"}, "store": True, "seed": 3}
    await post(client, body)
    record = await records.wait(1)
    sent = llama_fake.requests[-1]
    assert not set(HOSTED_FIELDS) & set(sent)
    assert sent["temperature"] == 0.5 and sent["seed"] == 3
    assert record.hosted_fields_stripped == [
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "store",
        "metadata",
    ]
    assert record.affinity_source == "prompt_cache_key"


async def test_stripping_is_configurable_per_dialect(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """--strip-hosted-fields llamacpp strips for llama.cpp; none strips for no dialect."""
    hosted = resolve(
        {"backend": [llama_fake.url], "strip_hosted_fields": ["llamacpp"]}, environ={}
    ).hosted
    client, records, _ = await make_proxy(llama_fake.url, hosted=hosted)
    await post(client, turn("hi", prompt_cache_key="k"))
    assert (await records.wait(1)).hosted_fields_stripped == ["prompt_cache_key"]
    assert "prompt_cache_key" not in llama_fake.requests[-1]
    client2, records2, _ = await make_proxy(
        llama_fake.url, dialect="openai", hosted=HostedFields(strip_dialects=())
    )
    await post(client2, turn("hi", prompt_cache_key="k"))
    await records2.wait(1)
    assert llama_fake.requests[-1]["prompt_cache_key"] == "k"


def test_settings_for_hosted_fields() -> None:
    """Defaults, 'none', environment lists, and an unknown dialect refused."""
    base = {"backend": ["http://b"]}
    default = resolve(base, environ={}).hosted
    assert default.session_headers == ("x-session-affinity", "x-session-id")
    assert default.strip_dialects == ("openai",)
    env = {"PREFIXGATE_SESSION_HEADER": "X-Thread,none-such", "PREFIXGATE_STRIP_HOSTED_FIELDS": ""}
    got = resolve(base, environ=env).hosted
    assert got.session_headers == ("x-thread", "none-such")
    assert resolve({**base, "session_header": ["none"]}, environ={}).hosted.session_headers == ()
    with pytest.raises(ConfigError, match="strip-hosted-fields"):
        resolve({**base, "strip_hosted_fields": ["auto"]}, environ={})
