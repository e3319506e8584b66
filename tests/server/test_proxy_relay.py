"""Relay of complete and streamed answers: exact bytes, status, and the usage round trip."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from fakes import DONE, PING, FakeBackend, LlamaFake, MakeProxy, VllmFake, sse_events, sse_payloads

CHAT: dict[str, Any] = {
    "model": "fake-model",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello to my friend please"},
    ],
}
COMPLETION: dict[str, Any] = {"model": "fake-model", "prompt": "Once upon a time there was"}


async def direct(fake: FakeBackend, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """The same request straight to the fake, its cache state as the proxied one saw it."""
    fake.forget()
    async with aiohttp.ClientSession() as s, s.post(fake.url + path, json=body) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize(
    "path,body",
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION), ("/completion", COMPLETION)],
)
async def test_llama_non_stream_is_byte_identical(
    llama_fake: LlamaFake, make_proxy: MakeProxy, path: str, body: dict[str, Any]
) -> None:
    """A non-streamed llama.cpp answer reaches the client with the backend's bytes and status."""
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.post(path, json=body) as resp:
        got = (resp.status, await resp.read())
        assert resp.headers["Content-Type"].startswith("application/json")
    assert got == await direct(llama_fake, path, body)
    assert got[0] == 200


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
async def test_vllm_non_stream_is_byte_identical(
    vllm_fake: VllmFake, make_proxy: MakeProxy, path: str, body: dict[str, Any]
) -> None:
    """A non-streamed vLLM answer reaches the client with the backend's bytes and status."""
    client, _, _ = await make_proxy(vllm_fake.url)
    async with client.post(path, json=body) as resp:
        got = (resp.status, await resp.read())
    assert got == await direct(vllm_fake, path, body)


@pytest.mark.parametrize(
    "path,body",
    [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION), ("/completion", COMPLETION)],
)
@pytest.mark.parametrize("include_usage", [False, True])
async def test_llama_stream_is_byte_identical(
    llama_fake: LlamaFake,
    make_proxy: MakeProxy,
    path: str,
    body: dict[str, Any],
    include_usage: bool,
) -> None:
    """Streamed llama.cpp events, pings and [DONE] reach the client exactly as sent directly."""
    llama_fake.knobs.ping_first = True
    req = {**body, "stream": True}
    if include_usage and path != "/completion":
        req["stream_options"] = {"include_usage": True}
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.post(path, json=req) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        got = await resp.read()
    _, want = await direct(llama_fake, path, req)
    assert got == want
    assert got.startswith(PING)
    assert got.endswith(DONE) == (path != "/completion")


@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]
)
@pytest.mark.parametrize("include_usage", [False, True])
async def test_vllm_stream_is_byte_identical(
    vllm_fake: VllmFake,
    make_proxy: MakeProxy,
    path: str,
    body: dict[str, Any],
    include_usage: bool,
) -> None:
    """Streamed vLLM events reach the client exactly as the backend sends them directly."""
    vllm_fake.prompt_tokens_details = True
    vllm_fake.knobs.reasoning = ["Let", " me", " think"]
    req = {**body, "stream": True}
    if include_usage:
        req["stream_options"] = {"include_usage": True}
    client, _, _ = await make_proxy(vllm_fake.url)
    async with client.post(path, json=req) as resp:
        got = await resp.read()
    _, want = await direct(vllm_fake, path, req)
    assert got == want
    assert got.endswith(DONE)


