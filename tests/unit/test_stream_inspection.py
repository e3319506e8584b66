"""The relay's per-event inspection: plain token events are counted without parsing, and that
shortcut observes exactly what parsing every event would."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import proxy.stream_inspect as stream_inspect
from proxy.backends import DIALECTS
from proxy.backends.apis import MESSAGES, RESPONSES
from proxy.backends.base import CHAT, COMPLETIONS, NATIVE_COMPLETION
from proxy.exchange import Exchange
from proxy.records import Observation
from proxy.sse import EventSplitter
from proxy.stream_inspect import (
    StreamInspector,
    plain_token_event,
    plain_token_run,
    token_shape,
)


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
    saved = stream_inspect.plain_token_event
    # (patched before the first event: an inspector that never passes one keeps no shape, so
    # every event is parsed)
    if not shortcut:
        stream_inspect.plain_token_event = lambda event, route: False
    try:
        out: list[bytes] = []
        for i, event in enumerate(events):
            inspector.process(event, float(i + 1), out)
        inspector.finish(out)
    finally:
        stream_inspect.plain_token_event = saved
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


def relay_chunks(
    chunks: list[bytes], route: str, dialect: str, *, first_visible: float | None = None
) -> tuple[Observation, list[bytes]]:
    """The relay's own handling of upstream reads (``proxy.stream_relay._StreamRelay``): a read
    that is nothing but plain token events once the first visible token is timed is counted and
    forwarded whole; before it, one the inspector would forward as it came is forwarded, then
    read; anything else is split."""
    ex = Exchange(
        request_id="r",
        route=route,
        upstream_path=route,
        obs=Observation(t_start=0.0, t_first_token=first_visible, t_first_visible=first_visible),
        dialect=DIALECTS[dialect](),
        strip_usage=True,
    )
    inspector, splitter = StreamInspector(ex), EventSplitter()
    out: list[bytes] = []
    seen: list[bytes]
    for i, chunk in enumerate(chunks):
        now = float(i + 1)
        if not splitter.pending and inspector.plain_chunk(chunk, now):
            out.append(chunk)
            continue
        if ex.obs.t_first_visible is None and not splitter.pending and inspector.forwardable(chunk):
            # Forwarded first, then read: reading it first would have forwarded the same.
            twin = StreamInspector(dataclasses.replace(ex, obs=dataclasses.replace(ex.obs)))
            seen = []
            for event in EventSplitter().feed(chunk):
                twin.process(event, now, seen)
            assert b"".join(seen) == chunk
            out.append(chunk)
            inspector.read_forwarded(list(splitter.feed(chunk)), now)
            assert not splitter.pending
            assert ex.obs == twin.ex.obs  # and observed the same as reading each event
            continue
        inspector.process_all(list(splitter.feed(chunk)), now, out)
    inspector.finish(out)
    rest = splitter.flush()
    if rest:
        out.append(rest)
    ex.obs.inspect_s = 0.0
    return ex.obs, out


def test_a_run_of_plain_events() -> None:
    events = [chat_chunk({"content": t}) for t in ("a", "b", "c")]
    assert plain_token_run(b"".join(events), CHAT) == 3
    assert plain_token_run(events[0], CHAT) == 1
    assert plain_token_run(b"".join([*events, chat_chunk({}, finish="stop")]), CHAT) == 0
    assert plain_token_run(b"".join([*events, b": ping\n\n"]), CHAT) == 0
    assert plain_token_run(b"".join(events)[:-1], CHAT) == 0  # the last one unfinished
    assert plain_token_run(events[0].replace(b"\n\n", b"\r\n\r\n") + events[1], CHAT) == 0
    text = sse({"choices": [{"text": "lo", "index": 0, "finish_reason": None}], "model": "m"})
    assert plain_token_run(text * 2, COMPLETIONS) == 2
    native = sse({"content": "lo", "stop": False, "id_slot": 0, "tokens": []})
    assert plain_token_run(native * 3, NATIVE_COMPLETION) == 3
    assert plain_token_run(native + sse({"content": "", "stop": False}), NATIVE_COMPLETION) == 0


def test_a_token_events_shape_is_the_bytes_around_its_text() -> None:
    native = sse({"content": "lo", "stop": False, "id_slot": 0, "tokens": []})
    text = sse({"choices": [{"text": "lo", "index": 0, "finish_reason": None}], "model": "m"})
    responses = b'event: response.output_text.delta\ndata: {"delta":"lo","item_id":"i"}\n\n'
    messages = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"lo"}}\n\n'
    )
    for event, route in (
        (chat_chunk({"content": "lo"}), CHAT),
        (chat_chunk({"reasoning_content": "lo"}), CHAT),
        (chat_chunk({"content": "", "reasoning_content": "lo"}), CHAT),
        (text, COMPLETIONS),
        (native, NATIVE_COMPLETION),
        (responses, RESPONSES),
        (messages, MESSAGES),
    ):
        assert plain_token_event(event, route)
        shape = token_shape(event, route)
        assert shape is not None
        head, tail = shape
        assert head + b"lo" + tail == event, route
    # The closing quote is the first one no odd run of backslashes escapes.
    for content in ('say "hi"', "a\\", 'a\\"b', "\\\\"):
        event = chat_chunk({"content": content})
        shape = token_shape(event, CHAT)
        assert shape is not None
        head, tail = shape
        assert orjson.loads(b'"' + event[len(head) : len(event) - len(tail)] + b'"') == content
    assert token_shape(chat_chunk({"tool_calls": [{"index": 0}]}), CHAT) is None


def test_the_next_token_events_are_compared_with_the_shape_not_tested_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inspector = _inspector(CHAT)
    ex = inspector.ex
    assert inspector.plain_chunk(chat_chunk({"content": "Hel"}), 2.0)

    def tested(event: bytes, route: str) -> bool:
        raise AssertionError("tested whole")

    monkeypatch.setattr(stream_inspect, "plain_token_event", tested)
    assert inspector.plain_chunk(chat_chunk({"content": "lo, wor"}), 3.0)
    assert inspector.plain_chunk(chat_chunk({"content": "ld \\n"}), 4.0)
    assert ex.obs.token_events == 3
    with pytest.raises(AssertionError, match="tested whole"):  # a quote in it: tested whole
        inspector.plain_chunk(chat_chunk({"content": 'a "b"'}), 5.0)


def test_a_read_of_token_events_of_the_shape_is_counted_without_testing_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inspector = _inspector(CHAT)
    assert inspector.plain_chunk(chat_chunk({"content": "Hel"}), 2.0)

    def tested(chunk: bytes, route: str) -> int:
        raise AssertionError("tested whole")

    monkeypatch.setattr(stream_inspect, "plain_token_run", tested)
    read = b"".join(chat_chunk({"content": t}) for t in ("lo", ", ", "wor", "ld"))
    assert inspector.plain_chunk(read, 3.0)
    assert inspector.ex.obs.token_events == 5
    for odd in (
        read + chat_chunk({}, finish="stop"),  # one event of another shape
        read + chat_chunk({"content": 'say "hi"'}),  # one the shape cannot vouch for
        read[:-1],  # the last one unfinished
        read.replace(b"\n\n", b"\n\n\n", 1),  # an odd run of line breaks
    ):
        with pytest.raises(AssertionError, match="tested whole"):
            inspector.plain_chunk(odd, 4.0)


def _inspector(route: str) -> StreamInspector:
    """An inspector past the first visible token (plain token events are counted, not parsed)."""
    return StreamInspector(
        Exchange(
            request_id="r",
            route=route,
            upstream_path=route,
            obs=Observation(t_start=0.0, t_first_token=1.0, t_first_visible=1.0),
            dialect=DIALECTS["llamacpp"](),
        )
    )


@pytest.mark.parametrize("raw", [b']"', b"]\n", b"]\\", b"]x\n\ndata: [DONE]\n\ndata: y"])
def test_a_text_the_shape_cannot_vouch_for_is_judged_as_before(raw: bytes) -> None:
    """A quote, a line break or a backslash at its end in what lies between a shape's two parts
    could end the string (or the event) elsewhere: such an event is tested whole. (A text
    starting with "]" is one the whole test refuses, so each case shows the shape deferring.)"""
    inspector = _inspector(CHAT)
    assert inspector.plain_chunk(chat_chunk({"content": "Hel"}), 2.0)
    assert inspector._shape is not None
    head, tail = inspector._shape
    event = head + raw + tail
    assert not plain_token_event(event, CHAT)
    assert not inspector._plain(event)
    assert not inspector.plain_chunk(event, 3.0)
    assert inspector.ex.obs.token_events == 1


def test_every_route_keeps_a_shape_and_gives_it_up_when_its_events_differ_elsewhere() -> None:
    responses = b'event: response.output_text.delta\ndata: {"delta":"%b","item_id":"i"}\n\n'
    messages = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"%b"}}\n\n'
    )
    for route, event in (
        (CHAT, lambda t, i: chat_chunk({"content": t.decode()})),
        (COMPLETIONS, lambda t, i: sse({"choices": [{"text": t.decode(), "finish_reason": None}]})),
        (NATIVE_COMPLETION, lambda t, i: sse({"content": t.decode(), "stop": False})),
        (RESPONSES, lambda t, i: responses % t),
        (MESSAGES, lambda t, i: messages % t),
    ):
        inspector = _inspector(route)
        for i, text in enumerate([b"a", b"bc", b"d e", b"f"]):
            assert inspector._plain(event(text, i)), route
        assert inspector._shape is not None and inspector._misses == 0, route
    # llama-server's native events carry the token ids and a count: no two alike outside the
    # text. The shape is given up; every event is still counted, tested whole.
    inspector = _inspector(NATIVE_COMPLETION)
    for i in range(8):
        native = sse({"content": "x", "tokens": [i], "stop": False, "tokens_predicted": i})
        assert inspector._plain(native)
    assert inspector._shape is None and inspector._misses == stream_inspect.SHAPE_MISSES
    # A chat stream whose clock ("created") moves now and then keeps its shape.
    inspector = _inspector(CHAT)
    for i in range(12):
        assert inspector._plain(chat_chunk({"content": "x"}, created=1764567000 + i // 4))
    assert inspector._shape is not None and inspector._misses == 0


@settings(max_examples=500, deadline=None)
@given(
    st.text(max_size=6),
    st.lists(st.text(alphabet=st.sampled_from('ab "\\\n\u00e9{}:,usagerror'), max_size=8)),
    st.sampled_from(["content", "reasoning_content"]),
)
def test_an_event_of_a_known_shape_is_a_plain_token_event(
    first: str, texts: list[str], key: str
) -> None:
    """What the inspector takes as plain by a stream's token shape is a token event of the same
    JSON, another text in the same place: never usage, a finish, or anything else."""
    inspector = _inspector(CHAT)
    inspector.plain_chunk(chat_chunk({key: first}), 2.0)  # a shape, when that one is plain
    for text in texts:
        event = chat_chunk({key: text})
        if inspector._plain(event):
            # (taken by its shape alone, or tested whole: then a text that reads like a key,
            # "usage", is parsed instead, and counted the same)
            obj = orjson.loads(event[len(b"data: ") :])
            assert text
            assert obj["choices"] == [{"finish_reason": None, "index": 0, "delta": {key: text}}]
            assert obj.keys() == {"choices", "created", "id", "model", "object"}
        else:
            assert not plain_token_event(event, CHAT)
    for other in (
        chat_chunk({key: "x"}, finish="stop"),
        chat_chunk({key: "x"}, usage={"prompt_tokens": 3}),
        chat_chunk({key: "x"}, timings={"prompt_n": 3}),
        chat_chunk({key: ""}),
        sse({"error": {"message": "boom"}}),
        b"data: [DONE]\n\n",
    ):
        assert not inspector._plain(other)


mostly_plain = st.one_of(
    st.builds(lambda t: chat_chunk({"content": t}), texts),
    st.builds(lambda t: chat_chunk({"reasoning_content": t}), texts),
    chunks,
)
separators = st.sampled_from([b"\n\n", b"\n\n", b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\n\n"])


def test_a_read_one_line_break_short_of_an_event_end_is_not_a_whole_event() -> None:
    """A read that stops between an event's two closing line breaks is not yet that event: its
    token is timed when the read that ends it arrives, as parsing each event times it."""
    event = chat_chunk({"content": "a"})
    stream = event + usage_event
    assert not plain_token_event(event[:-1], CHAT)
    api = b'event: response.output_text.delta\ndata: {"delta":"a"}\n\n'
    assert plain_token_event(api, RESPONSES) and not plain_token_event(api[:-1], RESPONSES)
    for first_visible in (None, 0.5):
        obs, out = relay_chunks(
            [stream[: len(event) - 1], stream[len(event) - 1 :]],
            CHAT,
            "llamacpp",
            first_visible=first_visible,
        )
        assert obs.t_last_token == 2.0 and obs.token_events == 1
        assert b"".join(out) == event  # the usage event the proxy asked for is dropped


def test_a_read_cut_by_a_carriage_return_pair_is_two_events() -> None:
    """A read whose only line feed ends it but that holds a "\r\r" is two events to the
    splitter (two tokens), not one plain event."""
    first = chat_chunk({"content": "a"})[:-2] + b"\r\r"
    read = first + chat_chunk({"content": "b"})
    obs, out = relay_chunks([read], CHAT, "llamacpp", first_visible=0.5)
    assert obs.token_events == 2
    assert b"".join(out) == read


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(mostly_plain, separators), max_size=16),
    st.lists(st.integers(min_value=0, max_value=18), max_size=8),
    st.lists(st.integers(min_value=0, max_value=3000), max_size=3),
    st.sampled_from(["llamacpp", "vllm", "openai"]),
)
def test_reads_of_several_events_observe_what_parsing_does(
    events: list[tuple[bytes, bytes]], between: list[int], cuts: list[int], dialect: str
) -> None:
    """However the stream is cut into reads (several whole events each, or cut mid-event),
    the relay observes and forwards what parsing every event one by one does."""
    pieces = [event[:-2] + sep for event, sep in events]
    stream = b"".join(pieces) + usage_event + b"data: [DONE]\n\n"
    ends = [sum(len(p) for p in pieces[: i + 1]) for i in range(len(pieces))]
    at = {ends[i] for i in between if i < len(ends)}  # reads of whole events
    at |= {min(c, len(stream)) for c in cuts}  # and reads cut anywhere
    points = sorted(at)
    bounds = zip([0, *points], [*points, len(stream)], strict=True)
    reads = [stream[a:b] for a, b in bounds if b > a]
    for first_visible in (None, 0.5):  # from the stream's start, or a stream already under way
        fast = relay_chunks(reads, CHAT, dialect, first_visible=first_visible)
        ex_events = list(EventSplitter().feed(stream))
        obs = Observation(t_start=0.0, t_first_token=first_visible, t_first_visible=first_visible)
        ex = Exchange(
            request_id="r",
            route=CHAT,
            upstream_path=CHAT,
            obs=obs,
            dialect=DIALECTS[dialect](),
            strip_usage=True,
        )
        inspector = StreamInspector(ex)
        out: list[bytes] = []
        saved = stream_inspect.plain_token_event
        stream_inspect.plain_token_event = lambda event, route: False
        try:
            # Every event of a read is seen at that read's time.
            ends, at = [], 0
            for read in reads:
                at += len(read)
                ends.append(at)
            pos = 0
            for event in ex_events:
                pos += len(event)
                read_no = next(i for i, end in enumerate(ends) if end >= pos)
                inspector.process(event, float(read_no + 1), out)
            inspector.finish(out)
        finally:
            stream_inspect.plain_token_event = saved
        obs.inspect_s = 0.0
        assert fast[0] == obs
        assert b"".join(fast[1]) == b"".join(out)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(mostly_plain, separators), min_size=1, max_size=8))
def test_plain_token_run_is_every_event_plain(events: list[tuple[bytes, bytes]]) -> None:
    chunk = b"".join(event[:-2] + sep for event, sep in events)
    split = list(EventSplitter().feed(chunk))
    whole = b"\r" not in chunk and b"".join(split) == chunk
    expected = len(split) if whole and all(plain_token_event(e, CHAT) for e in split) else 0
    assert plain_token_run(chunk, CHAT) == expected


@pytest.mark.parametrize("dialect", ["llamacpp", "vllm", "openai"])
def test_a_read_cut_inside_an_event_is_never_forwarded_twice(dialect: str) -> None:
    """Before the first visible token, a read that ends after an event's first line break
    (its blank line still to come) is not forwarded ahead of reading: the splitter holds it,
    and it reaches the client once, whole."""
    first = chat_chunk({"content": "Hel"})
    stream = [first[:-1], b"\n", chat_chunk({"content": "lo"}), usage_event, b"data: [DONE]\n\n"]
    _, out = relay_chunks(stream, CHAT, dialect)
    forwarded = b"".join(out)
    assert forwarded.count(b'"content":"Hel"') == 1
    assert next(iter(EventSplitter().feed(forwarded))) == first


def chat_inspector(*, strip_usage: bool = True) -> StreamInspector:
    """A fresh chat stream's inspector (llama.cpp), the proxy having asked for the usage or not."""
    ex = Exchange(
        request_id="r",
        route=CHAT,
        upstream_path=CHAT,
        obs=Observation(t_start=0.0),
        dialect=DIALECTS["llamacpp"](),
        strip_usage=strip_usage,
    )
    return StreamInspector(ex)


