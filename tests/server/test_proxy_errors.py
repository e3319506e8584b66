"""Failures: the client's bad requests, the backend's errors, timeouts and disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from fakes import DONE, LlamaFake, MakeProxy, VllmFake, sse_events, sse_payloads

from proxy.config import Timeouts
from tests.ports import free_port

CHAT: dict[str, Any] = {
    "model": "fake-model",
    "messages": [{"role": "user", "content": "tell me a story"}],
}
FAST = Timeouts(connect=0.5, idle=0.25)


def closed_port_url() -> str:
    """A local URL nothing listens on."""
    return f"http://127.0.0.1:{free_port()}"


def assert_openai_error(body: Any, type_: str) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_
    assert body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
async def test_upstream_error_passes_through(
    llama_fake: LlamaFake, make_proxy: MakeProxy, stream: bool
) -> None:
    """A backend's HTTP error (first result) reaches the client with its status and body."""
    llama_fake.knobs.reject_status = 400
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
        assert resp.status == 400
        body = await resp.read()
    assert orjson.loads(body) == {
        "error": {
            "code": 400,
            "type": "invalid_request_error",
            "message": "the request exceeds the context size",
        }
    }
    rec = await records.wait()
    assert (rec.status, rec.error) == (400, "upstream_error")


async def test_vllm_error_passes_through(vllm_fake: VllmFake, make_proxy: MakeProxy) -> None:
    """vLLM's error envelope (integer code, BadRequestError) is relayed unchanged."""
    vllm_fake.knobs.reject_status = 400
    client, _, _ = await make_proxy(vllm_fake.url)
    async with client.post("/v1/completions", json={"prompt": "x", "stream": True}) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["error"]["type"] == "BadRequestError"
    assert body["error"]["code"] == 400