async def test_proxy_asks_for_usage_and_strips_it(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Without include_usage the proxy asks upstream, hides the usage chunk, keeps timings."""
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        got = await resp.read()
    assert llama_fake.last_body is not None
    assert llama_fake.last_body["stream_options"] == {"include_usage": True}
    payloads = sse_payloads(got)
    assert all(p["choices"] for p in payloads), "a usage-only chunk reached the client"
    assert not any("usage" in p for p in payloads)
    finish = payloads[-1]
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["timings"]["prompt_n"] > 0
    rec = await records.wait()
    assert rec.prompt_tokens == finish["timings"]["prompt_n"] + finish["timings"]["cache_n"]
    assert rec.completion_tokens == 5


async def test_vllm_usage_stripped_when_not_asked(
    vllm_fake: VllmFake, make_proxy: MakeProxy
) -> None:
    """vLLM: the injected usage chunk is removed, yet the record still has the counts."""
    client, records, _ = await make_proxy(vllm_fake.url)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        got = await resp.read()
    assert vllm_fake.last_body is not None
    assert vllm_fake.last_body["stream_options"] == {"include_usage": True}
    assert all(p["choices"] for p in sse_payloads(got))
    rec = await records.wait()
    assert rec.completion_tokens == 5
    assert rec.prompt_tokens == 11  # words of roles and contents


async def test_client_usage_request_is_honoured(vllm_fake: VllmFake, make_proxy: MakeProxy) -> None:
    """When the client asked for usage it gets the usage chunk, before [DONE]."""
    client, _, _ = await make_proxy(vllm_fake.url)
    req = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with client.post("/v1/chat/completions", json=req) as resp:
        got = await resp.read()
    events = sse_events(got)
    assert events[-1] == DONE
    usage = sse_payloads(got)[-1]
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 5


async def test_stream_events_arrive_as_sent(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """Each streamed event reaches the client before the backend sends the next one."""
    llama_fake.knobs.token_delay_s = 0.15
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        first = await resp.content.readuntil(b"\n\n")
        second = await resp.content.readuntil(b"\n\n")
        assert not llama_fake.finished.is_set()
        await resp.read()
    assert b'"role":"assistant"' in first
    assert b'"content":"Hello"' in second


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/models"])
async def test_query_string_reaches_the_backend_as_encoded(
    llama_fake: LlamaFake, make_proxy: MakeProxy, path: str
) -> None:
    """An encoded ``&``, ``=`` or ``#`` in a query value stays one value upstream."""
    client, _, _ = await make_proxy(llama_fake.url)
    query = "tag=a%26b%3Dc%23d&x=%20y"
    if path == "/v1/models":
        async with client.get(f"{path}?{query}") as resp:
            assert resp.status == 200
    else:
        async with client.post(f"{path}?{query}", json=CHAT) as resp:
            assert resp.status == 200
    assert llama_fake.last_query == {"tag": "a&b=c#d", "x": " y"}


async def test_an_inspection_failure_on_the_first_read_ends_the_stream(
    llama_fake: LlamaFake, make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fails inside its own callback, even the one fed while the client's head was
    being sent (nothing waits on the answer yet), ends the exchange: the stream ends with an
    error event, the record says so, nothing hangs."""
    from proxy import stream_inspect

    def broken(self: object, chunk: bytes, now: float) -> bool:
        raise RuntimeError("inspection failed")

    monkeypatch.setattr(stream_inspect.StreamInspector, "plain_chunk", broken)
    client, records, _ = await make_proxy(llama_fake.url)
    async with asyncio.timeout(5):
        async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            raw = await r.read()
    last = sse_payloads(raw)[-1]
    assert last["error"]["type"] == "server_error"
    await records.wait(1)
    assert records[0].error == "server_error"


async def test_a_failure_after_the_answer_started_closes_the_connection(
    llama_fake: LlamaFake, make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected failure once the response's head is out cannot become a 500 (it would be
    read as the body's next bytes): the client's connection is closed, cutting the body."""
    from proxy import stream_relay

    async def broken(*args: object, **kwargs: object) -> bool:
        raise RuntimeError("failed at the end")

    monkeypatch.setattr(stream_relay, "write_to_client", broken)
    client, _, _ = await make_proxy(llama_fake.url)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with asyncio.timeout(5):
            async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                await r.read()


async def test_an_http_1_0_client_gets_the_stream_unchunked_until_the_connection_closes(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """The relay frames what it writes itself: an HTTP/1.0 client gets no chunked framing (its
    body ends when the connection does), with the events exactly as an HTTP/1.1 client's."""
    client, _, _ = await make_proxy(llama_fake.url)
    req = {**CHAT, "stream": True}
    async with client.post("/v1/chat/completions", json=req) as resp:
        want = await resp.read()
    body = orjson.dumps(req)
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.0\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    await writer.drain()
    async with asyncio.timeout(5):
        raw = await reader.read()  # to the end: the proxy closes the connection
    writer.close()
    head, _, got = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200") or head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()

    def events(raw: bytes) -> list[dict[str, Any]]:  # (the second one's cache differs)
        return [
            {k: v for k, v in e.items() if k not in ("timings", "created")}
            for e in sse_payloads(raw)
        ]

    assert events(got) == events(want)
    assert got.endswith(DONE)


async def test_a_head_with_nothing_after_it_reaches_the_client_at_once(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """The client's head goes out as soon as the backend's has come: a backend that sends its
    head and then nothing (still thinking) has the client see the status and content type at
    once, and a client sets its response up while the first token is on its way."""
    llama_fake.knobs.head_only = True
    client, _, _ = await make_proxy(llama_fake.url)
    async with asyncio.timeout(2):
        async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["X-Accel-Buffering"] == "no"


@pytest.mark.parametrize("together", [True, False])
async def test_the_head_goes_out_with_the_first_events_that_came_with_it(
    llama_fake: LlamaFake, make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch, together: bool
) -> None:
    """A backend's head and first events read together reach the client in one write (one
    segment: the client reads them at once); a head that came alone goes out alone, at once (a
    backend still prefilling keeps its client informed)."""
    from asyncio import selector_events

    writes: list[bytes] = []
    original = selector_events._SelectorSocketTransport.write

    def recorded(self: Any, data: Any) -> None:
        writes.append(bytes(data))
        original(self, data)

    monkeypatch.setattr(selector_events._SelectorSocketTransport, "write", recorded)
    llama_fake.knobs.head_with_first = together
    llama_fake.knobs.head_only = not together
    llama_fake.knobs.token_delay_s = 0.05  # (the answer's first read is not all of it)
    client, _, _ = await make_proxy(llama_fake.url)
    async with asyncio.timeout(5):
        async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200
            body = await resp.read() if together else b""
    heads = [w for w in writes if w.startswith(b"HTTP/1.1 200") and b"X-Request-Id" in w]
    assert len(heads) == 1
    head, _, rest = heads[0].partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    if not together:
        assert rest == b""
        return
    assert rest, "the head went out without the events that came with it"
    size, _, framed = rest.partition(b"\r\n")
    chunk = framed[: int(size, 16)]
    assert framed == chunk + b"\r\n"
    assert body.startswith(chunk)
    assert b'"role":"assistant"' in chunk


async def test_records_of_overlapping_requests_all_come_and_nothing_stays_held(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Requests in progress together have their records held and written together: every one
    comes (answered, refused, cut off by its client), and nothing stays held once the
    batch's moment has passed."""
    from proxy.state import STATE

    llama_fake.knobs.token_delay_s = 0.02
    client, records, app = await make_proxy(llama_fake.url)

    async def streamed() -> None:
        async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            await r.read()

    async def refused() -> None:
        async with client.post("/v1/chat/completions", json={"model": 3}) as r:
            assert r.status == 400
            await r.read()

    async def cut_off() -> None:
        async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            await r.content.readuntil(b"\n\n")  # then gone

    async with asyncio.timeout(10):
        await asyncio.gather(streamed(), streamed(), refused(), cut_off(), streamed())
        await records.wait(5)
    state = app[STATE]
    assert state.awaiting_first == 0  # (requests whose first token is not out: records wait)
    await asyncio.sleep(0.05)
    assert not state.writer._ended  # the timer sent them all
    await state.writer.drain()
    assert sorted(r.status for r in records) == [200, 200, 200, 400, 499]


@pytest.mark.parametrize("delay_s", [0.001, 30.0])
async def test_the_first_tokens_read_is_read_a_moment_after_it_is_written(
    llama_fake: LlamaFake, make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch, delay_s: float
) -> None:
    """The read carrying the first token goes to the client before it is read: its event is
    parsed, and the first-token hook called, ``READ_AFTER_WRITE_S`` later (mid-answer here), or
    before the next read, whichever comes first. The token is timed at its read either way."""
    from proxy import stream_relay
    from proxy.state import STATE

    monkeypatch.setattr(stream_relay, "READ_AFTER_WRITE_S", delay_s)
    llama_fake.knobs.token_delay_s = 0.2
    client, records, app = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        read = b""
        while b'"content":"Hello"' not in read:
            assert not resp.content.at_eof()
            read += await resp.content.readany()
        await asyncio.sleep(0.05)
        assert not llama_fake.finished.is_set()  # (mid-answer)
        # The first-token hook takes the request off the proxy's count of those waiting.
        assert app[STATE].awaiting_first == (0 if delay_s < 1.0 else 1)
        await resp.read()
    record = await records.wait(1)
    assert app[STATE].awaiting_first == 0
    assert record.ttft_ms is not None and record.tpot_ms is not None
    # Timed at its read (four gaps of 0.2 s before the end), not when it was read a token
    # later (three).
    assert record.e2e_ms - record.ttft_ms > 700


async def test_a_first_token_left_unread_is_read_when_the_client_goes(
    llama_fake: LlamaFake, make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client gone before the first token's read was read: its record still has the token,
    and no timer is left behind to read it into a finished exchange."""
    from proxy import stream_relay

    monkeypatch.setattr(stream_relay, "READ_AFTER_WRITE_S", 30.0)
    llama_fake.knobs.token_delay_s = 0.2
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        read = b""
        while b'"content":"Hello"' not in read:
            read += await resp.content.readany()
        resp.close()  # gone mid-answer
    record = await records.wait(1, limit_s=5.0)
    assert record.error == "client_disconnected"
    assert record.ttft_ms is not None
    loop = asyncio.get_running_loop()
    timers = [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()]
    assert not any("read_unread" in repr(h) for h in timers)