def test_a_read_with_a_choice_finishing_is_read_before_it_is_forwarded() -> None:
    """One choice still streaming, another finishing (``n`` > 1): the finishing event may be
    held back (the usage event the proxy asked for comes after it), so it is read first."""
    both = sse(
        {
            "choices": [
                {"finish_reason": None, "index": 0, "delta": {"content": "a"}},
                {"finish_reason": "stop", "index": 1, "delta": {"content": "b"}},
            ],
            "object": "chat.completion.chunk",
        }
    )
    inspector = chat_inspector()
    assert plain_token_event(both, CHAT)  # the byte check alone would take it
    assert not inspector.forwardable(both)
    assert inspector.forwardable(chat_chunk({"content": "a"}))
    assert not inspector.forwardable(chat_chunk({"content": "a"})[:-1])


def test_what_may_reach_the_client_before_it_is_read() -> None:
    """Before the first token: a read of whole events the inspector forwards as they came
    (the role and the first token, a ping); not one that ends mid-event, holds a carriage
    return, or, where the proxy asked for the usage itself, carries usage or a choice
    finishing (the relay holds or removes those)."""
    role = chat_chunk({"role": "assistant", "content": None})
    first = role + chat_chunk({"content": "Hel"})

    def inspector(strip_usage: bool) -> StreamInspector:
        return chat_inspector(strip_usage=strip_usage)

    for strip in (True, False):
        assert inspector(strip).forwardable(first)
        assert inspector(strip).forwardable(b":\n\n")
        assert not inspector(strip).forwardable(first[:-1])
        assert not inspector(strip).forwardable(first + b"\n")  # (one left for the next read)
        assert inspector(strip).forwardable(first + b"\n\n")
        assert not inspector(strip).forwardable(first.replace(b"\n\n", b"\r\n\r\n"))
    finishing = chat_chunk({"content": "x"}, finish="stop")
    assert not inspector(True).forwardable(role + finishing)
    assert not inspector(True).forwardable(role + usage_event)
    assert inspector(False).forwardable(role + finishing + usage_event)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.text(alphabet=st.sampled_from('ab "\\\n\r]\u00e9usage'), max_size=5), max_size=6),
    st.sampled_from([b"", b"\n\n", b": ping\n\n", b"data: [DONE]\n\n"]),
)
def test_a_read_walked_against_the_shape_counts_what_testing_it_whole_counts(
    texts: list[str], after: bytes
) -> None:
    inspector = _inspector(CHAT)
    assert inspector.plain_chunk(chat_chunk({"content": "Hel"}), 2.0)
    read = b"".join(chat_chunk({"content": t}) for t in texts) + after
    counted = inspector._plain_read(read)
    if counted:
        # every event of the read a token with text in it, and nothing else in the read
        assert counted == len(texts) and all(texts) and not after
        whole = plain_token_run(read, CHAT)
        assert whole in (0, counted)  # (0: a text that reads like a key, "usage", is parsed)
    else:
        assert not plain_token_run(read, CHAT)