async def test_malformed_json_is_400(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """Malformed JSON is rejected with 400 in the OpenAI error shape, never forwarded."""
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post(
        "/v1/chat/completions", data=b'{"model": ', headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
        assert resp.headers["X-Request-Id"]
        assert_openai_error(await resp.json(), "invalid_request_error")
    assert llama_fake.requests == []
    rec = await records.wait()
    assert (rec.status, rec.error) == (400, "invalid_request_error")


@pytest.mark.parametrize("payload", [b"[1, 2]", b'"text"', b"42", b""])
async def test_non_object_is_400(
    llama_fake: LlamaFake, make_proxy: MakeProxy, payload: bytes
) -> None:
    """A body that is not a JSON object (or is empty) is a 400 in the OpenAI shape."""
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.post(
        "/v1/completions", data=payload, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 400
        assert_openai_error(await resp.json(), "invalid_request_error")


async def test_body_over_limit_is_413(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """A body over max_body_bytes is refused with 413, announced length or chunked."""
    client, _, _ = await make_proxy(llama_fake.url, max_body_bytes=1024)
    big = orjson.dumps({"prompt": "x" * 2000})
    async with client.post(
        "/v1/completions", data=big, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 413
        assert_openai_error(await resp.json(), "invalid_request_error")

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 256):
            yield big[i : i + 256]

    async with client.post(
        "/v1/completions", data=chunks(), headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 413
    assert llama_fake.requests == []


async def test_backend_unreachable_is_502(make_proxy: MakeProxy) -> None:
    """A backend that refuses connections gives 502 backend_unavailable, on every path."""
    client, records, _ = await make_proxy(closed_port_url(), timeouts=FAST)
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 502
        assert_openai_error(await resp.json(), "backend_unavailable")
    async with client.get("/v1/models") as resp:
        assert resp.status == 502
    rec = await records.wait()
    assert (rec.status, rec.error) == (502, "backend_unavailable")


@pytest.mark.parametrize("stream", [False, True])
async def test_slow_headers_is_504(
    llama_fake: LlamaFake, make_proxy: MakeProxy, stream: bool
) -> None:
    """A backend that sends no status line within the idle timeout gives 504."""
    llama_fake.knobs.header_delay_s = 1.0
    client, records, _ = await make_proxy(llama_fake.url, timeouts=FAST)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
        assert resp.status == 504
        assert_openai_error(await resp.json(), "backend_timeout")
    rec = await records.wait()
    assert (rec.status, rec.error) == (504, "backend_timeout")
    await asyncio.wait_for(llama_fake.closed.wait(), 1.0)


async def test_mid_stream_stall_ends_with_error_event(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """A stream that stalls past the idle timeout ends with an SSE error event, recorded."""
    llama_fake.knobs.stall_after = 2
    client, records, _ = await make_proxy(llama_fake.url, timeouts=FAST)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status == 200
        raw = await resp.read()
    payloads = sse_payloads(raw)
    assert [p["choices"][0]["delta"].get("content") for p in payloads[:3]] == [
        None,
        "Hello",
        " there",
    ]
    assert payloads[-1]["error"]["type"] == "backend_timeout"
    assert not raw.endswith(DONE)
    rec = await records.wait()
    assert (rec.status, rec.error) == (200, "backend_timeout")
    await asyncio.wait_for(llama_fake.closed.wait(), 1.0)


async def test_llama_mid_stream_error_recorded(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """llama.cpp's mid-stream error event is relayed as sent (no [DONE]) and recorded."""
    llama_fake.knobs.fail_after = 3
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        raw = await resp.read()
    events = sse_events(raw)
    assert orjson.loads(events[-1][6:])["error"]["message"] == "the slot failed to decode"
    assert len(events) == 1 + 3 + 1  # role chunk, three tokens, the error
    rec = await records.wait()
    assert (rec.status, rec.error) == (200, "upstream_stream_error")
    assert rec.slo_met is False  # the default SLO is configured; a broken stream misses it


async def test_vllm_mid_stream_error_recorded(vllm_fake: VllmFake, make_proxy: MakeProxy) -> None:
    """vLLM's mid-stream error event and the [DONE] after it are relayed; the record errs."""
    vllm_fake.knobs.fail_after = 1
    client, records, _ = await make_proxy(vllm_fake.url)
    async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        raw = await resp.read()
    events = sse_events(raw)
    assert events[-1] == DONE
    assert orjson.loads(events[-2][6:])["error"]["type"] == "InternalServerError"
    rec = await records.wait()
    assert rec.error == "upstream_stream_error"


@pytest.mark.parametrize("stall", [False, True])
async def test_client_disconnect_closes_upstream(
    llama_fake: LlamaFake, make_proxy: MakeProxy, stall: bool
) -> None:
    """A client leaving mid-stream closes the upstream request within a second; 499 recorded."""
    if stall:
        llama_fake.knobs.stall_after = 1
    else:
        llama_fake.knobs.token_delay_s = 0.2
    client, records, _ = await make_proxy(llama_fake.url)
    resp = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    await resp.content.readuntil(b"\n\n")  # the role chunk
    await resp.content.readuntil(b"\n\n")  # the first token
    resp.close()
    await asyncio.wait_for(llama_fake.closed.wait(), 1.0)
    assert not llama_fake.finished.is_set()
    rec = await records.wait()
    assert (rec.status, rec.error) == (499, "client_disconnected")


@pytest.mark.parametrize("length", [None, "0"])
async def test_a_bodiless_request_is_answered_at_once(
    llama_fake: LlamaFake, make_proxy: MakeProxy, length: str | None
) -> None:
    """A POST with no body at all (no Content-Length, or 0) gets its 400 at once: reading an
    empty body must end (its reader reports the end of a piece forever)."""
    client, _, _ = await make_proxy(llama_fake.url)
    reader, writer = await asyncio.open_connection("127.0.0.1", client.server.port)
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    writer.write((head + "\r\n").encode())
    await writer.drain()
    try:
        status = await asyncio.wait_for(reader.readline(), 5.0)
    finally:
        writer.close()
    assert status.split()[1] == b"400", status
