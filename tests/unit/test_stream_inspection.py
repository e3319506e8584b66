"""The relay's per-event inspection: plain token events are counted without parsing, and that
shortcut observes exactly what parsing every event would."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proxy.relay as relay
from proxy.backends import DIALECTS
from proxy.backends.base import CHAT, COMPLETIONS, NATIVE_COMPLETION
from proxy.records import Observation
from proxy.relay import Exchange, StreamInspector, plain_token_event


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    return sse(
        {
            "choices": [{"finish_reason": finish, "index": 0, "delta": delta}],
            "created": 1764567000,
            "id": "chatcmpl-1",
            "model": "smollm2",
            "object": "chat.completion.chunk",
            **extra,
        }
    )


def test_plain_token_events() -> None:
    assert plain_token_event(chat_chunk({"content": "Hel"}), CHAT)
    assert plain_token_event(chat_chunk({"reasoning_content": "hmm"}), CHAT)
    assert plain_token_event(chat_chunk({"tool_calls": [{"index": 0}]}), CHAT)
    # Keys quoted inside the text are escaped, so they are not mistaken for keys.
    assert plain_token_event(chat_chunk({"content": 'say "usage": {"error": 1}'}), CHAT)
    text = sse({"choices": [{"text": "lo", "index": 0, "finish_reason": None}], "model": "m"})
    assert plain_token_event(text, COMPLETIONS)
    native = sse({"content": "lo", "stop": False, "id_slot": 0, "tokens": []})
    assert plain_token_event(native, NATIVE_COMPLETION)


@pytest.mark.parametrize(
    "event",
    [
        chat_chunk({"content": ""}),  # nothing in it
        chat_chunk({"role": "assistant"}),
        chat_chunk({}, finish="stop"),
        chat_chunk({"content": "x"}, finish="length"),
        chat_chunk({"content": "x"}, usage={"prompt_tokens": 3}),
        chat_chunk({"content": "x"}, usage=None),
        chat_chunk({"content": "x"}, timings={"prompt_n": 3}),
        chat_chunk({"tool_calls": []}),
        sse({"error": {"message": "boom"}}),
        b": ping\n\n",
        b"data: [DONE]\n\n",
        b"event: message\ndata: " + orjson.dumps({"choices": []}) + b"\n\n",
        b'data: {"choices":[{"finish_reason":null,"delta":{"content":"x"}}]}\r\n\r\n',
        chat_chunk({"content": "x"})[:-2] + b"\ndata: {}\n\n",  # two data lines
    ],
)
def test_events_that_are_parsed(event: bytes) -> None:
    assert not plain_token_event(event, CHAT)


def test_native_events_that_are_parsed() -> None:
    assert not plain_token_event(sse({"content": "x", "stop": True}), NATIVE_COMPLETION)
    assert not plain_token_event(sse({"content": "", "stop": False}), NATIVE_COMPLETION)


def observe(
    events: list[bytes], route: str, dialect: str, *, shortcut: bool
) -> tuple[Observation, list[bytes]]:
    """Run events through a StreamInspector: what it observed and forwarded.

    ``shortcut=False`` parses every event.
    """
    ex = Exchange(
        request_id="r",
        route=route,
        upstream_path=route,
        obs=Observation(t_start=0.0),
        dialect=DIALECTS[dialect](),
        strip_usage=True,
    )
    inspector = StreamInspector(ex)
    saved = relay.plain_token_event
    if not shortcut:
        relay.plain_token_event = lambda event, route: False
    try:
        out: list[bytes] = []
        for i, event in enumerate(events):
            inspector.process(event, float(i + 1), out)
        inspector.finish(out)
    finally:
        relay.plain_token_event = saved
    ex.obs.inspect_s = 0.0
    return ex.obs, out


texts = st.text(alphabet=st.sampled_from('ab "\\{}:,usagerror\n'), max_size=12)
deltas = st.one_of(
    st.builds(lambda t: {"content": t}, texts),
    st.builds(lambda t: {"reasoning_content": t}, texts),
    st.builds(lambda t: {"role": "assistant", "content": t}, texts),
    st.just({}),
    st.just({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}),
)
chunks = st.builds(
    lambda delta, finish, usage: chat_chunk(delta, finish, **usage),
    deltas,
    st.sampled_from([None, None, None, "stop", "length"]),
    st.sampled_from([{}, {}, {"usage": None}, {"timings": {"prompt_n": 5, "prompt_ms": 2.0}}]),
)
usage_event = sse(
    {
        "choices": [],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13},
        "timings": {"prompt_n": 2, "prompt_ms": 1.5, "predicted_ms": 8.0, "predicted_n": 4},
    }
)


@settings(max_examples=300, deadline=None)
@given(st.lists(chunks, max_size=20), st.sampled_from(["llamacpp", "vllm", "openai"]))
def test_shortcut_observes_what_parsing_does(events: list[bytes], dialect: str) -> None:
    stream = [*events, usage_event, b"data: [DONE]\n\n"]
    fast = observe(stream, CHAT, dialect, shortcut=True)
    slow = observe(stream, CHAT, dialect, shortcut=False)
    assert fast == slow