def test_reads_the_walk_leaves_to_the_whole_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw bytes between the shape's parts that could end the text, the event or the read
    elsewhere: the read is tested whole."""
    inspector = _inspector(CHAT)
    assert inspector.plain_chunk(chat_chunk({"content": "Hel"}), 2.0)
    assert inspector._shape is not None
    head, tail = inspector._shape

    def tested(chunk: bytes, route: str) -> int:
        raise AssertionError("tested whole")

    monkeypatch.setattr(stream_inspect, "plain_token_run", tested)
    read = b"".join(chat_chunk({"content": t}) for t in ("lo", ", "))
    for odd in (
        read + head + b"x\\" + tail,  # a trailing backslash
        read + head + b"a\nb" + tail,  # a line break in the text
        read + head + b"a\r\rb" + tail,  # a separator the splitter cuts at
        read + chat_chunk({"content": "x"}).replace(b"smollm2", b"smollm3"),  # another tail
    ):
        with pytest.raises(AssertionError, match="tested whole"):
            inspector.plain_chunk(odd, 4.0)


RAW = st.sampled_from([b"a", b'"', b"\\", b"\n", b"\r", b"\n\n", b"\r\r", b"}", b"]"])


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.lists(RAW, max_size=4).map(b"".join), max_size=5),
    st.sampled_from([b"", b"\n", b"x"]),
)
def test_a_walked_read_is_what_the_splitter_and_the_shape_would_count(
    texts: list[bytes], after: bytes
) -> None:
    inspector = _inspector(CHAT)
    assert inspector.plain_chunk(chat_chunk({"content": "Hel"}), 2.0)
    assert inspector._shape is not None
    head, tail = inspector._shape
    read = b"".join(head + t + tail for t in texts) + after
    whole, one_whole = stream_inspect.plain_token_run, stream_inspect.plain_token_event
    try:
        stream_inspect.plain_token_run = lambda chunk, route: 0  # the walk alone
        stream_inspect.plain_token_event = lambda event, route: False
        counted = inspector._plain_read(read)
    finally:
        stream_inspect.plain_token_run, stream_inspect.plain_token_event = whole, one_whole
    if counted:
        splitter = EventSplitter()
        events = list(splitter.feed(read))
        assert len(events) == counted and not splitter.pending
        one = copy.deepcopy(inspector)
        assert all(one._plain(event) for event in events)


def test_a_shape_follows_the_clock_through_reads_of_several_events(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """llama-server's chat events carry a clock of seconds ("created"): a busy proxy reads them
    a dozen at a time, and each second's first read, tested whole, gives the shape again."""
    inspector = _inspector(CHAT)
    whole = stream_inspect.plain_token_run
    calls: list[int] = []

    def counted(chunk: bytes, route: str) -> int:
        calls.append(1)
        return whole(chunk, route)

    monkeypatch.setattr(stream_inspect, "plain_token_run", counted)
    for second in range(4):
        for _ in range(20):
            read = b"".join(
                chat_chunk({"content": "x"}, created=1764567000 + second) for _ in range(16)
            )
            assert inspector.plain_chunk(read, 2.0)
        assert inspector._shape is not None and inspector._misses == 0
    assert len(calls) == 4  # one read a second tested whole
    assert inspector.ex.obs.token_events == 4 * 20 * 16


def test_a_read_ending_in_an_odd_run_of_line_breaks_is_not_a_run_of_events() -> None:
    """The splitter would keep the third line break for the next event."""
    messages = (
        b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"a"}}\n\n'
    )
    assert plain_token_run(messages, MESSAGES) == 1
    assert plain_token_run(messages + b"\n", MESSAGES) == 0
    assert plain_token_run(chat_chunk({"content": "a"}) + b"\n", CHAT) == 0
